"""GPU timing helpers shared by the benchmark runners, and the check for a CUDA device.

Every time is the median of a CUDA-graph replay (``triton.testing.do_bench_cudagraph``): Python
launch overhead, which serving stacks also remove with graphs, counts for no variant, the torch
baselines included. :func:`eager_us` is the exception, for eager (no graph) calls.
"""

from __future__ import annotations

import time

import torch

__all__ = ["NO_CUDA_EXIT", "TIMING", "cuda_missing", "graph_us", "eager_us", "call_once", "environment"]

# Exit status of a benchmark run where no CUDA device is found. 2, not 0: nothing was measured,
# so a caller that chains the run (`tqkern bench --out f.json && publish f.json`, a CI step)
# must not take it for a success; 2 is also what argparse returns for a command that cannot run
# as invoked. What matters to a person is the message, which says why, with no traceback.
NO_CUDA_EXIT = 2

TIMING = "median of CUDA-graph replays (triton.testing.do_bench_cudagraph), after one warm-up call"


def cuda_missing() -> str | None:
    """Why no benchmark can run here (no CUDA device), or ``None`` where one is found."""
    if torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"no CUDA device found (torch {torch.__version__}, {build}); nothing was run"


def graph_us(fn, rep_ms: int = 100) -> float:
    """Median microseconds of GPU time of ``fn()`` captured in a CUDA graph and replayed for
    about ``rep_ms`` milliseconds."""
    import triton

    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


def eager_us(fn, iters: int = 200) -> float:
    """Mean microseconds per call of ``fn`` called from Python without a CUDA graph (as
    transformers' ``generate`` calls attention): host overhead and launches included."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def call_once(fn) -> float:
    """Run ``fn()`` once (compiling what it launches) and time nothing: NaN. The timer of
    ``tqkern bench --compile-only``, whose records are never written."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return float("nan")


def environment() -> dict:
    """The report's ``environment``: GPU, versions and the start time."""
    import triton

    import tqkern

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "capability": f"sm_{props.major}{props.minor}", "sms": props.multi_processor_count,
            "torch": str(torch.__version__), "cuda": torch.version.cuda, "triton": triton.__version__,
            "tqkern": tqkern.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
