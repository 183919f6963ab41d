"""CI sees the prefill kernel as a GPU compiles it: compiled for sm_90 (H100) with Triton's bundled
ptxas on a machine without a GPU (``tqkern/ops/prefill/aot.py``), with the plan's own constexprs,
for fp16 and bf16 outputs, head_dim 64–256, a raw-bf16 cache (the bf16 tensor-core path, which the interpreter
cannot run) and every option. Each kernel must compile within 255 registers and the H100's shared memory, and its stack bytes
(spills) and SASS instruction count stay within the budgets below (today's values from Triton
3.9's ptxas, instructions + 3%), so that a change adding spills or instructions fails here before
any device time is spent. These are compile facts only: the kernel has not run on a GPU yet.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tqkern.ops.paged_decode.aot import tool_path
from tqkern.ops.prefill.aot import report_in_subprocess

# case -> (stack bytes, SASS instructions) today (Triton 3.9). Stack > 0: spills, pinned as budgets.
BUDGETS = {
    "tq4:row:128:8:32:fp16": (72, 5576),
    "turboquant_4bit_nc:slot:128:8:32:bf16": (0, 5152),
    "turboquant_k8v4:slot:128:8:32:fp16": (16, 5056),
    "turboquant_3bit_nc:slot:64:3:9:fp16": (0, 4792),
    "tqkern_k5v3:slot:128:8:32:bf16": (456, 8664),
    "fp16:slot:256:2:8:bf16": (0, 2704),
    "raw_bf16:slot:128:2:8:bf16:window+softcap+sinks+lse": (0, 3168),
    # head_dim 256 with the rotate-back epilogue (its tf32x3 dot took 256 KiB of shared memory
    # with 64-column chunks: the H100 failed to launch it); spills measured, not yet addressed
    "tqkern_k5v3:slot:256:1:3:bf16": (2888, 21368),
    # one KV head: turboquant_4bit_nc's 16-bit-halves word read, which crashes Triton 3.6's
    # compiler beside another 4-bit side; the plan reads both sides through the loader
    "turboquant_4bit_nc:slot:128:1:3:fp16": (56, 8272),
}
SM90_SHARED = 232448  # bytes of shared memory one program may use on an H100 (opt-in maximum)
INSTR_SLACK = 1.03


@pytest.fixture(scope="module")
def reports() -> dict:
    if not os.path.exists(tool_path("ptxas")):
        pytest.skip(f"Triton's bundled ptxas is not installed ({tool_path('ptxas')})")
    cases = sorted(BUDGETS)
    with ThreadPoolExecutor(2) as pool:
        got = [r for part in pool.map(report_in_subprocess, [cases[0::2], cases[1::2]]) for r in part]
    return {r["name"]: r for r in got}


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_prefill_sm90_registers_spills_and_instructions(reports, name):
    r = reports.get(name)
    assert r is not None, f"{name} was not compiled"
    stack_budget, instrs_today = BUDGETS[name]
    assert 0 < r["regs"] <= 255, f"{name}: {r['regs']} registers"
    assert r["shared"] <= SM90_SHARED, f"{name}: {r['shared']} bytes of shared memory, the H100 has {SM90_SHARED}"
    assert r["stack"] <= stack_budget, f"{name}: {r['stack']} stack bytes (spills), budget {stack_budget}"
    limit = math.ceil(instrs_today * INSTR_SLACK)
    assert r["instrs"] <= limit, f"{name}: {r['instrs']} SASS instructions, budget {limit} (today {instrs_today})"
