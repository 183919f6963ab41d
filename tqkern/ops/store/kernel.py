"""The store kernel: normalize, rotate, quantize, pack and write slots into a paged cache.

One kernel serves every codec and both arrangements: the layout becomes constexprs
(:func:`tqkern.ops.codecs.layout_args`), the launch's choices a
:class:`~tqkern.ops.store.plan.StorePlan`, each side's encoding
:func:`tqkern.ops.fields.encode_side`. A program takes ``TILES`` tiles of ``BV`` vectors, vector
``v`` being head ``v % H`` of token ``v // H``; the rotation operand (the plan's method) is built
once per program, before its tiles (a ``COLS`` plan reads ``rot_ptr`` as Π's fp16 parts ``[2, D, D]``,
:func:`tqkern.ops.store.triton.rotation_parts`, instead of float32 Π). Norms, uniform scales/codes and stored gains equal the
oracle's bytes (float64 sums; float32 estimates checked exactly); only the rotation runs in float32
(codes within ``tqkern.ops.quantize.reference.EPS`` of a boundary may differ, as the spec allows).
``K_SYM`` / ``V_SYM``: that side's Lloyd-Max table is antisymmetric and searched by its positive half
(:func:`tqkern.ops.fields.symmetric_codes`; a tie |y| = boundary may differ, as above).
``F16_ROT`` (``pm1`` / ``split`` with a key offset or bf16 inputs): the rotation's operands are fp16
whatever the input dtype; each row enters scaled by a power of two (:func:`_scaled_parts`): bf16
rows exactly in one fp16 part, the keys' ``x − μ`` (float32) in two (~22 bits). ``chunked`` scales
bf16 rows by the same powers of two in float32. Scaled rows come back as ``y · 2^k`` (``YS``): a
bf16 row's norm may be ~2^-133, whose float32 reciprocal overflows.

Safety (``tqkern.errors``): a slot outside ``[0, num_slots)`` writes nothing (negative: skipped
silently; too large: ``SLOT_OUT_OF_RANGE``); a key or value vector holding a NaN or ±inf is read
as zeros (``NONFINITE_INPUT``); a stored float beyond its dtype's range saturates
(``SATURATED``). Each program ORs its bits into ``err_ptr[0]`` with one atomic, only when set.

No torch here: ``tqkern.ops.store.aot`` compiles this module with Triton alone.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.errors import ErrorFlag
from tqkern.ops.common import row_scales
from tqkern.ops.fields import encode_side, finite_rows, flag
from tqkern.ops.store.plan import ROT_CHUNKED, ROT_PM1, ROT_SPLIT
from tqkern.ops.store.wide import SPLIT_SCALE, store_columns

__all__ = ["_store_kernel"]

_ERR_NONFINITE = tl.constexpr(int(ErrorFlag.NONFINITE_INPUT))
_ERR_SLOT = tl.constexpr(int(ErrorFlag.SLOT_OUT_OF_RANGE))


@triton.jit
def _rotation_operand(rot_ptr, D: tl.constexpr, DP: tl.constexpr, ROT: tl.constexpr, DOT: tl.constexpr):
    """The B operands of ``y = (x @ B_0 [+ x @ B_1 [+ x @ B_2]]) · c`` for the plan's method, each
    ``[DP, DP]`` (zero beyond D), and c (float32): ``pm1``: B_0 = sign(Π) in ``DOT`` built from Π's
    first column s (Π[i, j] = s_i·(−1)^popcount(i & j)/√D), c = |Π[0, 0]|; ``split``: the ``DOT``
    parts of 16·Π, c = 1/16. Other methods: placeholders."""
    i = tl.arange(0, DP)
    m = i < D
    m2 = m[:, None] & m[None, :]
    if ROT == ROT_PM1:
        s = tl.load(rot_ptr + i * D, mask=m, other=0.0)
        a = i[:, None] & i[None, :]
        a ^= a >> 4  # fold bits 7..0 to the parity in bit 0 (DP ≤ 128: seven bits)
        a ^= a >> 2
        a ^= a >> 1
        b = tl.where(s[:, None] > 0, 1.0, -1.0) * (1 - 2 * (a & 1)).to(tl.float32)
        b = tl.where(m2, b, 0.0).to(DOT)
        return b, b, b, tl.abs(tl.load(rot_ptr))
    elif ROT == ROT_SPLIT:
        r = tl.load(rot_ptr + i[:, None] * D + i[None, :], mask=m2, other=0.0) * SPLIT_SCALE
        b0 = r.to(DOT)
        r = r - b0.to(tl.float32)
        b1 = r.to(DOT)
        b2 = (r - b1.to(tl.float32)).to(DOT)
        return b0, b1, b2, 1.0 / SPLIT_SCALE
    else:
        return 0.0, 0.0, 0.0, 1.0


@triton.jit
def _scaled_parts(d, TWO: tl.constexpr):
    """Row ``r`` of float32 ``d [BV, DP]`` times 2^k_r, max |d_r|·2^k_r in [2^13, 2^14) (k_r = 140 where
    that max is zero or subnormal; applied as two factors, each a float32), as fp16 parts
    ``hi (+ lo)`` (``TWO``: lo = the rounding of what hi leaves, so hi + lo holds ~22 of d's bits;
    otherwise hi alone, exact for bf16 inputs down to 2^-30 of the row's largest element), and 2^k_r
    in float64 ``[BV]``. No part overflows fp16 or loses bits to its subnormals above 2^-24 of the
    row's largest element."""
    sa, sb = row_scales(tl.max(tl.abs(d), axis=1))
    ds = d * sa[:, None] * sb[:, None]  # exact: powers of two, results normal or zero
    hi = ds.to(tl.float16)
    lo = hi
    if TWO:
        lo = (ds - hi.to(tl.float32)).to(tl.float16)  # ds − hi is exact in float32
    return hi, lo, sa.to(tl.float64) * sb.to(tl.float64)


@triton.jit
def _rotate_chunked(x_ptr_2d, ld_mask, rot_ptr, D: tl.constexpr, DP: tl.constexpr, KC: tl.constexpr,
                    BV: tl.constexpr, DOT_PRECISION: tl.constexpr, mu_ptr_2d, HAS_MU: tl.constexpr, sa, sb,
                    SCALED: tl.constexpr):
    """y = (x − μ) @ Π in float32 [BV, DP] (``SCALED``: row r times ``sa[r]·sb[r]``, exact powers
    of two); x (and μ) read from global in KC-wide chunks (Π stays on chip one [KC, DP] chunk at a
    time, so D = 256 fits); rows outside ``ld_mask`` read 0."""
    acc = tl.zeros([BV, DP], tl.float32)
    cols = tl.arange(0, DP)
    for k0 in tl.static_range(0, DP, KC):
        kk = k0 + tl.arange(0, KC)
        km = ld_mask[:, None] & (kk < D)[None, :]
        xk = tl.load(x_ptr_2d + kk[None, :], mask=km, other=0.0).to(tl.float32)
        if HAS_MU:
            xk = xk - tl.load(mu_ptr_2d + kk[None, :], mask=km, other=0.0)
        if SCALED:
            xk = xk * sa[:, None] * sb[:, None]
        r = tl.load(rot_ptr + kk[:, None] * D + cols[None, :], mask=(kk < D)[:, None] & (cols < D)[None, :],
                    other=0.0)
        acc += tl.dot(xk, r, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _rotate(x, x_ptr_2d, ld_mask, mu, mu_ptr_2d, rot_ptr, b0, b1, b2, c, HAS_MU: tl.constexpr,
            IN_BF16: tl.constexpr, F16_ROT: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
            KC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``(y, ys)``: y = (x − μ) @ Π · ys in float32 ``[BV, DP]`` by the plan's method, from the tile
    ``x`` (``chunked``: from memory) and the operands of :func:`_rotation_operand`; ``ys`` 1.0, or
    with ``F16_ROT`` and ``HAS_MU`` or ``IN_BF16`` each row's power of two of :func:`_scaled_parts`
    (float64 ``[BV]``; two parts of x − μ with μ, one without), or ``chunked`` with ``IN_BF16`` the
    same power of two, applied to the float32 chunks (bf16 rows whose norm's reciprocal would
    overflow float32, or whose elements are float32 subnormals that tf32 products flush)."""
    ys = 1.0
    if ROT == ROT_CHUNKED:  # (a single return: Triton compiles the code after an early return too)
        sa = 1.0
        sb = 1.0
        if IN_BF16:
            d = x.to(tl.float32)
            if HAS_MU:
                d = d - mu
            sa, sb = row_scales(tl.max(tl.abs(d), axis=1))
            ys = sa.to(tl.float64) * sb.to(tl.float64)
        acc = _rotate_chunked(x_ptr_2d, ld_mask, rot_ptr, D, DP, KC, x.shape[0], DOT_PRECISION, mu_ptr_2d, HAS_MU,
                              sa, sb, IN_BF16)
    else:
        a = x
        a_lo = x
        if F16_ROT and (HAS_MU or IN_BF16):
            d = x.to(tl.float32)
            if HAS_MU:
                d = d - mu
            a, a_lo, ys = _scaled_parts(d, HAS_MU)
        acc = tl.dot(a, b0)
        if ROT == ROT_PM1:
            if F16_ROT and HAS_MU:
                acc = tl.dot(a_lo, b0, acc)
        else:  # ROT_SPLIT
            acc = tl.dot(a, b1, acc)
            if F16_ROT and HAS_MU:
                acc = tl.dot(a_lo, b0, acc)  # (a_lo·b1 is ~2^-22 of the product: left out, as tf32x3 does)
            elif IN_BF16 and not F16_ROT:
                acc = tl.dot(a, b2, acc)
        acc = acc * c
    return acc, ys


@triton.jit
def _encode(x, x_ptr_2d, ld_mask, mu, mu_ptr_2d, row, h, ok, rot_ptr, b0, b1, b2, c, bnd_ptr, cen_ptr,
            HAS_MU: tl.constexpr, IN_BF16: tl.constexpr, F16_ROT: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr,
            DP: tl.constexpr, KC: tl.constexpr, DOT_PRECISION: tl.constexpr, NIBBLE: tl.constexpr,
            ALIGNED: tl.constexpr, HW_FP8: tl.constexpr, COLS: tl.constexpr, COL_STAGES: tl.constexpr, S: tl.constexpr,
            SYM: tl.constexpr):
    """Encode one side (``S``) of the tile ``x`` (rows outside ``ld_mask`` zero; ``mu`` its key
    offset, ``HAS_MU`` false for values) into its fields; the error bits. A rotated side of a
    ``COLS`` plan (Lloyd-Max, the plan says) goes through
    :func:`~tqkern.ops.store.wide.store_columns`; others are rotated by :func:`_rotate` and encoded
    by ``encode_side``, told whether the rows came back scaled (``YS``: :func:`_rotate`'s own
    condition)."""
    YS: tl.constexpr = S.ROTATED and (ROT == ROT_CHUNKED and IN_BF16
                                      or ROT != ROT_CHUNKED and F16_ROT and (HAS_MU or IN_BF16))
    if COLS > 0 and S.ROTATED:
        err = store_columns(x_ptr_2d, mu_ptr_2d, ld_mask, row, h, ok, rot_ptr, bnd_ptr, cen_ptr, HAS_MU, IN_BF16, D,
                            COLS, KC, NIBBLE, ALIGNED, S, SYM, COL_STAGES)
    else:
        y = 0.0
        ys = 1.0
        if S.ROTATED:
            y, ys = _rotate(x, x_ptr_2d, ld_mask, mu, mu_ptr_2d, rot_ptr, b0, b1, b2, c, HAS_MU, IN_BF16, F16_ROT, ROT,
                            D, DP, KC, DOT_PRECISION)
        err = encode_side(x, mu, y, row, h, ok, bnd_ptr, cen_ptr, HAS_MU, IN_BF16, D, DP, NIBBLE, ALIGNED, HW_FP8, S,
                          SYM, ys, YS)
    return err


@triton.jit
def _store_kernel(
    key_ptr, value_ptr, slot_ptr, cache_ptr, rot_ptr, kb_ptr, kc_ptr, vb_ptr, vc_ptr, mu_ptr, err_ptr,
    num_tokens, num_slots, stride_kt, stride_kh, stride_vt, stride_vh,
    HAS_MU: tl.constexpr, IN_BF16: tl.constexpr, H: tl.constexpr, BV: tl.constexpr, TILES: tl.constexpr,
    ROT: tl.constexpr, KC: tl.constexpr, DOT_PRECISION: tl.constexpr, K_ALIGNED: tl.constexpr,
    V_ALIGNED: tl.constexpr, HW_FP8: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, ROW_BYTES: tl.constexpr,
    NIBBLE: tl.constexpr, F16_ROT: tl.constexpr, COLS: tl.constexpr, COL_STAGES: tl.constexpr,
    PAD_OFF: tl.constexpr, PAD_STRIDE: tl.constexpr, PAD_BYTES: tl.constexpr, PADP: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, K_SYM: tl.constexpr, V_SYM: tl.constexpr,
):
    DOT: tl.constexpr = tl.bfloat16 if IN_BF16 and not F16_ROT else tl.float16
    b0, b1, b2, c = _rotation_operand(rot_ptr, D, DP, ROT, DOT)
    cols = tl.arange(0, DP)
    dm = cols < D
    err = tl.program_id(0) * 0
    for i in range(TILES):
        v = (tl.program_id(0) * TILES + i) * BV + tl.arange(0, BV)
        t = v // H
        h = v % H
        vmask = t < num_tokens
        slot = tl.load(slot_ptr + t, mask=vmask, other=-1).to(tl.int64)
        ok = vmask & (slot >= 0) & (slot < num_slots)  # never a byte outside the cache
        err |= flag(vmask & (slot >= num_slots), _ERR_SLOT)
        row = cache_ptr + tl.where(ok, slot, 0) * ROW_BYTES  # [BV] pointers to each vector's token row
        t64 = t.to(tl.int64)
        k_ptr_2d = key_ptr + (t64 * stride_kt + h * stride_kh)[:, None]
        v_ptr_2d = value_ptr + (t64 * stride_vt + h * stride_vh)[:, None]
        m2 = ok[:, None] & dm[None, :]
        if COLS > 0 and K.ROTATED and V.ROTATED:  # both sides by Π's columns: they read x and check it themselves
            kx = 0.0
            vx = 0.0
            k_ok = ok
            v_ok = ok
        else:
            kx = tl.load(k_ptr_2d + cols[None, :], mask=m2, other=0.0)
            vx = tl.load(v_ptr_2d + cols[None, :], mask=m2, other=0.0)
            k_ok = finite_rows(kx)
            v_ok = finite_rows(vx)
            err |= flag(ok & ~(k_ok & v_ok), _ERR_NONFINITE)
            kx = tl.where(k_ok[:, None], kx, 0.0)
            vx = tl.where(v_ok[:, None], vx, 0.0)
        mu_ptr_2d = mu_ptr + (h * D)[:, None]
        mu = 0.0
        if HAS_MU and not (COLS > 0 and K.ROTATED):  # (Π's columns: μ read a chunk at a time)
            mu = tl.load(mu_ptr_2d + cols[None, :], mask=m2 & k_ok[:, None], other=0.0)
        err |= _encode(kx, k_ptr_2d, ok & k_ok, mu, mu_ptr_2d, row, h, ok, rot_ptr, b0, b1, b2, c, kb_ptr, kc_ptr,
                       HAS_MU, IN_BF16, F16_ROT, ROT, D, DP, KC, DOT_PRECISION, NIBBLE, K_ALIGNED, HW_FP8, COLS,
                       COL_STAGES, K, K_SYM)
        err |= _encode(vx, v_ptr_2d, ok & v_ok, 0.0, mu_ptr_2d, row, h, ok, rot_ptr, b0, b1, b2, c, vb_ptr, vc_ptr,
                       False, IN_BF16, F16_ROT, ROT, D, DP, KC, DOT_PRECISION, NIBBLE, V_ALIGNED, HW_FP8, COLS,
                       COL_STAGES, V, V_SYM)
        if PAD_BYTES > 0:
            p = tl.arange(0, PADP)
            tl.store((row + PAD_OFF + h * PAD_STRIDE)[:, None] + p[None, :], tl.zeros([BV, PADP], tl.uint8),
                     mask=ok[:, None] & (p < PAD_BYTES)[None, :])
    tl.atomic_or(err_ptr, err, mask=err != 0, sem="relaxed")
