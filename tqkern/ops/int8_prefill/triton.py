"""The int8 kernels of ``int8_prefill``'s tiled path (no torch): the symmetric int8 codes of
:mod:`.reference` (:func:`int8_codes`), the queries' codes in the key codec's space
(:func:`_quantize_q_kernel`) and attention over a dense int8 key / half-precision value workspace
(:func:`_int8_attend_kernel`). The keys' codes are made once per key by the gather
(:mod:`tqkern.ops.decompress.gather` with ``K_INT8``), not once per query tile.

Attention (:func:`_int8_attend_kernel`), per query row i and key j of one piece (``Lq`` queries,
``Lk`` keys; query i sits at key position ``Lk − Lq + i``):

    a_ij = (scale · s_q[i]) · s_k[j] · (c_q[i] · c_k[j])       (int8 tensor-core product, int32 sums)
    a_ij = c · tanh(a_ij / c)                                  (``SOFTCAP``)
    masks: ``CAUSAL`` keys ``j ≤ Lk − Lq + i``; ``WINDOW`` also ``j ≥ Lk − Lq + i − window_left``
    out_i = Σ_j softmax(a_i)_j · v_j    (P rounded to v's dtype, float32 sums), lse_i = log Σ_j e^{a_ij}

The scores are float32 (the oracle's float64 up to float32 rounding); the online softmax runs in
base 2 like the other prefill kernels. A query row whose scale is not finite (the row held a NaN
or ±inf) gives a NaN row and lse; a row with no visible key gives zeros and lse −inf (the tiled
plan never makes one). Grid ``(⌈Lq / BM⌉, batch · HQ)``: program ``(m, b·HQ + h)`` takes query
rows ``m·BM ..`` of sequence b's head h, which reads KV head ``h // G``; the batch's sequences
have equal lengths and sit one after another in every operand.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from tqkern.ops.store.kernel import _rotate, _rotation_operand
from tqkern.ops.store.plan import HOIST_MAX_DP, ROT_NONE, ROTATIONS

__all__ = ["int8_codes", "int8_codes_with", "_quantize_q_kernel", "_int8_attend_kernel", "AttendConfig",
           "attend_config", "QuantizeConfig", "quantize_config"]



class AttendConfig(NamedTuple):
    """Tiles and compile options of :func:`_int8_attend_kernel`: ``BM`` query rows by ``BN`` keys,
    ``DP`` padded head_dim (≥ 32: the int8 product's reduction)."""

    BM: int
    BN: int
    DP: int
    num_warps: int
    num_stages: int


class QuantizeConfig(NamedTuple):
    """:func:`_quantize_q_kernel`'s launch: rotation method (``ROT``, an index of
    :data:`tqkern.ops.store.plan.ROTATIONS`), ``KC`` (chunk of the ``chunked`` method), ``ROWS`` ×
    ``TILES`` rows a program, ``DOT_PRECISION`` (``chunked``), ``num_warps``."""

    ROT: int
    KC: int
    ROWS: int
    TILES: int
    DOT_PRECISION: str
    num_warps: int


def quantize_config(rotated: bool, signed_sylvester: bool, head_dim: int, interpret: bool) -> QuantizeConfig:
    """The query quantization for a key codec (``rotated``) with this rotation: the store's methods
    (exact ±1 products for a signed Sylvester Π up to head_dim 128, split half-precision parts for
    another Π, float32 chunks past 128) and its tiles (64 rows × 8 warps, 2 or 4 tiles a program;
    ``chunked``: 32 rows × 8 warps, 32-column chunks, the fewest spills of the sm_90 compiles
    tried, 504 stack bytes; no rotation: 16 rows × 4 warps). Measured on the H100 at 16K tokens ×
    32 heads × 128 (fp16): no rotation 73 µs, ``pm1`` 194, ``split`` 183 (bf16: 306)."""
    dp = max(16, triton.next_power_of_2(head_dim))
    method = "none" if not rotated else "chunked" if dp > HOIST_MAX_DP else "pm1" if signed_sylvester else "split"
    rows, tiles, kc, warps = {"pm1": (64, 2, 64, 8), "split": (64, 4, 64, 8), "chunked": (32, 1, 32, 8)}.get(
        method, (16, 1, 64, 4))
    return QuantizeConfig(ROTATIONS.index(method), min(dp, kc), rows, tiles, "ieee" if interpret else "tf32x3",
                          warps)


def attend_config(head_dim: int, interpret: bool) -> AttendConfig:
    """The attention tiles for ``head_dim``. Up to 128 columns: 128 query rows × 64 keys, 4 warps, 3
    stages, the fastest of eight measured on the H100 at 1×16K, Hq32/Hkv8/D128 (5534 µs; 64 × 128 ×
    4 warps 5566; 8 warps 6081–6211; 2 stages 11586; 254 registers, no spills). At 256: 64 × 64, 8
    warps, 2 stages, the fewest spills of six sm_90 compiles (280 stack bytes), not timed. The
    interpreter takes 32 × 32 (fewer, larger NumPy steps)."""
    dp = max(32, triton.next_power_of_2(head_dim))
    if interpret:
        return AttendConfig(32, 32, dp, 4, 1)
    if dp <= 128:
        return AttendConfig(128, 64, dp, 4, 3)
    return AttendConfig(64, 64, dp, 8, 2)

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def int8_codes_with(x, s):
    """The int8 codes of the rows of ``x [rows, cols]`` (float32) for given row scales ``s [rows]``:
    ``clamp(rint(x / s), −127, 127)``, ties to even (``floor(t + ½)``, one less where that is odd
    and t was exactly halfway); 0 where ``s`` is 0."""
    t = x / tl.where(s > 0, s, 1.0)[:, None]
    r = tl.floor(t + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where((r - t == 0.5) & odd, r - 1.0, r)
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)


@triton.jit
def int8_codes(x):
    """Symmetric int8 codes and scales of the rows of ``x [rows, cols]`` (float32; padding columns
    must be 0), as :func:`tqkern.ops.int8_prefill.reference.quantize_int8`: ``s = max|x| / 127``,
    codes by :func:`int8_codes_with`; ``s = 0`` and codes 0 for a zero row."""
    s = tl.max(tl.abs(x), axis=1) / 127.0
    return int8_codes_with(x, s), s


@triton.jit
def _quantize_q_kernel(q_ptr, rot_ptr, q8_ptr, qs_ptr, n_rows, stride_qs, stride_qh, HQ: tl.constexpr,
                       D: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr,
                       ROT: tl.constexpr, KC: tl.constexpr, IN_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Query rows ``r = t·HQ + h`` of ``q`` (fp16/bf16, last dimension contiguous), rotated into the
    key codec's space by the store's rotation method ``ROT`` (:mod:`tqkern.ops.store.plan`:
    ``none``, ``pm1`` — exact ±1 products —, ``split``, ``chunked``; float32 sums), as int8 codes
    ``q8 [n_rows, D]`` and float32 scales ``qs [n_rows]`` (NaN for a row holding a NaN or ±inf:
    the attention kernel then writes a NaN row). ``TILES`` tiles of ``ROWS`` rows a program, the
    rotation operand built once."""
    DOT: tl.constexpr = tl.bfloat16 if IN_BF16 else tl.float16
    b0, b1, b2, c = _rotation_operand(rot_ptr, D, DP, ROT, DOT)
    cols = tl.arange(0, DP)
    cm = cols < D
    for i in range(TILES):
        rows = (tl.program_id(0) * TILES + i) * ROWS + tl.arange(0, ROWS)
        rm = rows < n_rows
        src = q_ptr + (rows // HQ).to(tl.int64)[:, None] * stride_qs + (rows % HQ).to(tl.int64)[:, None] * stride_qh
        x = tl.load(src + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0)
        xf = x.to(tl.float32)
        bad = tl.sum(((xf - xf) != 0).to(tl.int32), axis=1) > 0  # a NaN or ±inf in the row (max ignores NaN)
        if ROT == ROT_NONE:
            y = xf
        else:
            y = _rotate(x, src, rm, src, rot_ptr, b0, b1, b2, c, False, IN_BF16, ROT, D, DP, KC, DOT_PRECISION)
        codes, s = int8_codes(tl.where(cm[None, :], y, 0.0))
        tl.store(q8_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], codes, mask=rm[:, None] & cm[None, :])
        tl.store(qs_ptr + rows, tl.where(bad, float("nan"), s), mask=rm)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, qs, pos_q, t0, kv_end, k_base, ks_base, v_base, cols, stride_kt, stride_kst,
                 stride_vt, softcap, window_left, MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 SOFTCAP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr):
    """One online-softmax step over keys ``t0 .. t0 + BN − 1`` (``MASK``: keys at or past
    ``kv_end`` and the causal / window masks applied; without it every row sees every key)."""
    kk = t0 + tl.arange(0, BN)
    if MASK:
        km = kk < kv_end
    else:
        km = kk >= 0
    if D == DP:
        m2 = km[:, None]
    else:
        m2 = km[:, None] & (cols < D)[None, :]
    k = tl.load(k_base + kk.to(tl.int64)[:, None] * stride_kt + cols[None, :], mask=m2, other=0)
    ks = tl.load(ks_base + kk.to(tl.int64) * stride_kst, mask=km, other=0.0)
    s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * qs[:, None] * ks[None, :]
    if SOFTCAP:  # c·tanh(a/c) as c·(1 − 2/(e^{2a/c} + 1)), then base 2
        s = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * _LOG2E / softcap)) + 1.0)) * _LOG2E
    if MASK:
        vis = km[None, :]
        if CAUSAL:
            vis = vis & (kk[None, :] <= pos_q[:, None])
        if WINDOW:
            vis = vis & (kk[None, :] >= pos_q[:, None] - window_left)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + kk.to(tl.int64)[:, None] * stride_vt + cols[None, :], mask=m2, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _int8_attend_kernel(
    q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, o_ptr, lse_ptr, Lq, Lk, qk_scale, softcap, window_left,
    stride_qt, stride_qh, stride_qst, stride_kt, stride_kh, stride_kst, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lt,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """q: int8 ``[batch·Lq, HQ, D]`` codes, qs: float32 ``[batch·Lq, HQ]`` their scales (last
    dimension contiguous); k: int8 ``[batch·Lk, HQ/G, D]``, ks: float32 ``[batch·Lk, HQ/G]``; v,
    o: ``[batch·Lk, HQ/G, D]`` / ``[batch·Lq, HQ, D]`` fp16 or bf16; lse: float32 ``[batch·Lq,
    HQ]`` (natural log). ``qk_scale``: the score scale, times log2(e) unless ``SOFTCAP``."""
    b = tl.program_id(1) // HQ
    h = tl.program_id(1) % HQ
    kh = h // G
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = rows < Lq
    cols = tl.arange(0, DP)
    tok = (b * Lq + tl.where(rm, rows, 0)).to(tl.int64)
    qm = rm[:, None] & (cols < D)[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + cols[None, :], mask=qm, other=0)
    qs = tl.load(qs_ptr + tok * stride_qst + h, mask=rm, other=0.0)
    poison = tl.where(qs - qs != 0, float("nan"), 0.0)  # a NaN or ±inf scale: the row held one
    qs = qs * qk_scale
    pos_q = Lk - Lq + rows
    k0 = (b * Lk).to(tl.int64)
    k_base = k_ptr + k0 * stride_kt + kh * stride_kh
    ks_base = ks_ptr + k0 * stride_kst + kh
    v_base = v_ptr + k0 * stride_vt + kh * stride_vh

    first = Lk - Lq + tl.program_id(0) * BM  # the first row's key position
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
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, qs, pos_q, t0, kv_end, k_base, ks_base, v_base, cols,
                                     stride_kt, stride_kst, stride_vt, softcap, window_left, False, CAUSAL, WINDOW,
                                     SOFTCAP, D, DP, BN)
    for t0 in range(tl.maximum(full, lo), kv_end, BN):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, qs, pos_q, t0, kv_end, k_base, ks_base, v_base, cols,
                                     stride_kt, stride_kst, stride_vt, softcap, window_left, True, CAUSAL, WINDOW,
                                     SOFTCAP, D, DP, BN)
    inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    o = acc * inv[:, None] + poison[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + cols[None, :], o.to(o_ptr.dtype.element_ty), mask=qm)
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * _LN2, float("-inf"))
    tl.store(lse_ptr + tok * stride_lt + h, lse + poison, mask=rm)
