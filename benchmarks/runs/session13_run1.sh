# Session 13 run 1 (NOTES §47): unpredicated shared reads and late value reads vs the session-12
# tree (_base/, HEAD at the session start) in the same run, B32x16K and B8x64K, SDPA in each.
export PYTHONPATH=$PWD
SH="B32x16K B8x64K"
S="python benchmarks/sweep_mma.py --hint 1 --warps 4 --shapes $SH"
(cd _base && PYTHONPATH=$PWD timeout 200 $S --out $OUT/old --presets tq4 turboquant_4bit_nc --coop -1) > $OUT/old.log 2>&1; echo "old rc $?"
timeout 200 $S --out $OUT/new --presets tq4 turboquant_4bit_nc --coop -1 --late-v 0 1 > $OUT/new.log 2>&1; echo "new rc $?"
timeout 180 $S --out $OUT/sub2 --presets turboquant_4bit_nc --sub 2 --coop 2 --late-v 0 1 > $OUT/sub2.log 2>&1; echo "sub2 rc $?"
grep -h "gate" $OUT/*.log | grep -v " ok$"
grep -h " us " $OUT/*.log | grep -v "^gate" | grep -E "x SDPA|sdpa" 
