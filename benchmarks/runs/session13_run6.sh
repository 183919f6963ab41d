# Session 13 run 6: the remaining bit-identity cases, then the full benchmark (public API).
export PYTHONPATH=$PWD
timeout 300 python -m pytest -v tests/test_gpu_decode.py -k "bit_for_bit and (k3v4 and 32 or 3bit_nc and 32 or k5v3)" > $OUT/pytest_bit_rest.log 2>&1; echo "bit rest rc $?"
timeout 260 python benchmarks/bench_decode.py --out $OUT --no-store > $OUT/bench.log 2>&1; echo "bench rc $?"
grep -hE "PASSED|FAIL|ERROR|passed|failed" $OUT/pytest_bit_rest.log | tail -10
tail -45 $OUT/bench.log
