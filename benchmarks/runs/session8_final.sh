# Session 8, final: tests on the GPU (the general launcher was restructured for the wave rule),
# then the full decode benchmark (every preset, every shape, SDPA same run).
export PYTHONPATH=$PWD
timeout 250 python -m pytest -q -x tests/test_decode_launch.py tests/test_gpu_decode.py tests/test_torch_ops.py \
  -p no:cacheprovider > $OUT/pytest_gpu.log 2>&1; echo "pytest rc $?"; tail -3 $OUT/pytest_gpu.log
timeout 320 python benchmarks/bench_decode.py --out $OUT --no-store > $OUT/bench.log 2>&1
echo "bench rc $?"; grep -v "^gate.* ok$" $OUT/bench.log | tail -50
