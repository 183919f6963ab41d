# Session 13 run 7: the bit-identity case runs 5-6 did not reach (tqkern_k5v3, block size 32), and
# a longer warp-MMA property run against the oracle (the two-step stages are new in the plan).
export PYTHONPATH=$PWD
timeout 150 python -m pytest -v tests/test_gpu_decode.py -k "bit_for_bit and k5v3 and 32" > $OUT/pytest_bit_k5v3_32.log 2>&1; echo "k5v3-32 rc $?"
timeout 300 env TQKERN_MAX_EXAMPLES=40 TQKERN_NO_SHRINK=1 python -m pytest -q property_tests/test_paged_decode_triton.py -k mma --hypothesis-profile thorough --hypothesis-show-statistics > $OUT/pytest_prop40.log 2>&1; echo "prop rc $?"
grep -hE "PASSED|FAIL|ERROR|passed|failed|cooperative stages|keys|values" $OUT/*.log | tail -30
