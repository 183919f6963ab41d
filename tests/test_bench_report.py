"""``tqkern bench`` without a GPU: the report's schema, table, plot and progress bar on fake
records, which presets and shapes a run selects, and the command's exits (no CUDA device,
no matplotlib, bad arguments). The timing itself needs a GPU (benchmarks/test_bench.py)."""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from tqkern.cli import main
from tqkern_torch.bench import report as rep
from tqkern_torch.bench import runner
from tqkern_torch.bench.shapes import (BLOCK_SIZE, DECODE_SHAPES, PREFILL_SHAPES, QUICK_SHAPES, STORE_SHAPES, StoreShape,
                                       store_shape)
from tqkern_torch.bench.store import slot_mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"gpu": "Fake GPU", "torch": "0.0", "triton": "0.0", "tqkern": "0.0", "time": "2026-01-01 00:00:00"}


def fake_report() -> dict:
    """Decode at two shapes (SDPA 200 / 40 µs), store at one (baseline 10 µs), one eager shape;
    turboquant_k8v4 failed its decode gate, so it has no decode record."""
    r = rep.record
    records = [
        r("decode", "B32x4K", "sdpa_fp16", "sdpa_fp16", 200.0, 200.0, nbytes=536870912),
        r("decode", "B32x4K", "tq4", "sdpa_fp16", 80.0, 200.0, nbytes=142606336),
        r("decode", "SmolLM2_B32x4K", "sdpa_fp16", "sdpa_fp16", 40.0, 40.0, nbytes=100663296),
        r("decode", "SmolLM2_B32x4K", "tq4", "sdpa_fp16", 25.0, 40.0, nbytes=26738688),
        r("store", "decode_B32", "fp16_index_copy", "fp16_index_copy", 10.0, 10.0, nbytes=262144),
        r("store", "decode_B32", "tq4", "fp16_index_copy", 40.0, 10.0, nbytes=165888),
        r("store", "decode_B32", "turboquant_k8v4", "fp16_index_copy", 8.0, 10.0, nbytes=181248),
        r("decode", "B1x4K", "sdpa_fp16", "sdpa_fp16", 45.0, 45.0, mode="eager"),
        r("decode", "B1x4K", "tq4", "sdpa_fp16", 450.0, 45.0, mode="eager"),
    ]
    gate = [{"op": "decode", "preset": "tq4", "case": "Hq32/Hkv8/D128", "ok": True},
            {"op": "decode", "preset": "turboquant_k8v4", "case": "Hq32/Hkv8/D128", "ok": False}]
    return {"schema": rep.SCHEMA, "environment": ENV, "timing": "fake", "gate": gate, "records": records}


# -- records and schema --------------------------------------------------------------------------
def test_record_speedup_and_bandwidth():
    r = rep.record("decode", "B32x4K", "tq4", "sdpa_fp16", 80.0, 200.0, nbytes=160_000_000)
    assert r["speedup"] == 2.5  # 200 µs / 80 µs
    assert r["gbps"] == 2000.0  # 160 MB in 80 µs
    assert rep.record("decode", "B1x4K", "tq4", "sdpa_fp16", 90.0, 45.0, mode="eager")["gbps"] is None
    assert "plan" not in r
    assert rep.record("decode", "B1x4K", "tq4", "sdpa_fp16", 90.0, 45.0, plan="mma kernel, 8 splits")["plan"] == \
        "mma kernel, 8 splits"


def test_fake_report_is_valid_and_round_trips(tmp_path):
    report = fake_report()
    path = tmp_path / "r.json"
    rep.write_json(report, str(path))
    assert rep.read_json(str(path)) == report
    assert json.loads(path.read_text())["schema"] == "tqkern.bench/1"


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda r: r.update(schema="tqkern.bench/0"), ValueError, r"report\['schema'\] must be 'tqkern.bench/1'"),
    (lambda r: r.pop("timing"), ValueError, "report must have a 'timing' field"),
    (lambda r: r.update(records={}), TypeError, r"report\['records'\] must be a list, got dict"),
    (lambda r: r["records"].append([]), TypeError, r"report\['records'\]\[9\] must be a dict, got list"),
    (lambda r: r["records"][1].pop("speedup"), ValueError, r"\[1\] must have a 'speedup' field"),
    (lambda r: r["records"][1].update(us="80"), TypeError, r"\[1\]\['us'\] must be a number, got str"),
    (lambda r: r["records"][1].update(us=True), TypeError, r"\[1\]\['us'\] must be a number, got bool"),
    (lambda r: r["records"][1].update(bytes=1.5), TypeError, r"\[1\]\['bytes'\] must be int or None, got float"),
    (lambda r: r["records"][1].update(op="prefil"), ValueError, r"\['op'\] must be one of .*, got 'prefil'"),
    (lambda r: r["records"][1].update(flops=10), ValueError, "'flops' .* and 'tflops' come together"),
    (lambda r: r["records"][1].update(mode="graphs"), ValueError, r"\['mode'\] must be one of .*, got 'graphs'"),
    (lambda r: r["records"][1].update(us=math.nan), ValueError, r"\['us'\] must be a positive finite time, got nan"),
    (lambda r: r["records"][1].update(us=0.0), ValueError, r"\['us'\] must be a positive finite time, got 0.0"),
    (lambda r: r["records"][0].update(speedup=1.1), ValueError, "the baseline's own speedup must be 1.0, got 1.1"),
    (lambda r: r["records"][1].update(plan=3), TypeError, r"\[1\]\['plan'\] must be a str, got int"),
])
def test_invalid_reports_are_rejected(mutate, exc, match):
    report = fake_report()
    mutate(report)
    with pytest.raises(exc, match=match):
        rep.validate_report(report)


def test_report_must_be_a_dict():
    with pytest.raises(TypeError, match="report must be a dict, got list"):
        rep.validate_report([])


# -- table ---------------------------------------------------------------------------------------
def _table_rows(text: str, title_start: str) -> dict[str, list[str]]:
    """Rows of the table whose title starts with ``title_start``: first cell -> the others."""
    block = text[text.index(title_start):].split("\n\n")[0].splitlines()
    return {line.split("  ")[0].strip(): [c.strip() for c in line.split("  ")[1:] if c.strip()]
            for line in block[3:]}


def test_table_cells():
    text = rep.render_table(fake_report())
    assert text.splitlines()[0] == "Fake GPU | torch 0.0 | triton 0.0 | tqkern 0.0 | fake"
    decode = _table_rows(text, "decode (CUDA-graph replay): us, and speedup over sdpa_fp16")
    assert list(decode) == ["sdpa_fp16", "tq4"]  # the baseline first
    assert decode["sdpa_fp16"] == ["200.0", "40.0"]
    assert decode["tq4"] == ["80.0 (2.50x)", "25.0 (1.60x)"]
    store = _table_rows(text, "store (CUDA-graph replay): us, and speedup over fp16_index_copy")
    assert store == {"fp16_index_copy": ["10.0"], "tq4": ["40.0 (0.25x)"], "turboquant_k8v4": ["8.0 (1.25x)"]}
    eager = _table_rows(text, "decode (eager calls)")
    assert eager == {"sdpa_fp16": ["45.0"], "tq4": ["450.0 (0.10x)"]}
    assert "gate FAILED: decode turboquant_k8v4 Hq32/Hkv8/D128 (not timed)" in text
    text.encode("ascii")  # ASCII only


def test_decode_table_gives_the_bandwidth_fraction_of_sdpa():
    """Each variant's bytes per µs over the baseline's at the same shape (fake_report: tq4 reads
    142,606,336 bytes in 80 µs where SDPA reads 536,870,912 in 200: 1782.6 / 2684.4 GB/s = 0.664;
    SmolLM2: 1069.5 / 2516.6 = 0.425, printed 43%)."""
    bw = _table_rows(rep.render_table(fake_report()), "decode: achieved bandwidth of the cache read")
    assert bw == {"tq4": ["66%", "43%"]}
    report = fake_report()
    del report["records"][3]
    assert _table_rows(rep.render_table(report), "decode: achieved bandwidth")["tq4"] == ["66%", "-"]


def test_store_table_gives_the_bandwidth_fraction_of_copy():
    """With a ``copy_`` record, each store variant's bytes per µs over copy_'s (copy_ moves 262,144
    bytes in 2 µs: 131.07 GB/s; tq4 165,888 in 40 µs: 4.15 GB/s = 3.2%; turboquant_k8v4 181,248
    in 8 µs: 22.66 GB/s = 17.3%; the index_copy_ baseline 262,144 in 10 µs: 20%)."""
    report = fake_report()
    report["records"].insert(5, rep.record("store", "decode_B32", "copy_", "fp16_index_copy", 2.0, 10.0,
                                           nbytes=262144))
    bw = _table_rows(rep.render_table(report), "store: achieved bandwidth")
    assert bw == {"tq4": ["3%"], "turboquant_k8v4": ["17%"]}
    assert "store: achieved bandwidth" not in rep.render_table(fake_report())  # no copy_, no fraction


def test_table_header_names_the_shapes_in_run_order():
    text = rep.render_table(fake_report())
    block = text[text.index("decode (CUDA-graph"):].splitlines()
    assert block[1].split() == ["variant", "B32x4K", "SmolLM2_B32x4K"]


def test_table_marks_a_missing_cell():
    report = fake_report()
    del report["records"][3]  # tq4 at SmolLM2_B32x4K
    decode = _table_rows(rep.render_table(report), "decode (CUDA-graph")
    assert decode["tq4"] == ["80.0 (2.50x)", "-"]


def test_table_of_no_records():
    report = dict(fake_report(), records=[], gate=[])
    assert rep.render_table(report).splitlines()[-1] == "no timing records"


# -- plot ----------------------------------------------------------------------------------------
def test_speedup_series():
    series = rep.speedup_series(fake_report())
    assert list(series) == [("decode", "graph"), ("store", "graph"), ("decode", "eager")]
    base, shapes, by_variant = series["decode", "graph"]
    assert (base, shapes, by_variant) == ("sdpa_fp16", ["B32x4K", "SmolLM2_B32x4K"], {"tq4": [2.5, 1.6]})
    assert series["store", "graph"][2] == {"tq4": [0.25], "turboquant_k8v4": [1.25]}
    report = fake_report()
    del report["records"][1]
    assert math.isnan(rep.speedup_series(report)["decode", "graph"][2]["tq4"][0])


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (the plot extra)")
    path = tmp_path / "speedup.png"
    assert rep.plot_report(fake_report(), str(path)) == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"--plot needs matplotlib: pip install 'tqkern\[plot\]'"):
        rep.plot_report(fake_report(), str(tmp_path / "p.png"))
    assert not (tmp_path / "p.png").exists()


# -- progress ------------------------------------------------------------------------------------
def test_progress_in_a_log_writes_one_line_per_step():
    out = io.StringIO()
    bar = rep.Progress(4, out, width=8)
    bar.step("decode gate tq4")
    bar.step("decode B32x4K sdpa_fp16")
    bar.close()
    assert out.getvalue() == "[##......] 1/4 decode gate tq4\n[####....] 2/4 decode B32x4K sdpa_fp16\n"


def test_progress_on_a_terminal_redraws_in_place():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    bar = rep.Progress(2, out, width=4)
    bar.step("a")
    bar.step("b")
    bar.close()
    assert out.getvalue() == "\r\x1b[K[##..] 1/2 a\r\x1b[K[####] 2/2 b\n"


@pytest.mark.parametrize("total", [-1, 2.0, None])
def test_progress_rejects_a_bad_total(total):
    with pytest.raises(ValueError, match=f"total must be an int >= 0, got {total!r}"):
        rep.Progress(total, io.StringIO())


# -- selection -----------------------------------------------------------------------------------
def test_select_defaults():
    sel = runner.select("all")
    assert list(sel) == ["decode", "store", "decompress", "prefill"]
    assert sel["decode"] == (runner.PRESETS, list(DECODE_SHAPES))
    assert sel["store"] == (runner.PRESETS, list(STORE_SHAPES))
    assert sel["decompress"] == (runner.PRESETS, list(STORE_SHAPES))
    assert sel["prefill"] == (runner.PRESETS, list(PREFILL_SHAPES))
    assert "fp16" in runner.PRESETS and "tq4" in runner.PRESETS


def test_select_quick_and_named():
    sel = runner.select("all", quick=True)
    assert {o: [s.name for s in sel[o][1]] for o in sel} == {o: list(QUICK_SHAPES[o]) for o in sel}
    sel = runner.select("all", ["tq4"], ["B33x16K", "decode_B256"])
    assert [s.name for s in sel["decode"][1]] == ["B33x16K"] and [s.name for s in sel["store"][1]] == ["decode_B256"]
    assert sel["decode"][0] == ("tq4",)
    assert list(runner.select("store", shapes=["decode_B32"])) == ["store"]
    # kXvYh formats (docs/quality.md's per-layer allocations) are timed like presets, slot arrangement
    assert runner.select("decode", ["k4v3h", "tq4"], ["B32x4K"])["decode"][0] == ("k4v3h", "tq4")


def test_model_shapes_table_spans_what_issue_22_asks():
    """At least a dozen shapes spanning head_dim 64/96/128/256, KV heads 1-16, GQA 1-16, batch
    1-256, contexts 1K-128K, with batch 1 at >= 64K; ``--shapes models`` selects them all."""
    from tqkern_torch.bench.shapes import MODEL_SHAPES, decode_shape

    names = [s.name for s in MODEL_SHAPES]
    assert len(names) >= 12 and len(set(names)) == len(names)
    assert {s.head_dim for s in MODEL_SHAPES} == {64, 96, 128, 256}
    assert min(s.num_kv_heads for s in MODEL_SHAPES) == 1 and max(s.num_kv_heads for s in MODEL_SHAPES) == 16
    groups = {s.num_q_heads // s.num_kv_heads for s in MODEL_SHAPES}
    assert min(groups) == 1 and max(groups) == 16
    assert all(s.num_q_heads % s.num_kv_heads == 0 for s in MODEL_SHAPES)
    assert min(s.batch for s in MODEL_SHAPES) == 1 and max(s.batch for s in MODEL_SHAPES) == 256
    assert min(s.seq_len for s in MODEL_SHAPES) == 1024 and max(s.seq_len for s in MODEL_SHAPES) == 131072
    assert any(s.batch == 1 and s.seq_len >= 65536 for s in MODEL_SHAPES)
    assert all(decode_shape(n) == s for n, s in zip(names, MODEL_SHAPES))
    assert runner.select("decode", ["tq4"], ["models"])["decode"][1] == list(MODEL_SHAPES)


@pytest.mark.parametrize("args,match", [
    (("prefil",), r"op must be one of \('decode', 'store', 'decompress', 'prefill', 'all'\), got 'prefil'"),
    (("decode", ["tq5"]), r"presets must be one or more of .*, got \['tq5'\]"),
    (("decode", []), r"presets must be one or more of .*, got \[\]"),
    (("decode", None, ["decode_B32"]), "shapes must be among B32x4K, .*Qwen2.5-0.5B_B256x2K or B<batch>x<tokens>K"
                                        r"\[_Hq<q>_Hkv<k>_D<d>\] or models .for decode., got 'decode_B32'"),
    (("all", None, ["B1x4K_Hq30_Hkv8_D128"]), "shape 'B1x4K_Hq30_Hkv8_D128': Hq must be a positive multiple of Hkv"),
    (("store", None, ["B32x4K"]), "shapes must be among prefill_1x4096, .*Gemma2-9B_prefill_1x16384 .for store., "
                                  "got 'B32x4K'"),
])
def test_select_rejects_unknown_names(args, match):
    with pytest.raises(ValueError, match=match):
        runner.select(*args)


def test_count_steps():
    sel = runner.select("all", ["tq4", "fp16"], ["B32x4K", "decode_B32", "prefill_1x4096"])
    # decode: 2 gates + 1 shape x (SDPA + 2); store: 2 gates + 2 shapes x (baseline + copy_ + tq4's
    # fp16, bf16 and key-offset stores + fp16's fp16 and bf16); decompress: 2 gates + 2 shapes x (copy_ +
    # tq4 + tq4 rotated back + fp16); prefill: 2 gates, no shape named; eager: 2 x 3
    assert runner.count_steps(sel) == (2 + 3) + (2 + 14) + (2 + 8) + 2
    assert runner.count_steps(sel, ["B1x4K", "B32x4K"]) == (2 + 3) + (2 + 14) + (2 + 8) + 2 + 6


# -- store slots ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [s.name for s in STORE_SHAPES])
def test_store_slot_mapping_is_distinct_and_in_the_cache(name):
    shape = store_shape(name)
    slots = slot_mapping(shape, 4096, torch.Generator().manual_seed(0))
    assert slots.dtype == torch.int64 and slots.shape == (shape.num_tokens,)
    assert slots.unique().numel() == shape.num_tokens
    assert int(slots.min()) >= 0 and int(slots.max()) < 4096 * BLOCK_SIZE
    blocks = (slots // BLOCK_SIZE).view(shape.num_seqs, -1)
    if shape.tokens_per_seq > 1:  # a prefill chunk fills whole blocks from offset 0, token by token
        assert torch.equal(slots.view(shape.num_seqs, -1) % BLOCK_SIZE,
                           torch.arange(shape.tokens_per_seq).remainder(BLOCK_SIZE).expand(shape.num_seqs, -1))
        assert blocks.unique().numel() == shape.num_tokens // BLOCK_SIZE
    else:  # a decode step: one token per sequence, each in its own block
        assert blocks.unique().numel() == shape.num_seqs


def test_store_slot_mapping_needs_enough_blocks():
    with pytest.raises(ValueError, match="num_blocks must be >= 256 for p, got 255"):
        slot_mapping(StoreShape("p", 1, 4096, 8, 128), 255, torch.Generator().manual_seed(0))


# -- the command ---------------------------------------------------------------------------------
def _bench(tmp_path, *args, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run([sys.executable, "-m", "tqkern.cli", "bench", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)


def test_bench_without_cuda_exits_2_and_writes_nothing(tmp_path):
    res = _bench(tmp_path, "--quick", "--out", "r.json")
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("tqkern bench needs a CUDA GPU: no CUDA device found")
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv,match", [
    (["bench", "prefil"], "invalid choice: 'prefil'"),
    (["bench", "--presets", "tq5"], r"bench: presets must be one or more of"),
    (["bench", "decode", "--shapes", "decode_B32"], "bench: shapes must be among"),
    (["bench", "store", "--eager"], "bench: --eager times decode only, got op 'store'"),
    (["bench", "decode", "--eager", "B1x4"], "bench: shape must be one of"),
    (["bench", "generate", "--jobs", "2"], "bench: --jobs and --compile-only are for the kernel ops"),
    (["bench", "generate", "--compile-only"], "bench: --jobs and --compile-only are for the kernel ops"),
    (["bench", "decode", "--compile-only", "--out", "r.json"], "bench: --compile-only writes nothing"),
    (["bench", "decode", "--compile-only", "--jobs", "2"], "bench: --compile-only writes nothing"),
    (["bench", "decode", "--jobs", "0"], "argument --jobs"),
    (["bench", "--from", "r.json", "--jobs", "2"], "bench: --from times nothing: no --jobs or --compile-only"),
    (["bench", "--from", "r.json", "--compile-only"], "bench: --from times nothing"),
])
def test_bench_bad_arguments_exit_2(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error" in err and re.search(match, err), err


def test_bench_plot_without_matplotlib_exits_1_before_timing(monkeypatch, capsys, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["bench", "--quick", "--plot", str(tmp_path / "p.png")]) == 1
    assert "tqkern bench: --plot needs matplotlib, which is not installed: pip install 'tqkern[plot]'" in \
        capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_bench_from_a_report_prints_its_table(tmp_path, capsys):
    path = tmp_path / "r.json"
    rep.write_json(fake_report(), str(path))
    assert main(["bench", "--from", str(path)]) == 1  # the fake report holds a failed gate
    assert capsys.readouterr().out.strip() == rep.render_table(fake_report())
    ok = dict(fake_report(), gate=[])
    rep.write_json(ok, str(path))
    assert main(["bench", "--from", str(path)]) == 0


def test_bench_from_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (the plot extra)")
    path = tmp_path / "r.json"
    rep.write_json(dict(fake_report(), gate=[]), str(path))
    assert main(["bench", "--from", str(path), "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {tmp_path / 'p.png'}"


def test_bench_from_a_file_that_is_not_a_report(tmp_path, capsys):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"gpu": "H100", "decode": []}))  # bench_decode.py's old format
    with pytest.raises(SystemExit) as e:
        main(["bench", "--from", str(path)])
    assert e.value.code == 2
    assert "bench: --from: report['schema'] must be 'tqkern.bench/1', got None" in capsys.readouterr().err


def test_merge_reports_replaces_by_key_and_records_history():
    """A newer run merged into a GPU's baseline file: records replaced by (op, mode, shape, variant)
    or added, gates by (op, case, preset, path); a replaced baseline leaves the other variants at
    that shape named as speedups against an earlier baseline; one history entry; inputs untouched."""
    base = fake_report()
    r = rep.record
    new = {"schema": rep.SCHEMA, "environment": dict(ENV, time="2026-02-02 00:00:00"), "timing": "fake",
           "gate": [{"op": "decode", "preset": "turboquant_k8v4", "case": "Hq32/Hkv8/D128", "ok": True},
                    {"op": "decode", "preset": "k5v4h", "case": "Hq32/Hkv8/D128", "ok": True}],
           "records": [r("decode", "B32x4K", "sdpa_fp16", "sdpa_fp16", 190.0, 190.0, nbytes=536870912),
                       r("decode", "B32x4K", "k5v4h", "sdpa_fp16", 100.0, 190.0, nbytes=150000000)]}
    before = json.dumps(base)
    merged, lines = rep.merge_reports(base, new, "session 9: k5v4h at B32x4K")
    assert json.dumps(base) == before and "history" not in ENV
    keys = [(x["op"], x["mode"], x["shape"], x["variant"]) for x in merged["records"]]
    assert len(keys) == len(set(keys)) == len(base["records"]) + 1
    sdpa = next(x for x in merged["records"] if x["shape"] == "B32x4K" and x["variant"] == "sdpa_fp16")
    assert sdpa["us"] == 190.0
    assert merged["records"][-1]["variant"] == "k5v4h"
    tq4 = next(x for x in merged["records"] if x["shape"] == "B32x4K" and x["variant"] == "tq4")
    assert tq4["speedup"] == 2.5  # (still against its own run's 200 µs: named below)
    assert [g["ok"] for g in merged["gate"]] == [True, True, True] and len(merged["gate"]) == 3
    (h,) = merged["environment"]["history"]
    assert h["note"] == "session 9: k5v4h at B32x4K" and h["environment"]["time"] == "2026-02-02 00:00:00"
    assert h["replaced"] == ["decode graph B32x4K sdpa_fp16"]
    assert h["added"] == ["decode graph B32x4K k5v4h"]
    assert h["speedups_against_earlier_baselines"] == ["decode graph B32x4K tq4"]
    assert lines[0] == "replaced 1 records, added 1; 2 gates merged"
    assert lines[1:] == ["kept an earlier run's speedup (its baseline replaced): decode graph B32x4K tq4"]
    again, _ = rep.merge_reports(merged, dict(new, interrupted="interrupted in decode at B32x16K"), "again")
    assert len(again["environment"]["history"]) == 2 and again["records"] == merged["records"]
    assert again["environment"]["history"][1]["interrupted"] == "interrupted in decode at B32x16K"
    with pytest.raises(ValueError, match="the reports must be of one GPU: base is 'Fake GPU', new is 'H100'"):
        rep.merge_reports(base, dict(new, environment=dict(ENV, gpu="H100")), "x")
    with pytest.raises(ValueError, match="note must be a non-empty str"):
        rep.merge_reports(base, new, " ")
    with pytest.raises(ValueError, match="report must have a 'records' field"):
        rep.merge_reports(base, {k: v for k, v in new.items() if k != "records"}, "x")


def test_bench_from_merge_into(tmp_path, capsys):
    """``tqkern bench --from NEW --merge-into BASE``: BASE rewritten with NEW merged in, the
    command line as the default note; bad uses exit 2 naming the option."""
    base, new = tmp_path / "h.json", tmp_path / "new.json"
    rep.write_json(dict(fake_report(), gate=[]), str(base))
    run = dict(fake_report(), gate=[], records=fake_report()["records"][4:6])
    rep.write_json(run, str(new))
    assert main(["bench", "--from", str(new), "--merge-into", str(base)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == ["replaced 2 records, added 0; 0 gates merged",
                        "kept an earlier run's speedup (its baseline replaced): store graph decode_B32 turboquant_k8v4",
                        f"merged into {base}"]
    (h,) = rep.read_json(str(base))["environment"]["history"]
    assert h["note"] == f"tqkern bench --from {new} --merge-into {base}"
    assert main(["bench", "--from", str(new), "--merge-into", str(base), "--note", "S9"]) == 0
    assert rep.read_json(str(base))["environment"]["history"][-1]["note"] == "S9"
    for argv, match in ((["--note", "x"], "bench: --note goes with --merge-into"),
                        (["--merge-into", str(tmp_path / "none.json")], "bench: --merge-into: .*No such file")):
        with pytest.raises(SystemExit) as e:
            main(["bench", "--from", str(new), *argv])
        assert e.value.code == 2 and re.search(match, capsys.readouterr().err)
    other = dict(run, environment=dict(ENV, gpu="Other GPU"))
    rep.write_json(other, str(new))
    with pytest.raises(SystemExit):
        main(["bench", "--from", str(new), "--merge-into", str(base)])
    assert "bench: --merge-into: the reports must be of one GPU" in capsys.readouterr().err


def test_bench_interrupted_writes_its_partial_report_and_exits_130(tmp_path, monkeypatch, capsys):
    """A run that SIGINT cut short (runner.run's ``interrupted``): the table says INCOMPLETE, the
    JSON is written, the exit status is 130, for a timed run and for --compile-only alike."""
    from tqkern_torch.bench import timing

    partial = dict(fake_report(), gate=[], interrupted="interrupted in decode at B32x16K; records of the shapes "
                                                        "before it kept")
    monkeypatch.setattr(timing, "cuda_missing", lambda: "")
    monkeypatch.setattr(runner, "run", lambda *a, **k: partial)
    out = tmp_path / "r.json"
    assert main(["bench", "decode", "--out", str(out)]) == 130
    assert capsys.readouterr().out.splitlines()[-2] == f"INCOMPLETE: {partial['interrupted']}"
    assert rep.read_json(str(out))["interrupted"] == partial["interrupted"]
    assert main(["bench", "decode", "--compile-only"]) == 130
    monkeypatch.setattr(runner, "run", lambda *a, **k: {k_: v for k_, v in partial.items() if k_ != "interrupted"})
    assert main(["bench", "decode", "--compile-only"]) == 0


def test_bench_needs_torch(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch blocked by the test')\n")
    res = _bench(tmp_path, "--quick", env={"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])})
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("tqkern bench: needs torch")
    res = _bench(tmp_path, "--help", env={"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])})
    assert res.returncode == 0 and "--plot FILE.png" in res.stdout, res.stderr  # help needs no torch


@pytest.mark.parametrize("name", ["h100.json", "h200.json"])
def test_kept_baselines_follow_the_schema(name):
    """The one baseline per GPU in benchmarks/results/ reads as a report (`tqkern bench --from`)."""
    report = rep.read_json(os.path.join(ROOT, "benchmarks", "results", name))
    assert report["environment"]["gpu"].startswith("NVIDIA H")
    assert {r["op"] for r in report["records"]} <= set(rep.OPS) and report["records"]
