# Session 8: the warp-MMA property test with the reweighted strategy (focus: 4-bit keys, 3-/5-bit keys, rows 2 mod 4).
export PYTHONPATH=$PWD
TQKERN_MAX_EXAMPLES=40 TQKERN_NO_SHRINK=1 timeout 300 python -m pytest -q property_tests/test_paged_decode_triton.py \
  -k mma --hypothesis-profile thorough --hypothesis-show-statistics -p no:cacheprovider > $OUT/pytest_mma.log 2>&1
echo "mma prop rc $?"; grep -E "passed|failed|%|Error" $OUT/pytest_mma.log | tail -30
