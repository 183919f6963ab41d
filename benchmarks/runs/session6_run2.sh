export PYTHONPATH=$PWD
python -m pytest -q -x tests/test_decode_launch.py tests/test_gpu_decode.py -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/pytest_launch.log
TQKERN_MAX_EXAMPLES=30 TQKERN_NO_SHRINK=1 timeout 240 python -m pytest -q -x property_tests/test_paged_decode_triton.py -k mma --hypothesis-profile thorough -p no:cacheprovider 2>&1 | tail -40 | tee $OUT/pytest_mma.log
timeout 300 python benchmarks/sweep_mma.py --presets turboquant_k3v4_nc turboquant_k8v4 --prefetch 1 --hint 1 --warps 4 --maxnreg -1 128 --shapes B32x16K B8x64K SmolLM2_B32x4K --out $OUT 2>&1 | tee $OUT/sweep.log | tail -14
