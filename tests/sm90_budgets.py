"""Shared by the offline sm_90 compile tests (store, prefill): compile every case in two
subprocesses and hold each report to its budget (registers, shared memory, spills, SASS)."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tqkern.ops.paged_decode.aot import tool_path

SM90_SHARED = 232448  # bytes of shared memory one program may use on an H100 (opt-in maximum)
INSTR_SLACK = 1.03


def compile_reports(report_in_subprocess, cases) -> dict:
    """``{name: report}`` of every case, compiled in two subprocesses (skips without ptxas)."""
    if not os.path.exists(tool_path("ptxas")):
        pytest.skip(f"Triton's bundled ptxas is not installed ({tool_path('ptxas')})")
    cases = sorted(cases)
    with ThreadPoolExecutor(2) as pool:
        got = [r for part in pool.map(report_in_subprocess, [cases[0::2], cases[1::2]]) for r in part]
    return {r["name"]: r for r in got}


def check_budget(reports: dict, name: str, budget: tuple[int, int]) -> None:
    """255 registers at most, the H100's shared memory (where reported), at most ``budget[0]``
    stack bytes and ``budget[1]`` SASS instructions plus 3%."""
    r = reports.get(name)
    assert r is not None, f"{name} was not compiled"
    stack_budget, instrs_today = budget
    assert 0 < r["regs"] <= 255, f"{name}: {r['regs']} registers"
    if "shared" in r:
        assert r["shared"] <= SM90_SHARED, f"{name}: {r['shared']} bytes of shared memory, the H100 has {SM90_SHARED}"
    assert r["stack"] <= stack_budget, f"{name}: {r['stack']} stack bytes (spills), budget {stack_budget}"
    limit = math.ceil(instrs_today * INSTR_SLACK)
    assert r["instrs"] <= limit, f"{name}: {r['instrs']} SASS instructions, budget {limit} (today {instrs_today})"
