#!/bin/bash
# Session 11 run 5: GPU tests with the cooperative stages in the launcher's plan; turboquant_4bit_nc
# with shifted reads under the stages.
export PYTHONPATH=$PWD
timeout 380 python -m pytest -q -x tests/test_decode_launch.py tests/test_gpu_decode.py tests/test_torch_ops.py \
  -p no:cacheprovider > $OUT/pytest_gpu.log 2>&1; echo "pytest rc $?"; tail -3 $OUT/pytest_gpu.log
timeout 150 python benchmarks/sweep_mma.py --out $OUT --hint 1 --warps 4 --presets turboquant_4bit_nc --coop -1 \
  --shifted 0 1 2>&1 | tee $OUT/sweep_shifted.log | grep -A8 "triton 3"
