"""The key offset μ as install's default (tqkern_torch.calibration): calibration on the caller's or
the default text, the first-prefill estimate, the key-mean warning, and saving μ. Tiny random
Llama and Qwen2 models built from configs (no downloads)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import tqkern_torch.transformers as tqt  # noqa: E402
from tqkern_torch import calibration as cal  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

from tests.test_transformers import VOCAB, _ids, _llama, _qwen2  # noqa: E402


class _ByteTokenizer:
    """A tokenizer stand-in: one id per UTF-8 byte, folded into the tiny models' vocabulary."""

    def __call__(self, text, add_special_tokens=True, return_tensors=None, padding=False):
        texts = [text] if isinstance(text, str) else list(text)
        ids = [[1 + b % (VOCAB - 1) for b in t.encode("utf-8")] for t in texts]
        if return_tensors is None:
            return {"input_ids": ids[0] if isinstance(text, str) else ids}
        width = max(map(len, ids))
        mask = [[0] * (width - len(i)) + [1] * len(i) for i in ids]  # left padding
        ids = [[0] * (width - len(i)) + i for i in ids]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


def _lowfreq_bias_qwen2():
    """A tiny Qwen2 whose k_proj bias sits in the low-frequency RoPE pairs (dims 4..7 and 12..15
    of each 16-dim head, rotated by at most 0.01 rad per position): a large common key component
    that RoPE does not average away, as in Qwen2.5-class models. A random bias of std 0.5 over all
    dims only reaches r ≈ 0.66-0.78 (the fast pairs average out)."""
    model = _qwen2()
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.self_attn.k_proj.bias.view(2, 16)  # [kv heads, head_dim]
            bias.zero_()
            bias[:, 4:8] = 6.0
            bias[:, 12:16] = -6.0
    return model


def _first_prefill_keys(model, ids):
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return [layer.keys for layer in cache.layers]  # [B, H, S, D] per layer


def test_default_install_calibrates_on_default_text():
    model = _llama()
    tok = _ByteTokenizer()
    spec = tqt.install(model, "tq4", tokenizer=tok)
    assert spec.key_offset_sources == ("default text",) * 2
    ids = tok(cal.default_calibration_text(), add_special_tokens=False)["input_ids"]
    assert len(ids) > cal.CALIBRATION_TOKENS
    want = tqt.calibrate(model, torch.tensor([ids[: cal.CALIBRATION_TOKENS]]))
    for p, m in zip(spec.params, want):
        np.testing.assert_array_equal(p.key_offset, m)
    other = tqt.calibrate(model, torch.tensor([ids[: cal.CALIBRATION_TOKENS // 2]]))
    assert not np.array_equal(spec.params[0].key_offset, other[0])  # the token count matters: 2,048 were used


def test_install_calibrates_on_the_callers_text():
    model, tok = _qwen2(), _ByteTokenizer()
    ids = _ids(2, 24, seed=11)
    spec = tqt.install(model, "tqkern_k5v3", calibration=ids)
    assert spec.key_offset_sources == ("calibration",) * 2
    for p, m in zip(spec.params, tqt.calibrate(model, ids)):
        np.testing.assert_array_equal(p.key_offset, m)
    spec = tqt.install(model, "tqkern_k5v3", calibration=["two short", "calibration texts"], tokenizer=tok)
    want = tqt.calibrate(model, ["two short", "calibration texts"], tokenizer=tok)
    assert all(np.array_equal(p.key_offset, m) for p, m in zip(spec.params, want))


def test_explicit_none_and_arrays():
    model = _llama()
    spec = tqt.install(model, "tq4", key_offset=None)
    assert spec.key_offset_sources == ("none",) * 2 and all(p.key_offset is None for p in spec.params)
    mu = [np.full((2, 32), 0.25 * i, np.float32) for i in range(2)]
    spec = tqt.install(model, "tq4", key_offset=mu)
    assert spec.key_offset_sources == ("given",) * 2
    assert all(np.array_equal(p.key_offset, m) for p, m in zip(spec.params, mu))
    spec = tqt.install(model, "tq4", key_offset=[None, mu[1]])  # a None entry: that layer has no μ
    assert spec.key_offset_sources == ("none", "given") and spec.params[0].key_offset is None


def test_no_tokenizer_falls_back_to_the_first_prefill(monkeypatch):
    model = _qwen2()
    spec = tqt.install(model, "tq4")  # a model built from a config has no name_or_path: no tokenizer to find
    assert spec.key_offset_sources == ("prefill",) * 2 and all(p.key_offset is None for p in spec.params)
    ids = _ids(2, 20, seed=12)
    keys = _first_prefill_keys(model, ids)
    cache = tqt.TQCache(model)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    # layer 0 sees the same input in both runs (later layers see compressed attention outputs):
    # μ is the mean of its prefill keys over every row and position, rounded to float32
    want = keys[0].double().mean(dim=(0, 2)).numpy()
    np.testing.assert_allclose(cache.layers[0].params.key_offset, want, rtol=0, atol=1e-6 * np.abs(want).max())
    first = [layer.params.key_offset.copy() for layer in cache.layers]
    with torch.no_grad():  # later steps keep μ fixed
        model(_ids(2, 1, seed=13), past_key_values=cache, use_cache=True)
    assert all(np.array_equal(layer.params.key_offset, f) for layer, f in zip(cache.layers, first))
    # the same as installing that μ explicitly
    lp = _logits(model, ids, tqt.TQCache(model))
    tqt.install(model, "tq4", key_offset=first)
    assert torch.equal(lp, _logits(model, ids, tqt.TQCache(model)))
    # "prefill" named explicitly; a TQCache built from params asks for it with estimate_key_offset
    assert tqt.install(model, "tq4", key_offset="prefill").key_offset_sources == ("prefill",) * 2
    c = tqt.TQCache(model, params=tqt.layer_params(model, "tq4"), estimate_key_offset=True)
    assert torch.equal(lp, _logits(model, ids, c))


def _logits(model, ids, cache):
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=True).logits


def test_tokenizer_found_beside_the_weights(monkeypatch):
    model = _llama()
    found = []

    def from_pretrained(name, local_files_only):
        found.append((name, local_files_only))
        return _ByteTokenizer()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    model.name_or_path = "/some/local/dir"
    assert tqt.install(model, "tq4").key_offset_sources == ("default text",) * 2
    assert found == [("/some/local/dir", True)]


def test_key_mean_ratio_hand_computed():
    # keys = m + noise: ‖m‖ = 3, noise N(0, 1) in D = 16 dims → E‖k‖² = 9 + 16, r = 3 / 5
    g = torch.Generator().manual_seed(0)
    m = torch.zeros(16)
    m[0] = 3.0
    keys = m + torch.randn(1, 2, 20000, 16, generator=g)
    np.testing.assert_allclose(cal.key_mean_ratio(keys).numpy(), [0.6, 0.6], atol=0.01)
    # two tokens of pure noise: the plain ratio of a 2-sample mean is ~0.7; the corrected one is small
    r = cal.key_mean_ratio(torch.randn(1, 64, 2, 16, generator=g))
    assert float(r.mean()) < 0.35


def test_warning_without_mu_on_large_key_means():
    model = _lowfreq_bias_qwen2()
    ratios = cal.key_mean_ratios(model, _ids(1, 40, seed=14))
    assert ratios.max() > cal.KEY_MEAN_WARN_RATIO  # the model is what the test says
    tqt.install(model, "tq4", key_offset=None)
    with pytest.warns(cal.KeyOffsetWarning, match=r"mu.*> 0.9"):
        _logits(model, _ids(1, 40, seed=14), tqt.TQCache(model))


@pytest.mark.parametrize("case", ["llama", "fp16", "mu", "short"])
def test_no_warning(case):
    model = _llama() if case == "llama" else _lowfreq_bias_qwen2()
    if case == "llama":
        assert cal.key_mean_ratios(model, _ids(1, 40, seed=14)).max() < 0.5
    fmt = "fp16" if case == "fp16" else "tq4"
    tqt.install(model, fmt, key_offset="prefill" if case == "mu" else None)
    length = cal.KEY_MEAN_MIN_TOKENS - 1 if case == "short" else 40
    with warnings.catch_warnings():
        warnings.simplefilter("error", cal.KeyOffsetWarning)
        _logits(model, _ids(1, length, seed=14), tqt.TQCache(model))


def test_save_and_load_key_offsets(tmp_path):
    model = _qwen2()
    spec = tqt.install(model, "tqkern_k5v3", calibration=_ids(1, 16, seed=15), formats={-1: "fp16"})
    spec.save(tmp_path / "mu.npz")
    loaded = tqt.load_key_offsets(tmp_path / "mu.npz")
    assert all(np.array_equal(p.key_offset, m) for p, m in zip(spec.params, loaded))
    again = tqt.install(model, "tqkern_k5v3", key_offset=loaded, formats={-1: "fp16"})
    # the fp16 layer got no μ under "auto": saved and loaded as None, and installed as none again
    assert spec.key_offset_sources == ("calibration", "off (raw keys)") and loaded[1] is None
    assert again.key_offset_sources == ("given", "none")
    assert all(np.array_equal(a.key_offset, b.key_offset) for a, b in zip(spec.params[:1], again.params[:1]))
    assert again.params[1].key_offset is None
    tqt.install(model, "tq4", key_offset=None).save(tmp_path / "none.npz")
    assert tqt.load_key_offsets(tmp_path / "none.npz") == [None, None]


def test_default_text_is_disjoint_from_eval():
    from tqkern_torch import eval as tqe
    assert tqe.CALIB_MODULES == cal.CALIBRATION_MODULES
    assert not set(cal.CALIBRATION_MODULES) & set(tqe.EVAL_MODULES)
    assert len(cal.default_calibration_text()) > 10_000


def test_default_text_needs_docstrings(monkeypatch):
    monkeypatch.setattr(cal, "stdlib_text", lambda modules: "")
    with pytest.raises(RuntimeError, match="docstrings"):
        tqt.install(_llama(), "tq4", tokenizer=_ByteTokenizer())


def test_key_offset_by_default_per_key_codec():
    """The rule of install(key_offset="auto"), pinned for every preset and a uniform-key format."""
    from tqkern.layouts import PRESETS, KVFormat, Uniform
    got = {name: cal.key_offset_by_default(KVFormat.preset(name, 64)) for name in PRESETS}
    assert got == {name: name not in ("turboquant_k8v4", "fp16") for name in PRESETS}
    uniform_keys = KVFormat(head_dim=64, key=Uniform(bits=4), value=Uniform(bits=4))
    assert cal.key_offset_by_default(uniform_keys)


def test_auto_decides_mu_layer_by_layer():
    model, tok = _llama(), _ByteTokenizer()
    spec = tqt.install(model, "tqkern_k5v3", tokenizer=tok, formats={0: "turboquant_k8v4"})
    assert spec.key_offset_sources == ("off (fp8 keys)", "default text")
    ids = tok(cal.default_calibration_text(), add_special_tokens=False)["input_ids"][: cal.CALIBRATION_TOKENS]
    want = tqt.calibrate(model, torch.tensor([ids]))
    assert spec.params[0].key_offset is None
    np.testing.assert_array_equal(spec.params[1].key_offset, want[1])
    spec = tqt.install(model, "fp16", tokenizer=tok, formats={-1: "tq4"})
    assert spec.key_offset_sources == ("off (raw keys)", "default text") and spec.params[0].key_offset is None


def test_auto_without_a_tokenizer_estimates_only_the_layers_it_gives_mu():
    model = _qwen2()
    spec = tqt.install(model, "tq4", formats={0: "turboquant_k8v4"})
    assert spec.key_offset_sources == ("off (fp8 keys)", "prefill")
    cache = tqt.TQCache(model)
    assert [layer.estimate_key_offset for layer in cache.layers] == [False, True]
    with torch.no_grad():
        model(_ids(1, 12, seed=16), past_key_values=cache, use_cache=True)
    assert cache.layers[0].params.key_offset is None and cache.layers[1].params.key_offset is not None


def test_auto_runs_no_calibration_where_no_layer_gets_mu(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("calibrate ran")

    monkeypatch.setattr(cal, "calibrate", fail)
    model = _llama()
    for kwargs in ({"tokenizer": _ByteTokenizer()}, {"calibration": _ids(1, 16, seed=17)}):
        spec = tqt.install(model, "turboquant_k8v4", formats={-1: "fp16"}, **kwargs)
        assert spec.key_offset_sources == ("off (fp8 keys)", "off (raw keys)")
        assert all(p.key_offset is None for p in spec.params)
    with pytest.raises(AssertionError, match="calibrate ran"):  # the stub is what install calls
        tqt.install(model, "tq4", calibration=_ids(1, 16, seed=17))


def test_explicit_key_offset_wins_over_the_format_rule():
    model = _qwen2()
    mu = tqt.calibrate(model, _ids(1, 16, seed=18))
    spec = tqt.install(model, "turboquant_k8v4", key_offset=mu)
    assert spec.key_offset_sources == ("given",) * 2
    assert all(np.array_equal(p.key_offset, m) for p, m in zip(spec.params, mu))
    spec = tqt.install(model, "turboquant_k8v4", key_offset="prefill")
    assert spec.key_offset_sources == ("prefill",) * 2
    cache = tqt.TQCache(model)
    with torch.no_grad():
        model(_ids(1, 12, seed=19), past_key_values=cache, use_cache=True)
    assert all(layer.params.key_offset is not None for layer in cache.layers)


def test_fp8_keys_left_without_mu_by_auto_still_warn():
    """FP8 rounding is relative to each key element, so a large common key component costs FP8
    keys too: "auto" leaves them without μ, and the warning names the explicit way to add it."""
    model = _lowfreq_bias_qwen2()
    assert tqt.install(model, "turboquant_k8v4").key_offset_sources == ("off (fp8 keys)",) * 2
    with pytest.warns(cal.KeyOffsetWarning, match="key_offset='auto' leaves these keys without mu"):
        _logits(model, _ids(1, 40, seed=14), tqt.TQCache(model))
    tqt.install(model, "turboquant_k8v4", key_offset="prefill")  # μ asked for explicitly: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", cal.KeyOffsetWarning)
        _logits(model, _ids(1, 40, seed=14), tqt.TQCache(model))
