"""TQCache(model, max_cache_len=N, exact_prefix=K) (:class:`TQStaticCacheLayer` with an
:class:`~tqkern_torch.exact_prefix.ExactPrefix`) on tiny randomly initialised models: the same
tokens and logits as the growing cache with the same exact prefix (left padding, μ, the prefill
kernels, Gemma-2's sliding windows and soft-capping), the 16-bit prefill when every prompt token is
exact, a decode step that torch.compile traces whole and once, tensors that keep their addresses
across steps and ``reset``, and bad input. Run with ``TRITON_INTERPRET=1`` for the kernels."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tqkern_torch.transformers as tqt  # noqa: E402
from tests.test_transformers import (MODELS, _Counter, _gemma2_capped, _generate, _ids, _left_padded,  # noqa: E402
                                     _teacher_forced_logits)


def _greedy(model, ids, mask, cache, new_tokens=5):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         past_key_values=cache, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits).float()


@pytest.mark.parametrize("name,pads,prefill,mu", [("llama", (3, 1), "kernel", True), ("qwen2", (0, 5), "dense", False)])
def test_static_exact_prefix_generates_as_the_growing_cache(name, pads, prefill, mu, monkeypatch):
    """Greedy generate over a left-padded batch of 2: TQCache(max_cache_len=, exact_prefix=2)
    gives the tokens (and the logits, to float32 rounding) of TQCache(exact_prefix=2), same format
    and μ, every decode step through paged_decode; each row's exact tokens sit at paged 0, 1."""
    model = MODELS[name]()
    ids, mask = _left_padded(pads, 10, seed=6)
    key_offset = tqt.calibrate(model, _ids(2, 16, seed=8)) if mu else None
    tqt.install(model, "tq4", key_offset=key_offset, block_size=4)
    want, want_logits = _greedy(model, ids, mask, tqt.TQCache(model, exact_prefix=2, prefill=prefill))
    counter = _Counter(monkeypatch)
    cache = tqt.TQCache(model, max_cache_len=18, exact_prefix=2, prefill=prefill)
    got, logits = _greedy(model, ids, mask, cache)
    assert got.tolist() == want.tolist()
    assert float((logits - want_logits).abs().max() / want_logits.std()) < 1e-4
    assert counter.calls == 4 * 2  # the decode steps of both layers
    for layer in cache.layers:
        assert layer.starts.tolist() == list(pads) and layer.exact.pos.tolist() == [[p, p + 1] for p in pads]
        assert layer.exact.k_pos.tolist() == [[0, 1], [0, 1]]


def test_static_exact_prefix_all_prompt_tokens(monkeypatch):
    """Every prompt token exact: the prefill's logits are those of a float16 cache bit for bit (as
    test_exact_prefix_all_prompt_tokens_gives_the_16_bit_prefill for the growing cache); in the
    fp16 format generate gives transformers' own tokens, every decode step corrected."""
    from tqkern_torch.eval import _Fp16Cache

    model = MODELS["qwen2"]()
    ids = _ids(1, 9, seed=4)
    tqt.install(model, "fp16", key_offset=None)
    ref = _teacher_forced_logits(model, ids, [], _Fp16Cache.make())
    tqt.install(model, "turboquant_3bit_nc", key_offset=None)
    got = _teacher_forced_logits(model, ids, [], tqt.TQCache(model, max_cache_len=12, exact_prefix=9))
    assert torch.equal(got, ref)
    tqt.uninstall(model)
    ids = _ids(2, 9, seed=7)
    want = _generate(model, ids)
    tqt.install(model, "fp16", block_size=4)
    counter = _Counter(monkeypatch)
    assert _generate(model, ids, cache=tqt.TQCache(model, max_cache_len=17, exact_prefix=9)).tolist() == want.tolist()
    assert counter.calls == 7 * 2


def test_static_exact_prefix_sliding_window_and_softcap():
    """Gemma-2 (soft-capped logits, a sliding-window layer of 6 and a full one): the static decode
    steps' correction applies the cap and the window (a prefix token leaves a query's window, or
    was dropped with the positions older than it at the prefill: paged position < 0) and gives
    the logits of the growing cache, whose soft-capped steps attend the patched dense K/V. The
    q/k projections × 4: logits large enough for the cap to bend them (without the cap in the
    correction the logits are 0.03 std off, without the window 0.17; with both 0.002)."""
    model = _gemma2_capped()
    ids, mask = _left_padded((0, 4), 10, seed=2)
    tqt.install(model, "tq4", key_offset=None, block_size=4)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = {}
    for static in (False, True):
        cache = tqt.TQCache(model, exact_prefix=2, **({"max_cache_len": 16} if static else {}))
        m, p = mask, pos
        with torch.no_grad():
            logits = [model(ids, attention_mask=m, position_ids=p, past_key_values=cache).logits[:, -1]]
            for t in (5, 9, 17):
                m, p = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], dim=1), p[:, -1:] + 1
                logits.append(model(torch.full((2, 1), t), attention_mask=m, position_ids=p,
                                    past_key_values=cache).logits[:, -1])
        out[static] = torch.stack(logits).float()
    assert float((out[True] - out[False]).abs().max() / out[False].std()) < 1e-2
    kinds = model.config.layer_types
    for layer, kind in zip(cache.layers, kinds):  # row 0: 10 real tokens, 4 older than the window
        assert layer.exact.k_pos.tolist() == ([[-4, -3], [0, 1]] if kind == "sliding_attention" else [[0, 1], [0, 1]])
    assert sorted(kinds) == ["full_attention", "sliding_attention"]


def test_static_exact_prefix_decode_step_compiles_whole_and_once():
    """As test_decode_step_compiles_whole_and_once, with exact_prefix, μ and left padding: the
    correction traced in the same graph, no recompilation, the eager tokens; the exact K/V, their
    reconstruction and positions keep their addresses across steps and across ``reset`` (the
    next prefill refills them in place)."""
    model = MODELS["llama"]()
    ids, mask = _left_padded((0, 2), 9, seed=3)
    tqt.install(model, "tq4", key_offset=tqt.calibrate(model, _ids(2, 16, seed=8)))
    full_mask = torch.cat([mask, torch.ones(2, 7, dtype=mask.dtype)], dim=1)  # fixed size: max_cache_len
    tokens = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        cache = tqt.TQCache(model, max_cache_len=16, exact_prefix=2)
        step = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
        with torch.no_grad():
            seq = [model(ids, attention_mask=mask, past_key_values=cache).logits[:, -1].argmax(-1)]
            exact = cache.layers[0].exact
            state = [exact.k, exact.v, exact.pos, exact.k_pos, *exact._hat]
            ptrs = [x.data_ptr() for x in state]
            with torch._dynamo.config.patch(error_on_recompile=True, automatic_dynamic_shapes=False):
                for i in range(4):
                    pos = torch.tensor([[9 + i], [7 + i]])
                    logits = step(seq[-1][:, None], attention_mask=full_mask, position_ids=pos,
                                  past_key_values=cache).logits
                    seq.append(logits[:, -1].argmax(-1))
        tokens[compiled] = torch.stack(seq, 1).tolist()
        assert [x.data_ptr() for x in state] == ptrs
    assert tokens[True] == tokens[False]
    cache.reset()
    mask[0, 0] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    exact = cache.layers[0].exact
    assert all(a is b for a, b in zip([exact.k, exact.v, exact.pos, exact.k_pos, *exact._hat], state))
    assert exact.pos.tolist() == [[1, 2], [2, 3]] and exact.k_pos.tolist() == [[0, 1], [0, 1]]


def test_static_exact_prefix_one_token_first_chunk_and_bad_input():
    """A one-token first chunk (a decode step of the static layer) keeps that token exact for
    exact_prefix=1, as the growing cache does; exact_prefix above max_cache_len, or above the first
    chunk's tokens, is refused."""
    model = MODELS["llama"]()
    tqt.install(model, "tq4", key_offset=None)
    ids, steps = _ids(1, 1, seed=5), [7]
    want = _teacher_forced_logits(model, ids, steps, tqt.TQCache(model, exact_prefix=1))
    cache = tqt.TQCache(model, max_cache_len=8, exact_prefix=1)
    got = _teacher_forced_logits(model, ids, steps, cache)
    assert float((got - want).abs().max() / want.std()) < 1e-4 and cache.layers[0].exact.k_pos.tolist() == [[0]]
    with pytest.raises(ValueError, match=r"exact_prefix must be <= max_cache_len = 8, got 9"):
        tqt.TQCache(model, max_cache_len=8, exact_prefix=9)
    with pytest.raises(ValueError, match=r"exact_prefix=2\) needs at least 2 real tokens in every row"):
        _teacher_forced_logits(model, ids, [], tqt.TQCache(model, max_cache_len=8, exact_prefix=2))
