"""Named cases and edges of the attention oracles: dense ``attention``, ``paged_decode``,
``prefill`` and ``int8_prefill``; every bad argument; the public API."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tqkern.layouts import KVFormat, PagedLayout, Raw, Uniform
from tqkern.ops.attention import reference as attention_mod
from tqkern.ops.attention.reference import attention
from tqkern.ops.decompress.reference import decompress, gather_slots
from tqkern.ops.int8_prefill import reference as int8_mod
from tqkern.ops.int8_prefill.reference import int8_prefill, quantize_int8
from tqkern.ops.paged_decode import reference as decode_mod
from tqkern.ops.paged_decode.reference import paged_decode
from tqkern.ops.prefill import reference as prefill_mod
from tqkern.ops.prefill.reference import prefill
from tqkern.ops.store.reference import store
from tqkern.params import TQParams


def _loop(q, k, v, scale, first_position):
    """Query i at position ``first_position + i`` sees keys 0..that position; plain loops."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    out = np.zeros((tq, hq, d))
    for h in range(hq):
        g = h // (hq // hkv)
        for i in range(tq):
            last = first_position + i
            if last < 0:
                continue
            s = [scale * float(np.dot(q[i, h], k[j, g])) for j in range(last + 1)]
            w = [math.exp(x - max(s)) for x in s]
            out[i, h] = sum(wj * v[j, g] for j, wj in enumerate(w)) / sum(w)
    return out


class Paged:
    """One or more sequences stored at shuffled physical blocks of a cache of random bytes."""

    def __init__(self, fmt, seq_lens, *, num_kv_heads=2, block_size=16, group=1, arrangement="slot", seed=0):
        rng = np.random.default_rng(seed)
        self.layout = PagedLayout(format=fmt, num_kv_heads=num_kv_heads, block_size=block_size,
                                  arrangement=arrangement)
        self.params = TQParams.default(fmt, seed=seed)
        self.seq_lens = np.array(seq_lens, np.int32)
        per = [-(-n // block_size) for n in seq_lens]
        max_blocks = max(per, default=0) + 1
        self.num_blocks = sum(per) + 2
        perm = rng.permutation(self.num_blocks)
        self.block_table = np.full((len(seq_lens), max_blocks), perm[-1], np.int32)
        i = 0
        for s, nb in enumerate(per):
            self.block_table[s, :nb] = perm[i: i + nb]
            i += nb
        self.slot_ids = [self.block_table[s, np.arange(n) // block_size].astype(np.int64) * block_size
                         + np.arange(n) % block_size for s, n in enumerate(seq_lens)]
        n_tok, d = int(sum(seq_lens)), fmt.head_dim
        k = rng.standard_normal((n_tok, num_kv_heads, d)).astype(np.float16)
        v = rng.standard_normal((n_tok, num_kv_heads, d)).astype(np.float16)
        cache = rng.integers(0, 256, self.layout.cache_shape(self.num_blocks), dtype=np.uint8)
        slots = np.concatenate(self.slot_ids) if seq_lens else np.zeros(0, np.int64)
        self.cache = store(cache, k, v, slots, self.layout, self.params)
        self.num_q_heads = group * num_kv_heads
        self.rng = rng

    def queries(self, n):
        return self.rng.standard_normal((n, self.num_q_heads, self.layout.head_dim)).astype(np.float32)

    def dense(self, s):
        return decompress(gather_slots(self.cache, self.layout, self.slot_ids[s]), self.params, rotate_back=True)

    def args(self):
        return self.cache, self.block_table, self.seq_lens

    def v_max(self):
        return max(float(np.max(np.linalg.norm(self.dense(s)[1], axis=-1))) for s in range(len(self.seq_lens)))


def _close(actual, expected, v_max, rtol=1e-9):
    assert actual.shape == expected.shape
    assert np.max(np.abs(actual - expected), initial=0.0) <= rtol * v_max


# -- dense attention ---------------------------------------------------------------------------
@pytest.mark.parametrize("tq, tk", [(3, 7), (1, 5), (4, 4), (6, 4)])
def test_attention_causal_is_bottom_right_aligned(tq, tk):
    rng = np.random.default_rng(tq * 10 + tk)
    q, k, v = (rng.standard_normal(s) for s in ((tq, 4, 8), (tk, 2, 8), (tk, 2, 8)))
    out = attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, _loop(q, k, v, 8 ** -0.5, tk - tq), rtol=1e-12, atol=1e-14)
    if tq > tk:  # the first tq − tk queries sit before the first key: zeros
        assert np.all(out[: tq - tk] == 0)


def test_attention_gqa_query_head_h_reads_kv_head_h_over_group():
    v = np.zeros((5, 2, 8))
    v[:, 1] = 1.0  # every value of KV head g equals g
    q = np.random.default_rng(0).standard_normal((3, 8, 8))
    out = attention(q, np.ones((5, 2, 8)), v)
    assert np.array_equal(out, np.broadcast_to((np.arange(8) // 4)[None, :, None], out.shape).astype(float))


def test_attention_single_key_returns_its_value_and_default_scale_is_inverse_sqrt_d():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 3, 96)), rng.standard_normal((1, 3, 96)), rng.standard_normal((1, 3, 96))
    assert np.array_equal(attention(q, k, v), np.broadcast_to(v, (2, 3, 96)))
    k2, v2 = rng.standard_normal((6, 3, 96)), rng.standard_normal((6, 3, 96))
    assert np.array_equal(attention(q, k2, v2), attention(q, k2, v2, scale=1 / math.sqrt(96)))


def test_attention_mask_is_additive_and_fully_masked_rows_are_zero():
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((2, 2, 4)), rng.standard_normal((3, 1, 4)), rng.standard_normal((3, 1, 4))
    mask = np.array([0.0, -np.inf, 0.5])  # broadcast over heads and queries
    bias = np.array([0.0, 0.5])  # key 1 is dropped, keys 0 and 2 get their additive terms
    want = np.zeros((2, 2, 4))
    for h in range(2):
        for i in range(2):
            s = 0.5 * (k[[0, 2], 0] @ q[i, h]) + bias
            w = np.exp(s - s.max())
            want[i, h] = w @ v[[0, 2], 0] / w.sum()
    np.testing.assert_allclose(attention(q, k, v, mask=mask, scale=0.5), want, rtol=1e-12)
    full = np.zeros((2, 2, 3))
    full[1, 0] = -np.inf  # head 1, query 0 sees nothing
    out = attention(q, k, v, mask=full)
    assert np.all(out[0, 1] == 0) and np.all(np.isfinite(out))
    assert np.array_equal(attention(q, k[:0], v[:0]), np.zeros((2, 2, 4)))


# -- paged decode and prefill ------------------------------------------------------------------
CASES = {"seq_len_1": 1, "exact_page_boundary": 32, "partial_last_page": 19}
FORMATS = {"tqkern_k4v4": "slot", "turboquant_k8v4": "slot", "tq4": "row"}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("preset", FORMATS)
def test_paged_decode_matches_a_loop_over_decompressed_kv(case, group, head_dim, preset):
    n = CASES[case]
    p = Paged(KVFormat.preset(preset, head_dim), [n, 3], group=group, arrangement=FORMATS[preset], seed=n)
    q = p.queries(2)
    out = paged_decode(q, *p.args(), p.layout, p.params)
    assert out.shape == (2, 2 * group, head_dim) and out.dtype == np.float64
    ref = np.concatenate([_loop(q[s: s + 1].astype(np.float64), *p.dense(s), head_dim ** -0.5, p.seq_lens[s] - 1)
                          for s in range(2)])
    _close(out, ref, p.v_max())


@pytest.mark.parametrize("preset", FORMATS)
def test_prefill_with_cached_prefix_matches_a_loop(preset):
    p = Paged(KVFormat.preset(preset, 64), [37, 16, 5], group=2, arrangement=FORMATS[preset], seed=7)
    q_lens = np.array([5, 16, 0], np.int32)
    qsl = np.array([0, 5, 21, 21], np.int32)
    q = p.queries(21)
    out = prefill(q, *p.args(), qsl, p.layout, p.params, scale=0.2)
    for s in range(3):
        first = p.seq_lens[s] - q_lens[s]  # position of the sequence's first new token
        ref = _loop(q[qsl[s]: qsl[s + 1]].astype(np.float64), *p.dense(s), 0.2, first)
        _close(out[qsl[s]: qsl[s + 1]], ref, p.v_max())


def test_paged_decode_of_an_empty_sequence_is_zero():
    p = Paged(KVFormat.preset("tqkern_k5v3", 64), [0, 20])
    out = paged_decode(p.queries(2), *p.args(), p.layout, p.params)
    assert np.all(out[0] == 0) and np.all(np.abs(out[1]) > 0)


def test_unused_block_table_entries_are_not_read_or_checked():
    p = Paged(KVFormat.preset("turboquant_4bit_nc", 64), [20, 3], seed=3)
    q = p.queries(2)
    want = paged_decode(q, *p.args(), p.layout, p.params)
    table = p.block_table.copy()
    table[0, 2:] = -1
    table[1, 1:] = 10**6
    assert np.array_equal(paged_decode(q, p.cache, table, p.seq_lens, p.layout, p.params), want)


@pytest.mark.parametrize("op", ["paged_decode", "prefill", "int8_prefill"])
def test_empty_batch_gives_an_empty_output(op):
    p = Paged(KVFormat.preset("tqkern_k4v4", 96), [], group=3)
    q = p.queries(0)
    if op == "paged_decode":
        out = paged_decode(q, *p.args(), p.layout, p.params)
    else:
        fn = prefill if op == "prefill" else int8_prefill
        out = fn(q, *p.args(), np.zeros(1, np.int32), p.layout, p.params)
    assert out.shape == (0, 6, 96) and out.dtype == np.float64


# -- int8 --------------------------------------------------------------------------------------
def test_quantize_int8_rounds_half_to_even_and_clamps():
    x = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -126.5, 3.49],
                  [0.0] * 8,
                  [-254.0, 1.0, 3.0, 5.0, 253.0, -253.0, 0.0, 2.0]])
    codes, s = quantize_int8(x)
    assert codes.dtype == np.int8 and np.array_equal(s, [1.0, 0.0, 2.0])
    assert codes.tolist() == [[127, 0, 2, 2, 0, -2, -126, 3], [0] * 8, [-127, 0, 2, 2, 126, -126, 0, 1]]


def test_int8_prefill_is_exact_when_q_and_k_sit_on_the_int8_grid():
    """Raw keys with integer entries whose max |.| is 127 quantize with s = 1 and no error."""
    fmt = KVFormat(head_dim=16, key=Raw(dtype="float16"), value=Uniform(bits=4))
    layout = PagedLayout(format=fmt, num_kv_heads=1, block_size=4)
    params = TQParams.default(fmt)
    rng = np.random.default_rng(5)
    k = rng.integers(-127, 128, (10, 1, 16)).astype(np.float16)
    k[:, 0, 3] = 127
    v = rng.standard_normal((10, 1, 16))
    cache = store(np.zeros(layout.cache_shape(3), np.uint8), k, v, np.arange(10), layout, params)
    q = rng.integers(-127, 128, (6, 2, 16)).astype(np.float32)
    q[..., 0] = -127
    args = (q, cache, np.array([[0, 1, 2]], np.int32), np.array([10], np.int32), np.array([0, 6], np.int32),
            layout, params)
    np.testing.assert_allclose(int8_prefill(*args, scale=1e-4), prefill(*args, scale=1e-4), rtol=1e-13, atol=1e-13)


# -- bad arguments -----------------------------------------------------------------------------
def _small():
    return Paged(KVFormat.preset("tqkern_k4v4", 64), [20, 3], group=2)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(q=np.ones((2, 4, 8), np.int32)), TypeError, "q must be a float"),
    (dict(k=np.ones((3, 2, 6))), ValueError, "k must have shape"),
    (dict(v=np.ones((4, 2, 8))), ValueError, "v must have the shape of k"),
    (dict(q=np.ones((2, 3, 8))), ValueError, r"q.shape\[1\] \(Hq\)"),
    (dict(q=np.ones((2, 4))), ValueError, "q must have shape"),
    (dict(mask=np.zeros((3, 2, 3))), ValueError, "mask must be broadcastable"),
    (dict(mask=np.full(3, np.nan)), ValueError, "mask must hold"),
    (dict(mask=np.full(3, np.inf)), ValueError, "mask must hold"),
    (dict(mask=np.zeros(3, np.int64)), TypeError, "mask must be a float"),
    (dict(scale="0.1"), TypeError, "scale must be a real number"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
])
def test_attention_rejects_bad_arguments(kwargs, exc, match):
    args = dict(q=np.ones((2, 4, 8)), k=np.ones((3, 2, 8)), v=np.ones((3, 2, 8)))
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=match):
        attention(q, k, v, **args)


def _paged_bad_cases(p):
    other = KVFormat.preset("tqkern_k5v3", 64)
    bt, sl = p.block_table, p.seq_lens
    return [
        (dict(layout="slot"), TypeError, "layout must be a PagedLayout"),
        (dict(params=None), TypeError, "params must be a TQParams"),
        (dict(params=TQParams.default(other)), ValueError, "params.format must equal layout.format"),
        (dict(params=p.params.with_key_offset(np.zeros((3, 64)))), ValueError, "params.key_offset must have 2 rows"),
        (dict(q=np.ones((2, 4, 64), np.int64)), TypeError, "q must be a float"),
        (dict(q=np.ones((2, 4, 32))), ValueError, "head_dim=64"),
        (dict(q=np.ones((2, 3, 64))), ValueError, r"num_q_heads\) must be a positive multiple"),
        (dict(cache=p.cache.astype(np.int8)), TypeError, "cache must be uint8"),
        (dict(cache=p.cache[..., :-1]), ValueError, "cache must have shape"),
        (dict(block_table=bt.astype(np.int64)), TypeError, "block_table must be int32, got int64"),
        (dict(block_table=bt[0]), ValueError, "block_table must have 2 dimension"),
        (dict(seq_lens=sl.astype(np.int64)), TypeError, "seq_lens must be int32, got int64"),
        (dict(seq_lens=sl[:1]), ValueError, r"seq_lens must have shape \(2,\)"),
        (dict(seq_lens=np.array([20, bt.shape[1] * 16 + 1], np.int32)), ValueError, "seq_lens must be in"),
        (dict(seq_lens=np.array([20, -1], np.int32)), ValueError, "seq_lens must be in"),
        (dict(block_table=np.where(np.arange(bt.shape[1]) == 0, p.num_blocks, bt).astype(np.int32)),
         ValueError, "block_table entries in use must be in"),
        (dict(block_table=np.where(np.arange(bt.shape[1]) == 1, -1, bt).astype(np.int32)),
         ValueError, "block_table entries in use must be in"),
    ]


def _call(fn, p, overrides, *, qsl=None):
    n_q = 2 if fn is paged_decode else 23
    a = dict(q=p.queries(n_q), cache=p.cache, block_table=p.block_table, seq_lens=p.seq_lens,
             layout=p.layout, params=p.params)
    if fn is not paged_decode:
        a["query_start_loc"] = np.array([0, 20, 23], np.int32) if qsl is None else qsl
    a.update(overrides)
    if fn is paged_decode:
        return fn(a["q"], a["cache"], a["block_table"], a["seq_lens"], a["layout"], a["params"])
    return fn(a["q"], a["cache"], a["block_table"], a["seq_lens"], a["query_start_loc"], a["layout"], a["params"])


@pytest.mark.parametrize("fn", [paged_decode, prefill, int8_prefill])
def test_paged_ops_reject_bad_arguments(fn):
    p = _small()
    _call(fn, p, {})  # the unmodified arguments are accepted
    for overrides, exc, match in _paged_bad_cases(p):
        with pytest.raises(exc, match=match):
            _call(fn, p, dict(overrides))


def test_paged_decode_rejects_q_rows_not_matching_num_seqs_and_a_bad_scale():
    p = _small()
    with pytest.raises(ValueError, match=r"q.shape\[0\] must be num_seqs = 2"):
        paged_decode(p.queries(3), *p.args(), p.layout, p.params)
    with pytest.raises(TypeError, match="scale must be a real number"):
        paged_decode(p.queries(2), *p.args(), p.layout, p.params, scale=True)


@pytest.mark.parametrize("fn", [prefill, int8_prefill])
@pytest.mark.parametrize("qsl, exc, match", [
    (np.array([0, 20, 23], np.int64), TypeError, "query_start_loc must be int32, got int64"),
    (np.array([0, 23], np.int32), ValueError, r"query_start_loc must have shape \(3,\)"),
    (np.array([1, 20, 23], np.int32), ValueError, r"query_start_loc\[0\] must be 0"),
    (np.array([0, 24, 23], np.int32), ValueError, "query_start_loc must be non-decreasing"),
    (np.array([0, 20, 22], np.int32), ValueError, r"query_start_loc\[-1\] must be num_tokens = 23"),
    (np.array([0, 19, 23], np.int32), ValueError, r"\(q_len\) must be <= seq_lens\[1\] = 3, got 4"),
])
def test_prefill_rejects_bad_query_start_loc(fn, qsl, exc, match):
    with pytest.raises(exc, match=match):
        _call(fn, _small(), {}, qsl=qsl)


def test_public_api():
    assert attention_mod.__all__ == ["attention", "softmax_attend", "causal_visible", "window_visible", "softcap",
                                     "check_options", "Options", "resolve_scale"]
    assert decode_mod.__all__ == ["paged_decode", "merge_partials"]  # (S70: the merge kernels' spec)
    assert prefill_mod.__all__ == ["prefill"]
    assert int8_mod.__all__ == ["int8_prefill", "int8_image", "quantize_int8", "INT8_MAX", "IMAGE_STEPS",
                                "EXACT_QUERY_MAX"]


def test_fast_path_plan_read_plans_and_bad_input():
    """Which read plan each vLLM / turboquant-vllm layout gets (what the word-path property tests
    rely on), and a TypeError naming the argument for anything but a PagedLayout."""
    from tqkern.ops.paged_decode.triton import fast_path_plan

    def plan(preset, d, heads, arrangement):
        fmt = KVFormat.preset(preset, d)
        lay = PagedLayout(format=fmt, num_kv_heads=heads, block_size=16, arrangement=arrangement)
        p = fast_path_plan(lay)
        return p["K_FAST"], p["V_FAST"]

    assert plan("tq4", 128, 8, "row") == (4, 4)  # every field 4-byte aligned
    assert plan("turboquant_4bit_nc", 128, 8, "slot") == (2, 2)  # 134-byte slots: funnel shift
    assert plan("turboquant_4bit_nc", 64, 3, "slot") == (1, 1)  # 210-byte rows: 16-bit halves
    assert plan("turboquant_k8v4", 128, 8, "slot") == (0, 4)  # FP8 keys take the general path
    assert plan("tqkern_k5v3", 128, 8, "slot") == (0, 0)
    with pytest.raises(TypeError, match="layout must be a tqkern.PagedLayout, got KVFormat"):
        fast_path_plan(KVFormat.preset("tq4", 128))
