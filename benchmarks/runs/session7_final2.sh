# Session 7, final GPU verification after the _row_of parity fix: read-scheme oracle tests, tests/ in full, mma property test.
export PYTHONPATH=$PWD
timeout 100 python -m pytest -q tests/test_gpu_decode.py -k read_schemes -p no:cacheprovider > $OUT/pytest_read_schemes.log 2>&1
echo "read schemes rc $?"; tail -2 $OUT/pytest_read_schemes.log
timeout 200 python -m pytest -q tests -p no:cacheprovider > $OUT/pytest_tests.log 2>&1; echo "tests rc $?"; tail -3 $OUT/pytest_tests.log
TQKERN_MAX_EXAMPLES=15 TQKERN_NO_SHRINK=1 timeout 100 python -m pytest -q property_tests/test_paged_decode_triton.py -k mma \
  --hypothesis-profile thorough -p no:cacheprovider > $OUT/pytest_mma.log 2>&1; echo "mma prop rc $?"; tail -2 $OUT/pytest_mma.log
