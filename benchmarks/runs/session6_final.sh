export PYTHONPATH=$PWD
timeout 280 python benchmarks/bench_decode.py --out $OUT > $OUT/bench.log 2>&1; echo "bench rc $?"
TQKERN_MAX_EXAMPLES=6 TQKERN_NO_SHRINK=1 timeout 300 python -m pytest -q property_tests/test_paged_decode_triton.py --hypothesis-profile thorough -p no:cacheprovider > $OUT/pytest_prop_decode.log 2>&1; echo "prop rc $?"
tail -3 $OUT/pytest_prop_decode.log
tail -45 $OUT/bench.log
