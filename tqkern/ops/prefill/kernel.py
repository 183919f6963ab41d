"""Varlen causal prefill over a compressed paged cache: :func:`_prefill_kernel` (every codec, both
arrangements).

Grid ``(num_tokens // BQ + num_seqs, num_kv_heads)`` (:meth:`.plan.PrefillPlan.grid`). Program
``(p, h)`` finds its sequence ``s`` by a binary search over ``query_start_loc`` (sequence s owns
programs ``qsl[s] // BQ + s ..``) and its query tile ``j = p − (qsl[s] // BQ + s)``: the
queries ``qsl[s] + j·BQ ..`` of s (a program past the sequence's last tile masks every row and
loops over nothing). Its ``BM = BQ·GP`` rows are those query positions times the GQA heads of KV
head h (row r: query ``r // GP``, head ``h·G + r % GP``), so every K/V tile of the sequence's
prefix is read and decoded once per query tile for the whole group.

Query i of the tile sits at position ``P_i = seq_len − q_len + i`` and sees keys ``0 .. P_i``
(bottom-right causal), with ``WINDOW`` also keys ``≥ P_i − window_left``. The key loop runs in
two parts: tiles every row sees whole (no mask; without ``WINDOW``), then the tiles that cross
the diagonal (masked); tiles entirely above the diagonal are never read. Keys and values are
decoded in their codec's space by the shared field loaders (:mod:`tqkern.ops.fields`), or for
4-bit codes by the decode's word path (:func:`tqkern.ops.paged_decode.general._whole_tile`:
byte-permute lookups on a GPU), with
the per-token scalars folded out of the per-element work as in the decode's general kernel
(score ``f·(q·c) + z·Σq``, probabilities times f). Online softmax in float32 (base 2);
``SOFTCAP`` caps the scaled logits as ``c·tanh(a/c)``; ``SINKS`` adds one logit per query head
to every row's normaliser; ``LSE`` writes the natural-log normaliser. The output is rotated back
(``@ Πᵀ``) in the epilogue when the value codec is rotated; a query row holding a NaN or ±inf
(the q rotation's ``poison``) gives a NaN row.

Indices: the block table read is the scan's clamped copy, the length is clamped into
``[0, max_blocks·BS]`` and ``query_start_loc`` entries into ``[0, num_tokens]``, so no index
makes the kernel read or write outside its tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.ops.codecs import KIND_LLOYD_MAX, KIND_UNIFORM, NC_DECODE
from tqkern.ops.fields import load_tile, token_factors
from tqkern.ops.int8_prefill.triton import image_codes, int8_codes
from tqkern.ops.prefill.attend import mask_scores, online_softmax_step, softcap_log2
from tqkern.ops.paged_decode._ptx import _prmt_tables
from tqkern.ops.paged_decode.general import _value_weights, _whole_tile
from tqkern.ops.paged_decode.merge import _store_merged

__all__ = ["_prefill_kernel"]

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _find_tile(qsl_ptr, num_seqs, num_tokens, BQ: tl.constexpr):
    """(s, first query, end of queries, tile) of this program: the last sequence s whose first
    program ``qsl[s] // BQ + s`` is at most ``program_id(0)`` (a binary search; entries clamped
    into ``[0, num_tokens]``)."""
    pid = tl.program_id(0)
    lo = pid * 0
    hi = num_seqs - 1 + lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.minimum(tl.maximum(tl.load(qsl_ptr + mid), 0), num_tokens) // BQ + mid
        go = first <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    q0 = tl.minimum(tl.maximum(tl.load(qsl_ptr + lo), 0), num_tokens)
    q1 = tl.minimum(tl.maximum(tl.load(qsl_ptr + lo + 1), q0), num_tokens)
    return lo, q0, q1, pid - (q0 // BQ + lo)


@triton.jit
def _attend(acc, m_i, l_i, q, q_sum, pos_q, t0, kv_end, seq_len, cache_ptr, bt_row, h, kc_ptr, vc_ptr,
            scale_log2, softcap, window_left, zero, k_tabs, v_tabs, MASK: tl.constexpr, WINDOW: tl.constexpr,
            SOFTCAP: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr, K_FAST: tl.constexpr,
            V_FAST: tl.constexpr, USE_ASM: tl.constexpr, K_ALIGNED: tl.constexpr,
            V_ALIGNED: tl.constexpr, K_PAR_ALIGNED: tl.constexpr, V_PAR_ALIGNED: tl.constexpr, D: tl.constexpr,
            DP: tl.constexpr, ROW_BYTES: tl.constexpr, NIBBLE: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
            INT8: tl.constexpr):
    """One step of the online softmax over keys ``t0 .. t0 + BN − 1`` (``MASK``: keys past
    ``kv_end`` and the causal / window masks applied; without it every row sees every key).
    ``INT8``: ``q`` holds the queries' int8 codes and ``q_sum`` their scales; the keys' int8 codes
    come from the codebook's int8 image (Lloyd-Max; ``kc_ptr`` is then ``key_int8_table``) or from
    their float32 reconstruction quantized per token as the queries are, and the scores are
    ``s_q·s_k·(c_q·c_k)`` from an int8 product with int32 accumulation."""
    pos = t0 + tl.arange(0, BN)
    if MASK:
        tmask = pos < kv_end
    else:
        tmask = pos >= 0
    blk = tl.load(bt_row + pos // BS, mask=tmask, other=0).to(tl.int64)
    # (`zero`, a runtime 0: no 16-byte alignment derived for the rows; see the decode's general kernel)
    row = cache_ptr + (blk * BS + (pos + zero) % BS) * ROW_BYTES  # [BN] token rows

    # -- scores [BM, BN] --------------------------------------------------------------------------
    if INT8 and K.KIND == KIND_LLOYD_MAX:  # the codebook's int8 image (kc_ptr: key_int8_table)
        ck, sk = image_codes(row, h, tmask, kc_ptr, D, DP, NIBBLE, K, K_PAR_ALIGNED)
        sc = (q_sum[:, None] * sk[None, :]) * tl.dot(q, tl.trans(ck), out_dtype=tl.int32).to(tl.float32)
    elif INT8:  # uniform, FP8, raw keys: K̂ = f·tile + z in float32, its int8 codes per token
        kf, kz = token_factors(row, h, tmask, K, tl.float32, K_PAR_ALIGNED)
        k32 = load_tile(row, h, tmask, DP, -1, NIBBLE, K, D, DP, kc_ptr, tl.float32, K_ALIGNED)  # [BN, DP]
        cols = tl.arange(0, DP)
        khat = tl.where((cols < D)[None, :], k32 * kf[:, None] + kz[:, None], 0.0)
        ck, sk = int8_codes(khat)
        sc = (q_sum[:, None] * sk[None, :]) * tl.dot(q, tl.trans(ck), out_dtype=tl.int32).to(tl.float32)
    else:
        kf, kz = token_factors(row, h, tmask, K, DOT, K_PAR_ALIGNED)
        k_t = _whole_tile(row, h, tmask, K_FAST, NIBBLE, K, D, DP, kc_ptr, k_tabs, DOT, K_ALIGNED, USE_ASM)  # [BN, DP]
        qk = tl.dot(q, tl.trans(k_t))
        if K.NORM_CORRECTION == NC_DECODE:  # vLLM's ‖c[idx]‖ divisor, per token
            k32 = k_t.to(tl.float32)
            kf = kf * tl.rsqrt(tl.maximum(tl.sum(k32 * k32, axis=1), 1e-30))
        sc = qk * kf[None, :] + q_sum[:, None] * kz[None, :]
    if SOFTCAP:  # c·tanh(a/c) with a = scale·q·k
        sc = softcap_log2(sc * (scale_log2 / _LOG2E), softcap)
    else:
        sc = sc * scale_log2
    if MASK:
        sc = mask_scores(sc, pos, tmask, pos_q, window_left, True, WINDOW)

    # -- online softmax (base 2); a row with no visible key so far keeps m = −inf -----------------
    p, alpha, m_new, l_i = online_softmax_step(sc, m_i, l_i)

    # -- values: p·f into the dot (scaled to the tile's largest |f|), p·z added per row -----------
    vf, vz = token_factors(row, h, tmask, V, DOT, V_PAR_ALIGNED)
    v_t = _whole_tile(row, h, tmask, V_FAST, NIBBLE, V, D, DP, vc_ptr, v_tabs, DOT, V_ALIGNED, USE_ASM)  # [BN, DP]
    if V.NORM_CORRECTION == NC_DECODE:
        v32 = v_t.to(tl.float32)
        vf = vf / tl.sqrt(tl.maximum(tl.sum(v32 * v32, axis=1), 1e-30))
    pv, fmax, pz = _value_weights(p, vf, vz, DOT)
    acc = acc * alpha[:, None] + tl.dot(pv, v_t) * fmax + pz[:, None]
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["zero", "qlen_lo", "qlen_hi"])
def _prefill_kernel(
    q_ptr, poison_ptr, cache_ptr, bt_ptr, sl_ptr, qsl_ptr, kc_ptr, vc_ptr, rot_ptr, sinks_ptr, out_ptr, lse_ptr,
    num_seqs, num_tokens, max_blocks, stride_os, stride_oh, scale_log2, softcap, window_left, zero, qlen_lo, qlen_hi,
    G: tl.constexpr, GP: tl.constexpr, HQ: tl.constexpr, BQ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BS: tl.constexpr, DOT: tl.constexpr, K_FAST: tl.constexpr, V_FAST: tl.constexpr, USE_ASM: tl.constexpr,
    K_ALIGNED: tl.constexpr, V_ALIGNED: tl.constexpr, K_PAR_ALIGNED: tl.constexpr, V_PAR_ALIGNED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr, LSE: tl.constexpr, ROTATE_BACK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, ROW_BYTES: tl.constexpr, NIBBLE: tl.constexpr, K: tl.constexpr,
    V: tl.constexpr, INT8: tl.constexpr = False,
):
    """q: float32 ``[num_tokens, HQ, D]`` contiguous, rotated (``q @ Π``) when the key codec is;
    poison: float32 ``[num_tokens·HQ]`` (NaN marks a non-finite query row, else 0); bt: the
    clamped block table; out: ``[num_tokens, HQ, D]`` (last dimension contiguous); lse: float32
    ``[num_tokens, HQ]`` (``LSE``); sinks: float32 ``[HQ]`` (``SINKS``). ``INT8``: Q·Kᵀ on int8
    codes (``int8_prefill``; :mod:`tqkern.ops.int8_prefill.reference` is the spec). A launch serves
    the sequences with ``qlen_lo ≤ q_len ≤ qlen_hi`` only: the others' rows are neither read nor
    written (``int8_prefill`` launches the kernel twice, the short sequences without ``INT8``)."""
    h = tl.program_id(1)
    s, q0, q1, tile = _find_tile(qsl_ptr, num_seqs, num_tokens, BQ)
    q_len = q1 - q0
    # a sequence outside [qlen_lo, qlen_hi] is not this launch's: no tile (no row read or written)
    tile = tl.where((q_len >= qlen_lo) & (q_len <= qlen_hi), tile, -1)
    seq_len = tl.minimum(tl.maximum(tl.load(sl_ptr + s), 0), max_blocks * BS)  # (a bad length: clamped)
    r = tl.arange(0, BM)
    qi = tile * BQ + r // GP  # query index in the sequence
    g = r % GP
    head = h * G + g
    rmask = (g < G) & (qi >= 0) & (qi < q_len)
    tok = q0 + tl.where(rmask, qi, 0)
    pos_q = seq_len - q_len + qi  # [BM] positions
    cols = tl.arange(0, DP)
    q_row = (tok.to(tl.int64) * HQ + head)  # [BM]
    q = tl.load(q_ptr + q_row[:, None] * D + cols[None, :], mask=rmask[:, None] & (cols < D)[None, :], other=0.0)
    if INT8:  # q becomes its int8 codes, q_sum their per-row scales
        q, q_sum = int8_codes(q)
    else:
        q_sum = tl.sum(q, axis=1)
        q = q.to(DOT)

    # keys of this tile: up to its last row's position (clamped to the sequence); empty for a
    # program past the sequence's last tile
    live = (tile >= 0) & (tile * BQ < q_len)
    first = seq_len - q_len + tile * BQ  # position of the tile's first query
    kv_end = tl.where(live, tl.minimum(seq_len, tl.maximum(first + BQ, 0)), 0)
    if WINDOW:
        lo = tl.maximum(first - window_left, 0)
        kv_lo = (lo // BN) * BN
        full_end = kv_lo  # (every tile masked)
    else:
        kv_lo = kv_end * 0
        full_end = (tl.minimum(tl.maximum(first + 1, 0), kv_end) // BN) * BN  # tiles every row sees whole
    full_end = tl.where(live, full_end, 0)

    k_tabs = _prmt_tables(kc_ptr, K.KIND if K_FAST > 0 else KIND_UNIFORM)  # (the 4-bit word path's tables)
    v_tabs = _prmt_tables(vc_ptr, V.KIND if V_FAST > 0 else KIND_UNIFORM)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DP], tl.float32)
    bt_row = bt_ptr + s.to(tl.int64) * max_blocks
    for t0 in range(kv_lo, full_end, BN):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_sum, pos_q, t0, kv_end, seq_len, cache_ptr, bt_row, h, kc_ptr,
                                vc_ptr, scale_log2, softcap, window_left, zero, k_tabs, v_tabs, False, WINDOW, SOFTCAP,
                                BN, BS, DOT, K_FAST, V_FAST, USE_ASM, K_ALIGNED, V_ALIGNED, K_PAR_ALIGNED, V_PAR_ALIGNED, D, DP, ROW_BYTES, NIBBLE, K, V, INT8)
    for t0 in range(tl.maximum(full_end, kv_lo), kv_end, BN):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_sum, pos_q, t0, kv_end, seq_len, cache_ptr, bt_row, h, kc_ptr,
                                vc_ptr, scale_log2, softcap, window_left, zero, k_tabs, v_tabs, True, WINDOW, SOFTCAP,
                                BN, BS, DOT, K_FAST, V_FAST, USE_ASM, K_ALIGNED, V_ALIGNED, K_PAR_ALIGNED, V_PAR_ALIGNED, D, DP, ROW_BYTES, NIBBLE, K, V, INT8)

    if SINKS:  # one more term exp(σ_h) in the normaliser (base 2: σ·log2 e)
        sink = tl.load(sinks_ptr + head, mask=g < G, other=0.0) * _LOG2E
        m_new = tl.maximum(m_i, sink)
        alpha = tl.where(m_i == float("-inf"), 0.0, tl.exp2(m_i - m_new))
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    poison = tl.load(poison_ptr + q_row, mask=rmask, other=0.0)
    inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)  # (no visible key: zeros)
    o = acc * inv[:, None] + poison[:, None]
    o_row = out_ptr + tok.to(tl.int64)[:, None] * stride_os + head.to(tl.int64)[:, None] * stride_oh
    _store_merged(o, o_row, rmask, rot_ptr, 0, cols, D, DP, ROTATE_BACK, DOT_PRECISION)
    if LSE:
        lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * _LN2, float("-inf"))
        tl.store(lse_ptr + q_row, lse + poison, mask=rmask)
