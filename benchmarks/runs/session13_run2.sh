# Session 13 run 2 (NOTES §47): the other presets under the new loop: the plan's stages vs two
# steps per update in 2 stages of 32 tokens (uniform values), values read late or not, and the
# per-warp kernel at the short shapes (short-split rule); the session-12 tree beside them.
export PYTHONPATH=$PWD
SH="B32x16K B8x64K B32x4K B128x1K"
S="python benchmarks/sweep_mma.py --hint 1 --warps 4 --shapes $SH"
U="turboquant_k8v4 turboquant_k3v4_nc turboquant_3bit_nc"
timeout 170 $S --out $OUT/uplan --presets $U --coop -1 --late-v 0 1 > $OUT/uplan.log 2>&1; echo "uplan rc $?"
timeout 170 $S --out $OUT/usub2 --presets $U turboquant_4bit_nc --sub 2 --coop 2 --late-v 0 1 > $OUT/usub2.log 2>&1; echo "usub2 rc $?"
timeout 120 $S --out $OUT/lm --presets tq4 tqkern_k5v3 --coop -1 --late-v 0 1 > $OUT/lm.log 2>&1; echo "lm rc $?"
grep -h "gate" $OUT/*.log | grep -v " ok$"
grep -h " us " $OUT/*.log | grep -v "^gate" | grep -E "x SDPA|sdpa_fp16 " | sed 's/pf0 hint1 w4 r-1 s0 //; s/(resident [0-9]*)//'
