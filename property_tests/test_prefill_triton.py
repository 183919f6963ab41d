"""The Triton prefill kernel equals its NumPy oracle (``tqkern.ops.prefill.reference``) on the same
compressed cache.

Error budget, as for the decode (``test_paged_decode_triton.py``), by the roundings of the route
the rows may take (:class:`tqkern.testing.Rounding`): each logit moves by at most
δ = 2u · scale · Σ_d |q_d|·|k̂_d| (u the products' unit roundoff: q and the decoded key are each
rounded once), V̂, the probabilities and the output are each rounded once more; so a row is compared
with ``atol = (4e-3 + 2·δ_max) · max|V̂|`` of its sequence (length-independent) on an all-fp16
route, plus ``(2^-8 − 2^-11)·max|V̂|`` for each of those roundings in bf16 (bf16 queries: the
fused kernel writes a bf16 output; the tiled path also rounds V̂ and P to bf16), and ``lse``
(natural log) with ``2·δ_max + 2e-3``. A checked call on a GPU may take the tiled path: its rows
get the tiled path's budget. Every batch mixes decode rows (q_len 1), speculative rows (2..8),
whole sequences (no cached prefix), chunks and sequences without new tokens (q_len 0), over
blocks shuffled across sequences. The cache is random bytes where nothing was stored, the output
starts as NaN (an unwritten row fails), and up to two query elements are NaN or ±inf: those rows
must come out NaN.

The cache is written by the NumPy ``store`` oracle (what the kernel reads is then exactly the
oracle's bytes; ``store``'s own kernel has its own property test) to keep the interpreter time
low: the ``ci`` profile runs every test here in well under a minute on two cores.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import tqkern
import tqkern.testing as T
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.layouts import PRESETS
from tqkern_torch.testing import device_under_test, kernels_available, poisoned_like, to_torch_kv

pytestmark = [pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1"),
              # NaN queries are injected on purpose: NumPy's and the interpreter's warnings about them are expected
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:All-NaN:RuntimeWarning",
                                         "ignore:overflow:RuntimeWarning")]

DEV = device_under_test()
ON_GPU = DEV.type == "cuda"


@st.composite
def prefill_cases(draw, presets=tuple(sorted(PRESETS))):
    """A preset layout (head_dim 32/64, larger on a GPU), its parameters, a GQA group, a mixed
    varlen batch and the q dtype."""
    preset = draw(st.sampled_from(presets), label="preset")
    d = draw(st.sampled_from([32, 64] + ([128, 256] if ON_GPU else [])), label="head_dim")
    fmt = tqkern.KVFormat.preset(preset, d)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=draw(st.integers(1, 2), label="num_kv_heads"),
                                block_size=16, arrangement=draw(st.sampled_from(["slot", "row"]), label="arrangement"))
    params = draw(T.tq_params(fmt, layout.num_kv_heads), label="params")
    group = draw(st.integers(1, 4), label="gqa_group")
    batch = draw(T.varlen_batches(16, max_seqs=T.scale(4, 8), max_len=T.scale(100, 3000)), label="batch")
    qdtype = draw(st.sampled_from([torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]), label="q_dtype")
    return layout, params, group, batch, qdtype


def _fill_cache(layout, params, batch, data):
    """Random bytes, then every sequence's K/V stored at its slots (the NumPy store oracle)."""
    cache = poisoned_like(layout.cache_shape(batch.num_blocks), torch.uint8, "cpu", seed=batch.num_blocks).numpy()
    h, d = layout.num_kv_heads, layout.head_dim
    for s in range(len(batch.seq_lens)):
        n = int(batch.seq_lens[s])
        if n:
            k, v = data.draw(T.kv_arrays(n, h, d, dtype=np.float16), label=f"kv{s}")
            cache = ref.store(cache, k, v, batch.slot_ids(s), layout, params)
    return cache


def _draw_q(layout, group, batch, qdtype, data):
    """q ``[num_tokens, Hq, D]`` (torch, and the float64 values it holds) with up to two
    non-finite elements."""
    hq, d = layout.num_kv_heads * group, layout.head_dim
    # (moderate queries, no outlier channels: with the K/V's outlier channels, σ = 8 queries put
    # the logits where fp16 cannot resolve them and the honest bound says little; see decode's test)
    sigma = data.draw(st.sampled_from([0.05, 0.3, 1.0]), label="q_sigma")
    q_np = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="q_seed")).standard_normal(
        (batch.num_tokens, hq, d)).astype(np.float32) * np.float32(sigma)
    if batch.num_tokens:
        bad = data.draw(st.lists(st.tuples(st.integers(0, batch.num_tokens - 1), st.integers(0, hq - 1),
                                           st.integers(0, d - 1), st.sampled_from([np.nan, np.inf, -np.inf])),
                                 max_size=2), label="non_finite_q")
        for t, hh, dd, x in bad:
            q_np[t, hh, dd] = x
    return to_torch_kv(q_np, qdtype, DEV)


KERNEL_PATH = 1 << 20  # a ``max_query_len`` above every q_len: the prefill kernel whatever the batch


def _run(layout, params, batch, q, cache, fn=None, **options):
    """The frontend (``fn``, default ``tqt.prefill``) on ``DEV`` with a NaN-poisoned output, on
    the prefill kernel unless ``options`` name a ``max_query_len``; returns NumPy (out, lse or None)."""
    options.setdefault("max_query_len", KERNEL_PATH)
    out = poisoned_like(tuple(q.shape), q.dtype, DEV)
    tensors = [torch.from_numpy(x).to(DEV) for x in (cache, batch.block_table, batch.seq_lens, batch.query_start_loc)]
    res = (fn or tqt.prefill)(q, *tensors, layout, params, out=out, **options)
    if options.get("return_lse"):
        assert res[0] is out
        return out.float().cpu().numpy(), res[1].cpu().numpy().astype(np.float64)
    assert res is out
    return out.float().cpu().numpy(), None


def sequence_operands(layout, params, batch, cache, q64, s):
    """Sequence s's decompressed keys in codec space ``[n, Hkv, D]``, max|V̂| (rotated back), and
    its finite query rows in the key codec's space ``[t, Hq, D]`` (non-finite rows zeroed)."""
    a, b = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
    slots = ref.gather_sequences(cache, layout, batch.block_table[s:s + 1], batch.seq_lens[s:s + 1])[0]
    khat, _ = ref.decompress(slots, params)
    _, vhat = ref.decompress(slots, params, rotate_back=True)
    vmax = float(np.abs(vhat).max()) if vhat.size else 0.0
    qs = np.where(np.isfinite(q64[a:b]).all(-1, keepdims=True), q64[a:b], 0.0)
    return khat, vmax, qs @ params.rotation if layout.format.key.rotated else qs


def rounding(layout, q, *, workspace):
    """:class:`~tqkern.testing.Rounding` of a route for ``q`` (torch) over ``layout``'s cache."""
    return T.Rounding.of(layout.format, str(q.dtype).removeprefix("torch."), workspace=workspace)


def _bounds(layout, params, batch, cache, q64, s, group, rnd):
    """(logit bound δ, max|V̂|) of sequence s for its finite query rows, products rounded as ``rnd``
    (:class:`~tqkern.testing.Rounding`) says."""
    khat, vmax, q_k = sequence_operands(layout, params, batch, cache, q64, s)
    return rnd.logit_bound(q_k, khat, group), vmax


def sequence_error(got, expect, layout, params, batch, cache, q64, group, s, bounds, rnd):
    """(max error over sequence s's finite query rows, its tolerance ``rnd.atol(δ, max|V̂|)``, δ,
    max|V̂|): the budget of the module docstring (``bounds`` gives δ and max|V̂| for the products'
    rounding ``rnd``, a :class:`~tqkern.testing.Rounding`)."""
    a, b = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
    good = np.all(np.isfinite(q64[a:b]), axis=-1)
    delta, vmax = bounds(layout, params, batch, cache, q64, s, group, rnd)
    err = float(np.abs(got[a:b][good] - expect[a:b][good]).max()) if good.any() else 0.0
    return err, rnd.atol(delta, vmax), delta, vmax


def _compare(got, expect, layout, params, batch, cache, q64, group, *, rnd, what="oracle", got_lse=None,
             expect_lse=None, bounds=_bounds):
    """Every finite query row of every sequence within the budget of the roundings ``rnd``
    (``bounds`` gives a sequence's logit bound δ and max|V̂|); non-finite rows NaN."""
    bad_rows = ~np.all(np.isfinite(q64), axis=-1)  # [T, Hq]
    assert np.all(np.isnan(got[bad_rows])), "a query row with NaN/inf must give a NaN output row"
    assert np.all(np.isfinite(got[~bad_rows])), "output has NaN/inf (unwritten or overflow)"
    if got_lse is not None:
        assert np.all(np.isnan(got_lse[bad_rows])), "a query row with NaN/inf must give a NaN lse"
    for s in range(len(batch.seq_lens)):
        a, b = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
        if a == b:
            continue
        err, tol, delta, vmax = sequence_error(got, expect, layout, params, batch, cache, q64, group, s, bounds, rnd)
        good = ~bad_rows[a:b]
        note(f"seq {s}: len {batch.seq_lens[s]}, q_len {b - a}, max err vs {what} {err:.3g}, tol {tol:.3g}")
        assert err <= tol, (f"seq {s}: error vs {what} {err:.3g} > tolerance {tol:.3g} (max|V| {vmax:.3g}, "
                            f"δ {delta:.3g}, {rnd})")
        if got_lse is not None and good.any():
            gl, el = got_lse[a:b][good], expect_lse[a:b][good]
            assert np.array_equal(np.isneginf(gl), np.isneginf(el)), f"seq {s}: lse -inf rows differ"
            fin = np.isfinite(el)
            lerr = float(np.abs(gl[fin] - el[fin]).max()) if fin.any() else 0.0
            assert lerr <= 2 * delta + 2e-3, f"seq {s}: lse error {lerr:.3g} > {2 * delta + 2e-3:.3g} ({rnd})"


def draw_options(data, hq: int):
    """``(window_left, logit_softcap, sinks, return_lse)`` drawn independently (sinks: float32 ``[hq]``)."""
    window = data.draw(st.one_of(st.none(), st.integers(0, 40)), label="window_left")
    cap = data.draw(st.one_of(st.none(), st.sampled_from([0.5, 5.0, 30.0])), label="logit_softcap")
    sinks = data.draw(st.one_of(st.none(), st.lists(st.floats(-3, 3), min_size=hq, max_size=hq)), label="sinks")
    lse = data.draw(st.booleans(), label="return_lse")
    return window, cap, None if sinks is None else np.asarray(sinks, np.float32), lse


@pytest.mark.parametrize("preset", sorted(PRESETS))
@settings(max_examples=T.scale(5, 40))
@given(st.data())
def test_prefill_matches_oracle(preset, data):
    """Every preset, both arrangements, GQA 1..4, mixed batches, shuffled blocks, empty
    sequences, NaN-poisoned queries: the kernel equals the oracle (on a GPU a checked call runs
    the tiled path, an unchecked one the fused kernel: ``check_inputs`` is drawn)."""
    layout, params, group, batch, qdtype = data.draw(prefill_cases(presets=(preset,)), label="case")
    cache = _fill_cache(layout, params, batch, data)
    q, q64 = _draw_q(layout, group, batch, qdtype, data)
    checked = data.draw(st.booleans(), label="check_inputs")
    got, _ = _run(layout, params, batch, q, cache, check_inputs=checked)
    expect = ref.prefill(q64, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, layout, params)
    _compare(got, expect, layout, params, batch, cache, q64, group,
             rnd=rounding(layout, q, workspace=ON_GPU and checked))


def check_options(case, data, fn=None, oracle=ref.prefill, bounds=_bounds, what="oracle"):
    """Drawn options (:func:`draw_options`) through ``fn`` (default ``tqt.prefill``) against
    ``oracle`` on one drawn case."""
    layout, params, group, batch, qdtype = case
    window, cap, sinks, lse = draw_options(data, layout.num_kv_heads * group)
    cache = _fill_cache(layout, params, batch, data)
    q, q64 = _draw_q(layout, group, batch, qdtype, data)
    checked = data.draw(st.booleans(), label="check_inputs")
    got, got_lse = _run(layout, params, batch, q, cache, fn=fn, window_left=window, logit_softcap=cap,
                        return_lse=lse, sinks=None if sinks is None else torch.from_numpy(sinks).to(DEV),
                        check_inputs=checked)
    res = oracle(q64, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, layout, params,
                 window_left=window, logit_softcap=cap, sinks=sinks, return_lse=True)
    _compare(got, res[0], layout, params, batch, cache, q64, group, what=what, got_lse=got_lse, expect_lse=res[1],
             bounds=bounds, rnd=rounding(layout, q, workspace=ON_GPU and checked))


@given(prefill_cases(presets=("tq4", "turboquant_k8v4", "turboquant_4bit_nc", "fp16")), st.data())
def test_prefill_options_match_oracle(case, data):
    """``window_left``, ``logit_softcap``, ``sinks`` and ``return_lse``, drawn independently."""
    check_options(case, data)


@settings(max_examples=T.scale(8, settings.default.max_examples))  # CI: 8 (slowest interpreted)
@given(prefill_cases(presets=("tq4", "turboquant_3bit_nc", "tqkern_k5v3", "turboquant_k8v4")), st.data())
def test_chunked_prefill_equals_one_call(case, data):
    """Each sequence's new tokens split at a drawn point into two calls (the first with the
    length the sequence had then) give the rows of one call."""
    layout, params, group, batch, qdtype = case
    cache = _fill_cache(layout, params, batch, data)
    q, q64 = _draw_q(layout, group, batch, qdtype, data)
    whole, _ = _run(layout, params, batch, q, cache)
    cuts = [data.draw(st.integers(0, int(n)), label=f"cut{s}") for s, n in enumerate(batch.q_lens)]
    parts = []
    for first in (True, False):
        q_lens = [c if first else int(n) - c for c, n in zip(cuts, batch.q_lens)]
        seq_lens = [int(L) - (int(n) - c if first else 0) for L, n, c in zip(batch.seq_lens, batch.q_lens, cuts)]
        part = T.VarlenBatch(batch.block_table, np.array(seq_lens, np.int32), batch.num_blocks, 16, q_lens)
        rows = np.concatenate([np.arange(a, a + ql) for a, ql in zip(batch.query_start_loc[:-1], q_lens)]
                              + [np.zeros(0, np.int64)]).astype(np.int64) + (0 if first else np.repeat(cuts, q_lens))
        got, _ = _run(layout, params, part, q[torch.from_numpy(rows).to(DEV)], cache) if len(rows) else (
            np.zeros((0,) + tuple(q.shape[1:])), None)
        parts.append((rows, got))
    chunked = np.full(whole.shape, np.nan)
    for rows, got in parts:
        chunked[rows] = got
    expect = ref.prefill(q64, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, layout, params)
    rnd = rounding(layout, q, workspace=ON_GPU)  # (checked calls)
    _compare(chunked, expect, layout, params, batch, cache, q64, group, what="oracle (chunked)", rnd=rnd)
    _compare(chunked, whole, layout, params, batch, cache, q64, group, what="one call", rnd=rnd)


@settings(max_examples=T.scale(8, settings.default.max_examples))  # CI: 8 (slowest interpreted)
@given(prefill_cases(), st.data())
def test_no_prefix_equals_causal_attention(case, data):
    """With every new token of a sequence in the call (q_len = seq_len), prefill is causal dense
    attention over the decompressed, rotated-back K/V in the original coordinates."""
    layout, params, group, batch, qdtype = case
    whole = T.VarlenBatch(batch.block_table, batch.seq_lens, batch.num_blocks, 16, batch.seq_lens)
    cache = _fill_cache(layout, params, whole, data)
    q, q64 = _draw_q(layout, group, whole, qdtype, data)
    got, _ = _run(layout, params, whole, q, cache)
    expect = np.zeros(got.shape)
    for s, slots in enumerate(ref.gather_sequences(cache, layout, whole.block_table, whole.seq_lens)):
        a, b = int(whole.query_start_loc[s]), int(whole.query_start_loc[s + 1])
        k, v = ref.decompress(slots, params, rotate_back=True)
        expect[a:b] = ref.attention(q64[a:b], k, v, causal=True)
    _compare(got, expect, layout, params, whole, cache, q64, group, what="causal attention",
             rnd=rounding(layout, q, workspace=ON_GPU))
