# Session 7, final GPU verification: the read-scheme oracle tests, tests/ in full, the decode property file.
export PYTHONPATH=$PWD
timeout 120 python -m pytest -q tests/test_gpu_decode.py -k read_schemes -p no:cacheprovider > $OUT/pytest_read_schemes.log 2>&1
echo "read schemes rc $?"; tail -3 $OUT/pytest_read_schemes.log; grep -m3 -A12 "Error\b\|assert " $OUT/pytest_read_schemes.log | head -30
timeout 250 python -m pytest -q tests -p no:cacheprovider -x > $OUT/pytest_tests.log 2>&1; echo "tests rc $?"; tail -3 $OUT/pytest_tests.log
TQKERN_MAX_EXAMPLES=6 TQKERN_NO_SHRINK=1 timeout 230 python -m pytest -q property_tests/test_paged_decode_triton.py --hypothesis-profile thorough -p no:cacheprovider > $OUT/pytest_prop_decode.log 2>&1; echo "prop rc $?"
tail -3 $OUT/pytest_prop_decode.log
