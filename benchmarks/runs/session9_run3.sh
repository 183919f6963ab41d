# Session 9 run 3: SUB=2 PREFETCH=2 (168-register cap) against the launcher's default, every
# warp-MMA preset but turboquant_4bit_nc (run 2: slower), every benchmark shape, SDPA same run.
export PYTHONPATH=$PWD
P="tq4 turboquant_k8v4 turboquant_k3v4_nc turboquant_3bit_nc tqkern_k5v3"
SH="B32x16K B8x64K B32x4K B128x1K SmolLM2_B32x4K"
S="python benchmarks/sweep_mma.py --hint 1 --warps 4 --presets $P --shapes $SH"
$S --out $OUT/def --prefetch 1 --maxnreg -1 --sub 1 > $OUT/sweep_def.log 2>&1; echo "def rc $?"
$S --out $OUT/sub2 --prefetch 2 --maxnreg 168 --sub 2 > $OUT/sweep_sub2.log 2>&1; echo "sub2 rc $?"
grep -h "gate" $OUT/*.log | grep -v " ok$"
python - <<'PY'
import json, os
o = os.environ["OUT"]
a = {(r["shape"], r["variant"]): r["us"] for r in json.load(open(f"{o}/def/sweep_mma.json"))["rows"]}
b = {(r["shape"], r["variant"]): r["us"] for r in json.load(open(f"{o}/sub2/sweep_mma.json"))["rows"]}
for k in sorted(a):
    if k in b:
        print(f"{k[0]:16s} {k[1]:20s} default {a[k]:8.1f}  sub2 {b[k]:8.1f}  {100 * (b[k] / a[k] - 1):+5.1f}%")
PY
