# Session 7, run 1: shifted reads + 3-bit uniform values: correctness, then shifted-vs-joined timing.
export PYTHONPATH=$PWD
TQKERN_MAX_EXAMPLES=40 TQKERN_NO_SHRINK=1 timeout 240 python -m pytest -q property_tests/test_paged_decode_triton.py \
  -k mma --hypothesis-profile thorough -p no:cacheprovider > $OUT/pytest_mma.log 2>&1; echo "mma prop rc $?"
tail -4 $OUT/pytest_mma.log
timeout 150 python -m pytest -q tests/test_decode_launch.py tests/test_gpu_decode.py -p no:cacheprovider \
  > $OUT/pytest_launch.log 2>&1; echo "launch rc $?"
tail -3 $OUT/pytest_launch.log
timeout 200 python benchmarks/sweep_mma.py --out $OUT --presets turboquant_4bit_nc turboquant_k8v4 turboquant_k3v4_nc tq4 \
  --prefetch 1 --hint 1 --warps 4 --maxnreg -1 0 --shifted 0 1 --shapes B32x16K B8x64K > $OUT/sweep.log 2>&1
echo "sweep rc $?"; grep -v "^gate" $OUT/sweep.log | tail -40
