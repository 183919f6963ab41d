export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python -m pytest -q -x tests/test_decode_launch.py -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/pytest_launch.log
TQKERN_MAX_EXAMPLES=20 TQKERN_NO_SHRINK=1 timeout 200 python -m pytest -q -x property_tests/test_paged_decode_triton.py -k mma --hypothesis-profile thorough -p no:cacheprovider 2>&1 | tail -30 | tee $OUT/pytest_mma.log
timeout 300 python benchmarks/sweep_mma.py --presets turboquant_k8v4 tq4 turboquant_4bit_nc --prefetch 1 --hint 1 2 --warps 4 --shapes B32x16K B8x64K SmolLM2_B32x4K --out $OUT 2>&1 | tee $OUT/sweep.log | tail -30
