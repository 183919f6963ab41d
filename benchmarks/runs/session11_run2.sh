#!/bin/bash
# Session 11 run 2: cooperative stages -- steps per softmax update x stage count.
export PYTHONPATH=$PWD
timeout 580 python benchmarks/sweep_mma.py --out $OUT --hint 1 --warps 4 --coop 0 2 3 4 --sub 1 2 --maxnreg -1 2>&1 | tee $OUT/sweep.log | tail -34
