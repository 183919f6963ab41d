"""The benchmarks on a machine without a CUDA device: a clear message, never a CUDA traceback.

Every subprocess runs with ``CUDA_VISIBLE_DEVICES=""``, so torch sees no CUDA device on any
machine and these tests run (and mean the same) on GPU machines too.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from tqkern_torch.bench.timing import NO_CUDA_EXIT

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

# One entry per op: each runs `tqkern bench <op>`, which checks for a CUDA device before any CUDA call.
GPU_SCRIPTS = {"bench_decode.py": "decode", "bench_store.py": "store", "bench_decompress.py": "decompress",
               "bench_prefill.py": "prefill", "bench_generate.py": "generate"}
# pytest-benchmark entries and the package marker, not scripts.
MODULES = ("__init__.py", "test_bench.py")


def _env() -> dict:
    # (an xdist worker's PYTEST_XDIST_* would make the inner pytest-benchmark think xdist is on)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS" and not k.startswith("PYTEST_XDIST_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_every_benchmark_file_is_classified():
    """benchmarks/ holds one entry per op and the pytest-benchmark file: one-off run scripts stay
    out of the tree (what they taught goes into docs/performance.md)."""
    assert sorted(p.name for p in BENCH.glob("*.py")) == sorted([*GPU_SCRIPTS, *MODULES])
    for name, op in GPU_SCRIPTS.items():
        assert f'main(["bench", "{op}", *sys.argv[1:]])' in (BENCH / name).read_text(), name


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_gpu_script_exits_cleanly_without_cuda(script, tmp_path):
    res = subprocess.run([sys.executable, str(BENCH / script)], capture_output=True, text=True, timeout=120,
                         env=_env(), cwd=tmp_path)
    assert res.returncode == NO_CUDA_EXIT, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith("tqkern bench needs a CUDA GPU: no CUDA device found")
    assert res.stdout == ""
    assert not any(tmp_path.iterdir())  # no result files written


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_entry_help_needs_no_gpu(script, tmp_path):
    res = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True,
                         text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "--shapes" in res.stdout and "--plot" in res.stdout


def _pytest(*args) -> subprocess.CompletedProcess:
    pytest.importorskip("pytest_benchmark")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)


def _shape_tests() -> int:
    """How many tests tests/test_bench_shapes.py holds (the non-benchmark tests these runs add)."""
    res = _pytest("--collect-only", "tests/test_bench_shapes.py")
    m = re.search(r"(\d+) tests? collected", res.stdout)
    assert m, res.stdout + res.stderr
    return int(m[1])


def test_benchmark_only_says_the_benchmarks_need_a_gpu():
    # decode: 4 presets + SDPA; store: (4 presets + the fp16 baseline) x 2 shapes; decompress: 4 presets
    # + copy_; prefill: 4 presets + SDPA; generate: 2
    res = _pytest("--benchmark-only", "benchmarks", "tests/test_bench_shapes.py")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "why no benchmark ran" in out
    assert "benchmarks need a CUDA GPU: 27 skipped (no CUDA device found)" in out
    assert f"--benchmark-only skipped {_shape_tests()} tests that are not benchmarks" in out
    assert "no benchmark collected" not in out
    assert "needs a CUDA GPU (no CUDA device found)" in out.split("short test summary info")[1]


def test_benchmark_only_outside_benchmarks_names_where_they_are():
    res = _pytest("--benchmark-only", "tests/test_bench_shapes.py")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no benchmark collected: the benchmarks are in benchmarks/test_bench.py" in res.stdout
    assert "benchmarks need a CUDA GPU, and no CUDA device was found here either" in res.stdout


def test_no_hint_without_benchmark_only():
    res = _pytest("tests/test_bench_shapes.py")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{_shape_tests()} passed" in res.stdout
    assert "why no benchmark ran" not in res.stdout and "CUDA" not in res.stdout
