"""``tqkern info``: the formats table and the reconstruction-error demo, on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

import tqkern
from tqkern import cli
from tqkern.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Slot bytes at head_dim 128. The first five are the peers' sizes (vLLM's turboquant_* cache
# dtypes, vllm-project/vllm#38479, and turboquant-vllm's 136 per head); the tqkern_* and fp16
# rows follow from the field sizes:
# k5v3 = (5·128/8 + 4) + (3·128/8 + 4), k4v4 = 2·(4·128/8 + 4), fp16 = 2·2·128.
GOLDEN_SLOT_BYTES_128 = {
    "turboquant_k8v4": 196,
    "turboquant_4bit_nc": 134,
    "turboquant_k3v4_nc": 118,
    "turboquant_3bit_nc": 102,
    "tq4": 136,
    "tqkern_k5v3": 136,
    "tqkern_k4v4": 136,
    "fp16": 512,
}

# D_mse of the Gaussian Lloyd-Max codebook for a unit vector (docs/algorithms.md): the relative
# key error of a Lloyd-Max key is about its square root (norm correction changes it by O(D²)).
DMSE = {3: 0.0345, 4: 0.0095}


def _run(argv, capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _table_rows(out: str) -> dict[str, list[str]]:
    """Rows of the formats table: preset name -> whitespace-split cells."""
    return {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in tqkern.PRESETS and len(line.split()) >= 5}


def _error_rows(out: str) -> dict[str, tuple[float, float]]:
    """Rows of the demo table: preset name -> (K error, V error)."""
    out = out[out.index("Demo:"):]
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if len(cells) == 3 and cells[0] in tqkern.PRESETS:
            rows[cells[0]] = (float(cells[1]), float(cells[2]))
    return rows


def test_golden_table_covers_every_preset():
    assert set(GOLDEN_SLOT_BYTES_128) == set(tqkern.PRESETS)


def test_info_lists_every_preset_with_its_slot_bytes(capsys):
    rows = _table_rows(_run(["info"], capsys))
    assert set(rows) == set(tqkern.PRESETS)
    for name, cells in rows.items():
        assert int(cells[1]) == GOLDEN_SLOT_BYTES_128[name], name
        assert cells[2] == f"{4 * 128 / GOLDEN_SLOT_BYTES_128[name]:.2f}x", name


def test_bare_command_runs_info(capsys):
    assert _run([], capsys) == _run(["info"], capsys)


def test_info_errors_are_finite_and_plausible(capsys):
    errors = _error_rows(_run(["info"], capsys))
    assert set(errors) == set(tqkern.PRESETS)
    for name, (ek, ev) in errors.items():
        assert math.isfinite(ek) and math.isfinite(ev), name
        assert 0.0 <= ek < 0.5 and 0.0 <= ev < 0.5, name
    # 4-bit Lloyd-Max keys: relative error ≈ sqrt(D_mse(4)) ≈ 0.097, ±30%.
    for name in ("turboquant_4bit_nc", "tq4", "tqkern_k4v4"):
        assert errors[name][0] == pytest.approx(math.sqrt(DMSE[4]), rel=0.3), name
    for name in ("turboquant_k3v4_nc", "turboquant_3bit_nc"):
        assert errors[name][0] == pytest.approx(math.sqrt(DMSE[3]), rel=0.3), name
    # More bits, less error; the fp16 format stores fp16 data exactly.
    assert errors["tqkern_k5v3"][0] < errors["tqkern_k4v4"][0]
    assert errors["turboquant_k8v4"][0] < errors["turboquant_4bit_nc"][0]
    assert errors["turboquant_3bit_nc"][1] > errors["turboquant_4bit_nc"][1]
    assert errors["fp16"] == (0.0, 0.0)


def test_info_json(capsys):
    report = json.loads(_run(["info", "--json", "--head-dim", "64"], capsys))
    assert report["head_dim"] == 64
    slots = {r["preset"]: r["slot_bytes"] for r in report["formats"]}
    assert {k: slots[k] for k in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                                  "turboquant_3bit_nc")} == {
        "turboquant_k8v4": 100, "turboquant_4bit_nc": 70, "turboquant_k3v4_nc": 62, "turboquant_3bit_nc": 54}
    for r in report["formats"]:
        fmt = tqkern.KVFormat.preset(r["preset"], 64)
        assert r["compression"] == pytest.approx(4 * 64 / fmt.slot_bytes)
        assert sum(f["nbytes"] for f in r["fields"]) + r["pad_bytes"] == r["slot_bytes"]
    errors = report["demo"]["errors"]
    assert set(errors) == set(tqkern.PRESETS)
    assert all(math.isfinite(e["key"]) and math.isfinite(e["value"]) for e in errors.values())


def test_info_non_power_of_two_head_dim(capsys):
    rows = _table_rows(_run(["info", "--head-dim", "96", "--num-tokens", "16"], capsys))
    assert int(rows["turboquant_4bit_nc"][1]) == tqkern.KVFormat.preset("turboquant_4bit_nc", 96).slot_bytes


@pytest.mark.parametrize("argv", [["info", "--head-dim", "7"], ["info", "--head-dim", "0"],
                                  ["info", "--num-tokens", "x"], ["bogus"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_module_entry_point_needs_no_gpu():
    out = subprocess.run(
        [sys.executable, "-m", "tqkern.cli", "--json", "--num-tokens", "8"],
        capture_output=True, text=True, check=True, timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    ).stdout
    assert json.loads(out)["environment"]["cuda"] is None


def _run_without(modules, tmp_path, *args) -> subprocess.CompletedProcess:
    """``python -m tqkern.cli *args`` where importing any of ``modules`` raises ImportError."""
    for name in modules:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} blocked by the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    return subprocess.run([sys.executable, "-m", "tqkern.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)


def test_info_needs_only_numpy(tmp_path):
    res = _run_without(["torch", "triton"], tmp_path, "info", "--num-tokens", "8")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    assert set(_table_rows(res.stdout)) == set(tqkern.PRESETS)
    assert set(_error_rows(res.stdout)) == set(tqkern.PRESETS)
    assert "torch not available" in res.stdout.splitlines()[0]
    assert "CUDA: none" in res.stdout.splitlines()[0]


def test_help_needs_only_numpy(tmp_path):
    res = _run_without(["torch", "triton"], tmp_path, "--help")
    assert res.returncode == 0, res.stderr
    assert "usage: tqkern" in res.stdout and "info" in res.stdout


def test_environment_reports_torch_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    from tqkern import info

    env = info._environment()
    assert env["torch"] is None and env["cuda"] is None
    assert env["numpy"] is not None


def test_subcommand_needing_torch_names_it(monkeypatch, capsys):
    def needs_torch(args) -> int:
        cli.require_torch()
        return 0

    cmd = cli.Command("needs-torch", "a subcommand that imports torch", lambda p: None, needs_torch)
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, cmd])
    assert main(["needs-torch"]) == 0  # torch is importable here
    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["needs-torch"]) == 1
    err = capsys.readouterr().err
    assert "tqkern needs-torch: needs torch" in err and "pip install torch" in err


def test_torch_frontend_reexports_the_cli():
    from tqkern_torch import cli as old

    assert old.main is main and old.info_report is cli.info_report


def test_plan_prints_the_decode_plan(capsys):
    """``tqkern plan`` prints the plan paged_decode would run: on an H100 tq4 takes the
    cooperative warp-MMA kernel (its four stages named), under the interpreter the general kernel."""
    assert main(["plan", "--preset", "tq4", "--batch", "4", "--tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "decode      coop kernel" in out and "COOP=4" in out and "shapes      4 seqs x 32 q heads, 256 blocks" in out
    assert main(["plan", "--preset", "fp16", "--device", "interpreter", "--num-splits", "3"]) == 0
    out = capsys.readouterr().out
    assert "decode      general kernel, 3 splits, grid (32, 8, 3)" in out and "(interpreter)" in out


def test_plan_prints_the_store_plans(capsys):
    """... and the store plans of a decode step and of a prefill: on an H100 a Hadamard preset
    takes the warp store kernel (one iteration per program for the 32-token step, more for a long
    prefill), tq4 (a dense rotation) the tile kernel, the interpreter always the tile kernel."""
    assert main(["plan", "--preset", "turboquant_4bit_nc", "--tokens", "16384"]) == 0
    out = capsys.readouterr().out
    assert ("store of a decode step: store fp16: warp kernel, rotation fwht, 8 lanes per vector, "
            "half-table search, 1 warp x 1 iteration") in out
    assert "store of a 16384-token prefill: store fp16: warp kernel" in out and "x 8 iterations" in out
    assert main(["plan", "--preset", "tq4"]) == 0
    assert "store of a decode step: store fp16: rotation split" in capsys.readouterr().out
    assert main(["plan", "--preset", "turboquant_4bit_nc", "--device", "interpreter"]) == 0
    assert "warp kernel" not in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["plan", "--preset", "nope"], ["plan", "--q-heads", "12"]])
def test_plan_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "tqkern: error: plan:" in capsys.readouterr().err
