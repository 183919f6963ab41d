# Session 13 run 3: the session-12 tree's plans for all six presets and the per-warp kernel at the
# short shapes (short-split rule), new tree, same run.
export PYTHONPATH=$PWD
S="python benchmarks/sweep_mma.py --hint 1 --warps 4"
A="tq4 turboquant_4bit_nc turboquant_k8v4 turboquant_k3v4_nc turboquant_3bit_nc tqkern_k5v3"
(cd _base && PYTHONPATH=$PWD timeout 230 $S --shapes B32x16K B8x64K B32x4K B128x1K --out $OUT/old --presets $A --coop -1) > $OUT/old.log 2>&1; echo "old rc $?"
timeout 200 $S --shapes B32x4K B128x1K --out $OUT/pw --presets $A --coop 0 > $OUT/pw.log 2>&1; echo "pw rc $?"
grep -h "gate" $OUT/*.log | grep -v " ok$"
grep -h " us " $OUT/*.log | grep -v "^gate" | grep -E "x SDPA|sdpa_fp16 " | sed 's/pf0 hint1 w4 r-1 s0 //; s/(resident [0-9]*)//'
