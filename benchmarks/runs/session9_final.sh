# Session 9, final: the full decode benchmark (every preset, every shape, SDPA same run).
export PYTHONPATH=$PWD
timeout 330 python benchmarks/bench_decode.py --out $OUT --no-store > $OUT/bench.log 2>&1
echo "bench rc $?"; grep -v "^gate.* ok$" $OUT/bench.log | tail -50
