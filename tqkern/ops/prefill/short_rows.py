"""Short query rows of a prefill (every ``q_len ≤ T ≤ 8``) through the decode kernel: the two small
kernels around it. The maths (a split at the cached prefix and a log-sum-exp merge) is in
:mod:`tqkern_torch.short_rows`, which launches, in order:

1. :func:`_short_rows_prep_kernel`, grid ``(num_seqs, Hkv)``: the padded query rows of each
   sequence as extra query heads of their KV head, ``q1 [num_seqs, Hkv·T·G, D]`` (row
   ``h·T·G + t·G + g`` = token ``qsl[s+1] − T + t`` of head ``h·G + g``; zeros for the padding
   rows ``t < T − q_len``), the prefix lengths ``max(L − T + 1, 0)`` and the slots of the tail
   keys ``L − T + 1 + u`` (``u < T − 1``; −1 where the position is negative or its block id lies
   outside ``[0, num_blocks)``);
2. ``paged_decode(q1, …, prefix lengths, return_lse=True)``, and ``decompress`` of the tail
   slots (float32, rotated back: original coordinates);
3. :func:`_short_rows_merge_kernel`, grid ``(num_seqs, Hkv)``: the tail attention of each padded
   row (float32, causal ``u < t``, soft-cap) merged with the prefix part by their log-sum-exps,
   written to the real rows of ``out`` (and ``lse``).

Indices: ``query_start_loc`` entries are clamped into ``[0, num_tokens]`` and a sequence's rows
before its last T are never written (zeroed by the frontend), lengths clamped into
``[0, max_blocks·block_size]`` (flagged ``SEQ_LEN_OUT_OF_RANGE``), tail block ids checked
(flagged ``BLOCK_OUT_OF_RANGE``), so no index reads or writes outside a tensor.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.errors import ErrorFlag
from tqkern.layouts import PagedLayout
from tqkern.ops.common import layout_consts
from tqkern.ops.int8_prefill.reference import EXACT_QUERY_MAX

__all__ = ["SHORT_QUERY_MAX", "short_rows_constexprs", "_short_rows_prep_kernel", "_short_rows_merge_kernel"]

# the longest q_len the decode path takes (T·G query heads per KV head): int8_prefill's spec gives
# exactly these sequences prefill's scores, so that both functions route them here
SHORT_QUERY_MAX = EXACT_QUERY_MAX


def short_rows_constexprs(layout: PagedLayout, t: int, num_q_heads: int) -> dict:
    """Both kernels' constexprs for ``t`` padded rows per sequence (pure): ``RP`` = T·G and ``UP`` =
    T − 1 rounded up to powers of two of at least 16 (``tl.dot``), ``DP`` the layout's."""
    g = num_q_heads // layout.num_kv_heads
    return dict(T=t, G=g, HKV=layout.num_kv_heads, BS=layout.block_size, D=layout.head_dim,
                DP=layout_consts(layout)["DP"], RP=max(16, 1 << (t * g - 1).bit_length()),
                UP=max(16, 1 << max(t - 2, 0).bit_length()))

_ERR_SEQ = tl.constexpr(int(ErrorFlag.SEQ_LEN_OUT_OF_RANGE))
_ERR_BLOCK = tl.constexpr(int(ErrorFlag.BLOCK_OUT_OF_RANGE))
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _bounds(qsl_ptr, sl_ptr, s, num_tokens, cap):
    """(end of sequence s's queries, its q_len, its length clamped into ``[0, cap]``, the raw length)."""
    q0 = tl.minimum(tl.maximum(tl.load(qsl_ptr + s), 0), num_tokens)
    q1 = tl.minimum(tl.maximum(tl.load(qsl_ptr + s + 1), q0), num_tokens)
    raw = tl.load(sl_ptr + s)
    return q1, q1 - q0, tl.minimum(tl.maximum(raw, 0), cap), raw


@triton.jit
def _short_rows_prep_kernel(q_ptr, qsl_ptr, sl_ptr, bt_ptr, q1_ptr, prefix_ptr, slot_ptr, err_ptr, num_tokens,
                            max_blocks, num_blocks, stride_qt, stride_qh, T: tl.constexpr, G: tl.constexpr,
                            HKV: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                            RP: tl.constexpr, UP: tl.constexpr):
    """q: ``[num_tokens, Hq, D]`` (last dimension contiguous); q1: ``[num_seqs, HKV·T·G, D]``
    contiguous, q's dtype; prefix: int32 ``[num_seqs]``; slots: int64 ``[num_seqs, T − 1]``
    (``UP``: T − 1 rounded up to a power of two); ``RP``: T·G rounded up to a power of two."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    cap = max_blocks * BS
    q_end, q_len, n, raw = _bounds(qsl_ptr, sl_ptr, s, num_tokens, cap)

    r = tl.arange(0, RP)
    t = r // G
    g = r % G
    cols = tl.arange(0, DP)
    real = (r < T * G) & (t >= T - q_len)
    tok = tl.where(real, q_end - T + t, 0).to(tl.int64)
    src = q_ptr + tok[:, None] * stride_qt + (h * G + g).to(tl.int64)[:, None] * stride_qh + cols[None, :]
    x = tl.load(src, mask=real[:, None] & (cols < D)[None, :], other=0.0)
    dst = q1_ptr + (s.to(tl.int64) * (HKV * T * G) + h * T * G + r)[:, None] * D + cols[None, :]
    tl.store(dst, x, mask=(r < T * G)[:, None] & (cols < D)[None, :])

    if h == 0:
        tl.store(prefix_ptr + s, tl.maximum(n - T + 1, 0))
        err = tl.where((raw < 0) | (raw > cap), _ERR_SEQ, 0)
        if T > 1:
            u = tl.arange(0, UP)
            pos = n - T + 1 + u
            want = (u < T - 1) & (pos >= 0)
            p = tl.maximum(pos, 0)
            blk = tl.load(bt_ptr + s.to(tl.int64) * max_blocks + tl.minimum(p // BS, max_blocks - 1), mask=want,
                          other=0)
            bad = want & ((blk < 0) | (blk >= num_blocks))
            slot = tl.where(want & ~bad, blk.to(tl.int64) * BS + p % BS, -1)
            tl.store(slot_ptr + s.to(tl.int64) * (T - 1) + u, slot, mask=u < T - 1)
            err = err | tl.where(tl.max(bad.to(tl.int32), axis=0) > 0, _ERR_BLOCK, 0)
        tl.atomic_or(err_ptr, err, mask=err != 0, sem="relaxed")


@triton.jit
def _short_rows_merge_kernel(q1_ptr, o1_ptr, l1_ptr, k_ptr, v_ptr, qsl_ptr, sl_ptr, out_ptr, lse_ptr, num_tokens,
                             max_blocks, stride_ot, stride_oh, scale_log2, softcap, T: tl.constexpr,
                             G: tl.constexpr, HKV: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                             DP: tl.constexpr, RP: tl.constexpr, UP: tl.constexpr, SOFTCAP: tl.constexpr,
                             LSE: tl.constexpr):
    """q1 / o1: ``[num_seqs, HKV·T·G, D]`` (the decode's queries and output); l1: float32
    ``[num_seqs, HKV·T·G]`` (natural log); k, v: float32 ``[num_seqs·(T − 1), HKV, D]`` (the tail,
    rotated back; zeros where the slot was −1); out: ``[num_tokens, Hq, D]`` (last dimension
    contiguous); lse: float32 ``[num_tokens, Hq]``. ``RP`` ≥ 16 and ``UP`` ≥ 16 (``tl.dot``)."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    q_end, q_len, n, raw = _bounds(qsl_ptr, sl_ptr, s, num_tokens, max_blocks * BS)
    r = tl.arange(0, RP)
    t = r // G
    g = r % G
    cols = tl.arange(0, DP)
    cmask = (cols < D)[None, :]
    real = (r < T * G) & (t >= T - q_len)
    row = s.to(tl.int64) * (HKV * T * G) + h * T * G + r
    o = tl.load(o1_ptr + row[:, None] * D + cols[None, :], mask=real[:, None] & cmask, other=0.0).to(tl.float32)
    l1 = tl.load(l1_ptr + row, mask=real, other=float("-inf"))
    if T > 1:
        q = tl.load(q1_ptr + row[:, None] * D + cols[None, :], mask=real[:, None] & cmask, other=0.0).to(tl.float32)
        u = tl.arange(0, UP)
        pos = n - T + 1 + u
        have = (u < T - 1) & (pos >= 0)
        kv_row = (s.to(tl.int64) * (T - 1) + u) * HKV + h
        kt = tl.load(k_ptr + kv_row[:, None] * D + cols[None, :], mask=have[:, None] & cmask, other=0.0)
        vt = tl.load(v_ptr + kv_row[:, None] * D + cols[None, :], mask=have[:, None] & cmask, other=0.0)
        a = tl.dot(q, tl.trans(kt), input_precision="ieee")  # [RP, UP]
        if SOFTCAP:  # c·tanh(a/c) with a = scale·q·k, as 1 − 2/(e^{2x} + 1); in base 2 after
            x = a * (scale_log2 / _LOG2E) / softcap
            a = softcap * (1.0 - 2.0 / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0)) * _LOG2E
        else:
            a = a * scale_log2
        vis = have[None, :] & (u[None, :] < t[:, None])
        a = tl.where(vis, a, float("-inf"))
        m2 = tl.max(a, axis=1)
        m2s = tl.where(m2 == float("-inf"), 0.0, m2)
        p = tl.exp2(a - m2s[:, None])
        l2 = tl.sum(p, axis=1)
        o2 = tl.dot(p, vt, input_precision="ieee")  # [RP, DP], unnormalised
        # merge in base 2: part 1's weight 2^(λ₁·log2e − m), part 2's 2^(m₂ − m)·(its sum)
        b1 = l1 * _LOG2E
        m = tl.maximum(b1, m2)
        m = tl.where(m == float("-inf"), 0.0, m)
        w1 = tl.exp2(b1 - m)
        w2 = tl.exp2(m2s - m)
        den = w1 + w2 * l2
        o = (w1[:, None] * o + w2[:, None] * o2) / tl.where(den > 0, den, 1.0)[:, None]
        lse = tl.where(den > 0, (m + tl.log2(tl.where(den > 0, den, 1.0))) * _LN2, float("-inf"))
        lse = tl.where(l1 != l1, l1, lse)  # (a non-finite query row: NaN from the decode, kept)
    else:
        lse = l1
    tok = (q_end - T + t).to(tl.int64)
    head = (h * G + g).to(tl.int64)
    dst = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + cols[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=real[:, None] & cmask)
    if LSE:
        tl.store(lse_ptr + tok * (HKV * G) + head, lse, mask=real)
