# Session 7, run 4 (after the 3-bit Lloyd-Max output-scale fix): 5-bit keys / 3-bit Lloyd-Max values: property test, launch tests, public benchmark.
export PYTHONPATH=$PWD
TQKERN_MAX_EXAMPLES=40 TQKERN_NO_SHRINK=1 timeout 230 python -m pytest -q property_tests/test_paged_decode_triton.py \
  -k mma --hypothesis-profile thorough --hypothesis-show-statistics -p no:cacheprovider > $OUT/pytest_mma.log 2>&1
echo "mma prop rc $?"; grep -A16 "Events" $OUT/pytest_mma.log | head -18; grep -B2 -A30 "Falsifying\|Error" $OUT/pytest_mma.log | head -60; tail -2 $OUT/pytest_mma.log
timeout 120 python -m pytest -q tests/test_decode_launch.py tests/test_gpu_decode.py -p no:cacheprovider \
  > $OUT/pytest_launch.log 2>&1; echo "launch rc $?"; tail -2 $OUT/pytest_launch.log
timeout 230 python benchmarks/bench_decode.py --out $OUT > $OUT/bench.log 2>&1; echo "bench rc $?"
grep "gate" $OUT/bench.log | grep -v " ok"; grep -v "^gate\|^store" $OUT/bench.log | tail -42
