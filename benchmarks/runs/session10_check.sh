#!/bin/bash
# Session 10: GPU tests after the timing-probe code went into the warp-MMA kernel (its default
# SASS is byte-identical offline; this checks it on the GPU), and the warp-MMA property test.
export PYTHONPATH=$PWD
timeout 330 python -m pytest -q -x tests/test_decode_launch.py tests/test_gpu_decode.py tests/test_torch_ops.py \
  -p no:cacheprovider > $OUT/pytest_gpu.log 2>&1; echo "pytest rc $?"; tail -3 $OUT/pytest_gpu.log
TQKERN_MAX_EXAMPLES=30 TQKERN_NO_SHRINK=1 timeout 220 python -m pytest -q property_tests/test_paged_decode_triton.py \
  -k mma --hypothesis-profile thorough -p no:cacheprovider > $OUT/pytest_mma.log 2>&1
echo "mma prop rc $?"; tail -3 $OUT/pytest_mma.log
