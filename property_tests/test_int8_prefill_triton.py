"""The Triton ``int8_prefill`` kernel equals its NumPy oracle
(``tqkern.ops.int8_prefill.reference``) on the same compressed cache.

Both quantize the same vectors (the rotated query per token and head, each reconstructed key per
token and KV head) to symmetric int8 codes and form ``s_q·s_k·(c_q·c_k)``; the kernel computes
the scales and ``x / s`` in float32, the oracle in float64, so a code may differ by one where
``x / s`` lies within float32 rounding of a half-integer (FP8 keys make such near-ties common:
``k = k_max / 2`` gives 63.5). Lloyd-Max keys take the codebook's int8 image, a table lookup:
their codes are exact (``T_k`` empty), their scales rounded to float32. The logit bound of a
sequence is therefore

    δ = scale · max_{i, j} s_q[i] · s_k[j] · (Σ_{d ∈ T_k(j)} (|c_q[i, d]| + 1) + Σ_{d ∈ T_q(i)} (|c_k[j, d]| + 1))

over its query rows i and keys j, with T the coordinates whose ``|x| / s`` lies within 2e-4 of a
half-integer (float32's error there is below 1e-4 at ``|x| / s ≤ 127``), plus float32's rounding
of the scores (3·2^-24 of the largest). The rest of the budget is the prefill test's: P·V in fp16
with float32 accumulation, ``atol = (4e-3 + 2·δ) · max|V̂|``, more for roundings in bf16
(:class:`tqkern.testing.Rounding`). A sequence of at most
``EXACT_QUERY_MAX`` queries takes ``prefill``'s scores (the oracle's rule, session 36) and the
prefill test's δ. Batches, poisoning and options are those of ``test_prefill_triton.py``; the
unchecked calls run the fused kernel (twice: int8 for the long sequences, without for the short
ones), the checked ones of the options test split a batch that holds short sequences.

The tiled path (:func:`~tqkern_torch.prefill_tiles.tile_prefill` with ``int8=True``: keys' codes
made once by the gather, the queries' by their own kernel, the int8 attention kernel per piece,
log-sum-exp merges) is held to the same budget: its codes are the oracle's away from ties as the
fused kernel's are; its values and probabilities are rounded to q's dtype (for bf16 queries the
tiled path's roundings, ``workspace=True``). Its batches have no sequence of 1..EXACT_QUERY_MAX
queries (raised past it, or to 0): those never reach it.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tqkern.testing as T
import tqkern_torch as tqt
from property_tests.test_prefill_triton import _bounds as _prefill_bounds
from property_tests.test_prefill_triton import rounding
from property_tests.test_prefill_triton import (_compare, _draw_q, _fill_cache, check_options, prefill_cases,
                                                sequence_operands)
from property_tests.test_prefill_triton import _run as _run_prefill
from property_tests.test_prefill_tiles import _equal_batch, _tiles
from tqkern import reference as ref
from tqkern.layouts import PRESETS, LloydMax
from tqkern.ops.int8_prefill.reference import EXACT_QUERY_MAX, _key_int8, int8_prefill, quantize_int8
from tqkern_torch.testing import kernels_available

pytestmark = [pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:All-NaN:RuntimeWarning",
                                         "ignore:overflow:RuntimeWarning")]

_TIE = 2e-4


def _near_tie(x, s):
    """Coordinates of ``x [..., D]`` whose ``|x| / s`` lies within ``_TIE`` of a half-integer."""
    t = np.abs(x) / np.where(s > 0, s, 1.0)[..., None]
    return np.abs(t - np.floor(t) - 0.5) <= _TIE


def _int8_bounds(layout, params, batch, cache, q64, s, group, rnd):
    """(logit bound δ of the module docstring, max|V̂|) of sequence s for its finite query rows; a
    sequence of at most EXACT_QUERY_MAX queries takes ``prefill``'s scores, and its bound."""
    if int(batch.q_lens[s]) <= EXACT_QUERY_MAX:
        return _prefill_bounds(layout, params, batch, cache, q64, s, group, rnd)
    khat, vmax, q_k = sequence_operands(layout, params, batch, cache, q64, s)
    if not khat.size or not q_k.size:
        return 0.0, vmax
    slots = ref.gather_sequences(cache, layout, batch.block_table[s:s + 1], batch.seq_lens[s:s + 1])[0]
    cq, sq = quantize_int8(q_k)
    ck, sk = _key_int8(slots, khat, params)
    tq = _near_tie(q_k, sq)
    # Lloyd-Max keys' codes are a table lookup (the codebook's int8 image): no ties
    tk = np.zeros(khat.shape, bool) if isinstance(layout.format.key, LloydMax) else _near_tie(khat, sk)
    rep = lambda x: np.repeat(x, group, axis=1)  # noqa: E731  [n, Hkv, ...] -> [n, Hq, ...]
    flips = (np.einsum("thd,nhd->thn", np.abs(cq.astype(np.float64)) + 1, rep(tk).astype(np.float64))
             + np.einsum("thd,nhd->thn", tq.astype(np.float64), np.abs(rep(ck).astype(np.float64)) + 1))
    scale = 1.0 / np.sqrt(layout.head_dim)
    pair = scale * sq[:, :, None] * rep(sk).T[None, :, :]  # [t, Hq, n]
    dots = np.abs(np.einsum("thd,nhd->thn", cq.astype(np.float64), rep(ck).astype(np.float64)))
    return float(np.max(pair * flips) + 3 * 2.0**-24 * np.max(pair * dots)), vmax


def _long_only(batch):
    """``batch`` with each ``q_len`` of 1..EXACT_QUERY_MAX raised to EXACT_QUERY_MAX + 1 where the
    sequence is that long, else 0: the int8 tiles serve long sequences only (the short ones take
    ``prefill``'s scores, on other paths)."""
    q_lens = [n if n == 0 or n > EXACT_QUERY_MAX else (EXACT_QUERY_MAX + 1 if L > EXACT_QUERY_MAX else 0)
              for n, L in zip(batch.q_lens.tolist(), batch.seq_lens.tolist())]
    return T.VarlenBatch(batch.block_table, batch.seq_lens, batch.num_blocks, batch.block_size, q_lens)


def _run(layout, params, batch, q, cache, **options):
    """The fused kernel (unchecked, no host lengths: known lengths would split a batch with short rows), which
    launches twice: int8 codes for the long sequences, prefill's scores for the short ones."""
    options.setdefault("check_inputs", False)
    return _run_prefill(layout, params, batch, q, cache, fn=tqt.int8_prefill, **options)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@settings(max_examples=T.scale(4, 30))
@given(st.data())
def test_int8_prefill_matches_oracle(preset, data):
    """Every preset, both arrangements, GQA 1..4, mixed batches, shuffled blocks, empty
    sequences, NaN-poisoned queries."""
    layout, params, group, batch, qdtype = data.draw(prefill_cases(presets=(preset,)), label="case")
    cache = _fill_cache(layout, params, batch, data)
    q, q64 = _draw_q(layout, group, batch, qdtype, data)
    got, _ = _run(layout, params, batch, q, cache)
    expect = int8_prefill(q64, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, layout, params)
    _compare(got, expect, layout, params, batch, cache, q64, group, what="int8 oracle", bounds=_int8_bounds,
             rnd=rounding(layout, q, workspace=False))


@given(prefill_cases(presets=("tq4", "turboquant_k8v4", "turboquant_4bit_nc", "fp16")), st.data())
def test_int8_prefill_options_match_oracle(case, data):
    """``window_left``, ``logit_softcap``, ``sinks`` and ``return_lse`` (the soft-cap on the int8 scores)."""
    check_options(case, data, fn=tqt.int8_prefill, oracle=int8_prefill, bounds=_int8_bounds, what="int8 oracle")


@pytest.mark.parametrize("preset", sorted(PRESETS))
@settings(max_examples=T.scale(3, 25))
@given(st.data())
def test_int8_tiles_match_oracle(preset, data):
    """The tiled path: every preset, both arrangements, GQA 1..4, mixed or equal-length batches,
    shuffled blocks, poisoned queries, workspaces from one row up (many merged pieces), a given or
    a fresh output; window, soft-cap, sinks and lse drawn."""
    layout, params, group, batch, qdtype = data.draw(prefill_cases(presets=(preset,)), label="case")
    if data.draw(st.booleans(), label="equal_lengths"):
        batch = data.draw(_equal_batch(len(batch.seq_lens), int(max(batch.seq_lens.max(), 1))), label="equal_batch")
    batch = _long_only(batch)
    hq = layout.num_kv_heads * group
    window = data.draw(st.one_of(st.none(), st.integers(0, 40)), label="window_left")
    cap = data.draw(st.one_of(st.none(), st.sampled_from([0.5, 5.0, 30.0])), label="logit_softcap")
    sinks = data.draw(st.one_of(st.none(), st.lists(st.floats(-3, 3), min_size=hq, max_size=hq)), label="sinks")
    sinks = None if sinks is None else np.asarray(sinks, np.float32)
    lse = data.draw(st.booleans(), label="return_lse")
    budget = data.draw(st.one_of(st.integers(1, 160), st.just(1 << 20)), label="budget_rows")
    cache = _fill_cache(layout, params, batch, data)
    q, q64 = _draw_q(layout, group, batch, qdtype, data)
    got, got_lse = _tiles(layout, params, batch, q, cache, budget_rows=budget, window_left=window, sinks=sinks,
                          return_lse=lse, fresh=data.draw(st.booleans(), label="out_none"), int8=True,
                          logit_softcap=cap, gather_fwht=data.draw(st.booleans(), label="gather_fwht"))
    res = int8_prefill(q64, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, layout, params,
                       window_left=window, logit_softcap=cap, sinks=sinks, return_lse=True)
    _compare(got, res[0], layout, params, batch, cache, q64, group, what="int8 oracle", got_lse=got_lse,
             expect_lse=res[1], bounds=_int8_bounds, rnd=rounding(layout, q, workspace=True))
