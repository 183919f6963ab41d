# Session 13 run 4: GPU tests of the new plans (two steps per update under 2 stages for uniform
# values next to table-decoded keys, values read after the update, unpredicated shared reads).
export PYTHONPATH=$PWD
timeout 330 python -m pytest -v -x tests/test_gpu_decode.py -k "bit_for_bit and 16" > $OUT/pytest_bit16.log 2>&1; echo "bit16 rc $?"
timeout 200 python -m pytest -v tests/test_gpu_decode.py -k "cuda_graph or 64k or 2gib" > $OUT/pytest_graph.log 2>&1; echo "graph rc $?"
grep -hE "PASS|FAIL|ERROR|passed|failed" $OUT/*.log | tail -40
