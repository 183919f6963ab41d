#!/bin/bash
# Session 10: the full decode benchmark (oracle gate first, SDPA fp16 in the same run) after the
# review mends (warp-MMA kernel SASS byte-identical offline), for the README's numbers.
export PYTHONPATH=$PWD
timeout 580 python benchmarks/bench_decode.py --out $OUT --no-store > $OUT/bench_decode.log 2>&1; echo "bench rc $?"
tail -32 $OUT/bench_decode.log
