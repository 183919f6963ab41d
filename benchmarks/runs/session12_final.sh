#!/bin/bash
# Session 12 final: the full decode benchmark (oracle gate first, SDPA fp16 in the same run) with
# the PRMT-addressed table (tq4), the new merge choice and the short-split rule; then the warp-MMA
# property test against the NumPy oracle (thorough profile).
export PYTHONPATH=$PWD
timeout 300 python benchmarks/bench_decode.py --out $OUT --no-store > $OUT/bench_decode.log 2>&1; echo "bench rc $?"
tail -32 $OUT/bench_decode.log
TQKERN_MAX_EXAMPLES=20 TQKERN_NO_SHRINK=1 timeout 240 python -m pytest -q -p no:cacheprovider \
  property_tests/test_paged_decode_triton.py -k mma --hypothesis-profile thorough --hypothesis-show-statistics \
  > $OUT/pytest_mma.log 2>&1
echo "mma prop rc $?"; grep -iE "passed|failed|error|cooperative" $OUT/pytest_mma.log | head -12
