#!/bin/bash
# Session 11 run 3: deeper cooperative rings at one CTA per SM.
export PYTHONPATH=$PWD
S="--out $OUT --hint 1 --warps 4"
timeout 190 python benchmarks/sweep_mma.py $S --presets tq4 --sub 2 --coop 4 5 2>&1 | tee $OUT/sweep_a.log | grep -A12 "triton 3"
timeout 190 python benchmarks/sweep_mma.py $S --presets tq4 --sub 1 --coop 6 8 2>&1 | tee $OUT/sweep_b.log | grep -A12 "triton 3"
timeout 200 python benchmarks/sweep_mma.py $S --presets turboquant_4bit_nc --sub 1 --coop 4 6 8 --maxnreg -1 0 2>&1 | tee $OUT/sweep_c.log | grep -A16 "triton 3"
