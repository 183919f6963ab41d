#!/bin/bash
# Session 12 run 1: where the public path's time goes at both goal shapes (q rotation, kernel,
# merge), the kernel at B33x16K (132 / 264 CTAs: what a balanced grid would give), the split
# count at B8x64K for turboquant_4bit_nc, and Nsight Compute on both cooperative kernels.
export PYTHONPATH=$PWD
S="--out $OUT --hint 1 --warps 4 --coop -1"
timeout 200 python benchmarks/sweep_mma.py $S --shapes B32x16K B8x64K B33x16K --presets tq4 turboquant_4bit_nc \
  --parts 2>&1 | tee $OUT/sweep_parts.log | grep -A12 "triton 3"
mv $OUT/sweep_mma.json $OUT/sweep_parts.json
timeout 100 python benchmarks/sweep_mma.py $S --shapes B8x64K --presets turboquant_4bit_nc --splits 32 30 24 \
  --parts 2>&1 | tee $OUT/sweep_splits.log | grep -A6 "triton 3"
rm -f $OUT/sweep_mma.json
for p in turboquant_4bit_nc tq4; do
  timeout 100 ncu --clock-control none -k regex:paged_decode_mma --launch-skip 1 --launch-count 1 --set full \
    -o $OUT/ncu_$p python benchmarks/ncu_decode.py --preset $p --shape B32x16K > $OUT/ncu_$p.run.log 2>&1
  echo "ncu $p rc $?"; tail -3 $OUT/ncu_$p.run.log
  ncu --import $OUT/ncu_$p.ncu-rep --page details > $OUT/ncu_$p.details.txt 2>&1
  ncu --import $OUT/ncu_$p.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $OUT/ncu_$p.sass.csv.gz
  ls -la $OUT/ncu_$p*
  grep -E "Duration|Issue Slots Busy|Executed Ipc Active|No Eligible|Registers Per|Achieved Occupancy|Warp Cycles Per Issued" $OUT/ncu_$p.details.txt | head -12
done
