"""``tqkern bench --jobs N``: compile a run's kernels in ``N`` processes before it is timed.

Each Triton variant a benchmark launches compiles on first use (10–30 s for the store and decode
kernels on an H200's host), one after another, so compiles, not timings, take most of a run of
several presets. ``--jobs N`` first runs ``tqkern bench OP --presets SHARE --shapes ...
--compile-only`` in up to ``N`` processes at once, the presets of each op dealt round-robin into
``N`` shares: each runs its gates and calls every variant once, untimed, filling Triton's on-disk
cache (``TRITON_CACHE_DIR``, shared by the processes). The timed run that follows, in this process
and alone on the GPU, then finds its kernels compiled: no time is measured while another process
runs. (Seen on an H200 in session 51, the same steps from a script: four presets at three decode
shapes compiled in four processes in 230 s, after which the serial gates and 19 timings took
65 s; one process alone had gated two of the presets and timed nothing after 240 s.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Sequence

__all__ = ["compile_commands", "compile_in_processes"]


def compile_commands(selection: dict, jobs: int, *, eager_shapes: Sequence[str] = (),
                     quick: bool = False) -> list[list[str]]:
    """The ``--compile-only`` commands of ``--jobs``: per op of ``selection`` (``{op: (presets,
    shapes)}``, :func:`~tqkern_torch.bench.runner.select`'s), its presets dealt round-robin into at
    most ``jobs`` shares, one command each, naming the op's shapes (and, for decode, the eager
    shapes) so that it compiles what the timed run launches."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    out = []
    for op, (presets, shapes) in selection.items():
        for k in range(min(jobs, len(presets))):
            cmd = [sys.executable, "-m", "tqkern.cli", "bench", op, "--presets", *presets[k::jobs],
                   "--shapes", *(s.name for s in shapes), "--compile-only"]
            if op == "decode" and eager_shapes:
                cmd += ["--eager", *eager_shapes]
            out.append(cmd + (["--quick"] if quick else []))
    return out


def compile_in_processes(commands: list[list[str]], jobs: int, *, poll_s: float = 0.5) -> list[str]:
    """Run ``commands`` with at most ``jobs`` at once; the failed ones, as lines naming their
    command and exit status (their output is discarded: the timed run gates and reports again)."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    waiting, running, failed = list(commands), [], []
    while waiting or running:
        while waiting and len(running) < jobs:
            cmd = waiting.pop(0)
            running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        time.sleep(poll_s)
        for cmd, proc in list(running):
            if proc.poll() is not None:
                running.remove((cmd, proc))
                if proc.returncode:
                    failed.append(f"exit {proc.returncode}: {' '.join(cmd[1:])}")
    return failed
