#!/bin/bash
# Session 11 run 4: timing probes of the cooperative kernel (tq4, turboquant_4bit_nc at B32x16K),
# the other warp-MMA presets with and without cooperative stages, the warp-MMA property test.
export PYTHONPATH=$PWD
S="--out $OUT --hint 1 --warps 4"
timeout 150 python benchmarks/sweep_mma.py $S --shapes B32x16K --presets tq4 turboquant_4bit_nc --coop -1 --probe 0 1 2 \
  2>&1 | tee $OUT/sweep_probe.log | grep -A10 "triton 3"
timeout 230 python benchmarks/sweep_mma.py $S --presets turboquant_k8v4 turboquant_k3v4_nc turboquant_3bit_nc tqkern_k5v3 \
  --coop 0 -1 2>&1 | tee $OUT/sweep_others.log | grep -A20 "triton 3"
TQKERN_MAX_EXAMPLES=20 TQKERN_NO_SHRINK=1 timeout 200 python -m pytest -q property_tests/test_paged_decode_triton.py \
  -k mma --hypothesis-profile thorough --hypothesis-show-statistics -p no:cacheprovider > $OUT/pytest_mma.log 2>&1
echo "mma prop rc $?"; grep -i "passed\|failed\|cooperative\|error" $OUT/pytest_mma.log | head -20
