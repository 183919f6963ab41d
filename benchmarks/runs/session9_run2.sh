# Session 9 run 2: two 16-token steps per softmax update (SUB=2), oracle-gated, SDPA same run.
export PYTHONPATH=$PWD
S="python benchmarks/sweep_mma.py --hint 1 --warps 4"
$S --out $OUT/a --presets tq4 --prefetch 1 --maxnreg -1 --sub 1 2 > $OUT/sweep_tq4_a.log 2>&1; echo "a rc $?"
$S --out $OUT/b --presets tq4 --prefetch 1 2 --maxnreg 0 168 --sub 2 > $OUT/sweep_tq4_b.log 2>&1; echo "b rc $?"
$S --out $OUT/c --presets turboquant_4bit_nc --prefetch 1 --maxnreg -1 168 --sub 1 2 > $OUT/sweep_nc.log 2>&1; echo "c rc $?"
grep -h "gate" $OUT/*.log | grep -v " ok$"
for f in $OUT/sweep_tq4_a.log $OUT/sweep_tq4_b.log $OUT/sweep_nc.log; do grep -E "^B(32x16K|8x64K) +(sdpa|tq4|turbo).* us( |$)" $f | grep -v resident; done
