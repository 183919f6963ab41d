# Session 9 review: the warp-MMA loop written once for any SUB (SASS byte-identical offline), the
# sweeps' shared oracle gate: gate-only runs of both sweeps, the GPU decode tests.
export PYTHONPATH=$PWD
python benchmarks/sweep_mma.py --out $OUT/m --presets tq4 turboquant_4bit_nc tqkern_k5v3 --hint 1 --warps 4 --sub 0 1 2 --shapes > $OUT/sweep_mma_gate.log 2>&1; echo "mma gate rc $?"; grep gate $OUT/sweep_mma_gate.log
python benchmarks/sweep_general.py --out $OUT/g --presets fp16 --shapes > $OUT/sweep_general_gate.log 2>&1; echo "general gate rc $?"; grep "gate" $OUT/sweep_general_gate.log | tail -3
timeout 300 python -m pytest -q tests/test_decode_launch.py tests/test_gpu_decode.py -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc $?"; tail -2 $OUT/pytest.log
