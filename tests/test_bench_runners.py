"""The benchmark runners' code paths without a GPU: the gates and the per-shape runs of
:mod:`tqkern_torch.bench.decode` and :mod:`~tqkern_torch.bench.store` on tiny shapes on the CPU
(Triton's interpreter, a fake timer; decompress's too), and :func:`tqkern_torch.bench.runner.run`'s orchestration
with fake runners. What stays GPU-only: CUDA-graph timing, the real shapes, ``environment()``."""

from __future__ import annotations

import io
import os
import time

import numpy as np
import pytest

from tqkern import KVFormat
from tqkern_torch.bench import decode, decompress, prefill, runner, store
from tqkern_torch.bench.report import Progress, render_table, validate_report
from tqkern_torch.bench.shapes import DecodeShape, PrefillShape, StoreShape
from tqkern_torch.testing import kernels_available

interpreter = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")


class FakeTimer:
    """Calls each timed function once (so it must run) and returns the next of ``times``."""

    def __init__(self, *times):
        self.times, self.calls = list(times), 0

    def __call__(self, fn):
        fn()
        self.calls += 1
        return self.times.pop(0)


@interpreter
def test_store_gate_passes_on_the_cpu():
    gates = store.gate(["tq4", "turboquant_k8v4", "fp16"], device="cpu", heads=((2, 64),))
    assert [(g["preset"], g["case"], g["ok"], g["bad_bytes"]) for g in gates] == [
        ("tq4", "Hkv2/D64", True, 0), ("tq4", "Hkv2/D64 mu", True, 0), ("turboquant_k8v4", "Hkv2/D64", True, 0),
        ("fp16", "Hkv2/D64", True, 0)]


@interpreter
def test_store_run_shape_records():
    shape = StoreShape("tiny", 2, 16, 2, 64)  # 2 sequences x 16 tokens
    steps, timer = [], FakeTimer(10.0, 5.0, 40.0, 50.0, 80.0)
    rows = store.run_shape(shape, ["tq4"], steps.append, device="cpu", timer=timer, cache_tokens=256)
    assert timer.calls == 5
    assert steps == ["store tiny fp16_index_copy", "store tiny copy_", "store tiny tq4", "store tiny bf16:tq4",
                     "store tiny mu:tq4"]
    kv = 2 * 32 * 2 * 64 * 2  # K and V: 32 tokens x 2 heads x 64 x 16-bit
    row_bytes = 2 * KVFormat.preset("tq4", 64).slot_bytes
    base, copy, tq4, bf16, mu = rows
    assert (mu["variant"], mu["us"], mu["speedup"], mu["bytes"]) == ("mu:tq4", 80.0, 0.125, kv + 32 * row_bytes)
    assert store.has_mu_variant("k5v4h", 64) and not store.has_mu_variant("turboquant_k8v4", 64)
    assert (base["variant"], base["baseline"], base["us"], base["speedup"], base["bytes"]) == \
        ("fp16_index_copy", "fp16_index_copy", 10.0, 1.0, 2 * kv)
    assert (copy["variant"], copy["us"], copy["speedup"], copy["bytes"]) == ("copy_", 5.0, 2.0, 2 * kv)
    assert (tq4["variant"], tq4["us"], tq4["speedup"], tq4["bytes"]) == ("tq4", 40.0, 0.25, kv + 32 * row_bytes)
    assert (bf16["variant"], bf16["us"], bf16["speedup"], bf16["bytes"]) == ("bf16:tq4", 50.0, 0.2,
                                                                             kv + 32 * row_bytes)


@interpreter
def test_decode_gate_passes_on_the_cpu():
    gates = decode.gate(["tq4", "fp16"], device="cpu", lengths=(1, 40), heads=((4, 2, 64),))
    assert [(g["preset"], g["case"], g["ok"]) for g in gates] == [("tq4", "Hq4/Hkv2/D64", True),
                                                                   ("fp16", "Hq4/Hkv2/D64", True)]
    assert all(g["max_err"] <= g["tol"] for g in gates)


@interpreter
def test_decode_gate_applies_a_shapes_options():
    """A case with options is gated with them: a soft-cap of 2 and a 15-key window on 40-token
    sequences change the output far beyond the tolerance, so the gate passes only if the kernel
    and the oracle both apply them."""
    shape = DecodeShape("opts", 2, 40, 4, 2, 64, logit_softcap=2.0, window_left=15)
    head = decode.gate_head(shape)
    assert head == (4, 2, 64, 2.0, 15) and decode.case_name(head) == "Hq4/Hkv2/D64 cap2 win15"
    gates = decode.gate(["tq4"], device="cpu", lengths=(1, 40), heads=(head,))
    assert [(g["case"], g["ok"]) for g in gates] == [("Hq4/Hkv2/D64 cap2 win15", True)]


def test_decode_gate_head_of_a_shape():
    """The gate's window is the shape's, at most GATE_WINDOW keys; a plain shape's case is its heads."""
    assert decode.gate_head(DecodeShape("p", 1, 64, 8, 2, 128)) == (8, 2, 128)
    assert decode.case_name((8, 2, 128)) == "Hq8/Hkv2/D128"
    wide = DecodeShape("w", 1, 64, 8, 2, 128, window_left=4095)
    assert decode.gate_head(wide) == (8, 2, 128, None, decode.GATE_WINDOW)
    assert decode.case_name(decode.gate_head(wide)) == f"Hq8/Hkv2/D128 win{decode.GATE_WINDOW}"
    assert decode.gate_head(DecodeShape("c", 1, 64, 8, 2, 128, logit_softcap=50.0)) == (8, 2, 128, 50.0, None)
    assert DecodeShape("c", 1, 64, 8, 2, 128, logit_softcap=50.0).options == {"logit_softcap": 50.0}
    assert wide.options == {"window_left": 4095} and wide.keys_read == 64
    assert DecodeShape("s", 1, 64, 8, 2, 128, window_left=9).keys_read == 10


@interpreter
def test_decode_run_shape_with_options(monkeypatch):
    """A windowed, soft-capped shape: the preset's call gets both options, and both records count
    the window's keys (SDPA's baseline reads only those)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append({k: kwargs.get(k) for k in ("logit_softcap", "window_left")})
        return paged_decode(*args, **kwargs)

    from tqkern_torch.attention import paged_decode
    monkeypatch.setattr(decode, "paged_decode", spy)
    shape = DecodeShape("tiny_opts", 2, 32, 4, 2, 64, logit_softcap=2.0, window_left=7)
    rows = decode.run_shape(shape, ["tq4"], lambda _: None, device="cpu", timer=FakeTimer(30.0, 20.0))
    assert calls == [{"logit_softcap": 2.0, "window_left": 7}]
    sdpa, tq4 = rows
    assert sdpa["bytes"] == 2 * 2 * 2 * 8 * 64 * 2
    assert tq4["bytes"] == 2 * 8 * 2 * KVFormat.preset("tq4", 64).slot_bytes


@interpreter
def test_decode_run_shape_records():
    shape = DecodeShape("tiny", 2, 32, 4, 2, 64)
    steps, timer = [], FakeTimer(30.0, 20.0)
    rows = decode.run_shape(shape, ["tq4"], steps.append, device="cpu", timer=timer)
    assert timer.calls == 2 and steps == ["decode tiny sdpa_fp16", "decode tiny tq4"]
    sdpa, tq4 = rows
    assert (sdpa["variant"], sdpa["speedup"], sdpa["bytes"]) == ("sdpa_fp16", 1.0, 2 * 2 * 2 * 32 * 64 * 2)
    assert (tq4["variant"], tq4["speedup"], tq4["bytes"]) == ("tq4", 1.5, 2 * 32 * 2 * KVFormat.preset("tq4", 64).slot_bytes)
    # the plan that ran (the interpreter's: the general kernel), and none on the baseline
    assert "plan" not in sdpa and tq4["plan"].startswith("general kernel, ") and " splits, grid (" in tq4["plan"]


def test_prefill_causal_flops():
    """4·D·Hq per visible (query, key) pair, counted by hand: a full prefill of 3 tokens has
    1 + 2 + 3 pairs; 2 queries on a 5-token context (prefix 3) have 4 + 5."""
    assert prefill.causal_flops(PrefillShape("a", 1, 3, 3, 2, 1, 16)) == 4 * 16 * 2 * 6
    assert prefill.causal_flops(PrefillShape("b", 2, 5, 2, 4, 2, 8)) == 4 * 8 * 4 * 2 * 9


@interpreter
def test_prefill_gate_passes_on_the_cpu():
    gates = prefill.gate(["turboquant_4bit_nc"], device="cpu")
    assert [(g["preset"], g["case"], g["ok"]) for g in gates] == [("turboquant_4bit_nc", "Hkv2/D64", True),
                                                                  ("turboquant_4bit_nc", "Hkv2/D64 short rows", True)]
    assert all(g["max_err"] <= g["tol"] for g in gates)


@interpreter
def test_prefill_run_shape_records():
    shape = PrefillShape("tiny", 2, 40, 9, 4, 2, 64)  # 9 new tokens on a 31-token prefix, twice
    steps, timer = [], FakeTimer(20.0, 10.0, 12.5, 30.0, 25.0, 5.0, 40.0)
    rows = prefill.run_shape(shape, ["turboquant_4bit_nc"], steps.append, device="cpu", timer=timer)
    assert timer.calls == 7 and steps == ["prefill tiny sdpa_fp16", "prefill tiny turboquant_4bit_nc",
                                          "prefill tiny out:turboquant_4bit_nc",
                                          "prefill tiny fused:turboquant_4bit_nc",
                                          "prefill tiny cap:turboquant_4bit_nc",
                                          "prefill tiny int8:turboquant_4bit_nc", "prefill tiny decompress_sdpa"]
    sdpa, tq, out, fused, cap, i8, dec = rows
    assert (out["variant"], out["speedup"]) == ("out:turboquant_4bit_nc", 20.0 / 12.5)
    assert (fused["variant"], fused["speedup"]) == ("fused:turboquant_4bit_nc", 20.0 / 30.0)
    assert (cap["variant"], cap["speedup"]) == ("cap:turboquant_4bit_nc", 20.0 / 25.0)
    assert (i8["variant"], i8["speedup"]) == ("int8:turboquant_4bit_nc", 4.0)
    flops = 4 * 64 * 4 * 2 * (9 * 31 + 45)
    assert (sdpa["variant"], sdpa["speedup"], sdpa["flops"]) == ("sdpa_fp16", 1.0, flops)
    assert (tq["variant"], tq["speedup"], tq["tflops"]) == ("turboquant_4bit_nc", 2.0, flops / 10.0 / 1e6)
    assert (dec["variant"], dec["speedup"]) == ("decompress_sdpa:turboquant_4bit_nc", 0.5)
    report = {"schema": "tqkern.bench/1", "environment": {}, "timing": "fake", "gate": [], "records": rows}
    assert validate_report(report) is report
    bad = dict(rows[1])
    del bad["tflops"]
    with pytest.raises(ValueError, match="'flops' .* and 'tflops' come together"):
        validate_report(dict(report, records=[bad]))


@interpreter
def test_prefill_run_shape_short_rows():
    """A shape of ≤ 8 new tokens also times SDPA's one-token decode (no FLOPs credited), and its
    prefill runs the short-row path (``max_query_len = q_len``)."""
    shape = PrefillShape("spec", 2, 40, 4, 4, 2, 64)
    steps, timer = [], FakeTimer(20.0, 8.0, 10.0, 11.0, 5.0, 40.0)
    rows = prefill.run_shape(shape, ["turboquant_4bit_nc"], steps.append, device="cpu", timer=timer)
    assert steps[:2] == ["prefill spec sdpa_fp16", "prefill spec sdpa_fp16_1token"] and timer.calls == 6
    one = rows[1]
    assert (one["variant"], one["us"], one["speedup"], "flops" in one) == ("sdpa_fp16_1token", 8.0, 2.5, False)


def test_prefill_selection():
    sel = runner.select("prefill", ["tq4"], quick=True)
    assert [s.name for s in sel["prefill"][1]] == ["full_1x4K", "spec4_on16K_x32"]
    assert set(runner.select("all", ["tq4"], quick=True)) == {"decode", "store", "decompress", "prefill"}
    # 2 gates + 2 shapes x (SDPA + 2 presets x (prefill, int8_prefill) + decompress-then-SDPA
    # + out:tq4 + the fused kernel (full_1x4K) or SDPA's one-token decode (spec4_on16K_x32))
    # + 2 presets x cap:<preset> (full_1x4K)
    assert runner.count_steps({"prefill": (("tq4", "fp16"), sel["prefill"][1])}) == 2 + 2 * 8 + 2
    with pytest.raises(ValueError, match="shapes must be among full_1x4K"):
        runner.select("prefill", ["tq4"], ["B32x4K"])


@interpreter
def test_decompress_gate_passes_on_the_cpu():
    gates = decompress.gate(["tq4", "turboquant_k8v4"], device="cpu", heads=((2, 64),))
    assert [(g["preset"], g["case"], g["ok"]) for g in gates] == [
        ("tq4", "Hkv2/D64", True), ("tq4", "Hkv2/D64 rotate_back", True), ("turboquant_k8v4", "Hkv2/D64", True),
        ("turboquant_k8v4", "Hkv2/D64 rotate_back", True)]


@interpreter
def test_decompress_run_shape_records():
    shape = StoreShape("tiny", 2, 16, 2, 64)  # 2 sequences x 16 tokens
    steps, timer = [], FakeTimer(10.0, 20.0, 40.0, 50.0)
    rows = decompress.run_shape(shape, ["tq4", "fp16"], steps.append, device="cpu", timer=timer, cache_tokens=256)
    assert steps == ["decompress tiny copy_", "decompress tiny tq4", "decompress tiny rot:tq4", "decompress tiny fp16"]
    out = 2 * 32 * 2 * 64 * 4  # float32 K and V: 32 tokens x 2 heads x 64
    base, tq4, rot, fp16 = rows
    assert (base["variant"], base["baseline"], base["speedup"], base["bytes"]) == ("copy_", "copy_", 1.0, 2 * out)
    row_bytes = 2 * KVFormat.preset("tq4", 64).slot_bytes
    assert (tq4["us"], tq4["speedup"], tq4["bytes"]) == (20.0, 0.5, 32 * row_bytes + out)
    assert (rot["variant"], rot["us"], rot["bytes"]) == ("rot:tq4", 40.0, 32 * row_bytes + out)
    assert (fp16["variant"], fp16["bytes"]) == ("fp16", 32 * 2 * KVFormat.preset("fp16", 64).slot_bytes + out)
    assert decompress.has_rotated_side("tq4", 64) and not decompress.has_rotated_side("fp16", 64)


def test_run_times_only_presets_that_pass_the_gate(monkeypatch):
    """runner.run with fake runners: a preset failing its op's gate is not timed at that op."""
    import tqkern_torch.bench.timing as timing

    timed = []

    def fake_gate(op, bad, bad_at=None):
        """``bad`` fails everywhere; ``(preset, case)`` = ``bad_at`` fails at that case only (decode:
        gate_head tuples; store / decompress: (Hkv, D))."""
        def gate(presets, heads=None):
            cases = ["c"] if heads is None else [f"Hkv{h[0]}/D{h[1]}" if len(h) == 2 else decode.case_name(h)
                                                 for h in heads]
            return [{"op": op, "preset": p, "case": c, "ok": p != bad and (p, c) != bad_at}
                    for p in presets for c in cases]
        return gate

    def fake_run_shape(op):
        def run_shape(shape, presets, step, *, rep_ms):
            assert rep_ms == 25  # quick
            timed.append((op, shape.name, tuple(presets)))
            base = {"store": "fp16_index_copy", "decompress": "copy_"}.get(op, "sdpa_fp16")
            extra = (*(f"int8:{p}" for p in presets), f"decompress_sdpa:{presets[0]}", f"out:{presets[0]}") \
                if op == "prefill" and presets else ()
            if op == "prefill" and (presets or shape.q_len <= 8):  # the fused kernel or SDPA's one-token decode
                extra += (f"fused:{presets[0]}" if shape.q_len > 8 else "sdpa_fp16_1token",)
            if op == "prefill" and shape.q_len > 8:  # soft-capped prefill
                extra += tuple(f"cap:{p}" for p in presets)
            if op == "store":
                extra = ("copy_", *(f"bf16:{p}" for p in presets),
                         *(f"mu:{p}" for p in presets if store.has_mu_variant(p, shape.head_dim)))
            if op == "decompress":  # rotated back: tq4's sides are rotated, fp16's are not
                extra = tuple(f"rot:{p}" for p in presets if p != "fp16")
            rows = [{"op": op, "mode": "graph", "shape": shape.name, "variant": v, "baseline": base, "us": 1.0,
                     "bytes": None, "gbps": None, "speedup": 1.0} for v in (base, *presets, *extra)]
            for _ in rows:
                step("x")
            return rows
        return run_shape

    monkeypatch.setattr(decode, "gate", fake_gate("decode", "fp16"))
    monkeypatch.setattr(store, "gate", fake_gate("store", "tq4"))
    monkeypatch.setattr(decode, "run_shape", fake_run_shape("decode"))
    monkeypatch.setattr(store, "run_shape", fake_run_shape("store"))
    monkeypatch.setattr(decompress, "gate", fake_gate("decompress", "fp16"))
    monkeypatch.setattr(decompress, "run_shape", fake_run_shape("decompress"))
    monkeypatch.setattr(prefill, "gate", fake_gate("prefill", "tq4"))
    monkeypatch.setattr(prefill, "run_shape", fake_run_shape("prefill"))
    monkeypatch.setattr(timing, "environment", lambda: {"gpu": "fake"})
    sel = runner.select("all", ["tq4", "fp16"], quick=True)
    out = io.StringIO()
    bar = Progress(runner.count_steps(sel), out)
    report = runner.run(sel, quick=True, progress=bar)
    validate_report(report)
    assert timed == [("decode", "B32x4K", ("tq4",)), ("decode", "SmolLM2_B32x4K", ("tq4",)),
                     ("store", "prefill_1x4096", ("fp16",)), ("store", "decode_B32", ("fp16",)),
                     ("decompress", "prefill_1x4096", ("tq4",)), ("decompress", "SmolLM2_prefill_1x4096", ("tq4",)),
                     ("prefill", "full_1x4K", ("fp16",)), ("prefill", "spec4_on16K_x32", ("fp16",))]
    # decode, store and decompress gates per preset: the two base geometries (the quick shapes' own are the same)
    assert [g["ok"] for g in report["gate"]] == [True, True, False, False, False, False, True, True, True, True,
                                                 False, False, False, True]
    # gates, then baseline + the passing preset (store: + copy_ + its bf16 input; prefill: +
    # int8_prefill + decompress-then-SDPA + out: + the fused kernel or SDPA's one-token decode, and
    # the soft-capped prefill at the long shape; decompress: copy_ + the preset + it rotated back)
    assert bar.done == bar.total == 2 + 2 * 2 + 2 + 2 * 4 + 2 + 2 * 3 + 2 + 2 * 6 + 1
    assert out.getvalue().splitlines()[-1].startswith(f"[{'#' * 24}] {bar.total}/{bar.total}")
    # a preset wrong only at a timed shape's own geometry (head_dim 96): gated there, not timed there
    timed.clear()
    monkeypatch.setattr(decode, "gate", fake_gate("decode", None, ("tq4", "Hq16/Hkv16/D96")))
    sel = runner.select("decode", ["tq4", "fp16"], ["B32x4K", "Phi3-mini-TP2_B16x4K"])
    bar = Progress(runner.count_steps(sel), io.StringIO())
    report = runner.run(sel, quick=True, progress=bar)
    assert {g["case"] for g in report["gate"]} == {"Hq32/Hkv8/D128", "Hq9/Hkv3/D64", "Hq16/Hkv16/D96"}
    assert timed == [("decode", "B32x4K", ("tq4", "fp16")), ("decode", "Phi3-mini-TP2_B16x4K", ("fp16",))]
    assert bar.done == bar.total
    # a shape with options is gated at its own case (soft-cap, the gate's window): wrong there only
    timed.clear()
    here = "Hq16/Hkv8/D256 cap50 win255"
    monkeypatch.setattr(decode, "gate", fake_gate("decode", None, ("tq4", here)))
    sel = runner.select("decode", ["tq4", "fp16"], ["Gemma2-9B_B8x8K", "Gemma2-9B-local_B8x8K"])
    bar = Progress(runner.count_steps(sel), io.StringIO())
    report = runner.run(sel, quick=True, progress=bar)
    assert {g["case"] for g in report["gate"]} == {"Hq32/Hkv8/D128", "Hq9/Hkv3/D64", "Hq16/Hkv8/D256", here}
    assert timed == [("decode", "Gemma2-9B_B8x8K", ("tq4", "fp16")), ("decode", "Gemma2-9B-local_B8x8K", ("fp16",))]
    assert bar.done == bar.total
    # a store wrong only at a timed shape's own heads and head_dim (8 x 256): gated there, not timed there
    timed.clear()
    monkeypatch.setattr(store, "gate", fake_gate("store", None, ("tq4", "Hkv8/D256")))
    sel = runner.select("store", ["tq4", "fp16"], ["prefill_1x4096", "Gemma2-9B_prefill_1x16384"])
    bar = Progress(runner.count_steps(sel), io.StringIO())
    report = runner.run(sel, quick=True, progress=bar)
    assert [g["case"] for g in report["gate"]][:3] == ["Hkv8/D128", "Hkv3/D64", "Hkv8/D256"]
    assert timed == [("store", "prefill_1x4096", ("tq4", "fp16")), ("store", "Gemma2-9B_prefill_1x16384", ("fp16",))]
    assert bar.done == bar.total


def test_run_passes_its_timer_to_every_runner(monkeypatch):
    """``runner.run(timer=...)`` (``--compile-only``'s :func:`~tqkern_torch.bench.timing.call_once`)
    replaces the timer of each op's runs and of the eager decode runs; without it none is passed."""
    import tqkern_torch.bench.timing as timing

    seen = []

    def run_shape(shape, presets, step, **kw):
        seen.append(("graph", shape.name, kw.get("timer")))
        return []

    def run_eager(shape, presets, step, **kw):
        seen.append(("eager", shape.name, kw.get("timer")))
        return []

    for mod in (decode, store, decompress, prefill):
        monkeypatch.setattr(mod, "gate", lambda presets, heads=None, _m=mod: [])
        monkeypatch.setattr(mod, "run_shape", run_shape)
    monkeypatch.setattr(decode, "run_eager", run_eager)
    monkeypatch.setattr(timing, "environment", lambda: {"gpu": "fake"})
    sel = runner.select("all", ["tq4"], quick=True)
    runner.run(sel, eager_shapes=["B1x4K"], quick=True, progress=Progress(runner.count_steps(sel), io.StringIO()),
               timer=timing.call_once)
    assert len(seen) == 9 and all(t is timing.call_once for *_, t in seen)
    assert seen[2] == ("eager", "B1x4K", timing.call_once)
    seen.clear()
    runner.run(sel, quick=True, progress=Progress(runner.count_steps(sel), io.StringIO()))
    assert len(seen) == 8 and all(t is None for *_, t in seen)


def test_an_interrupted_run_keeps_the_shapes_before_it(monkeypatch):
    """``timeout -s INT`` mid-run: :func:`runner.run` returns the gates and the records of the
    shapes finished before the interrupt, ``interrupted`` names where it stopped, the report
    validates and its table says it is incomplete."""
    import tqkern_torch.bench.timing as timing

    def run_shape(shape, presets, step, **kw):
        if shape.name == "B32x16K":
            raise KeyboardInterrupt
        return [{"op": "decode", "mode": "graph", "shape": shape.name, "variant": v, "baseline": "sdpa_fp16",
                 "us": 2.0, "bytes": None, "gbps": None, "speedup": 1.0} for v in ("sdpa_fp16", *presets)]

    monkeypatch.setattr(decode, "gate", lambda presets, heads=None: [{"op": "decode", "preset": p, "case": "c",
                                                                      "ok": True} for p in presets])
    monkeypatch.setattr(decode, "run_shape", run_shape)
    monkeypatch.setattr(timing, "environment", lambda: {"gpu": "fake"})
    sel = runner.select("decode", ["tq4"], ["B32x4K", "B32x16K", "B128x1K"])
    report = runner.run(sel, progress=Progress(runner.count_steps(sel), io.StringIO()))
    validate_report(report)
    assert [(r["shape"], r["variant"]) for r in report["records"]] == [("B32x4K", "sdpa_fp16"), ("B32x4K", "tq4")]
    assert report["interrupted"] == "interrupted in decode at B32x16K; records of the shapes before it kept"
    assert len(report["gate"]) == 1
    assert render_table(report).splitlines()[-1] == f"INCOMPLETE: {report['interrupted']}"
    done = runner.run(runner.select("decode", ["tq4"], ["B32x4K"]), progress=Progress(3, io.StringIO()))
    assert "interrupted" not in done and "INCOMPLETE" not in render_table(done)
    bad = dict(report, interrupted=3)
    with pytest.raises(TypeError, match=r"report\['interrupted'\] must be a str, got int"):
        validate_report(bad)


def test_call_once_runs_and_times_nothing():
    from tqkern_torch.bench.timing import call_once

    calls = []
    assert np.isnan(call_once(lambda: calls.append(1))) and calls == [1]


def test_jobs_compile_commands_deal_the_presets_and_name_the_shapes():
    """``--jobs``: per op, the presets dealt round-robin into at most N shares, each command naming
    the op's shapes (which select the same shapes again) and, for decode, the eager shapes."""
    import sys

    from tqkern_torch.bench import jobs

    sel = runner.select("all", ["tq4", "k5v4h", "turboquant_4bit_nc"], ["B32x16K", "models", "prefill_1x4096",
                                                                        "full_1x4K"])
    cmds = jobs.compile_commands(sel, 2, eager_shapes=["B1x4K"])
    assert [c[:5] for c in cmds] == [[sys.executable, "-m", "tqkern.cli", "bench", op]
                                     for op in ("decode", "decode", "store", "store", "decompress", "decompress",
                                                "prefill", "prefill")]
    for cmd in cmds:
        op, i, j = cmd[4], cmd.index("--presets"), cmd.index("--shapes")
        share = cmd[i + 1:j]
        assert share in (["tq4", "turboquant_4bit_nc"], ["k5v4h"])
        assert cmd[-3:] == ["--compile-only", "--eager", "B1x4K"] if op == "decode" else cmd[-1] == "--compile-only"
        names = cmd[j + 1:cmd.index("--compile-only")]
        assert runner.select(op, share, names)[op][1] == sel[op][1]  # the same shapes, in order
    assert len(jobs.compile_commands(sel, 3)) == 4 * 3  # as many shares as presets
    # fewer presets than jobs: each preset's shapes dealt into jobs // presets shares (never more
    # commands than jobs), which together name every shape; the eager shapes once per preset
    cmds = jobs.compile_commands(runner.select("decode", ["tq4", "k5v4h"], ["models"]), 7, eager_shapes=["B1x4K"])
    assert len(cmds) == 2 * 3
    for preset in ("tq4", "k5v4h"):
        mine = [c for c in cmds if c[c.index("--presets") + 1:c.index("--shapes")] == [preset]]
        names = [n for c in mine for n in c[c.index("--shapes") + 1:c.index("--compile-only")]]
        assert sorted(names) == sorted(s.name for s in runner.select("decode", None, ["models"])["decode"][1])
        assert [c[-2:] == ["--eager", "B1x4K"] for c in mine] == [True, False, False]
    assert len(jobs.compile_commands(runner.select("decode", ["tq4"], ["B32x4K", "B32x16K"]), 8)) == 2
    assert jobs.compile_commands(runner.select("decode", ["tq4"], quick=True), 1, quick=True)[0][-1] == "--quick"
    with pytest.raises(ValueError, match="jobs must be a positive int, got 0"):
        jobs.compile_commands(sel, 0)


def test_jobs_run_at_most_n_at_once_and_report_failures(tmp_path):
    """:func:`compile_in_processes`: every command runs, never more than ``jobs`` at once (each
    writes a start and an end mark), and a failing one is named with its exit status."""
    import sys

    from tqkern_torch.bench import jobs

    def cmd(i, code=0):
        return [sys.executable, "-c", f"import pathlib, sys, time; d = pathlib.Path({str(tmp_path)!r}); "
                                      f"(d / 's{i}').write_text(str(time.time())); time.sleep(0.3); "
                                      f"(d / 'e{i}').write_text(str(time.time())); sys.exit({code})"]
    with pytest.raises(ValueError, match="jobs must be a positive int, got 0"):
        jobs.compile_in_processes([cmd(0)], 0)
    failed = jobs.compile_in_processes([cmd(0), cmd(1, 3), cmd(2), cmd(3)], 2, poll_s=0.05)
    assert len(failed) == 1 and failed[0].startswith("exit 3: -c ") and "'s1'" in failed[0]
    marks = sorted((float((tmp_path / f"{k}{i}").read_text()), k) for i in range(4) for k in "se")
    live = 0
    for _, k in marks:
        live += 1 if k == "s" else -1
        assert live <= 2
    # each end is logged: which command, its status, its time, how many are done
    log = io.StringIO()
    jobs.compile_in_processes([cmd(4), cmd(5, 2)], 1, poll_s=0.05, log=log)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("compile 1/2 (") and lines[0].endswith(" s")
    assert " done in " in lines[0] and " exit 2 in " in lines[1] and lines[1].startswith("compile 2/2 (")


def test_jobs_interrupted_kill_their_processes(tmp_path, monkeypatch):
    """A ``KeyboardInterrupt`` in the compile phase kills the running commands (no orphan keeps
    the GPU) and propagates."""
    import sys

    from tqkern_torch.bench import jobs

    def cmd(i):
        return [sys.executable, "-c", f"import os, pathlib, time; pathlib.Path({str(tmp_path)!r}, 'p{i}')"
                                      f".write_text(str(os.getpid())); time.sleep(60)"]
    real_sleep = time.sleep

    def sleep(_):
        if all((tmp_path / f"p{i}").exists() for i in range(2)):
            raise KeyboardInterrupt
        real_sleep(0.05)
    monkeypatch.setattr(jobs.time, "sleep", sleep)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        jobs.compile_in_processes([cmd(0), cmd(1), cmd(2)], 2)
    assert time.perf_counter() - t0 < 30 and not (tmp_path / "p2").exists()
    for i in range(2):
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"p{i}").read_text()), 0)
