"""Properties of the attention oracles: dense ``attention``, ``paged_decode`` and ``prefill``
(tqkern/ops/*/reference.py; ``int8_prefill``'s: ``test_int8_prefill_reference.py``, which shares
this module's strategies).

The paged oracles are checked against dense attention over the decompressed K/V (original
coordinates), against each other (chunking, q_len 1 vs decode) and against a shuffled physical
placement. Outputs are convex combinations of
value rows, so float64 tolerances are stated relative to the largest value row norm.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import tqkern.testing  # noqa: F401  (registers the ci / thorough profiles)
from tqkern.layouts import KVFormat, LloydMax, PagedLayout, Raw
from tqkern.ops.attention.reference import attention
from tqkern.ops.decompress.reference import decompress, gather_slots
from tqkern.ops.paged_decode.reference import paged_decode
from tqkern.ops.prefill.reference import prefill
from tqkern.ops.store.reference import store
from tqkern.params import TQParams
from tqkern.testing import (
    codecs,
    float_arrays,
    is_thorough,
    kv_formats,
    paged_batches,
    paged_layouts,
    scale,
    tq_params,
)

RTOL = 1e-9  # float64 paths that differ only in rounding (rotation order, matmul shapes)


class PagedSetup:
    """A filled paged cache plus everything needed to read it back densely."""

    def __init__(self, layout, params, batch, cache, num_q_heads):
        self.layout, self.params, self.batch, self.cache = layout, params, batch, cache
        self.num_q_heads = num_q_heads

    @property
    def num_seqs(self) -> int:
        return len(self.batch.seq_lens)

    def dense_kv(self, s: int):
        """Sequence s's tokens, decompressed to original coordinates."""
        ids = self.batch.slot_ids(s)
        return decompress(gather_slots(self.cache, self.layout, ids), self.params, rotate_back=True)

    def v_scale(self) -> float:
        """Largest value row 2-norm in the batch: bounds every output row's 2-norm."""
        norms = [np.max(np.linalg.norm(self.dense_kv(s)[1], axis=-1), initial=0.0) for s in range(self.num_seqs)]
        return float(max(norms, default=0.0))

    def __repr__(self) -> str:
        return f"PagedSetup({self.layout!r}, Hq={self.num_q_heads}, {self.batch!r})"


def _formats(**kw):
    """Any format; small head_dims (96 the non-power-of-two one) under the ci profile."""
    return kv_formats(**kw) if is_thorough() else kv_formats(st.sampled_from([8, 16, 32, 96]), **kw)


@st.composite
def unit_gaussian(draw, shape) -> np.ndarray:
    """float16 N(0, 1) data: no outlier channels, no zero vectors."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="data_seed"))
    return rng.standard_normal(shape).astype(np.float16)


@st.composite
def paged_setups(draw, formats=None, *, key_offset=st.booleans(), min_len: int = 1, kv_data=float_arrays):
    """A layout, its params, a batch of sequences and a cache holding their K/V (drawn by
    ``kv_data(shape)``); unused slots are random bytes, so reading one shows up as garbage or NaN."""
    blocks = st.sampled_from([1, 16, 32, 64] if is_thorough() else [1, 4, 8, 16])
    layout = draw(paged_layouts(formats if formats is not None else _formats(), block_sizes=blocks),
                  label="layout")
    h, d = layout.num_kv_heads, layout.head_dim
    params = draw(tq_params(layout.format, h, key_offset=key_offset), label="params")
    batch = draw(paged_batches(layout.block_size, max_seqs=scale(3, 6), max_len=scale(40, 300),
                               min_len=min_len), label="batch")
    n_tok = int(batch.seq_lens.sum())
    k = draw(kv_data((n_tok, h, d)), label="key")
    v = draw(kv_data((n_tok, h, d)), label="value")
    rng = np.random.default_rng(draw(st.integers(0, 2**16), label="poison_seed"))
    cache = rng.integers(0, 256, layout.cache_shape(batch.num_blocks), dtype=np.uint8)
    slots = np.concatenate([batch.slot_ids(s) for s in range(len(batch.seq_lens))])
    cache = store(cache, k, v, slots, layout, params)
    group = draw(st.integers(1, 4), label="gqa_group")
    return PagedSetup(layout, params, batch, cache, group * h)


def _queries(draw, setup: PagedSetup, n: int, **kw) -> np.ndarray:
    return draw(float_arrays((n, setup.num_q_heads, setup.layout.head_dim), dtype=np.float32, **kw),
                label="q")


def _assert_close(actual, expected, v_scale: float, rtol: float = RTOL) -> None:
    assert actual.shape == expected.shape and actual.dtype == np.float64
    err = np.max(np.abs(actual - expected), initial=0.0)
    assert err <= rtol * v_scale, f"max error {err:.3g} > {rtol:g} * {v_scale:.3g}"


# -- dense attention ---------------------------------------------------------------------------
def _loop_attention(q, k, v, scale, causal, mask):
    """Row by row, head by head, with math.fsum dot products: an independent restatement."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    out = np.zeros((tq, hq, d))
    for h in range(hq):
        g = h // (hq // hkv)
        for i in range(tq):
            keys = [j for j in range(tk) if not (causal and j > tk - tq + i) and mask[h, i, j] != -np.inf]
            if not keys:
                continue
            s = [scale * math.fsum(q[i, h] * k[j, g]) + mask[h, i, j] for j in keys]
            w = [math.exp(x - max(s)) for x in s]
            out[i, h] = sum(wj * v[j, g] for wj, j in zip(w, keys)) / math.fsum(w)
    return out


@given(
    tq=st.integers(0, 6), tk=st.integers(0, 9), hkv=st.integers(1, 3), group=st.integers(1, 3),
    d=st.sampled_from([2, 8, 96]), causal=st.booleans(), mask_kind=st.sampled_from(["none", "full", "keys"]),
    scale_=st.one_of(st.none(), st.floats(0.01, 4.0)), data=st.data(),
)
def test_attention_equals_a_per_row_loop(tq, tk, hkv, group, d, causal, mask_kind, scale_, data):
    hq = group * hkv
    q = data.draw(float_arrays((tq, hq, d), dtype=np.float32, outliers=False), label="q")
    k = data.draw(float_arrays((tk, hkv, d), outliers=False), label="k")
    v = data.draw(float_arrays((tk, hkv, d), dtype=np.float64), label="v")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="mask_seed"))
    shape = {"none": (1, 1, 1), "full": (hq, tq, tk), "keys": (tk,)}[mask_kind]
    mask = np.zeros(shape) if mask_kind == "none" else rng.standard_normal(shape)
    if mask_kind != "none":
        mask[rng.random(shape) < 0.3] = -np.inf  # some rows lose every key
    out = attention(q, k, v, scale=scale_, causal=causal, mask=None if mask_kind == "none" else mask)
    sc = d ** -0.5 if scale_ is None else scale_
    ref = _loop_attention(q.astype(np.float64), k.astype(np.float64), v, sc, causal,
                          np.broadcast_to(mask, (hq, tq, tk)))
    vmax = float(np.max(np.linalg.norm(v, axis=-1), initial=0.0))
    _assert_close(out, ref, vmax, rtol=1e-12)


# -- paged_decode ------------------------------------------------------------------------------
@given(setup=paged_setups(), data=st.data())
def test_paged_decode_invariant_under_block_permutation(setup, data):
    b = setup.batch
    q = _queries(data.draw, setup, setup.num_seqs)
    perm = np.array(data.draw(st.permutations(range(b.num_blocks)), label="perm"), np.int64)
    moved = np.empty_like(setup.cache)
    moved[perm] = setup.cache  # physical block i now lives at perm[i]
    table = perm[b.block_table].astype(np.int32)
    args = (setup.layout, setup.params)
    out = paged_decode(q, setup.cache, b.block_table, b.seq_lens, *args)
    assert np.array_equal(paged_decode(q, moved, table, b.seq_lens, *args), out)
    assert np.all(np.isfinite(out))


@given(setup=paged_setups(), data=st.data())
def test_paged_decode_equals_dense_attention_over_decompressed_kv(setup, data):
    b = setup.batch
    q = _queries(data.draw, setup, setup.num_seqs)
    out = paged_decode(q, setup.cache, b.block_table, b.seq_lens, setup.layout, setup.params)
    ref = np.concatenate([attention(q[s: s + 1], *setup.dense_kv(s)) for s in range(setup.num_seqs)])
    _assert_close(out, ref, setup.v_scale())


# -- prefill -----------------------------------------------------------------------------------
def _draw_q_lens(draw, seq_lens, *, whole: bool = False) -> np.ndarray:
    if whole:
        return seq_lens.copy()
    return np.array([draw(st.integers(0, int(n)), label=f"q_len[{s}]") for s, n in enumerate(seq_lens)],
                    np.int32)


def _qsl(q_lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


@given(setup=paged_setups(), data=st.data())
def test_prefill_with_empty_prefix_equals_dense_causal_attention(setup, data):
    b = setup.batch
    qsl = _qsl(b.seq_lens)
    q = _queries(data.draw, setup, int(qsl[-1]))
    out = prefill(q, setup.cache, b.block_table, b.seq_lens, qsl, setup.layout, setup.params)
    ref = np.concatenate([attention(q[qsl[s]: qsl[s + 1]], *setup.dense_kv(s), causal=True)
                          for s in range(setup.num_seqs)])
    _assert_close(out, ref, setup.v_scale())


@given(setup=paged_setups(), data=st.data())
def test_prefill_with_prefix_equals_dense_causal_attention(setup, data):
    b = setup.batch
    q_lens = _draw_q_lens(data.draw, b.seq_lens)
    qsl = _qsl(q_lens)
    q = _queries(data.draw, setup, int(qsl[-1]))
    out = prefill(q, setup.cache, b.block_table, b.seq_lens, qsl, setup.layout, setup.params)
    # Query i of sequence s sits at position seq_len − q_len + i: it sees keys 0 .. that position.
    ref = np.zeros((int(qsl[-1]), setup.num_q_heads, setup.layout.head_dim))
    for s in range(setup.num_seqs):
        k, v = setup.dense_kv(s)
        for i in range(q_lens[s]):
            last = int(b.seq_lens[s] - q_lens[s]) + i
            ref[qsl[s] + i] = attention(q[qsl[s] + i: qsl[s] + i + 1], k[: last + 1], v[: last + 1])[0]
    _assert_close(out, ref, setup.v_scale())


@given(setup=paged_setups(), data=st.data())
def test_prefill_split_into_two_chunks_equals_unsplit(setup, data):
    b = setup.batch
    q_lens = _draw_q_lens(data.draw, b.seq_lens)
    cut = np.array([data.draw(st.integers(0, int(n)), label=f"cut[{s}]") for s, n in enumerate(q_lens)], np.int32)
    qsl = _qsl(q_lens)
    q = _queries(data.draw, setup, int(qsl[-1]))
    args = (setup.layout, setup.params)
    whole = prefill(q, setup.cache, b.block_table, b.seq_lens, qsl, *args)
    first = np.concatenate([np.arange(qsl[s], qsl[s] + cut[s]) for s in range(setup.num_seqs)]).astype(np.int64)
    rest = np.setdiff1d(np.arange(qsl[-1]), first)
    lens1 = (b.seq_lens - q_lens + cut).astype(np.int32)
    out1 = prefill(q[first], setup.cache, b.block_table, lens1, _qsl(cut), *args)
    out2 = prefill(q[rest], setup.cache, b.block_table, b.seq_lens, _qsl(q_lens - cut), *args)
    merged = np.empty_like(whole)
    merged[first], merged[rest] = out1, out2
    _assert_close(merged, whole, setup.v_scale())


@given(setup=paged_setups(), data=st.data())
def test_prefill_with_one_token_per_sequence_equals_paged_decode(setup, data):
    b = setup.batch
    q = _queries(data.draw, setup, setup.num_seqs)
    qsl = np.arange(setup.num_seqs + 1, dtype=np.int32)
    args = (setup.layout, setup.params)
    out = prefill(q, setup.cache, b.block_table, b.seq_lens, qsl, *args)
    _assert_close(out, paged_decode(q, setup.cache, b.block_table, b.seq_lens, *args), setup.v_scale())


# -- key offset --------------------------------------------------------------------------------
@st.composite
def raw_key_setups(draw):
    """The same keys stored with and without an offset μ under a lossless key codec: keys are
    multiples of 1/8 in [−32, 32] and μ integers in [−4, 4], so k − μ is exact in float16."""
    d = draw(st.sampled_from([8, 32, 96] if not is_thorough() else [64, 96, 128, 256]), label="head_dim")
    fmt = KVFormat(head_dim=d, key=Raw(dtype="float16"), value=draw(codecs(), label="value_codec"),
                   rotation=draw(st.sampled_from(["hadamard", "hadamard_signed", "haar"]), label="rotation"))
    layout = draw(paged_layouts(st.just(fmt), block_sizes=st.sampled_from([1, 4, 16])), label="layout")
    h = layout.num_kv_heads
    params = TQParams.default(fmt, seed=draw(st.integers(0, 2**16), label="seed"))
    batch = draw(paged_batches(layout.block_size, max_seqs=3, max_len=scale(40, 300)), label="batch")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="data_seed"))
    n_tok = int(batch.seq_lens.sum())
    k = (rng.integers(-256, 257, (n_tok, h, d)) / 8).astype(np.float16)
    v = draw(float_arrays((n_tok, h, d)), label="value")
    mu = rng.integers(-4, 5, (h, d)).astype(np.float32)
    cache = np.zeros(layout.cache_shape(batch.num_blocks), np.uint8)
    slots = np.concatenate([batch.slot_ids(s) for s in range(len(batch.seq_lens))])
    plain = PagedSetup(layout, params, batch, store(cache, k, v, slots, layout, params), 0)
    params_mu = params.with_key_offset(mu)
    shifted = PagedSetup(layout, params_mu, batch, store(cache, k, v, slots, layout, params_mu), 0)
    plain.num_q_heads = shifted.num_q_heads = h * draw(st.integers(1, 3), label="gqa_group")
    return plain, shifted, mu


@given(pair=raw_key_setups(), data=st.data())
def test_key_offset_leaves_attention_unchanged_with_a_lossless_key_codec(pair, data):
    plain, shifted, mu = pair
    b = plain.batch
    for s in range(plain.num_seqs):  # the premise: the stored keys differ by exactly μ
        assert np.array_equal(plain.dense_kv(s)[0] - mu, shifted.dense_kv(s)[0])
    q = _queries(data.draw, plain, plain.num_seqs)
    dec = [paged_decode(q, x.cache, b.block_table, b.seq_lens, x.layout, x.params) for x in (plain, shifted)]
    _assert_close(dec[1], dec[0], plain.v_scale())
    q_lens = _draw_q_lens(data.draw, b.seq_lens)
    qsl = _qsl(q_lens)
    qp = _queries(data.draw, plain, int(qsl[-1]))
    pre = [prefill(qp, x.cache, b.block_table, b.seq_lens, qsl, x.layout, x.params) for x in (plain, shifted)]
    _assert_close(pre[1], pre[0], plain.v_scale())


@given(
    d=st.sampled_from([32, 64, 96, 128]),
    key=st.builds(LloydMax, bits=st.just(4), distribution=st.sampled_from(["beta", "gaussian"]),
                  norm_dtype=st.sampled_from(["float16", "float32"]),
                  norm_correction=st.sampled_from(["none", "decode", "stored"])),
    rotation=st.sampled_from(["hadamard", "hadamard_signed", "haar"]),
    seed=st.integers(0, 2**16),
)
def test_quality_key_offset_with_lloyd_max_4bit_keys(d, key, rotation, seed):
    """Quality, not exactness. Keys = a per-head mean (2× the spread) + unit Gaussian noise;
    μ = the keys' mean; values fp16 (exact), so all the error is the keys'. The key error is
    ≈ √D_mse·‖k − μ‖ (D_mse ≈ 0.0095 at 4 bits), i.e. a score error with std ≈ √D_mse for unit
    q and k − μ. Stated bounds: relative output error with μ ≤ 2·√D_mse (≈ 0.19), and ≤ 0.75×
    the error without μ. Measured over 150 draws (D = 32..128, 64 and 256 tokens): 0.064–0.091
    with μ (at most 0.47 of the bound), 0.13–0.20 without; ratio at most 0.54."""
    fmt = KVFormat(head_dim=d, key=key, value=Raw(dtype="float16"), rotation=rotation)
    rng = np.random.default_rng(seed)
    h, t = 2, scale(64, 256)
    k = (rng.standard_normal((h, d))[None] * 2 + rng.standard_normal((t, h, d))).astype(np.float16)
    v = rng.standard_normal((t, h, d)).astype(np.float16)
    q = rng.standard_normal((t, 2 * h, d))
    layout = PagedLayout(format=fmt, num_kv_heads=h, block_size=16)
    table = rng.permutation(t // 16).astype(np.int32)[None]
    seq_lens, qsl = np.array([t], np.int32), np.array([0, t], np.int32)
    exact = attention(q, k, v, causal=True)
    params = TQParams.default(fmt, seed=seed)
    errs = []
    for p in (params, params.with_key_offset(k.astype(np.float64).mean(axis=0))):
        cache = store(np.zeros(layout.cache_shape(t // 16), np.uint8), k, v,
                      table[0, np.arange(t) // 16] * 16 + np.arange(t) % 16, layout, p)
        out = prefill(q, cache, table, seq_lens, qsl, layout, p)
        errs.append(np.linalg.norm(out - exact) / np.linalg.norm(exact))
    bound = 2 * np.sqrt(params.key_codebook.distortion)
    assert errs[1] <= bound, f"error with key offset {errs[1]:.4f} > 2·√D_mse = {bound:.4f}"
    assert errs[1] <= 0.75 * errs[0], f"key offset did not help: {errs[1]:.4f} vs {errs[0]:.4f} without"
