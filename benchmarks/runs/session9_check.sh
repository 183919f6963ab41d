# Session 9: GPU tests after SUB=2 became the plan for Lloyd-Max values, and the warp-MMA
# property test (40 examples, every read scheme drawn through the public path).
export PYTHONPATH=$PWD
timeout 250 python -m pytest -q -x tests/test_decode_launch.py tests/test_gpu_decode.py tests/test_torch_ops.py \
  -p no:cacheprovider > $OUT/pytest_gpu.log 2>&1; echo "pytest rc $?"; tail -3 $OUT/pytest_gpu.log
TQKERN_MAX_EXAMPLES=40 TQKERN_NO_SHRINK=1 timeout 280 python -m pytest -q property_tests/test_paged_decode_triton.py \
  -k mma --hypothesis-profile thorough --hypothesis-show-statistics -p no:cacheprovider > $OUT/pytest_mma.log 2>&1
echo "mma prop rc $?"; grep -E "passed|failed|%|Error" $OUT/pytest_mma.log | tail -30
