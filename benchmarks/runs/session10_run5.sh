#!/bin/bash
# Session 10, run 5: whole rows prefetched into L1 (L1PF) ahead of the head-warps' loads.
export PYTHONPATH=$PWD
python benchmarks/sweep_mma.py --out $OUT/tq4 --presets tq4 --hint 1 --warps 4 --l1pf 0 1 2 4 \
    > $OUT/sweep_l1pf_tq4.log 2>&1
grep -E "gate|splits" $OUT/sweep_l1pf_tq4.log | tail -14
python benchmarks/sweep_mma.py --out $OUT/nc --presets turboquant_4bit_nc --hint 1 --warps 4 --l1pf 0 1 2 \
    --maxnreg -1 168 > $OUT/sweep_l1pf_nc.log 2>&1
grep -E "gate|splits" $OUT/sweep_l1pf_nc.log | tail -18
