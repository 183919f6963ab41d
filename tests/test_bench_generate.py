"""The generate benchmark's plumbing on the CPU (:mod:`tqkern_torch.bench.generate`): a tiny Llama
config through the real ``run`` (TQCache ops through Triton's interpreter with
``TRITON_INTERPRET=1``, else the NumPy oracles), the report's structure and units, the paths the
rows claim, out-of-memory handling and the selection. Speed is not asserted: GPU only."""

from __future__ import annotations

import io
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tqkern_torch.kv_cache as kv_cache  # noqa: E402
import tqkern_torch.transformers as tqt  # noqa: E402
from tqkern import KVFormat  # noqa: E402
from tqkern_torch.bench import generate as gen  # noqa: E402
from tqkern_torch.bench.report import Progress, render_table, validate_report  # noqa: E402
from tqkern_torch.bench.shapes import GenerateShape  # noqa: E402

PRESET = "turboquant_4bit_nc"


def _config(layers=2):
    return transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    max_position_embeddings=256, eos_token_id=2, attn_implementation="sdpa")


def test_run_on_the_cpu_report_structure_and_units(monkeypatch):
    calls = []
    inner = kv_cache.decompress_sequences
    monkeypatch.setattr(kv_cache, "decompress_sequences", lambda *a, **k: calls.append(1) or inner(*a, **k))
    shape = GenerateShape("tiny", 2, 30)  # 30 + 4 tokens: the pool grows from 2 to 4 blocks per row
    out = io.StringIO()
    bar = Progress(gen.count_steps((PRESET,), [shape]), out)
    report = gen.run((PRESET,), [shape], config=_config(), device="cpu", new_tokens=4, gate=False, progress=bar)
    validate_report(report)
    assert bar.done == bar.total == 1 + 1 + 2
    # prefill through TQCacheLayer.dense (decompress_sequences), once per layer and generate (warm-up
    # and timed); decode never decompresses: every decode attention call ran paged_decode
    assert len(calls) == 2 * 2
    base, tq = report["records"]
    assert (base["op"], base["mode"], base["variant"], base["baseline"], base["speedup"]) == \
        ("generate", "eager", gen.BASELINE, gen.BASELINE, 1.0)
    assert (tq["variant"], tq["baseline"]) == (PRESET, gen.BASELINE)
    assert tq["speedup"] == pytest.approx(base["us"] / tq["us"])
    assert tq["decode_path"] == "paged_decode in 8 of 8 decode attention calls"  # 2 layers x 4 steps
    assert tq["prefill_path"] == gen.PREFILL_PATHS["tqkern"] and base["decode_path"] == "transformers sdpa"
    for r in (base, tq):
        assert (r["batch"], r["prompt"], r["new_tokens"], r["layers"]) == (2, 30, 4, 2)
        assert r["tokens_per_s"] == pytest.approx(2 / (r["us"] * 1e-6))  # batch rows per decode step
        assert r["prefill_ms"] > 0 and r["peak_bytes"] is None and r["split"] is None  # CUDA only
    # cache bytes: the last generated token is never fed back, so 30 + 4 positions are stored
    assert base["cache_bytes"] == base["cache_used_bytes"] == 2 * 2 * (2 * 2 * 34 * 64) * 2  # layers, K+V, bf16
    slot = KVFormat.preset(PRESET, 64).slot_bytes
    block = 16 * 2 * slot  # tokens x KV heads x slot bytes
    tables = 2 * 3 * 4 + 2 * 4 + 2 * 8  # block_table [2, 3] int32, seq_lens int32, starts int64
    assert tq["cache_used_bytes"] == 2 * (6 * block + tables)
    assert tq["cache_bytes"] == 2 * (8 * block + tables)  # the pool doubled from 4 blocks when it grew
    assert report["model"]["layers"] == 2 and report["model"]["cut"] and report["errors"] == []
    assert [(n["batch"], n["prompt"], n["device_us"]) for n in report["no_attention"]] == [(2, gen.NOOP_PROMPT, None)]
    assert report["no_attention"][0]["step_us"] > 0
    text = render_table(report)
    assert "2 of 32 layers (CUT: not the full model)" in text and "paged_decode in 8 of 8" in text


def test_static_variants_on_the_cpu():
    """``PRESET:static`` (TQCache(max_cache_len=...)) and transformers' StaticCache: fixed
    capacity prompt + new tokens + 1, the cache reused for the timed run (on the CPU generate does
    not compile: the plumbing only)."""
    shape = GenerateShape("tiny", 2, 30)
    variants = (PRESET + gen.STATIC, gen.COMPILED_BASELINE)
    report = gen.run(variants, [shape], config=_config(), device="cpu", new_tokens=4, gate=False,
                     progress=Progress(gen.count_steps(variants, [shape]), io.StringIO()))
    validate_report(report)
    base, tq, static = report["records"]
    assert (tq["variant"], static["variant"]) == variants and base["variant"] == gen.BASELINE
    assert "compiled by generate" in tq["decode_path"] and "StaticCache" in static["decode_path"]
    slot = KVFormat.preset(PRESET, 64).slot_bytes
    tables = 2 * 3 * 4 + 2 * 4 + 2 * 8  # block_table [2, 3] (35 positions: 3 blocks a row), seq_lens, starts
    assert tq["cache_bytes"] == tq["cache_used_bytes"] == 2 * (6 * 16 * 2 * slot + tables)
    assert static["cache_bytes"] == 2 * 2 * (2 * 2 * 35 * 64) * 2  # layers, K+V, [batch, heads, 35, 64] bf16


def test_split_is_the_step_time_in_three_parts():
    assert gen._split(1000.0, 700.0, 400.0) == {"weights_us": 400.0, "attention_us": 300.0, "host_us": 300.0}
    assert gen._split(1000.0, None, 400.0) is None and gen._split(1000.0, 700.0, None) is None


def test_out_of_memory_is_an_error_entry(monkeypatch):
    def fake(model, variant, ids, new_tokens):
        if variant == gen.BASELINE:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return {"prefill_s": 0.5, "step_s": 0.02, "device_us": None, "peak_bytes": None, "cache": tqt.TQCache(
            model, params=tqt.layer_params(model, PRESET)), "paged_calls": 0}

    monkeypatch.setattr(gen, "_run_variant", fake)
    model = gen.build_model(_config(layers=1), "cpu")
    steps = []
    records, errors = gen.run_shape(model, GenerateShape("big", 1, 8), [PRESET], steps.append)
    assert errors == [{"op": "generate", "shape": "big", "variant": gen.BASELINE,
                       "error": "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"}]
    assert [r["variant"] for r in records] == [PRESET] and math.isnan(records[0]["speedup"])
    assert records[0]["us"] == pytest.approx(2e4) and len(steps) == 2


def test_selection_and_config():
    presets, shapes = gen.select(quick=True)
    assert presets == gen.QUICK_PRESETS and [s.name for s in shapes] == ["B1x1K", "B8x16K"]
    presets, shapes = gen.select()
    assert [(s.batch, s.prompt) for s in shapes] == [(b, 1024 * k) for b in (1, 8) for k in (1, 16, 32)]
    assert gen.count_steps(presets, shapes) == 6 + 2 + 6 * 7  # 6 variants (2 static, the compiled baseline)
    assert gen.select(["tq4:static", gen.COMPILED_BASELINE])[0] == ("tq4:static", gen.COMPILED_BASELINE)
    assert gen.select(["k5v4h:static"])[0] == ("k5v4h:static",)  # the kXvYh family, install's default among it
    for bad in ("tq5", "tq5:static", "tq4:graph", "k9v4h", "k5v4h:graph"):
        with pytest.raises(ValueError, match="presets must be among"):
            gen.select([bad])
    with pytest.raises(ValueError, match="shape must be one of"):
        gen.select(shapes=["B32x4K"])
    cfg = gen.llama3_8b_config(layers=4)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.vocab_size, cfg.num_hidden_layers) == (4096, 32, 8, 128, 14336, 128256, 4)
    with pytest.raises(ValueError, match=r"layers must be an int in \[1, 32\]"):
        gen.llama3_8b_config(layers=33)


def test_cli_generate_arguments(tmp_path):
    from tqkern.cli import main
    with pytest.raises(SystemExit) as e:
        main(["bench", "decode", "--layers", "4"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["bench", "generate", "--layers", "40"])
    with pytest.raises(SystemExit):
        main(["bench", "generate", "--eager"])
