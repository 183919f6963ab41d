#!/bin/bash
# Session 11 review: the launcher refactor (fallback on sizing failures) and the warp-MMA property
# test with a cooperative-stages focus, on the GPU.
export PYTHONPATH=$PWD
timeout 200 python -m pytest -q -x tests/test_decode_launch.py tests/test_gpu_decode.py -p no:cacheprovider \
  -k "launch or cuda_graph or (cooperative and (tq4 or 4bit_nc))" > $OUT/pytest_review.log 2>&1
echo "pytest rc $?"; tail -2 $OUT/pytest_review.log
TQKERN_MAX_EXAMPLES=25 TQKERN_NO_SHRINK=1 timeout 330 python -m pytest -q property_tests/test_paged_decode_triton.py \
  -k mma --hypothesis-profile thorough --hypothesis-show-statistics -p no:cacheprovider > $OUT/pytest_mma.log 2>&1
echo "mma prop rc $?"; grep -i "passed\|failed\|cooperative\|error" $OUT/pytest_mma.log | head -12
