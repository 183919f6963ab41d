"""Properties of the ``int8_prefill`` oracle (tqkern/ops/int8_prefill/reference.py): its int8
quantizer against a brute-force one, the codebook's int8 image for Lloyd-Max keys, equality with
attention over the int8-dequantized q and K, short sequences equal to ``prefill``, and its
rigorous error bound against ``prefill``. Strategies and tolerances: ``test_attention_reference.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tqkern.testing  # noqa: F401  (registers the ci / thorough profiles)
from property_tests.test_attention_reference import (
    RTOL, _assert_close, _draw_q_lens, _formats, _qsl, _queries, paged_setups, unit_gaussian,
)
from tqkern.layouts import KVFormat, LloydMax
from tqkern.ops.attention.reference import attention
from tqkern.ops.decompress.reference import decompress, gather_slots
from tqkern.ops.int8_prefill.reference import EXACT_QUERY_MAX, _key_int8, int8_image, int8_prefill, quantize_int8
from tqkern.ops.prefill.reference import prefill
from tqkern.testing import float_arrays


def _brute_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per vector: s = max|x|/127; each code the integer of [−127, 127] nearest x/s, a tie going
    to the even one; a zero vector gets s = 0 and codes 0. One element at a time."""
    x = np.asarray(x, np.float64)
    flat = x.reshape(-1, x.shape[-1])
    codes, scales = np.zeros(flat.shape, np.int64), np.zeros(flat.shape[0])
    cands = np.arange(-127, 128)
    for r, row in enumerate(flat):
        s = np.max(np.abs(row)) / 127
        scales[r] = s
        for j, xj in enumerate(row):
            if s == 0:
                continue
            dist = np.abs(xj / s - cands)
            best = cands[dist == dist.min()]
            codes[r, j] = best[0] if len(best) == 1 else best[best % 2 == 0][0]
    return codes.reshape(x.shape), scales.reshape(x.shape[:-1])


@st.composite
def tie_vectors(draw):
    """Vectors [n, D] with s = 2^e exactly and entries (m + ½·h)·2^e, so x/s hits exact
    half-integers; one entry per vector is ±127·2^e (the max), or the vector is zero."""
    n, d = draw(st.integers(1, 4), label="n"), draw(st.integers(1, 24), label="d")
    e = draw(st.integers(-20, 20), label="exponent")
    m = np.array(draw(st.lists(st.integers(-127, 126), min_size=n * d, max_size=n * d), label="m"), np.float64)
    half = np.array(draw(st.lists(st.booleans(), min_size=n * d, max_size=n * d), label="half"), np.float64)
    x = ((m + 0.5 * half) * 2.0**e).reshape(n, d)
    x[:, 0] = np.where(np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n), label="neg")), -127, 127) * 2.0**e
    if draw(st.booleans(), label="zero_row"):
        x[-1] = 0.0
    return np.ascontiguousarray(x[:, draw(st.permutations(range(d)), label="column_order")])


@given(x=st.one_of(tie_vectors(), float_arrays((3, 2, 17), dtype=np.float32), float_arrays((5, 40))))
def test_quantize_int8_equals_brute_force(x):
    codes, s = quantize_int8(x)
    want_codes, want_s = _brute_int8(x)
    assert codes.dtype == np.int8 and s.dtype == np.float64
    assert np.array_equal(s, want_s)
    assert np.array_equal(codes.astype(np.int64), want_codes)
    assert np.all(np.abs(x - codes * s[..., None]) <= s[..., None] * (0.5 + 1e-12))


@st.composite
def centroid_tables(draw) -> np.ndarray:
    """Strictly ascending finite tables of 2–256 centroids, not all zero (any scale)."""
    n = draw(st.sampled_from([2, 4, 8, 16, 32, 256]), label="levels")
    scale_ = draw(st.sampled_from([1e-3, 0.1, 1.0, 300.0]), label="scale")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    c = np.unique(np.round(rng.standard_normal(n) * scale_, 12))
    if draw(st.booleans(), label="symmetric"):
        c = np.unique(np.concatenate([c, -c]))
    return c if np.any(c) else np.array([-1.0, 1.0])


def _image_error(c, s):
    r = c - s * np.clip(np.rint(c / s), -127, 127)
    return float(np.sum(r * r))


@given(c=centroid_tables())
def test_int8_image_is_an_int8_grid_no_worse_than_the_max_scale(c):
    """The codebook's int8 image: codes in [−127, 127], every centroid within s/2 of its image, s on
    the grid s_0·(1 + k/1024), k ≤ 512, and a squared error no larger than at s_0 = max|c|/127."""
    c8, s_cb = int8_image(c)
    s0 = np.max(np.abs(c)) / 127
    assert c8.dtype == np.int8 and c8.shape == c.shape and np.all(np.abs(c8.astype(np.int64)) <= 127)
    assert s0 <= s_cb <= 1.5 * s0 * (1 + 1e-12)
    k = (s_cb / s0 - 1) * 1024
    assert abs(k - round(k)) < 1e-6
    assert np.all(np.abs(c - s_cb * c8) <= s_cb * (0.5 + 1e-12))
    assert _image_error(c, s_cb) <= _image_error(c, s0) * (1 + 1e-12) + 1e-300
    assert np.all(np.diff(c8.astype(np.int64)) >= 0)  # ascending centroids keep their order


def test_int8_image_keeps_the_max_scale_where_it_is_exact_and_names_bad_input():
    c = np.array([-127.0, -40.0, -3.0, 5.0, 90.0]) / 64  # multiples of s_0 = 1/64: zero error at k = 0
    c8, s_cb = int8_image(c)
    assert s_cb == 1 / 64 and np.array_equal(c8, [-127, -40, -3, 5, 90])
    for bad in (np.zeros(4), np.array([1.0, np.nan]), np.ones((2, 2)), np.array([])):
        with pytest.raises(ValueError, match="centroids must be a finite 1-D array"):
            int8_image(bad)


def _lloyd_max_keys(f: KVFormat):
    bits = st.just(4) if f.bit_order == "nibble_high_even" else st.integers(1, 6)
    return st.builds(lambda b, nc, nd: f.replace(key=LloydMax(bits=b, norm_correction=nc, norm_dtype=nd)),
                     bits, st.sampled_from(["none", "decode", "stored"]), st.sampled_from(["float16", "float32"]))


@given(setup=paged_setups(formats=st.one_of(_formats(), _formats().flatmap(_lloyd_max_keys))))
def test_key_int8_of_lloyd_max_keys_is_the_codebook_image(setup):
    """Lloyd-Max keys: each key's int8 code is c8 at the index of its centroid (recovered here from
    K̂/α by the nearest centroid) and its scale α·s_cb; other key codecs: the per-token maximum."""
    b, p = setup.batch, setup.params
    slots = gather_slots(setup.cache, setup.layout, b.slot_ids(0))
    k, _ = decompress(slots, p)
    ck, sk = _key_int8(slots, k, p)
    assert ck.dtype == np.int8 and ck.shape == k.shape and sk.shape == k.shape[:2]
    if not isinstance(p.format.key, LloydMax):
        want_c, want_s = quantize_int8(k)
        assert np.array_equal(ck, want_c) and np.array_equal(sk, want_s)
        return
    c = p.key_codebook.centroids
    c8, s_cb = int8_image(c)
    live = np.any(k != 0, axis=-1)  # a zero key (norm 0): any codes, scale 0
    assert np.all(sk[~live] == 0)
    kl, sl_ = k[live], sk[live]
    # α = s_k / s_cb; K̂/α are centroids, so the nearest centroid gives the stored code
    alpha = sl_ / s_cb
    idx = np.argmin(np.abs((kl / alpha[:, None])[..., None] - c), axis=-1)
    assert np.allclose(kl, alpha[:, None] * c[idx], rtol=1e-9, atol=0)
    assert np.array_equal(ck[live], c8[idx])
    assert np.all(np.abs(kl - sl_[:, None] * ck[live]) <= sl_[:, None] * (0.5 + 1e-9))


def _int8_dequant(x):
    c, s = quantize_int8(x)
    return c * s[..., None]


def _key_dequant(slots, k, params):
    c, s = _key_int8(slots, k, params)
    return c * s[..., None]


@given(setup=paged_setups(), data=st.data())
def test_int8_prefill_equals_attention_over_int8_dequantized_q_and_k(setup, data):
    """Structure: int8 scores are scale·(s_q·c_q)·(s_k·c_k), in the key codec's space (the keys'
    codes and scales by their codec's rule: the codebook's int8 image for Lloyd-Max keys)."""
    b, p = setup.batch, setup.params
    q_lens = _draw_q_lens(data.draw, b.seq_lens)
    qsl = _qsl(q_lens)
    q = _queries(data.draw, setup, int(qsl[-1]))
    out = int8_prefill(q, setup.cache, b.block_table, b.seq_lens, qsl, setup.layout, p)
    ref = np.zeros_like(out)
    for s in range(setup.num_seqs):
        slots = gather_slots(setup.cache, setup.layout, b.slot_ids(s))
        k, v = decompress(slots, p)  # codec spaces
        qs = q[qsl[s]: qsl[s + 1]].astype(np.float64)
        qk = qs @ p.rotation if p.format.key.rotated else qs
        if len(qs) <= EXACT_QUERY_MAX:  # short sequences: prefill's exact scores
            o = attention(qk, k, v, causal=True)
        else:
            o = attention(_int8_dequant(qk), _key_dequant(slots, k, p), v, causal=True)
        ref[qsl[s]: qsl[s + 1]] = o @ p.rotation.T if p.format.value.rotated else o
    _assert_close(out, ref, setup.v_scale())


@given(setup=paged_setups(), data=st.data())
def test_int8_prefill_short_sequences_equal_prefill_and_rows_are_per_sequence(setup, data):
    """A sequence of 1..EXACT_QUERY_MAX queries gets exactly ``prefill``'s rows (and lse); every
    sequence's rows equal those of a call holding it alone (the rule is per sequence)."""
    b, p = setup.batch, setup.params
    q_lens = _draw_q_lens(data.draw, b.seq_lens)
    qsl = _qsl(q_lens)
    q = _queries(data.draw, setup, int(qsl[-1]))
    args = (q, setup.cache, b.block_table, b.seq_lens, qsl, setup.layout, p)
    o8, l8 = int8_prefill(*args, return_lse=True)
    o, lse = prefill(*args, return_lse=True)
    for s in range(setup.num_seqs):
        a, e = int(qsl[s]), int(qsl[s + 1])
        if e - a <= EXACT_QUERY_MAX:
            assert np.array_equal(o8[a:e], o[a:e], equal_nan=True)
            assert np.array_equal(l8[a:e], lse[a:e], equal_nan=True)
        alone = int8_prefill(q[a:e], setup.cache, b.block_table[s:s + 1], b.seq_lens[s:s + 1],
                             np.array([0, e - a], np.int32), setup.layout, p)
        assert np.array_equal(alone, o8[a:e], equal_nan=True)


@given(setup=paged_setups(), data=st.data())
def test_int8_prefill_within_its_rigorous_error_bound_of_prefill(setup, data):
    """Per output row: ‖o8 − o‖₂ ≤ (e^{2Δ} − 1)·max_j ‖V̂_j‖₂, Δ the row's largest bound
    scale·s_q·s_k·(‖c_q‖₁ + ‖c_k‖₁ + D/2)/2 on a visible score's int8 error."""
    b, p, d = setup.batch, setup.params, setup.layout.head_dim
    q_lens = _draw_q_lens(data.draw, b.seq_lens)
    qsl = _qsl(q_lens)
    q = _queries(data.draw, setup, int(qsl[-1]))
    args = (q, setup.cache, b.block_table, b.seq_lens, qsl, setup.layout, p)
    err = np.linalg.norm(int8_prefill(*args) - prefill(*args), axis=-1)  # [num_tokens, Hq]
    group = setup.num_q_heads // setup.layout.num_kv_heads
    for s in range(setup.num_seqs):
        if q_lens[s] <= EXACT_QUERY_MAX:  # prefill's scores: no int8 error (NaN rows compare NaN)
            assert not np.any(err[qsl[s]: qsl[s + 1]] > 0)
            continue
        slots = gather_slots(setup.cache, setup.layout, b.slot_ids(s))
        k, v = decompress(slots, p)
        qs = q[qsl[s]: qsl[s + 1]].astype(np.float64)
        cq, sq = quantize_int8(qs @ p.rotation if p.format.key.rotated else qs)  # [Tq, Hq, D], [Tq, Hq]
        ck, sk = _key_int8(slots, k, p)
        l1q, l1k = np.abs(cq.astype(np.int64)).sum(-1), np.abs(ck.astype(np.int64)).sum(-1)
        g = np.arange(setup.num_q_heads) // group
        delta = (d ** -0.5) * sq[:, :, None] * sk[:, g].T[None] * (l1q[:, :, None] + l1k[:, g].T[None] + d / 2) / 2
        tq, tk = len(qs), len(k)
        visible = np.arange(tk)[None, :] <= (tk - tq + np.arange(tq))[:, None]  # [Tq, Tk]
        vnorm = np.linalg.norm(v, axis=-1)[:, g].T  # [Hq, Tk]
        bound_delta = np.max(np.where(visible[:, None], delta, 0.0), axis=-1, initial=0.0)
        vmax = np.max(np.where(visible[:, None], vnorm[None], 0.0), axis=-1, initial=0.0)
        with np.errstate(over="ignore"):
            bound = np.expm1(2 * bound_delta) * vmax + RTOL * setup.v_scale()
        assert np.all(err[qsl[s]: qsl[s + 1]] <= bound)


@given(setup=paged_setups(kv_data=unit_gaussian), data=st.data())
def test_quality_int8_prefill_relative_error_on_gaussian_data(setup, data):
    """Quality, not exactness. Unit Gaussian q (no outlier channels), K/V as stored by the
    drawn format: the int8 rounding error per coordinate is at most s/2 (std about s/√12), s ≈
    max|x|/127 (the image's s_cb ≤ 1.5·max|c|/127 for Lloyd-Max keys), so a score moves by ~0.01
    of its spread. Stated bound on ‖o8 − o‖_F / ‖o‖_F: 0.03."""
    b = setup.batch
    q_lens = _draw_q_lens(data.draw, b.seq_lens)
    qsl = _qsl(q_lens)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="q_seed"))
    q = rng.standard_normal((int(qsl[-1]), setup.num_q_heads, setup.layout.head_dim))
    args = (q, setup.cache, b.block_table, b.seq_lens, qsl, setup.layout, setup.params)
    o8, o = int8_prefill(*args), prefill(*args)
    assert np.linalg.norm(o8 - o) <= 0.03 * np.linalg.norm(o)
