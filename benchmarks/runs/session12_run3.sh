#!/bin/bash
# Session 12 run 3: two work items per CTA with the PRMT-addressed table for turboquant_4bit_nc:
# bit-identity GPU tests for the 4-bit presets, then the sweep (items 1 / 2, table 32 KB / PRMT).
export PYTHONPATH=$PWD
timeout 300 python -m pytest -v -p no:cacheprovider tests/test_gpu_decode.py \
  -k "cooperative and (tq4 or 4bit_nc)" > $OUT/pytest.log 2>&1
echo "pytest rc $?"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/pytest.log | tail -8
timeout 220 python benchmarks/sweep_mma.py --out $OUT --hint 1 --warps 4 --coop -1 --items 0 2 --table256 -1 0 \
  --shapes B32x16K B8x64K --presets turboquant_4bit_nc --parts > $OUT/sweep.log 2>&1
grep -E "gate|rotate" $OUT/sweep.log | head -20; grep -A10 "triton 3" $OUT/sweep.log
