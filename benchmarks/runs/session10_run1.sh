#!/bin/bash
# Session 10, run 1: timing probes of the warp-MMA kernel (loads only / no DRAM) and Nsight
# Compute (full set + per-SASS-line source counters) of the real tq4 and turboquant_4bit_nc kernels.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
python benchmarks/sweep_mma.py --out $OUT --presets tq4 turboquant_4bit_nc --hint 1 --warps 4 --probe 0 1 2 --parts \
    > $OUT/sweep_probe.log 2>&1
tail -20 $OUT/sweep_probe.log
which ncu || exit 0
for p in tq4 turboquant_4bit_nc; do
  timeout 200 ncu --clock-control none -k regex:_paged_decode_mma --launch-skip 1 --launch-count 1 --set full \
      --import-source no -o $OUT/ncu_$p python benchmarks/ncu_mma.py $p > $OUT/ncu_$p.log 2>&1
  tail -3 $OUT/ncu_$p.log
  ncu -i $OUT/ncu_$p.ncu-rep --page details > $OUT/ncu_${p}_details.txt 2>&1
  ncu -i $OUT/ncu_$p.ncu-rep --page source --csv --print-source sass > $OUT/ncu_${p}_sass.csv 2>&1
  ls -la $OUT/ncu_${p}*
done
