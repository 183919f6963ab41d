"""The store's column-chunked Lloyd-Max side (plan constexpr ``COLS``, head_dim above 128).

A ``[DP, DP]`` rotation does not fit on chip beside a tile of vectors at head_dim 256, and the
``chunked`` method's float32 ``y [BV, DP]`` with tf32x3 products over 32-row chunks of Π is slow
(2–3% of ``copy_``: ``docs/performance.md``). A rotated Lloyd-Max side needs ``y`` only column by
column: code ``j`` is the search of ``y_j / ‖x − μ‖``, so the norm comes first, from ``x``, and
then Π's columns are taken ``COLS`` at a time: ``y[:, c] = Σ_k x[:, k] @ Π[k, c]`` over ``KC``-row
blocks, on fp16 operands as the ``split`` method's: ``16·Π ≈ Π_1 + Π_2`` read as two fp16 tensors made
once per rotation (:func:`tqkern.ops.store.triton.rotation_parts`, ``DeviceParams.rotation_parts``;
session 75, where each block of Π was split in registers per tile before), x exact in fp16, or scaled
by a power of two per row into one fp16 part (bf16) or two (``x − μ``,
:func:`tqkern.ops.store.kernel._scaled_parts`); then that chunk's codes are searched and packed at
their own bytes (a chunk of a multiple of 32 codes starts at a whole byte and a whole 32-code word).
``x`` chunks are read again from memory (L1/L2) for each column chunk. ``STAGES`` > 0 runs the
row-block loop as a software-pipelined loop of that many stages (the plan's choice for fp16 inputs
without μ: loads of the next blocks in flight during this block's products), 0 unrolls it.

Exact where the oracle is certain: norms and stored gains in float64 as
:func:`tqkern.ops.fields.encode_side`; y's error near ``√D · 2^-21 · ‖x − μ‖`` (two fp16 parts of
Π; two of ``x − μ``), inside ``EPS`` = 2^-16 as the ``split`` method's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.errors import ErrorFlag
from tqkern.ops.common import NC_STORED, f64_to_bits, row_scales, store_bytes, store_packed
from tqkern.ops.fields import _ERR_SATURATED, _lloyd_max_codes, _saturates, flag, half_bounds, symmetric_codes

__all__ = ["store_columns", "SPLIT_SCALE"]

_ERR_NONFINITE = tl.constexpr(int(ErrorFlag.NONFINITE_INPUT))
SPLIT_SCALE = tl.constexpr(16.0)  # fp16 parts of 16·Π (an exact power of two; keeps Π_2 normal in fp16)


@triton.jit
def _column_block(acc, x_ptr_2d, mu_ptr_2d, ld_mask, parts_ptr, k0, c0, sa, sb, HAS_MU: tl.constexpr,
                  SCALED: tl.constexpr, D: tl.constexpr, COLS: tl.constexpr, KC: tl.constexpr):
    """``acc + x[:, k0:k0+KC] @ 16·Π[k0:k0+KC, c0:c0+COLS]`` on fp16 operands: Π's two parts from
    ``parts_ptr`` (fp16 ``[2, D, D]``), x exact (fp16) or scaled per row by ``sa · sb`` (powers of
    two) into one part (bf16) or two (``x − μ``, whose ``lo · Π_2`` is left out)."""
    kk = k0 + tl.arange(0, KC)
    cc = c0 + tl.arange(0, COLS)
    m = ld_mask[:, None] & (kk < D)[None, :]
    xk = tl.load(x_ptr_2d + kk[None, :], mask=m, other=0.0)
    at = parts_ptr + kk[:, None] * D + cc[None, :]
    p1 = tl.load(at)
    p2 = tl.load(at + D * D)
    if SCALED:
        dk = xk.to(tl.float32)
        if HAS_MU:
            dk = dk - tl.load(mu_ptr_2d + kk[None, :], mask=m, other=0.0)
        dk = dk * sa[:, None] * sb[:, None]  # exact: powers of two
        hi = dk.to(tl.float16)
        acc = tl.dot(hi, p1, acc)
        acc = tl.dot(hi, p2, acc)
        if HAS_MU:
            acc = tl.dot((dk - hi.to(tl.float32)).to(tl.float16), p1, acc)  # lo·Π_2 left out
    else:  # fp16 x: exact as it is
        acc = tl.dot(xk, p1, acc)
        acc = tl.dot(xk, p2, acc)
    return acc


@triton.jit
def store_columns(x_ptr_2d, mu_ptr_2d, ld_mask, row, h, tok_mask, rot_ptr, bnd_ptr, cen_ptr, HAS_MU: tl.constexpr,
                  IN_BF16: tl.constexpr, D: tl.constexpr, COLS: tl.constexpr, KC: tl.constexpr,
                  NIBBLE: tl.constexpr, ALIGNED: tl.constexpr, S: tl.constexpr, SYM: tl.constexpr,
                  STAGES: tl.constexpr):
    """Encode one rotated Lloyd-Max side (``S``) of a tile of ``BV = ld_mask.shape[0]`` vectors into
    its fields; returns the error bits. ``rot_ptr``: Π's fp16 parts ``[2, D, D]`` (module docstring).

    ``x_ptr_2d`` / ``mu_ptr_2d`` ``[BV, 1]``: pointers to each row's first element of x (fp16/bf16)
    and of its key offset (float32; ``HAS_MU``), read ``KC`` columns at a time, as zeros outside
    ``ld_mask`` (rows not read); ``row`` / ``h`` / ``tok_mask`` as
    :func:`tqkern.ops.fields.encode_side`. ``D`` is a multiple of ``COLS`` and ``KC``. A first pass
    over the row takes the norm (float64) and the largest |x − μ| (its power of two); a row whose
    sum of squares is not finite (it holds a NaN or ±inf) is then read as zeros and flagged
    ``NONFINITE_INPUT``, so the kernel need not load whole rows to check them. Nothing of the row
    stays in registers across the passes."""
    BITS: tl.constexpr = S.BITS
    BV: tl.constexpr = ld_mask.shape[0]
    SCALED: tl.constexpr = HAS_MU or IN_BF16  # x (− μ) not exact in fp16 as it is: scaled per row
    kk = tl.arange(0, KC)
    ss = tl.zeros([BV], tl.float64)
    mx = tl.zeros([BV], tl.float32)
    for k0 in tl.static_range(0, D, KC):
        m = ld_mask[:, None] & (k0 + kk < D)[None, :]
        xk = tl.load(x_ptr_2d + (k0 + kk)[None, :], mask=m, other=0.0)
        x64 = xk.to(tl.float64)
        if HAS_MU:
            muk = tl.load(mu_ptr_2d + (k0 + kk)[None, :], mask=m, other=0.0)
            x64 = x64 - muk.to(tl.float64)
            mx = tl.maximum(mx, tl.max(tl.abs(xk.to(tl.float32) - muk), axis=1))
        elif IN_BF16:
            mx = tl.maximum(mx, tl.max(tl.abs(xk.to(tl.float32)), axis=1))
        ss += tl.sum(x64 * x64, axis=1)
    # a row holding a NaN or ±inf has a sum of squares NaN or inf (a finite row's is finite in float64,
    # whatever its dtype): read as zeros from here on, as the whole-row path reads it
    fin = ss < float("inf")
    ld_mask &= fin
    ss = tl.where(fin, ss, 0.0)
    mx = tl.where(fin, mx, 0.0)
    n = tl.sqrt(ss)  # float64: the norm bytes equal the oracle's
    sa = tl.full([BV], 1.0, tl.float32)
    sb = sa
    if SCALED:  # the row's power of two, as _scaled_parts: max |d_r|·2^k_r in [2^13, 2^14)
        sa, sb = row_scales(mx)
    ys = sa.to(tl.float64) * sb.to(tl.float64)
    inv = tl.where(n > 0, 1.0 / tl.where(n > 0, n * ys, 1.0), 0.0).to(tl.float32)
    hb = half_bounds(bnd_ptr, BITS) if SYM else 0.0
    cn2 = tl.zeros([BV], tl.float64)
    codes_at = row + S.A_OFF + h * S.A_STRIDE
    for c0 in tl.static_range(0, D, COLS):
        acc = tl.zeros([BV, COLS], tl.float32)
        if STAGES > 0:
            for k0 in tl.range(0, D, KC, num_stages=STAGES):
                acc = _column_block(acc, x_ptr_2d, mu_ptr_2d, ld_mask, rot_ptr, k0, c0, sa, sb, HAS_MU, SCALED, D,
                                    COLS, KC)
        else:
            for k0 in tl.static_range(0, D, KC):
                acc = _column_block(acc, x_ptr_2d, mu_ptr_2d, ld_mask, rot_ptr, k0, c0, sa, sb, HAS_MU, SCALED, D,
                                    COLS, KC)
        y = acc * (inv / SPLIT_SCALE)[:, None]
        if SYM:
            idx = symmetric_codes(y, hb, BITS)
        else:
            idx = _lloyd_max_codes(y, bnd_ptr, BITS)
        store_packed(codes_at + (c0 * BITS) // 8, idx, tok_mask, BITS, NIBBLE, (COLS * BITS) // 8, BV, COLS, ALIGNED)
        if S.NORM_CORRECTION == NC_STORED:
            c = tl.load(cen_ptr + idx).to(tl.float64)
            cn2 += tl.sum(c * c, axis=1)
    if S.NORM_CORRECTION == NC_STORED:
        cn = tl.sqrt(cn2)
        n = n / tl.where(cn > 0, cn, 1.0)
    PB: tl.constexpr = 2 + 2 * S.PARAM_DTYPE
    store_bytes(row + S.B_OFF + h * S.B_STRIDE, f64_to_bits(n, S.PARAM_DTYPE), PB, tok_mask)
    return flag(tok_mask & _saturates(n, S.PARAM_DTYPE), _ERR_SATURATED) | flag(tok_mask & ~fin, _ERR_NONFINITE)
