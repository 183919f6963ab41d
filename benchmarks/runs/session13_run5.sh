# Session 13 run 5: bit identity at block size 32 (4-bit and FP8 keys), the warp-MMA property
# test against the oracle, read schemes and torch ops.
export PYTHONPATH=$PWD
timeout 230 python -m pytest -v -x tests/test_gpu_decode.py -k "bit_for_bit and 32 and (tq4 or 4bit_nc or k8v4)" > $OUT/pytest_bit32a.log 2>&1; echo "bit32a rc $?"
timeout 150 env TQKERN_MAX_EXAMPLES=20 TQKERN_NO_SHRINK=1 python -m pytest -q property_tests/test_paged_decode_triton.py -k mma --hypothesis-profile thorough --hypothesis-show-statistics > $OUT/pytest_prop.log 2>&1; echo "prop rc $?"
timeout 120 python -m pytest -q tests/test_torch_ops.py tests/test_gpu_decode.py -k "torch_ops or read_schemes" > $OUT/pytest_ops.log 2>&1; echo "ops rc $?"
grep -hE "PASSED|FAIL|ERROR|passed|failed|cooperative stages" $OUT/*.log | tail -40
