#!/bin/bash
# Session 10, run 2: CTAs of 4 vs 8 warps (all KV heads of a (sequence, split) on one SM), real and
# loads-only, with the launcher's register cap and 128; raw L2/DRAM counters of run 1's reports.
export PYTHONPATH=$PWD
python benchmarks/sweep_mma.py --out $OUT/tq4 --presets tq4 --hint 1 --warps 4 8 --probe 0 1 --maxnreg -1 128 \
    --sub 0 1 > $OUT/sweep_w8_tq4.log 2>&1
tail -36 $OUT/sweep_w8_tq4.log | grep -v "^B.*sdpa" 
python benchmarks/sweep_mma.py --out $OUT/nc --presets turboquant_4bit_nc --hint 1 --warps 4 8 --probe 0 1 \
    --maxnreg -1 128 > $OUT/sweep_w8_nc.log 2>&1
tail -18 $OUT/sweep_w8_nc.log
for p in tq4 turboquant_4bit_nc; do
  ncu -i ncu_in/ncu_$p.ncu-rep --page raw --csv 2>/dev/null | python3 -c "
import csv, sys
rows = list(csv.reader(sys.stdin))
h, u, v = rows[0], rows[1], rows[2]
for i, name in enumerate(h):
    if name.startswith(('lts__', 'dram__', 'l1tex__m_', 'l1tex__t_sectors', 'l1tex__t_requests', 'gpu__compute_memory')):
        print(name, u[i], v[i])
" > $OUT/raw_$p.txt
  wc -l $OUT/raw_$p.txt
done
