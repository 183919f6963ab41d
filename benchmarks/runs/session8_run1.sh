# Session 8, run 1: bulk L2 prefetch (l2pf 0/1/2/4), every preset and shape, oracle gate first.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 560 python benchmarks/sweep_l2pf.py --out $OUT --l2pf 0 1 2 4 > $OUT/sweep.log 2>&1
echo "sweep rc $?"; grep -v "^gate.* ok$" $OUT/sweep.log | tail -75
