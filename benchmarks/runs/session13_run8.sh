# Session 13 run 8: Nsight Compute on turboquant_4bit_nc's new plan (two steps per update, 2
# stages of 32 tokens, values read late), B32x16K: what bounds it now.
export PYTHONPATH=$PWD
p=turboquant_4bit_nc
timeout 150 ncu --clock-control none -k regex:paged_decode_mma --launch-skip 1 --launch-count 1 --set full \
  -o $OUT/ncu_$p python benchmarks/ncu_decode.py --preset $p --shape B32x16K > $OUT/ncu_$p.run.log 2>&1
echo "ncu $p rc $?"; tail -3 $OUT/ncu_$p.run.log
ncu --import $OUT/ncu_$p.ncu-rep --page details > $OUT/ncu_$p.details.txt 2>&1
ncu --import $OUT/ncu_$p.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $OUT/ncu_$p.sass.csv.gz
rm -f $OUT/ncu_$p.ncu-rep
grep -E "Duration|Issue Slots Busy|Executed Ipc Active|No Eligible|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|DRAM Throughput|Memory Throughput" $OUT/ncu_$p.details.txt | head -14
python benchmarks/ncu_stalls.py $OUT/ncu_$p.sass.csv.gz | head -30
