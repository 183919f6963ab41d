# Session 8, run 2: the general kernel (fp16 path): BN / warps / stages, then split counts.
export PYTHONPATH=$PWD
timeout 420 python benchmarks/sweep_general.py --out $OUT > $OUT/sweep.log 2>&1
echo "sweep rc $?"; grep -v "^gate.* ok$" $OUT/sweep.log | tail -70
