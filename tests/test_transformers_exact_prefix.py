"""TQCache(exact_prefix=N) on tiny randomly initialised Llama and Qwen2 models: the first N real
tokens of each row attended with their exact K/V, through the dense path (prefill) and through
paged_decode's log-sum-exp correction (decode steps), against the oracle round trip with those
positions exact; left padding; bad arguments. Run with ``TRITON_INTERPRET=1`` for the kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import tqkern_torch.transformers as tqt  # noqa: E402
from tqkern_torch.errors import read_errors  # noqa: E402
from tests.test_transformers import (MODELS, _Counter, _gemma2_capped, _ids, _left_padded,  # noqa: E402
                                     _oracle_attention, _teacher_forced_logits)
from transformers.cache_utils import DynamicCache  # noqa: E402


@pytest.fixture(params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def _oracle_exact(params, n):
    """The oracle round trip of test_transformers, with key/value positions < n exact (rounded to
    float16, what TQCache keeps of a float32 model's prefix tokens)."""
    inner = _oracle_attention(params)

    def fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        captured = {}

        def dense(q, k, v, mask, scale, softcap):
            k, v = k.clone(), v.clone()
            k[:, :, :n], v[:, :, :n] = key[:, :, :n].half(), value[:, :, :n].half()  # as the cache keeps them
            captured["out"] = orig(q, k, v, mask, scale, softcap)
            return captured["out"]

        orig = tqt._dense_attention
        tqt._dense_attention = dense
        try:
            return inner(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        finally:
            tqt._dense_attention = orig

    return fn


class _PrefillCounter:
    """Counts the calls of the prefill kernels' entry in tqkern_torch.hf_prefill."""

    def __init__(self, monkeypatch):
        import tqkern_torch.hf_prefill as hp

        self.calls, inner = 0, hp.prefill

        def counted(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(hp, "prefill", counted)


@pytest.mark.parametrize("prefill", ["dense", "kernel"])
@pytest.mark.parametrize("mu", [False, True])
def test_exact_prefix_logits_equal_the_oracle_with_exact_first_tokens(model, mu, prefill, monkeypatch):
    """Prefill (the dense path, or ``prefill`` + the correction) and two decode steps
    (paged_decode + the correction) against the oracle round trip with positions < 3 exact. The
    bound of test_compressed_logits (the kernels read q in float16), and the exact prefix must
    change the logits (it is not a no-op)."""
    ids, steps, n = _ids(1, 11, seed=3), [5, 9], 3
    key_offset = tqt.calibrate(model, _ids(2, 16, seed=8)) if mu else None
    spec = tqt.install(model, "tq4", key_offset=key_offset)
    counter, prefills = _Counter(monkeypatch), _PrefillCounter(monkeypatch)
    got = _teacher_forced_logits(model, ids, steps, tqt.TQCache(model, exact_prefix=n, prefill=prefill))
    assert counter.calls == len(steps) * 2  # the decode steps ran paged_decode
    assert prefills.calls == (2 if prefill == "kernel" else 0)  # one prefill per layer
    plain = _teacher_forced_logits(model, ids, steps, tqt.TQCache(model))
    transformers.AttentionInterface.register("tqkern_oracle", _oracle_exact(spec.params, n))
    transformers.AttentionMaskInterface.register("tqkern_oracle", transformers.masking_utils.sdpa_mask)
    model.set_attn_implementation("tqkern_oracle")
    emul = _teacher_forced_logits(model, ids, steps, DynamicCache())
    assert torch.isfinite(got).all()
    assert float((got - emul).abs().max() / emul.std()) < 1e-2
    assert float((plain - emul).abs().max() / emul.std()) > 2e-2


def test_exact_prefix_prefill_kernel_with_sliding_window_and_softcap(monkeypatch):
    """Gemma-2 (soft-capped logits, a sliding-window layer of 6 and a full one), left padding: the
    prefill kernel's output corrected with the same window and cap gives the dense path's logits
    (which attend the patched K/V with transformers' mask)."""
    model = _gemma2_capped()
    ids, mask = _left_padded((0, 4), 10, seed=2)
    tqt.install(model, "tq4", key_offset=None, block_size=4)
    out = {}
    for prefill in ("dense", "kernel"):
        prefills = _PrefillCounter(monkeypatch)
        with torch.no_grad():
            out[prefill] = model(ids, attention_mask=mask, past_key_values=tqt.TQCache(
                model, exact_prefix=2, prefill=prefill)).logits.float()
        assert prefills.calls == (2 if prefill == "kernel" else 0)  # the kernel path ran in both layers
    real = mask.bool()
    assert float((out["kernel"] - out["dense"])[real].abs().max() / out["dense"][real].std()) < 1e-2
    read_errors("cpu")  # (the padded row's positions were flagged NONFINITE_INPUT: leave the word clear)


def test_exact_prefix_all_prompt_tokens_gives_the_16_bit_prefill(model):
    """With every prompt token exact the prefill attends the model's K/V rounded to float16 (what
    the exact copy holds): its logits are those of a float16 cache (tqkern eval's reference) with
    the same attention code, bit for bit."""
    from tqkern_torch.eval import _Fp16Cache

    ids = _ids(1, 9, seed=4)
    tqt.install(model, "fp16", key_offset=None)
    ref = _teacher_forced_logits(model, ids, [], _Fp16Cache.make())
    tqt.install(model, "turboquant_3bit_nc", key_offset=None)
    got = _teacher_forced_logits(model, ids, [], tqt.TQCache(model, exact_prefix=9))
    assert torch.equal(got, ref)


@pytest.mark.parametrize("name,pads,prefill", [("qwen2", (0, 5), "dense"), ("llama", (3, 1), "kernel")])
def test_exact_prefix_left_padded_rows_equal_each_row_alone(name, pads, prefill):
    """A left-padded batch keeps each row's first real tokens exact: every row's logits (prefill,
    then decode steps through the re-paged rows) equal the row run alone. One model per path (CI
    time): both models' prefixes are checked against the oracle above."""
    model = MODELS[name]()
    ids, mask = _left_padded(pads, 10, seed=6)
    tqt.install(model, "tq4", key_offset=None, block_size=4)
    n, steps = 2, [7, 11]
    cache = tqt.TQCache(model, exact_prefix=n, prefill=prefill)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate: each row's real tokens from position 0
    with torch.no_grad():
        out = [model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                     use_cache=True).logits[:, -1]]
        for t in steps:
            mask = torch.cat([mask, torch.ones(len(pads), 1, dtype=mask.dtype)], dim=1)
            pos = pos[:, -1:] + 1
            step = torch.full((len(pads), 1), t)
            out.append(model(step, attention_mask=mask, position_ids=pos, past_key_values=cache,
                             use_cache=True).logits[:, -1])
    got = torch.stack(out).float()  # [steps + 1, rows, vocab]
    for row, pad in enumerate(pads):
        alone = _teacher_forced_logits(model, ids[row: row + 1, pad:], steps,
                                       tqt.TQCache(model, exact_prefix=n, prefill=prefill))
        assert float((got[:, row] - alone[:, 0]).abs().max() / alone.std()) < 1e-2, row
    assert cache.layers[0].exact.pos.tolist() == [[p, p + 1] for p in pads]


def test_exact_prefix_bad_arguments(model):
    tqt.install(model, "tq4", key_offset=None)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="exact_prefix must be an int >= 0"):
            tqt.TQCache(model, exact_prefix=bad)
    with pytest.raises(ValueError, match=r"exact_prefix must be <= max_cache_len = 32, got 33"):
        tqt.TQCache(model, max_cache_len=32, exact_prefix=33)
    assert all(layer.exact.n == 2 for layer in tqt.TQCache(model, max_cache_len=32, exact_prefix=2).layers)
    with pytest.raises(ValueError, match=r"exact_prefix=12\) needs at least 12 real tokens in every row"):
        _teacher_forced_logits(model, _ids(1, 11), [], tqt.TQCache(model, exact_prefix=12))
    np.testing.assert_equal(tqt.TQCache(model, exact_prefix=0).layers[0].exact, None)
