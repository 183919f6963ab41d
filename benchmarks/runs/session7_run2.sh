# Session 7, run 2: the public benchmark (every preset and shape, oracle gate first), then the GPU tests.
export PYTHONPATH=$PWD
timeout 280 python benchmarks/bench_decode.py --out $OUT > $OUT/bench.log 2>&1; echo "bench rc $?"
TQKERN_MAX_EXAMPLES=30 TQKERN_NO_SHRINK=1 timeout 200 python -m pytest -q property_tests/test_paged_decode_triton.py \
  -k mma --hypothesis-profile thorough --hypothesis-show-statistics -p no:cacheprovider > $OUT/pytest_mma.log 2>&1
echo "mma prop rc $?"; grep -A12 "Events" $OUT/pytest_mma.log | head -14; tail -2 $OUT/pytest_mma.log
timeout 100 python -m pytest -q tests/test_decode_launch.py tests/test_gpu_decode.py -p no:cacheprovider \
  > $OUT/pytest_launch.log 2>&1; echo "launch rc $?"; tail -2 $OUT/pytest_launch.log
tail -48 $OUT/bench.log
