#!/bin/bash
# Session 11: the full decode benchmark (oracle gate first, SDPA fp16 in the same run) with the
# cooperative stages in the launcher's plan, for the README's numbers.
export PYTHONPATH=$PWD
timeout 580 python benchmarks/bench_decode.py --out $OUT --no-store > $OUT/bench_decode.log 2>&1; echo "bench rc $?"
tail -32 $OUT/bench_decode.log
