"""Dense attention over the tiled prefill's workspace (no torch): :func:`_tile_attend_kernel`, one
piece of ``Lq`` queries against ``Lk`` gathered keys, for ``int8_prefill`` (``INT8``: int8 Q·Kᵀ
codes and scales, :mod:`tqkern.ops.int8_prefill.triton`) and for ``prefill`` where the
half-precision dense kernels cannot serve (a logit soft-cap: fp16/bf16 Q·Kᵀ).

Per query row i and key j (query i sits at key position ``Lk − Lq + i``):

    a_ij = (scale · s_q[i]) · s_k[j] · (c_q[i] · c_k[j])   (``INT8``: int8 tensor cores, int32 sums)
    a_ij = scale · (q_i · k_j)                             (otherwise: fp16/bf16 products, float32 sums)
    a_ij = c · tanh(a_ij / c)                              (``SOFTCAP``)
    masks: ``CAUSAL`` keys ``j ≤ Lk − Lq + i``; ``WINDOW`` also ``j ≥ Lk − Lq + i − window_left``
    out_i = Σ_j softmax(a_i)_j · v_j    (P rounded to v's dtype, float32 sums), lse_i = log Σ_j e^{a_ij}

The scores are float32; the online softmax runs in base 2 like the other prefill kernels. A query
row that held a NaN or ±inf gives a NaN row and lse; a row with no visible key gives zeros and lse −inf (the tiled plan never makes
one). Grid ``(⌈Lq / BM⌉, batch · HQ)``: program ``(m, b·HQ + h)`` takes query rows ``m·BM ..`` of
sequence b's head h, which reads KV head ``h // G``; the batch's sequences have equal lengths and
sit one after another in every operand.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

__all__ = ["_tile_attend_kernel", "AttendConfig", "attend_config", "attend_tma", "softcap_log2", "mask_scores",
           "online_softmax_step"]

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


class AttendConfig(NamedTuple):
    """Tiles and compile options of :func:`_tile_attend_kernel`: ``BM`` query rows by ``BN`` keys,
    ``DP`` padded head_dim (≥ 32: the int8 product's reduction)."""

    BM: int
    BN: int
    DP: int
    num_warps: int
    num_stages: int


def attend_config(head_dim: int, int8: bool, interpret: bool) -> AttendConfig:
    """The attention tiles for ``head_dim``, measured on the H100 (cuDNN on the same K/V in the same
    run). Up to 128 columns, Hq32/Hkv8/D128 at 1×16K: int8 128 query rows × 64 keys, 4 warps, 3
    stages (5341–5534 µs, cuDNN 3767–3935; of eight tilings: 8 warps 6081–6212, 2 stages 11586);
    half precision 64 × 64, 4 warps, 3 stages (bf16 with a soft-cap 6419 µs, cuDNN 3650; of five:
    128 × 64 × 8 warps 7022, 128 × 32 × 4 warps 7439; fp16 at 128 × 64 with 4 warps 14151: spills).
    At 256 columns (Hq16/Hkv8 at 1×8K, cuDNN 947 µs; seven tilings): 128 × 64, 8 warps, 2 stages
    for both (int8 1414 µs, half 1431; the 64 × 64 × 8-warp tile chosen by compile before took 2545 /
    2715). Re-swept on the H200 (session 35, int8 D128, the kernel alone, eleven tilings): the
    int8 tile stays fastest (1×16K 4586 µs, SDPA fp16 3997; 64 × 64 × 4 warps, nearly spill-free,
    5468–5570). The interpreter takes 32 × 32 (fewer, larger NumPy steps)."""
    dp = max(32, triton.next_power_of_2(head_dim))
    if interpret:
        return AttendConfig(32, 32, dp, 4, 1)
    if dp <= 128:
        return AttendConfig(128, 64, dp, 4, 3) if int8 else AttendConfig(64, 64, dp, 4, 3)
    return AttendConfig(128, 64, dp, 8, 2)


def attend_tma(head_dim: int, int8: bool) -> bool:
    """Whether the kernel should read K/V tiles through tensor descriptors (where they can: the
    host checks contiguity, alignment and the device): half-precision Q·Kᵀ at every power-of-two
    head_dim, int8 at 256 only. Measured (H200, session 29, the kernel alone at its tiles, causal,
    µs, descriptors / pointers, the scales head-major for both): int8 D128 1×16K 4881.9 / 4667.8,
    1×4K 406.3 / 362.7, D256 1×8K (Hq16) 971.6 / 1099.9; bf16/fp16 with a soft-cap D128 1×16K
    6571.7 / 7211.8, 1×4K 475.9 / 517.9, D256 1×8K 1411.9 / 1419.6, D64 1×16K 4836.3 / 5008.3
    (cuDNN without a cap 3897.6, 285.6, 952.1, 2592.1)."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be an int >= 1, got {head_dim!r}")
    if not isinstance(int8, bool):
        raise TypeError(f"int8 must be a bool, got {type(int8).__name__}")
    return (not int8) or head_dim >= 256


@triton.jit
def softcap_log2(a, c):
    """``c·tanh(a/c)`` in base-2 units (times log2 e), for natural-log scores ``a``: tanh as
    ``1 − 2/(e^{2x} + 1)``."""
    return c * (1.0 - 2.0 / (tl.exp2(a * (2.0 * _LOG2E / c)) + 1.0)) * _LOG2E


@triton.jit
def mask_scores(s, keys, key_ok, pos_q, window_left, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Scores ``s [rows, keys]`` with −inf where a key is not ``key_ok``, or (``CAUSAL``) past the
    row's position ``pos_q``, or (``WINDOW``) more than ``window_left`` positions before it."""
    vis = key_ok[None, :]
    if CAUSAL:
        vis = vis & (keys[None, :] <= pos_q[:, None])
    if WINDOW:
        vis = vis & (keys[None, :] >= pos_q[:, None] - window_left)
    return tl.where(vis, s, float("-inf"))


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One base-2 online-softmax step over scores ``s [rows, keys]``: ``(p, α, m, l)`` with the new
    row maxima m (a row with no finite score so far keeps −inf), α the rescale of what was summed
    before, ``p = 2^{s − m}`` and the running sums l."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, qs, pos_q, t0, kv_end, k_base, ks_base, v_base, k_desc, v_desc, desc_row, desc_col,
                 cols, stride_kt, stride_kst, stride_vt, softcap, window_left, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                 WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr,
                 INT8: tl.constexpr, TMA: tl.constexpr):
    """One online-softmax step over keys ``t0 .. t0 + BN − 1`` (``MASK``: keys at or past
    ``kv_end`` and the causal / window masks applied; without it every row sees every key).
    ``TMA``: K and V tiles through the tensor descriptors at rows ``desc_row + t0``, column
    ``desc_col`` (rows past ``kv_end`` belong to the next sequence or are zero-filled: their
    values are zeroed so that a non-finite one cannot reach the output through a zero weight)."""
    kk = t0 + tl.arange(0, BN)
    if MASK:
        km = kk < kv_end
    else:
        km = kk >= 0
    if D == DP:
        m2 = km[:, None]
    else:
        m2 = km[:, None] & (cols < D)[None, :]
    if TMA:
        k = k_desc.load([desc_row + t0, desc_col])
    else:
        k = tl.load(k_base + kk.to(tl.int64)[:, None] * stride_kt + cols[None, :], mask=m2, other=0)
    if INT8:
        if MASK:
            ks = tl.load(ks_base + kk.to(tl.int64) * stride_kst, mask=km, other=0.0)
        else:  # no mask: contiguous scales load as vectors
            ks = tl.load(ks_base + kk.to(tl.int64) * stride_kst)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * qs[:, None] * ks[None, :]
    else:
        s = tl.dot(q, tl.trans(k)) * qs[:, None]
    if SOFTCAP:
        s = softcap_log2(s, softcap)
    if MASK:
        s = mask_scores(s, kk, km, pos_q, window_left, CAUSAL, WINDOW)
    p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)
    if TMA:
        v = v_desc.load([desc_row + t0, desc_col])
        if MASK:
            v = tl.where(km[:, None], v, 0.0)
    else:
        v = tl.load(v_base + kk.to(tl.int64)[:, None] * stride_vt + cols[None, :], mask=m2, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["Lq", "Lk"])
def _tile_attend_kernel(
    q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, o_ptr, lse_ptr, k_desc, v_desc, Lq, Lk, qk_scale, softcap, window_left,
    stride_qt, stride_qh, stride_qst, stride_kt, stride_kh, stride_kst, stride_ksh, stride_vt, stride_vh, stride_ot,
    stride_oh, stride_lt,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, INT8: tl.constexpr, TMA: tl.constexpr,
):
    """``INT8``: q int8 ``[batch·Lq, HQ, D]`` codes, qs float32 ``[batch·Lq, HQ]`` their scales;
    k int8 ``[batch·Lk, HQ/G, D]``, ks float32 ``[batch·Lk, HQ/G]`` at strides ``(stride_kst,
    stride_ksh)`` (head-major from the host: contiguous per head). Otherwise q and k are in v's
    dtype and ``qs_ptr``/``ks_ptr`` are not read. v, o: ``[batch·Lk, HQ/G, D]`` / ``[batch·Lq,
    HQ, D]`` fp16 or bf16 (last dimensions contiguous); lse: float32 ``[batch·Lq, HQ]`` (natural
    log). ``qk_scale``: the score scale, times log2(e) unless ``SOFTCAP``. ``Lq`` and ``Lk`` are
    never specialized: a causal piece of one query and one key (``Lq = Lk = 1``, a constexpr 1
    under Triton's specialization) crashed Triton 3.6's ptxas (CUDA 12.8, signal 11) with this
    kernel's int8 form at head_dim 64; reproduced offline, gone without the specialization.
    ``TMA``: K and V are read through ``k_desc`` / ``v_desc``, tensor descriptors of the
    contiguous ``[batch·Lk, HQ/G·D]`` views with ``[BN, D]`` boxes (``D == DP``); otherwise through
    the pointers (the descriptors are not read). The query tiles run last row block first (the
    longest causal rows start first)."""
    b = tl.program_id(1) // HQ
    h = tl.program_id(1) % HQ
    kh = h // G
    mt = tl.num_programs(0) - 1 - tl.program_id(0)
    rows = mt * BM + tl.arange(0, BM)
    rm = rows < Lq
    cols = tl.arange(0, DP)
    tok = (b * Lq + tl.where(rm, rows, 0)).to(tl.int64)
    qm = rm[:, None] & (cols < D)[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + cols[None, :], mask=qm, other=0)
    if INT8:
        qs = tl.load(qs_ptr + tok * stride_qst + h, mask=rm, other=0.0)
        poison = tl.where(qs - qs != 0, float("nan"), 0.0)  # a NaN or ±inf scale: the row held one
        qs = qs * qk_scale
    else:
        qf = q.to(tl.float32)
        poison = tl.where(tl.sum(((qf - qf) != 0).to(tl.int32), axis=1) > 0, float("nan"), 0.0)
        qs = tl.full([BM], 1.0, tl.float32) * qk_scale
    pos_q = Lk - Lq + rows
    k0 = (b * Lk).to(tl.int64)
    k_base = k_ptr + k0 * stride_kt + kh * stride_kh
    ks_base = ks_ptr + k0 * stride_kst + kh * stride_ksh
    v_base = v_ptr + k0 * stride_vt + kh * stride_vh

    first = Lk - Lq + mt * BM  # the first row's key position
    if CAUSAL or WINDOW:
        kv_end = tl.minimum(Lk, tl.maximum(first + BM, 0))
    else:
        kv_end = Lk
    if WINDOW:  # every tile masked
        lo = (tl.maximum(first - window_left, 0) // BN) * BN
        full = lo
    elif CAUSAL:
        lo = 0
        full = (tl.minimum(tl.maximum(first + 1, 0), kv_end) // BN) * BN
    else:
        lo = 0
        full = (kv_end // BN) * BN
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DP], tl.float32)
    for t0 in range(lo, full, BN):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, qs, pos_q, t0, kv_end, k_base, ks_base, v_base, k_desc,
                                     v_desc, b * Lk, kh * D, cols, stride_kt, stride_kst, stride_vt, softcap,
                                     window_left, False, CAUSAL, WINDOW, SOFTCAP, D, DP, BN, INT8, TMA)
    for t0 in range(tl.maximum(full, lo), kv_end, BN):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, qs, pos_q, t0, kv_end, k_base, ks_base, v_base, k_desc,
                                     v_desc, b * Lk, kh * D, cols, stride_kt, stride_kst, stride_vt, softcap,
                                     window_left, True, CAUSAL, WINDOW, SOFTCAP, D, DP, BN, INT8, TMA)
    inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    o = acc * inv[:, None] + poison[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + cols[None, :], o.to(o_ptr.dtype.element_ty), mask=qm)
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * _LN2, float("-inf"))
    tl.store(lse_ptr + tok * stride_lt + h, lse + poison, mask=rm)
