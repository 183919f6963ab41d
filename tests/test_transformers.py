"""tqkern_torch.transformers on tiny randomly initialised Llama and Qwen2 models (no downloads).

Run with ``TRITON_INTERPRET=1`` to drive the Triton kernels through the interpreter; without it
the ops run their NumPy oracles.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import tqkern_torch.transformers as tqt  # noqa: E402
from tqkern import KVFormat, reference  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

VOCAB = 128


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _qwen2(**extra):
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   **extra)  # head_dim 64/4 = 16; q/k/v biases
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # randomly initialised biases are zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _gemma2():
    """Gemma-2: soft-capped logits, query_pre_attn_scalar scaling, sliding and full layers alternating."""
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=2.0, sliding_window=6,
                                    max_position_embeddings=256, attn_implementation="eager")
    torch.manual_seed(2)
    return transformers.Gemma2ForCausalLM(cfg).eval()


def _gemma2_capped():
    """:func:`_gemma2` with the q/k projections × 4: logits large enough for the soft-cap to bend them."""
    model = _gemma2()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


MODELS = {"llama": _llama, "qwen2": _qwen2}


@pytest.fixture(params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def _ids(batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g)


def _left_padded(pads, length: int, seed: int):
    """``(ids, mask)`` of ``len(pads)`` rows, row ``i`` left-padded by ``pads[i]`` tokens."""
    ids, mask = _ids(len(pads), length, seed=seed), torch.ones(len(pads), length, dtype=torch.long)
    for row, pad in enumerate(pads):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


class _Counter:
    """Counts the calls of tqkern_torch.transformers.paged_decode (to see which path ran)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        inner = tqt.paged_decode

        def counted(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(tqt, "paged_decode", counted)


def _generate(model, ids, mask=None, cache=None, new_tokens=8):
    return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                          max_new_tokens=new_tokens, do_sample=False, past_key_values=cache)


@pytest.mark.parametrize("batch", [1, 2])
def test_fp16_generate_matches_sdpa(model, batch, monkeypatch):
    ids = _ids(batch, 11)
    ref = _generate(model, ids)
    tqt.install(model, "fp16")
    counter = _Counter(monkeypatch)
    out = _generate(model, ids, cache=tqt.TQCache(model))
    assert out.tolist() == ref.tolist()
    assert counter.calls == 7 * 2  # every decode step of both layers ran paged_decode (no padding)


@pytest.mark.parametrize("pads", [(0, 5), (3, 8)])
def test_fp16_generate_left_padding_matches_sdpa(model, pads, monkeypatch):
    ids, mask = _left_padded(pads, 11, seed=1)
    ref = _generate(model, ids, mask)
    tqt.install(model, "fp16", block_size=4)  # pads start rows mid-block and cross blocks
    counter = _Counter(monkeypatch)
    cache = tqt.TQCache(model)
    out = _generate(model, ids, mask, cache=cache)
    assert out.tolist() == ref.tolist()
    assert counter.calls == 7 * 2  # the rows were re-paged from their first token: paged_decode
    for layer in cache.layers:
        assert layer.starts.tolist() == list(pads) and layer.seq_lens.tolist() == [11 + 7 - p for p in pads]


def test_padded_rows_dense_view_and_dropped_positions(model):
    ids, mask = _ids(2, 7, seed=9), torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    tqt.install(model, "fp16", block_size=2)
    cache = tqt.TQCache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        before = [layer.dense() for layer in cache.layers]
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        model(torch.tensor([[4], [4]]), attention_mask=step_mask, past_key_values=cache, use_cache=True)
    for layer, (k0, v0) in zip(cache.layers, before):
        k1, v1 = layer.dense()
        assert layer.starts.tolist() == [0, 3]
        # the kept positions are bit-identical after re-paging; dropped ones read as zeros
        assert torch.equal(k1[0, :, :7], k0[0]) and torch.equal(v1[1, :, 3:7], v0[1, :, 3:])
        assert not k1[1, :, :3].any() and not v1[1, :, :3].any()
    with pytest.raises(RuntimeError, match="dropped"), torch.no_grad():  # a mask attending them
        model(torch.tensor([[4], [4]]), attention_mask=torch.ones(2, 9, dtype=torch.long), past_key_values=cache,
              use_cache=True)


def test_per_layer_formats_and_block_growth(model):
    tqt.install(model, "tqkern_k5v3", formats={-1: "fp16"}, block_size=2)
    cache = tqt.TQCache(model)
    assert [layer.params.format.key.kind for layer in cache.layers] == ["lloyd_max", "raw"]
    _generate(model, _ids(1, 5), cache=cache)
    layer = cache.layers[0]
    assert layer.seq_len == 5 + 7 and layer.block_table.shape == (1, 6)
    assert sorted(layer.block_table.flatten().tolist()) == list(range(6))


def test_caches_share_one_device_copy_of_each_layers_params(model, monkeypatch):
    """Every cache over an installed model reads its layers' params from one device copy (a new
    cache per ``generate`` used to copy every layer's tables again: host-to-device copies, each a
    stream synchronisation on CUDA, in each prefill); a μ estimated from a cache's own first
    prefill stays that cache's."""
    import tqkern_torch.kv_cache as kv_cache

    spec = tqt.install(model, "tqkern_k5v3", key_offset=None)
    copies = []
    real = kv_cache.to_device
    monkeypatch.setattr(kv_cache, "to_device", lambda *a: copies.append(a[0]) or real(*a))
    caches = [tqt.TQCache(model) for _ in range(2)]
    for cache in caches:  # (a prefill and one decode step each: what reads the params)
        _generate(model, _ids(1, 5), cache=cache, new_tokens=2)
    assert all(a.device_params is b.device_params for a, b in zip(caches[0].layers, caches[1].layers))
    assert all(layer.device_params is spec.device_copies[p, layer.device]
               for p, layer in zip(spec.params, caches[0].layers))
    assert copies == list(dict.fromkeys(spec.params))  # one copy per params object, made by the first cache
    tqt.install(model, "tqkern_k5v3", key_offset="prefill")
    own = [tqt.TQCache(model) for _ in range(2)]
    for seed, cache in enumerate(own):
        _generate(model, _ids(1, 5, seed=seed), cache=cache, new_tokens=2)
    for a, b in zip(own[0].layers, own[1].layers):
        assert a.device_params is not b.device_params
        assert not np.array_equal(a.params.key_offset, b.params.key_offset)


def _oracle_attention(params_by_layer):
    """Dense attention over K/V round-tripped through the NumPy oracles (compress, then
    decompress with rotate_back), from float16: what a TQCache of these params must attend."""

    def fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        p = params_by_layer[module.layer_idx]
        b, h, s, d = key.shape
        k = key.transpose(1, 2).reshape(b * s, h, d).half().double().numpy()
        v = value.transpose(1, 2).reshape(b * s, h, d).half().double().numpy()
        kk, vv = reference.decompress(reference.compress(k, v, p), p, rotate_back=True)
        if p.key_offset is not None:
            kk = kk + p.key_offset
        kk, vv = (torch.from_numpy(x).float().reshape(b, s, h, d).transpose(1, 2) for x in (kk, vv))
        return tqt._dense_attention(query, kk, vv, attention_mask, scaling, None), None

    return fn


def _teacher_forced_logits(model, ids, steps, cache):
    """Next-token logits after the prompt and after each of ``steps`` fixed decode tokens."""
    with torch.no_grad():
        out = [model(ids, past_key_values=cache, use_cache=True).logits[:, -1]]
        for t in steps:
            out.append(model(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(out).float()


@pytest.mark.parametrize("fmt", ["tqkern_k5v3", "tq4"])
def test_compressed_logits(model, fmt):
    ids, steps = _ids(1, 11, seed=2), [3, 77]
    ref_cache = DynamicCache()
    ref = _teacher_forced_logits(model, ids, steps, ref_cache)
    spec = tqt.install(model, fmt, key_offset=None)  # kernels vs oracles without μ (μ: test_key_offset_through_...)
    cache = tqt.TQCache(model)
    got = _teacher_forced_logits(model, ids, steps, cache)
    transformers.AttentionInterface.register("tqkern_oracle", _oracle_attention(spec.params))
    transformers.AttentionMaskInterface.register("tqkern_oracle", transformers.masking_utils.sdpa_mask)
    model.set_attn_implementation("tqkern_oracle")
    emul = _teacher_forced_logits(model, ids, steps, DynamicCache())
    assert torch.isfinite(got).all()
    # 1. The kernels equal the oracles on the same quantized K/V. What differs: paged_decode reads
    # q as float16 (relative error 2^-11 per element) and codes within float32 rounding of a
    # boundary may differ. Bound: max |Δ| ≤ 1e-2 · std(logits).
    assert float((got - emul).abs().max() / ref.std()) < 1e-2
    # 2. Quality against the unquantized model (a separate, labelled bound). e: the relative RMS
    # error of layer 0's stored keys and values in this run (layer 0 sees the same input in both
    # runs; k5v3 measured 0.04 / 0.17, tq4 0.09 / 0.09, matching sqrt(D_mse) at 5, 3 and 4 bits).
    # To first order the attention output moves by ≲ e relative (the value error passes through
    # the softmax average, the key error through the scores), the residual stream dilutes it and
    # two layers compound it: bound ‖Δlogits‖ ≤ 2·e·‖logits‖. Measured ratio 0.3-0.9 over Llama and
    # Qwen2 × k5v3, tq4, k4v4.
    k0, v0 = cache.layers[0].dense()
    rk, rv = ref_cache.layers[0].keys, ref_cache.layers[0].values
    e = max(float((k0 - rk).norm() / rk.norm()), float((v0 - rv).norm() / rv.norm()))
    assert float((got - ref).norm() / ref.norm()) < 2 * e


def test_install_uninstall_restores(model):
    ids = _ids(1, 9, seed=3)
    before_impl = model.config._attn_implementation
    with torch.no_grad():
        before = model(ids).logits
    spec = tqt.install(model)  # the default format: k5v4h (docs/quality.md), for every layer
    head_dim = tqt._geometry(model.config)[2]
    assert tqt.DEFAULT_FORMAT == "k5v4h"
    assert all(p.format == KVFormat.preset("k5v4h", head_dim) for p in spec.params)
    assert model.config._attn_implementation == "tqkern"
    tqt.install(model, "fp16")  # a second install keeps the implementation to restore
    tqt.uninstall(model)
    assert model.config._attn_implementation == before_impl
    assert not hasattr(model, "_tqkern_install")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    with pytest.raises(ValueError, match="no tqkern install"):
        tqt.uninstall(model)
    with pytest.raises(ValueError, match="install"):
        tqt.TQCache(model)
    cache = tqt.TQCache(model, params=tqt.layer_params(model, "fp16"))
    with pytest.raises(RuntimeError, match="attention implementation"), torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)  # built without install: refused


def test_calibrate_is_the_mean_stored_key(model):
    ids, mask = _ids(2, 10, seed=4), torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    mu = tqt.calibrate(model, ids, attention_mask=mask)
    num_layers, kv_heads, head_dim = tqt._geometry(model.config)
    assert len(mu) == num_layers and all(m.shape == (kv_heads, head_dim) and m.dtype == np.float32 for m in mu)
    # the keys a fp16 TQCache stores (no offset), over the non-padded tokens
    tqt.install(model, "fp16")
    cache = tqt.TQCache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    w = mask.double()[:, None, :, None]
    for layer, m in zip(cache.layers, mu):
        stored = layer.dense()[0].double()
        want = (stored * w).sum(dim=(0, 2)) / w.sum()
        np.testing.assert_allclose(m, want.numpy(), rtol=0, atol=2e-3 * float(stored.abs().max()))
    # with μ installed, the cache stores k − μ and gives k back
    tqt.install(model, "fp16", key_offset=mu)
    cache_mu = tqt.TQCache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache_mu, use_cache=True)
    for a, b in zip(cache.layers, cache_mu.layers):
        torch.testing.assert_close(a.dense()[0], b.dense()[0], rtol=0, atol=2e-3 * float(a.dense()[0].abs().max()))


def test_sliding_window_layers_decode_paged(monkeypatch):
    model = _qwen2(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    ids = _ids(1, 9, seed=5)
    ref = _generate(model, ids)
    tqt.install(model, "fp16")
    counter = _Counter(monkeypatch)
    out = _generate(model, ids, cache=tqt.TQCache(model))
    assert out.tolist() == ref.tolist()
    assert counter.calls == 7 * 2  # layer 1's active window too: paged_decode(window_left=5)


@pytest.mark.parametrize("pads", [(0, 5), (3, 8), (2, 0)])
def test_sliding_window_left_padding_decode_paged(pads, monkeypatch):
    """A 6-key window over left-padded rows of 11: padding reaching into the window (8 at the first
    step, whose window starts at position 6) is re-paged away, padding wholly before it (3, 5)
    stays, masked by the window; both give transformers' tokens, every step on paged_decode."""
    model = _qwen2(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    ids, mask = _left_padded(pads, 11, seed=4)
    ref = _generate(model, ids, mask)
    tqt.install(model, "fp16", block_size=4)
    counter = _Counter(monkeypatch)
    cache = tqt.TQCache(model)
    out = _generate(model, ids, mask, cache=cache)
    assert out.tolist() == ref.tolist()
    assert counter.calls == 7 * 2
    assert cache.layers[0].starts.tolist() == list(pads)  # full attention: every pad re-paged
    assert cache.layers[1].starts.tolist() == [p if p > 6 else 0 for p in pads]


def test_sliding_window_mask_that_attends_before_the_window_is_not_paged():
    """paged_rows(mask, window) accepts a mask only if it masks every key before the window."""
    model = _qwen2(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    tqt.install(model, "fp16", block_size=4)
    cache = tqt.TQCache(model)
    with torch.no_grad():
        model(_ids(1, 9, seed=3), past_key_values=cache, use_cache=True)
    layer = cache.layers[1]
    full = torch.zeros(1, 1, 1, 9)  # additive: attends all 9 keys
    assert not layer.paged_rows(full, 6)
    windowed = full.clone()
    windowed[..., :3] = torch.finfo(torch.float32).min  # keys 0-2 masked: the window of the query at 8
    assert layer.paged_rows(windowed, 6) and layer.starts.tolist() == [0]
    assert not layer.paged_rows(windowed, 5)  # a 5-key window would mask key 3 too


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="formats keys"):
        tqt.install(model, "fp16", formats={5: "fp16"})
    with pytest.raises(ValueError, match="key_offset"):
        tqt.install(model, "fp16", key_offset=[np.zeros((2, 2))])
    with pytest.raises(ValueError, match="name"):
        tqt.install(model, "no_such_format")
    with pytest.raises(ValueError, match="key_offset must be 'auto', 'prefill', None"):
        tqt.install(model, "tq4", key_offset="calibrated")
    with pytest.raises(ValueError, match="calibration must be None unless key_offset is 'auto'"):
        tqt.install(model, "tq4", key_offset=None, calibration=_ids(1, 8))
    with pytest.raises(ValueError, match="tokenizer must be given"):
        tqt.install(model, "tq4", calibration=["some text"])
    with pytest.raises(ValueError, match="inputs must be input_ids"):
        tqt.install(model, "tq4", calibration=torch.zeros(8, dtype=torch.long))
    ids = _ids(1, 8)
    with pytest.raises(ValueError, match="attention_mask must mark at least one token .*got only padding"):
        tqt.calibrate(model, ids, attention_mask=torch.zeros_like(ids))
    with pytest.raises(ValueError, match=r"attention_mask must be a tensor of the inputs' shape \[1, 8\], got \[1, 7\]"):
        tqt.calibrate(model, ids, attention_mask=torch.ones(1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask must be a tensor of the inputs' shape \[1, 8\], got list"):
        tqt.calibrate(model, ids, attention_mask=[[1] * 8])
    with pytest.raises(TypeError, match="model must be a transformers model .*, got NoneType"):
        tqt.calibrate(None, ids)
    with pytest.raises(TypeError, match="model must be a transformers model or its config, got NoneType"):
        tqt.install(None, "tq4", key_offset=None)
    with pytest.raises(TypeError, match="formats must be a mapping of layer index to format, got list"):
        tqt.install(model, "tq4", key_offset=None, formats=["fp16"])
    with pytest.raises(ValueError, match="key_offset must be 'auto', 'prefill', None or one .* got int"):
        tqt.install(model, "tq4", key_offset=5)
    tqt.install(model, "tq4", key_offset=None)
    with pytest.raises(ValueError, match="block_size is install\\(\\)'s unless params= is given, got block_size 8"):
        tqt.TQCache(model, block_size=8)
    params = tqt.layer_params(model, "tq4")
    for bad in (0, -16, 2.0, True):
        with pytest.raises(ValueError, match=f"block_size must be None or a positive int, got {bad!r}"):
            tqt.TQCache(model, params=params, block_size=bad)
    for kw in (dict(params=params), {}):  # (installed: the flag is install()'s, still checked)
        with pytest.raises(TypeError, match="estimate_key_offset must be a bool, got str"):
            tqt.TQCache(model, estimate_key_offset="yes", **kw)


def test_gemma2_softcap_scaling_alternating_windows(monkeypatch):
    """Gemma2: soft-capped logits, query_pre_attn_scalar scaling, sliding and full layers
    alternating: every decode step runs paged_decode with the soft-cap (and the window)."""
    model = _gemma2()
    ids = _ids(1, 9, seed=6)
    ref = _generate(model, ids)  # transformers' eager attention (soft-capping)
    tqt.install(model, "fp16")
    counter = _Counter(monkeypatch)
    out = _generate(model, ids, cache=tqt.TQCache(model))
    assert out.tolist() == ref.tolist()
    assert counter.calls == 7 * 2
    # with a key offset μ the kernel would cap q·(k − μ): the soft-capped steps stay dense
    tqt.install(model, "fp16", key_offset=tqt.calibrate(model, _ids(1, 12, seed=3)))
    calls = counter.calls
    assert _generate(model, ids, cache=tqt.TQCache(model)).tolist() == ref.tolist()
    assert counter.calls == calls
    tqt.uninstall(model)
    assert model.config._attn_implementation == "eager"


def test_gemma2_paged_decode_equals_the_dense_path(monkeypatch):
    """Compressed (tq4) Gemma-2 with logits the soft-cap bends, left padding crossing the window:
    the decode steps' logits through paged_decode (soft-cap, window) equal those of the dense path
    over the same cache (paged_rows refused, so each step attends the decompressed K/V under
    transformers' mask and the soft-cap): the bound of test_compressed_logits, 1e-2·std."""
    from tqkern_torch.kv_cache import TQCacheLayer

    model = _gemma2_capped()
    ids, mask = _left_padded((0, 4), 10, seed=8)
    steps = [[5, 9], [17, 3], [40, 41]]

    def logits():
        cache, m, out = tqt.TQCache(model), mask, []
        with torch.no_grad():
            out.append(model(ids, attention_mask=m, past_key_values=cache, use_cache=True).logits[:, -1])
            for t in steps:
                m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], dim=1)
                out.append(model(torch.tensor(t)[:, None], attention_mask=m, past_key_values=cache,
                                 use_cache=True).logits[:, -1])
        return torch.stack(out).float()

    tqt.install(model, "tq4")
    counter = _Counter(monkeypatch)
    paged = logits()
    assert counter.calls == len(steps) * 2
    monkeypatch.setattr(TQCacheLayer, "paged_rows", lambda self, mask, window=None: False)
    dense = logits()
    assert counter.calls == len(steps) * 2  # none more
    assert torch.isfinite(paged).all()
    assert float((paged - dense).abs().max() / dense.std()) < 1e-2


def test_key_offset_through_paged_decode(model, monkeypatch):
    """With a calibrated μ the cache stores k − μ: paged_decode attends it as is (softmax drops
    q·μ), the dense path adds μ back; both must give the logits of the oracle round trip."""
    ids, steps = _ids(1, 11, seed=7), [5, 9]
    mu = tqt.calibrate(model, _ids(2, 16, seed=8))
    spec = tqt.install(model, "tqkern_k5v3", key_offset=mu)
    assert all(np.array_equal(p.key_offset, m) for p, m in zip(spec.params, mu))
    counter = _Counter(monkeypatch)
    got = _teacher_forced_logits(model, ids, steps, tqt.TQCache(model))
    assert counter.calls == len(steps) * 2
    transformers.AttentionInterface.register("tqkern_oracle", _oracle_attention(spec.params))
    transformers.AttentionMaskInterface.register("tqkern_oracle", transformers.masking_utils.sdpa_mask)
    model.set_attn_implementation("tqkern_oracle")
    emul = _teacher_forced_logits(model, ids, steps, DynamicCache())
    assert float((got - emul).abs().max() / emul.std()) < 1e-2  # the bound of test_compressed_logits


def test_public_api_is_pinned():
    assert tqt.__all__ == ["ATTN_IMPLEMENTATION", "DEFAULT_FORMAT", "KeyOffsetWarning", "TQCache", "TQCacheLayer", "TQInstall",
                           "TQStaticCacheLayer", "attention_forward", "calibrate", "install", "layer_params", "load_key_offsets",
                           "uninstall"]
    assert tqt.ATTN_IMPLEMENTATION == "tqkern"
