#!/bin/bash
# Session 12 run 2: the PRMT-addressed pair table (tq4): GPU tests (partials bit-identical with
# both tables and every stage count), then tq4 with and without it at both goal shapes.
export PYTHONPATH=$PWD
timeout 260 python -m pytest -q -p no:cacheprovider tests/test_decode_launch.py tests/test_gpu_decode.py \
  -k "cooperative or graph or plan or smem or fallback" > $OUT/pytest.log 2>&1
echo "pytest rc $?"; tail -3 $OUT/pytest.log; grep -E "FAIL|Error" $OUT/pytest.log | head
timeout 200 python benchmarks/sweep_mma.py --out $OUT --hint 1 --warps 4 --coop -1 --table256 -1 0 \
  --shapes B32x16K B8x64K --presets tq4 --parts 2>&1 > $OUT/sweep.log
grep -E "gate|rotate" $OUT/sweep.log | head -20; grep -A8 "triton 3" $OUT/sweep.log
