"""Repository-wide pytest hooks: the interpreter's bounds check, a faster interpreter for the
tests, and why ``pytest --benchmark-only`` timed nothing.

Under Triton's interpreter (``TRITON_INTERPRET=1``) every test runs inside
:func:`tqkern_torch.bounds.interpreter_bounds_checked`: a kernel launch that reads or writes
memory outside its tensor arguments fails the test (or the Hypothesis example) that made it.

``--benchmark-only`` (pytest-benchmark) skips every test that does not use the ``benchmark``
fixture, and the benchmarks themselves (``benchmarks/test_bench.py``, outside ``testpaths``)
need a CUDA GPU. Without these hooks a CPU machine reports only "N skipped"; with them the
summary ends with one line per reason.
"""

from __future__ import annotations

import inspect
import os

import pytest

_BENCHMARK_IDS = pytest.StashKey[frozenset]()


def _skip_nested_language_patches() -> bool:
    """Triton's interpreter (3.9) re-patches ``triton.language`` on every ``@triton.jit`` device
    function call (``_patch_lang``: a scan of every member of the language modules), though the
    launch has patched those modules already and the nested patch is never undone; in the
    interpreted tests that scan took ~40% of the time (a profile of one transformers test). Within
    a launch, a device function whose language modules the launch has patched skips the repeat
    (the same attributes, the same semantics); anything else takes Triton's path. No-op where the
    interpreter's internals differ (another Triton) or ``TQKERN_FAST_INTERPRETER=0``. Returns
    whether it was installed."""
    if os.environ.get("TQKERN_FAST_INTERPRETER", "1") == "0" or not os.environ.get("TRITON_INTERPRET"):
        return False
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    if not all(hasattr(interp, n) for n in ("_patch_lang", "GridExecutor", "_LangPatchScope", "tl")):
        return False
    if getattr(interp, "_tqkern_nested_patches_skipped", False):
        return True
    patch0, call0 = interp._patch_lang, interp.GridExecutor.__call__
    tl = interp.tl
    state = {"depth": 0, "patched": frozenset()}
    modules = {}  # function -> ids of the language modules its globals hold (found once)

    def patch_lang(fn):
        langs = modules.get(fn)
        if langs is None:
            langs = modules[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                            if inspect.ismodule(v) and v in (tl, tl.core))
        if state["depth"] and langs <= state["patched"]:
            return interp._LangPatchScope()  # (an empty scope: nothing to undo)
        scope = patch0(fn)
        if state["depth"]:
            state["patched"] |= langs
        return scope

    def call(self, *args, **kwargs):
        outer = state["patched"]
        state["depth"] += 1
        state["patched"] = frozenset()
        try:
            return call0(self, *args, **kwargs)
        finally:
            state["depth"] -= 1
            state["patched"] = outer

    interp._patch_lang, interp.GridExecutor.__call__ = patch_lang, call
    interp._tqkern_nested_patches_skipped = True
    return True


def pytest_configure(config: pytest.Config) -> None:
    _skip_nested_language_patches()


@pytest.fixture(autouse=True)
def _interpreter_bounds_checked(request):
    """Every test under the interpreter's bounds check (module docstring); elsewhere, and for a
    test marked ``bounds_unchecked`` (the checker's own tests), a no-op."""
    if request.node.get_closest_marker("bounds_unchecked"):
        yield
        return
    try:
        from tqkern_torch._validate import interpreting
        from tqkern_torch.bounds import interpreter_bounds_checked
    except ImportError:  # (no torch: the NumPy-only tests run unchecked, as they launch nothing)
        yield
        return
    if not interpreting():
        yield
        return
    with interpreter_bounds_checked():
        yield


def _benchmark_only(config: pytest.Config) -> bool:
    return bool(config.getoption("benchmark_only", default=False))  # False without pytest-benchmark


def _cuda_device() -> bool:
    try:
        import torch
    except Exception:  # noqa: BLE001 - no (working) torch: no CUDA device either
        return False
    return torch.cuda.is_available()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _benchmark_only(config):
        config.stash[_BENCHMARK_IDS] = frozenset(
            item.nodeid for item in items if "benchmark" in getattr(item, "fixturenames", ()))


def benchmark_hints(config: pytest.Config, stats: dict) -> list[str]:
    """The lines that explain a ``--benchmark-only`` run that timed no benchmark (else none).

    Args:
        config: the session's config.
        stats: the terminal reporter's ``stats`` (outcome -> reports).
    """
    if not _benchmark_only(config):
        return []
    bench = config.stash.get(_BENCHMARK_IDS, frozenset())
    if any(r.nodeid in bench for r in stats.get("passed", ())):
        return []
    skipped = [r for r in stats.get("skipped", ()) if getattr(r, "nodeid", None)]
    lines = []
    if not bench:
        lines.append("no benchmark collected: the benchmarks are in benchmarks/test_bench.py (not in testpaths); "
                     "run `pytest benchmarks --benchmark-only`")
    if not _cuda_device():
        n = sum(r.nodeid in bench for r in skipped)
        lines.append(f"benchmarks need a CUDA GPU: {n} skipped (no CUDA device found)" if bench else
                     "benchmarks need a CUDA GPU, and no CUDA device was found here either")
    others = sum(r.nodeid not in bench for r in skipped)
    if others:
        lines.append(f"--benchmark-only skipped {others} tests that are not benchmarks")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    lines = benchmark_hints(config, terminalreporter.stats)
    if lines:
        terminalreporter.write_sep("=", "why no benchmark ran", yellow=True)
        for line in lines:
            terminalreporter.write_line(line)
