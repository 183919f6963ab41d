"""Shared by the offline sm_90 compile tests (decode, store, prefill): compile the cases in two
subprocesses and hold each report to its budget (registers, shared memory, spills, SASS); which
cases: :func:`compiled_names`.

Budgets are ptxas-specific: each test file's ``BUDGETS`` hold Triton 3.9's numbers (CI's), its
``TRITON36`` Triton 3.6's where they exceed those (the GPU machines' compiler: its ptxas spills
more in some kernels, less in others, and emits up to 29% more instructions in one);
:func:`budget_of` picks by the running Triton."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import triton

from tqkern.ops.paged_decode.aot import tool_path

SM90_SHARED = 232448  # bytes of shared memory one program may use on an H100 (opt-in maximum)
INSTR_SLACK = 1.03
ALL_ENV = "TQKERN_SM90_ALL"  # =1: compile every budgeted kernel, not only each file's CI set


def compiled_names(budgets: dict, ci: tuple) -> list[str]:
    """The budgeted kernels this run compiles and checks: every one of ``budgets`` where
    ``TQKERN_SM90_ALL=1`` (before a change to a kernel's inner loop, and in the sessions that
    record budgets), else the file's CI set ``ci``: each kernel source and GPU-only feature at
    least once (bf16, FP8 conversion, inline PTX, every plan kind and head_dim), so that the
    README's test command stays within CI's time (the full set: 152 kernels, 1–27 CPU-seconds
    each here)."""
    unknown = sorted(set(ci) - set(budgets))
    if unknown:
        raise ValueError(f"CI cases without a budget: {unknown}")
    return sorted(budgets) if os.environ.get(ALL_ENV) == "1" else sorted(ci)


def compile_reports(report_in_subprocess, cases) -> dict:
    """``{name: report}`` of every case, compiled in two subprocesses (skips without ptxas)."""
    if not os.path.exists(tool_path("ptxas")):
        pytest.skip(f"Triton's bundled ptxas is not installed ({tool_path('ptxas')})")
    cases = sorted(cases)
    with ThreadPoolExecutor(2) as pool:
        got = [r for part in pool.map(report_in_subprocess, [cases[0::2], cases[1::2]]) for r in part]
    return {r["name"]: r for r in got}


def budget_of(name: str, budgets: dict, triton36: dict) -> tuple[int, int]:
    """``name``'s (stack bytes, SASS instructions) under the running Triton: ``triton36``'s entry
    under Triton 3.6, else ``budgets``' (Triton 3.9's)."""
    if triton.__version__.startswith("3.6.") and name in triton36:
        return triton36[name]
    return budgets[name]


def check_budget(reports: dict, name: str, budget: tuple[int, int]) -> None:
    """The launcher's register cap (``maxnreg`` where the report has one, else 255), the H100's
    shared memory (where reported), at most ``budget[0]`` stack bytes and ``budget[1]`` SASS
    instructions plus 3%."""
    r = reports.get(name)
    assert r is not None, f"{name} was not compiled"
    stack_budget, instrs_today = budget
    cap = r.get("maxnreg") or 255
    assert 0 < r["regs"] <= cap, f"{name}: {r['regs']} registers, the launcher's cap is {cap}"
    if "shared" in r:
        assert r["shared"] <= SM90_SHARED, f"{name}: {r['shared']} bytes of shared memory, the H100 has {SM90_SHARED}"
    assert r["stack"] <= stack_budget, f"{name}: {r['stack']} stack bytes (spills), budget {stack_budget}"
    limit = math.ceil(instrs_today * INSTR_SLACK)
    assert r["instrs"] <= limit, f"{name}: {r['instrs']} SASS instructions, budget {limit} (today {instrs_today})"
