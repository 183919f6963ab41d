"""Prefills of the transformers integration through ``tqkern_torch.prefill``
(``TQCache(prefill="kernel")``; on CPU the Triton kernels run in the interpreter) and the
``"tqkern"`` mask entry (:mod:`tqkern_torch.hf_prefill`): the same tokens as transformers' own
attention, left padding dropped before the attention, no dense mask built, and the dense path
wherever the kernels cannot serve the mask."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tqkern_torch.hf_prefill as hf_prefill  # noqa: E402
from tqkern import KVFormat, TQParams  # noqa: E402
import tqkern_torch.transformers as tqt  # noqa: E402
from tests.test_transformers import (MODELS, VOCAB, _gemma2, _generate, _ids, _left_padded, _qwen2,  # noqa: E402
                                     _teacher_forced_logits)
from transformers.masking_utils import (causal_mask_function, sdpa_mask,  # noqa: E402
                                        sliding_window_causal_mask_function)


class _Spy:
    """Counts the calls of ``module.name`` (to see which path ran)."""

    def __init__(self, monkeypatch, module, name: str, when=lambda *a, **k: True):
        self.calls = 0
        inner = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += bool(when(*args, **kwargs))
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


@pytest.fixture(params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def _spies(monkeypatch):
    prefills = _Spy(monkeypatch, hf_prefill, "prefill")
    dense_masks = _Spy(monkeypatch, hf_prefill, "sdpa_mask", when=lambda **k: k["q_length"] > 1)
    return prefills, dense_masks


@pytest.mark.parametrize("max_cache_len", [None, 20])
@pytest.mark.parametrize("pads", [(0, 0), (0, 5), (3, 8)])
def test_kernel_prefill_generate_matches_sdpa(model, pads, max_cache_len, monkeypatch):
    ids, mask = _left_padded(pads, 11, seed=1)
    ref = _generate(model, ids, mask)
    tqt.install(model, "fp16", block_size=4)  # pads start rows mid-block and cross blocks
    prefills, dense_masks = _spies(monkeypatch)
    cache = tqt.TQCache(model, max_cache_len=max_cache_len, prefill="kernel")
    out = _generate(model, ids, mask, cache=cache)
    assert out.tolist() == ref.tolist()
    assert prefills.calls == 2 and dense_masks.calls == 0  # both layers' prefills, no [b, 1, 11, 11] mask
    for layer in cache.layers:  # padding dropped before the prefill's attention
        assert layer.starts.tolist() == list(pads) and layer.seq_lens.tolist() == [11 + 7 - p for p in pads]


def test_kernel_prefill_padded_rows_read_zeros(model):
    ids, mask = _left_padded((0, 4), 9, seed=2)
    tqt.install(model, "fp16")
    seen = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        out, _ = tqt.attention_forward(module, query, key, value, attention_mask, **kwargs)
        seen.setdefault("out", out)
        return out, None

    transformers.AttentionInterface.register("tqkern", capture)
    try:
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=tqt.TQCache(model, prefill="kernel"), use_cache=True)
    finally:
        tqt.install(model, "fp16")  # registers the real attention again
    out = seen["out"]  # layer 0: [2, 9, Hq, D]
    assert not out[1, :4].any() and out[1, 4:].abs().amax(dim=(-1, -2)).gt(0).all() and out[0].abs().gt(0).any()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the tiled prefill path)")


@pytest.mark.parametrize("dev, t", [("cpu", 13), pytest.param("cuda", 70, marks=CUDA)])
@pytest.mark.parametrize("fmt", ["fp16", "tqkern_k5v3", "tq4"])
def test_kernel_prefill_on_one_layer(fmt, dev, t):
    """One layer's stored K/V (left padding (0, 3); μ for k5v3) attended through the kernel path,
    against float64 attention of the float16-rounded q over the layer's decompressed K/V
    (:meth:`TQCacheLayer.dense`, μ added back) with the causal, padded mask. Budget: the prefill
    kernel's (property_tests/test_prefill_triton.py): ``(4e-3 + 2δ)·max|V̂|`` with
    ``δ = 2u·scale·max Σ_d |q̃_d|·|k̃_d|`` in the codec's rotated coordinates (u = 2^-11). A wrong
    row, window or padding moves an output by a sizeable fraction of max|V̂|. The dense path
    passes the same check. On CUDA (70 tokens) the kernel path is the tiled one."""
    g = torch.Generator().manual_seed(11)
    b, hkv, hq, d = 2, 2, 4, 64 if dev == "cuda" else 32
    k, v = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)
    k = k + 0.5 * torch.randn(1, hkv, 1, d, generator=g)  # a key mean for μ to take out
    q = torch.randn(b, hq, t, d, generator=g)
    pad = torch.ones(b, t, dtype=torch.bool)
    pad[1, :3] = False
    mu = k.mean(dim=(0, 2)).numpy() if fmt == "tqkern_k5v3" else None
    params = TQParams.default(KVFormat.preset(fmt, d), key_offset=mu)
    scale = d ** -0.5
    for mode in ("dense", "kernel"):
        layer = tqt.TQCacheLayer(params, hkv, block_size=4, prefill=mode)
        key, value = layer.update(k.to(dev), v.to(dev))
        kd, vd = (x.cpu().double().repeat_interleave(hq // hkv, dim=1) for x in layer.dense())  # before any drop
        mask = hf_prefill.causal_mask(batch_size=b, q_length=t, kv_length=t, attention_mask=pad.to(dev), device=dev)
        out, _ = tqt.attention_forward(None, q.to(dev), key, value, mask, scaling=scale)
        out = out.cpu()
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & pad[:, None, None, :]  # [b, 1, t, t]
        s_ = (q.half().double() @ kd.transpose(-1, -2)) * scale
        ref = (torch.softmax(s_.masked_fill(~allowed, float("-inf")), dim=-1) @ vd).transpose(1, 2)
        real = pad[:, :, None, None].expand(b, t, hq, d)
        rot = torch.eye(d, dtype=torch.float64) if params.rotation is None else torch.from_numpy(params.rotation)
        kq = (kd - (0 if mu is None else torch.from_numpy(mu).double().repeat_interleave(hq // hkv, 0)[:, None])) @ rot
        dot = torch.einsum("bhtd,bhnd->bhtn", (q.half().double() @ rot).abs(), kq.abs())
        delta = 2 * 2.0 ** -11 * scale * float(dot.max())
        bound = (4e-3 + 2 * delta) * float(vd.abs().max())
        err = float((out.double() - ref)[real].abs().max())
        assert err <= bound, (mode, err, bound)
    assert layer.starts.tolist() == [0, 3]  # the kernel path dropped the padding before the attention
    assert not out[1, :3].any()  # padded query positions read zeros


def test_chunked_prefill_equals_one_prefill(model, monkeypatch):
    """A padded prompt in two chunks: the second chunk (mask causal with the same left padding)
    runs the kernels over the re-paged rows and gives the one-call logits."""
    ids, mask = _left_padded((0, 3), 12, seed=4)
    tqt.install(model, "fp16")  # (a compressed format: a layer-1 code may flip with layer 0's rounding)
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, past_key_values=tqt.TQCache(model, prefill="kernel")).logits
        prefills, _ = _spies(monkeypatch)
        cache = tqt.TQCache(model, prefill="kernel")
        first = model(ids[:, :7], attention_mask=mask[:, :7], past_key_values=cache).logits
        second = model(ids[:, 7:], attention_mask=mask, past_key_values=cache).logits
    assert prefills.calls == 4
    got = torch.cat([first, second], dim=1)
    real = mask.bool()
    assert float((got - whole)[real].abs().max() / whole[real].std()) < 1e-2


def test_sliding_window_prefill_through_the_kernels(monkeypatch):
    model = _qwen2(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    ids, mask = _left_padded((0, 2), 11, seed=5)
    ref = _generate(model, ids, mask)
    tqt.install(model, "fp16")
    prefills, dense_masks = _spies(monkeypatch)
    out = _generate(model, ids, mask, cache=tqt.TQCache(model, prefill="kernel"))
    assert out.tolist() == ref.tolist()
    assert prefills.calls == 2 and dense_masks.calls == 0  # the windowed layer too


def test_gemma2_softcap_prefill(monkeypatch):
    """Soft-capping without μ runs the prefill kernel (with the cap); with μ the cap of
    q·(k − μ) is not that of q·k, so the prefill takes the dense path (μ added back)."""
    model = _gemma2()
    ids = _ids(1, 9, seed=6)
    ref = _generate(model, ids)  # transformers' eager attention (soft-capping)
    tqt.install(model, "fp16")
    prefills, _ = _spies(monkeypatch)
    out = _generate(model, ids, cache=tqt.TQCache(model, prefill="kernel"))
    assert out.tolist() == ref.tolist() and prefills.calls == 2
    tqt.install(model, "fp16", key_offset="prefill")
    out = _generate(model, ids, cache=tqt.TQCache(model, prefill="kernel"))
    assert out.tolist() == ref.tolist() and prefills.calls == 2  # no further kernel prefill


def test_masks_the_kernels_cannot_serve_take_the_dense_path(model, monkeypatch):
    """Padding inside a row (not a prefix) is no left padding: the dense path with the mask."""
    ids = _ids(2, 9, seed=7)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 4] = 0
    tqt.install(model, "fp16")
    ref = _teacher_forced_logits(model, ids[:1], [], tqt.TQCache(model, prefill="dense"))
    prefills, _ = _spies(monkeypatch)
    with torch.no_grad():
        got = model(ids, attention_mask=mask, past_key_values=tqt.TQCache(model, prefill="kernel")).logits
    assert prefills.calls == 0
    torch.testing.assert_close(got[:1, -1].float(), ref[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("window", [None, 4])
def test_causal_mask_entry(window):
    """The entry recognises transformers' causal and sliding-window functions, keeps the padding
    and offsets, and its dense form is sdpa_mask's; other masks get sdpa_mask's tensor."""
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[1, :3] = False
    args = dict(batch_size=2, q_length=6, kv_length=10, q_offset=4, kv_offset=0, mask_function=fn,
                attention_mask=pad, local_size=window)
    m = hf_prefill.causal_mask(**args)
    assert isinstance(m, hf_prefill.CausalMask) and m.window == window and m.shape == (2, 1, 6, 10)
    assert torch.equal(m.dense(), sdpa_mask(**args)) and m.left_padding(10)[1] == [0, 3]
    assert hf_prefill.causal_mask(**args, kwarg_passed_through=1).q_offset == 4
    assert hf_prefill.causal_mask(attention_mask=m, **{k: v for k, v in args.items() if k != "attention_mask"}) is m
    one = dict(args, q_length=1, q_offset=9)
    assert torch.equal(hf_prefill.causal_mask(**one), sdpa_mask(**one))  # a decode step: the tensor
    custom = dict(args, mask_function=lambda b, h, q, kv: kv <= q)  # not transformers' function
    assert torch.equal(hf_prefill.causal_mask(**custom), sdpa_mask(**custom))
    other = dict(args, local_size=None if window else 4)  # a window that local_size does not name
    assert isinstance(hf_prefill.causal_mask(**other), torch.Tensor) or window is None
    inner = pad.clone()
    inner[0, 5] = False
    assert hf_prefill.causal_mask(**dict(args, attention_mask=inner)).left_padding(10) is None


@CUDA
@pytest.mark.parametrize("pads", [(0, 0), (0, 13)])
def test_cuda_generate_through_the_tiled_prefill(pads, monkeypatch):
    """On CUDA ``prefill="auto"`` takes the kernels (rows of 40 tokens: the tiled path)."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().cuda()
    ids, mask = _left_padded(pads, 40, seed=12)
    ids, mask = ids.cuda(), mask.cuda()
    ref = _generate(model, ids, mask)
    tqt.install(model, "fp16")
    prefills, dense_masks = _spies(monkeypatch)
    out = _generate(model, ids, mask, cache=tqt.TQCache(model))
    assert out.tolist() == ref.tolist()
    assert prefills.calls == 2 and dense_masks.calls == 0


def test_bad_prefill_mode(model):
    tqt.install(model, "fp16")
    with pytest.raises(ValueError, match=r"prefill must be one of \('auto', 'kernel', 'dense'\), got 'fast'"):
        tqt.TQCache(model, prefill="fast")
