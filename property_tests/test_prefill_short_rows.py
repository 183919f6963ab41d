"""``prefill``'s short-row path (``q_len ≤ 8``: the decode kernel over the cached prefix, the newest
keys in float32, a log-sum-exp merge; :mod:`tqkern_torch.short_rows`) equals the prefill oracle.

Same cases, error budget and poisoning as ``test_prefill_triton.py`` (its helpers), on batches whose
every ``q_len`` is at most 8: decode rows, speculative rows, sequences shorter than the padded
width, empty sequences, whole short sequences (no cached prefix), blocks shuffled across
sequences, NaN-poisoned outputs and non-finite query elements. The path is taken both from a
given ``max_query_len`` (drawn from the longest q_len to 8) and from the one ``check_inputs``
finds; a prefill-kernel call on the same batch must agree within the same budget.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tqkern
import tqkern.testing as T
from property_tests.test_prefill_triton import (DEV, KERNEL_PATH, ON_GPU, _compare, _draw_q, _fill_cache, _run,
                                                prefill_cases, rounding)
from tqkern import reference as ref
from tqkern.layouts import PRESETS
from tqkern_torch.short_rows import SHORT_QUERY_MAX
from tqkern_torch.testing import kernels_available

pytestmark = [pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:All-NaN:RuntimeWarning",
                                         "ignore:overflow:RuntimeWarning")]


@st.composite
def short_cases(draw, presets=tuple(sorted(PRESETS))):
    """A :func:`prefill_cases` case whose batch has every ``q_len ≤ 8``."""
    layout, params, group, _, qdtype = draw(prefill_cases(presets=presets), label="case")
    batch = draw(T.varlen_batches(16, max_seqs=T.scale(4, 8), max_len=T.scale(70, 3000),
                                  max_q_len=SHORT_QUERY_MAX), label="short_batch")
    return layout, params, group, batch, qdtype


def _bound(data, batch):
    """``max_query_len``: None (found by ``check_inputs``) or a drawn bound ≥ the longest q_len."""
    longest = max([int(n) for n in batch.q_lens] + [1])
    return data.draw(st.one_of(st.none(), st.integers(longest, SHORT_QUERY_MAX)), label="max_query_len")


@pytest.mark.parametrize("preset", sorted(PRESETS))
@settings(max_examples=T.scale(4, 30))
@given(st.data())
def test_short_rows_match_oracle(preset, data):
    """Every preset, both arrangements, GQA 1..4, soft-cap / sinks / lse drawn: the oracle's rows."""
    layout, params, group, batch, qdtype = data.draw(short_cases(presets=(preset,)), label="short")
    hq = layout.num_kv_heads * group
    cap = data.draw(st.one_of(st.none(), st.sampled_from([0.5, 5.0, 30.0])), label="logit_softcap")
    sinks = data.draw(st.one_of(st.none(), st.lists(st.floats(-3, 3), min_size=hq, max_size=hq)), label="sinks")
    sinks = None if sinks is None else np.asarray(sinks, np.float32)
    lse = data.draw(st.booleans(), label="return_lse")
    cache = _fill_cache(layout, params, batch, data)
    q, q64 = _draw_q(layout, group, batch, qdtype, data)
    got, got_lse = _run(layout, params, batch, q, cache, logit_softcap=cap, return_lse=lse,
                        sinks=None if sinks is None else torch.from_numpy(sinks).to(DEV),
                        max_query_len=_bound(data, batch))
    res = ref.prefill(q64, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, layout, params,
                      logit_softcap=cap, sinks=sinks, return_lse=True)
    _compare(got, res[0], layout, params, batch, cache, q64, group, got_lse=got_lse if lse else None,
             expect_lse=res[1], rnd=rounding(layout, q, workspace=False))


@settings(max_examples=T.scale(8, settings.default.max_examples))  # CI: 8 (slowest interpreted)
@given(short_cases(presets=("tq4", "turboquant_4bit_nc", "turboquant_k8v4", "fp16")), st.data())
def test_short_rows_equal_the_prefill_kernel(case, data):
    """The two paths of one call agree on every row (each within the oracle's budget of the other)."""
    layout, params, group, batch, qdtype = case
    cache = _fill_cache(layout, params, batch, data)
    q, q64 = _draw_q(layout, group, batch, qdtype, data)
    short, _ = _run(layout, params, batch, q, cache, max_query_len=_bound(data, batch))
    kernel, _ = _run(layout, params, batch, q, cache, max_query_len=KERNEL_PATH)
    _compare(short, kernel, layout, params, batch, cache, q64, group, what="prefill kernel",
             rnd=rounding(layout, q, workspace=ON_GPU))


def test_short_rows_under_a_broken_bound_give_zero_rows():
    """``max_query_len`` below a q_len with ``check_inputs=False``: that sequence's rows before its
    last ``max_query_len`` ones are zeros (never unwritten), the others as the oracle says; with
    ``check_inputs`` the same call raises."""
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset("tq4", 64), num_kv_heads=1, block_size=16)
    params = tqkern.TQParams.default(layout.format)
    batch = T.VarlenBatch(np.array([[1, 0, 2]], np.int32), np.array([40], np.int32), 3, 16, [5])
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((40, 1, 64)).astype(np.float16) for _ in range(2))
    cache = ref.store(np.zeros(layout.cache_shape(3), np.uint8), k, v, batch.slot_ids(0), layout, params)
    q = torch.from_numpy(rng.standard_normal((5, 2, 64)).astype(np.float16)).to(DEV)
    got, _ = _run(layout, params, batch, q, cache, max_query_len=3, check_inputs=False)
    assert np.all(got[:2] == 0)
    expect = ref.prefill(q.double().cpu().numpy(), cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                         layout, params)
    np.testing.assert_allclose(got[2:], expect[2:], atol=2e-2)
    with pytest.raises(ValueError, match="max_query_len must be >= every q_len, got 3 < q_len 5 of sequence 0"):
        _run(layout, params, batch, q, cache, max_query_len=3)


@settings(max_examples=T.scale(8, settings.default.max_examples))  # CI: 8 (slowest interpreted)
@given(prefill_cases(presets=("tq4", "turboquant_4bit_nc", "turboquant_3bit_nc", "fp16")), st.data())
def test_mixed_batches_split_by_length_match_oracle(case, data):
    """A checked call without a bound on a batch mixing every kind of row: the short sequences run
    the short-row path and the others the long-row path (the prefill kernel, or the tiled path on
    a GPU; both spied on when both kinds are present), the rows as the oracle says. Off the GPU
    the long rows are drawn onto the tiled path too (its float32 dense attention), the GPU's
    routing: a mixed batch's long rows as one tiled call."""
    import sys

    layout, params, group, batch, qdtype = case
    mod = sys.modules["tqkern_torch.prefill"]
    calls = {"short": 0, "kernel": 0}
    short_fn, kernel_fn, tiles_fn = mod.short_rows, mod._long_rows, mod.tiles_supported
    tiled = DEV.type != "cuda" and data.draw(st.booleans(), label="tiled_path")

    def short_spy(*a, **k):
        calls["short"] += 1
        return short_fn(*a, **k)

    def kernel_spy(*a, **k):
        calls["kernel"] += 1
        return kernel_fn(*a, **k)

    cache = _fill_cache(layout, params, batch, data)
    q, q64 = _draw_q(layout, group, batch, qdtype, data)
    mod.short_rows, mod._long_rows = short_spy, kernel_spy
    if tiled:
        mod.tiles_supported = lambda *a, **k: True
    try:
        got, _ = _run(layout, params, batch, q, cache, max_query_len=None)
    finally:
        mod.short_rows, mod._long_rows, mod.tiles_supported = short_fn, kernel_fn, tiles_fn
    q_lens = np.asarray(batch.q_lens)
    has_short = bool(((q_lens > 0) & (q_lens <= SHORT_QUERY_MAX)).any())
    has_long = bool((q_lens > SHORT_QUERY_MAX).any())
    assert calls == {"short": int(has_short), "kernel": int(has_long)}
    expect = ref.prefill(q64, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, layout, params)
    _compare(got, expect, layout, params, batch, cache, q64, group, rnd=rounding(layout, q, workspace=ON_GPU))

