#!/bin/bash
# Session 12 run 5: GPU tests of the cooperative kernel (bit-identity, every preset, both tables;
# CUDA graphs; plan rules), then every warp-MMA preset with and without the stages at B32x4K and
# B128x1K (after the prologue change).
export PYTHONPATH=$PWD
timeout 330 python -m pytest -v -p no:cacheprovider tests/test_gpu_decode.py tests/test_decode_launch.py \
  -k "cooperative or graph or plan or smem or fallback or table256 or merge" > $OUT/pytest.log 2>&1
echo "pytest rc $?"; grep -E "FAIL|Error|passed|failed" $OUT/pytest.log | tail -6
timeout 220 python benchmarks/sweep_mma.py --out $OUT --hint 1 --warps 4 --coop -1 0 --shapes B32x4K B128x1K \
  --presets tq4 turboquant_4bit_nc turboquant_k8v4 turboquant_k3v4_nc turboquant_3bit_nc tqkern_k5v3 > $OUT/sweep.log 2>&1
grep -E "FAIL|skipped" $OUT/sweep.log | head; grep -A30 "triton 3" $OUT/sweep.log
