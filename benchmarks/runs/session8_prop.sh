# Session 8: the whole GPU decode property file (thorough profile), the run session 7 could not finish.
export PYTHONPATH=$PWD
TQKERN_MAX_EXAMPLES=6 TQKERN_NO_SHRINK=1 timeout 540 python -m pytest -q property_tests/test_paged_decode_triton.py \
  --hypothesis-profile thorough --durations=0 -p no:cacheprovider > $OUT/pytest_prop_decode.log 2>&1; echo "prop rc $?"
grep -E "passed|failed|s call" $OUT/pytest_prop_decode.log | tail -12
