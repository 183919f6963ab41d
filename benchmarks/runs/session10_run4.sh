#!/bin/bash
# Session 10, run 4: two-step rings (turboquant_4bit_nc; tq4 with one step per update at 128
# registers), and the plain block read of turboquant_4bit_nc's cache.
export PYTHONPATH=$PWD
python benchmarks/sweep_mma.py --out $OUT/nc --presets turboquant_4bit_nc --hint 1 --warps 4 --prefetch 0 2 \
    --maxnreg -1 168 --shifted 0 1 > $OUT/sweep_ring_nc.log 2>&1
tail -18 $OUT/sweep_ring_nc.log
python benchmarks/sweep_mma.py --out $OUT/tq4 --presets tq4 --hint 1 --warps 4 --prefetch 0 2 --sub 0 1 \
    > $OUT/sweep_ring_tq4.log 2>&1
tail -10 $OUT/sweep_ring_tq4.log
python benchmarks/probe_reads.py --out $OUT --shapes B32x16K --presets turboquant_4bit_nc > $OUT/probe_reads_nc.log 2>&1
cat $OUT/probe_reads_nc.log
