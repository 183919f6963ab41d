#!/bin/bash
# Session 12 run 4: two items per CTA with a named barrier each (turboquant_4bit_nc), bit-identity
# tests for the 4-bit presets (items, tables, stage counts), merge variants at both shapes.
export PYTHONPATH=$PWD
timeout 250 python -m pytest -v -p no:cacheprovider tests/test_gpu_decode.py \
  -k "cooperative and (tq4 or 4bit_nc)" > $OUT/pytest.log 2>&1
echo "pytest rc $?"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/pytest.log | tail -8
timeout 300 python benchmarks/sweep_mma.py --out $OUT --hint 1 --warps 4 --coop -1 --items 0 2 --table256 -1 0 \
  --shapes B32x16K B8x64K --presets turboquant_4bit_nc tq4 --parts --fixed > $OUT/sweep.log 2>&1
grep -E "gate|rotate" $OUT/sweep.log | head -24; grep -A40 "triton 3" $OUT/sweep.log | grep -v rotate_q
