#!/bin/bash
# Session 12 review run: the cooperative bit-identity test for the 4-bit presets (both tables, a
# ring wholly above the PRMT table), the other GPU decode tests (CUDA graphs, 64K, >2 GiB), and the
# torch ops on the GPU.
export PYTHONPATH=$PWD
timeout 200 python -m pytest -v -p no:cacheprovider tests/test_gpu_decode.py -k "cooperative and (tq4 or 4bit_nc)" \
  > $OUT/pytest_coop.log 2>&1; echo "coop rc $?"; grep -E "PASSED|FAILED|passed|failed" $OUT/pytest_coop.log | tail -6
timeout 200 python -m pytest -v -p no:cacheprovider tests/test_gpu_decode.py -k "not cooperative" \
  > $OUT/pytest_gpu.log 2>&1; echo "gpu rc $?"; grep -E "FAILED|passed|failed" $OUT/pytest_gpu.log | tail -6
timeout 170 python -m pytest -q -p no:cacheprovider tests/test_torch_ops.py > $OUT/pytest_ops.log 2>&1
echo "ops rc $?"; tail -3 $OUT/pytest_ops.log
