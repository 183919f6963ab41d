"""``tqkern bench --jobs N``: compile a run's kernels in ``N`` processes before it is timed.

Each Triton variant a benchmark launches compiles on first use (10–30 s for the store and decode
kernels on an H200's host), one after another, so compiles, not timings, take most of a run of
several presets. ``--jobs N`` first runs ``tqkern bench OP --presets SHARE --shapes ...
--compile-only`` in up to ``N`` processes at once, the presets of each op dealt round-robin into
``N`` shares (or, with fewer presets than ``N``, each preset's shapes dealt into shares of their
own): each runs its gates and calls every variant once, untimed, filling Triton's on-disk cache
(``TRITON_CACHE_DIR``, shared by the processes). The timed run that follows, in this process and
alone on the GPU, then finds its kernels compiled: no time is measured while another process runs.
(Seen on an H200 in session 51, the same steps from a script: four presets at three decode shapes
compiled in four processes in 230 s, after which the serial gates and 19 timings took 65 s; one
process alone had gated two of the presets and timed nothing after 240 s. In session 55 eight
presets at the fifteen other model shapes, in 8 processes, had not finished compiling after 540 s,
nor after 420 s more: a model table takes several runs of a few shapes each. Each command's end is
logged.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import IO, Optional, Sequence

__all__ = ["compile_commands", "compile_in_processes"]


def compile_commands(selection: dict, jobs: int, *, eager_shapes: Sequence[str] = (),
                     quick: bool = False) -> list[list[str]]:
    """The ``--compile-only`` commands of ``--jobs``: per op of ``selection`` (``{op: (presets,
    shapes)}``, :func:`~tqkern_torch.bench.runner.select`'s), one command per share, each naming
    its presets and shapes (and, in a decode share holding the first shapes, the eager shapes) so that
    together they compile what the timed run launches. With at least ``jobs`` presets the presets
    are dealt round-robin into ``jobs`` shares over every shape; with fewer, each preset's shapes
    are dealt into ``jobs // len(presets)`` shares (a preset's gate then runs in each of its
    shares, at the heads of that share's shapes), so that no more than ``jobs`` commands are made
    and, where there are enough shapes, ``jobs`` processes have work."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    out = []
    for op, (presets, shapes) in selection.items():
        names = [s.name for s in shapes]
        if len(presets) >= jobs:
            shares = [(presets[k::jobs], names, True) for k in range(jobs)]
        else:
            per = max(1, min(len(names), jobs // max(1, len(presets))))
            shares = [([p], names[k::per], k == 0) for p in presets for k in range(per)]
        for share, share_shapes, first in shares:
            cmd = [sys.executable, "-m", "tqkern.cli", "bench", op, "--presets", *share,
                   "--shapes", *share_shapes, "--compile-only"]
            if op == "decode" and eager_shapes and first:
                cmd += ["--eager", *eager_shapes]
            out.append(cmd + (["--quick"] if quick else []))
    return out


def compile_in_processes(commands: list[list[str]], jobs: int, *, poll_s: float = 0.5,
                         log: Optional[IO[str]] = None) -> list[str]:
    """Run ``commands`` with at most ``jobs`` at once; the failed ones, as lines naming their
    command and exit status (their output is discarded: the timed run gates and reports again).
    ``log`` (a text stream, e.g. ``sys.stderr``) gets a line as each command ends: which, how long,
    how many are done, so that a run cut in this phase shows where its time went. On
    ``KeyboardInterrupt`` (``timeout -s INT``) the running commands are killed first."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    waiting, running, failed = list(commands), [], []
    done = 0
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                cmd = waiting.pop(0)
                running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                                time.perf_counter()))
            time.sleep(poll_s)
            for item in list(running):
                cmd, proc, t0 = item
                if proc.poll() is not None:
                    running.remove(item)
                    done += 1
                    if proc.returncode:
                        failed.append(f"exit {proc.returncode}: {' '.join(cmd[1:])}")
                    if log is not None:
                        print(f"compile {done}/{len(commands)} ({_describe(cmd)}) "
                              f"{'exit ' + str(proc.returncode) if proc.returncode else 'done'} in "
                              f"{time.perf_counter() - t0:.0f} s", file=log, flush=True)
    except KeyboardInterrupt:
        for _, proc, _ in running:
            proc.kill()
        for _, proc, _ in running:
            proc.wait()
        raise
    return failed


def _describe(cmd: list[str]) -> str:
    """``OP PRESETS at N shapes`` of a ``--compile-only`` command (any other: its arguments)."""
    if "--presets" not in cmd or "--shapes" not in cmd or "--compile-only" not in cmd:
        return " ".join(cmd[1:])
    i, j = cmd.index("--presets"), cmd.index("--shapes")
    shapes = cmd[j + 1:cmd.index("--compile-only")]
    return f"{cmd[i - 1]} {' '.join(cmd[i + 1:j])} at {len(shapes)} shape{'s' * (len(shapes) != 1)}"
