"""Field codecs on the GPU: the loaders that decode a side's per-token fields (decompress and the
general decode kernel) and the encoders that write them (store), side by side.

Every function takes a side's constants as one constexpr, ``S``
(:class:`~tqkern.ops.codecs.SideConsts`), and branches on ``S.KIND`` with the registry's
``KIND_*`` names. A decoded element is ``f·tile + z``: :func:`load_tile` gives the tile (in the
caller's dot dtype), :func:`token_factors` the per-token f and z, so a kernel keeps per-token
scalars out of its per-element loop. :func:`encode_side` is the inverse, from the store kernel.
Adding a codec: ``docs/codecs.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.errors import ErrorFlag
from tqkern.ops.codecs import DT_BF16, DT_F16, KIND_FP8, KIND_LLOYD_MAX, KIND_RAW, KIND_UNIFORM, NC_STORED
from tqkern.ops.common import (
    bits_to_f32,
    f32_to_bf16_bits,
    f32_to_fp8e4m3_bits,
    f64_to_bits,
    f64_to_f16_bits,
    fp8e4m3_bits_to_f32,
    load_packed,
    load_param,
    store_bytes,
    store_packed,
)

__all__ = ["load_tile", "token_factors", "encode_side", "finite_rows", "flag"]

_ERR_SATURATED = tl.constexpr(int(ErrorFlag.SATURATED))


# -- loaders (decompress, general decode) -------------------------------------------------------
@triton.jit
def _lut16(codes, cen_ptr):
    """c[codes] for a 16-entry table as a 4-level select tree on the code bits (15 selects per
    code, no memory traffic); the table is read once per call as 16 scalars."""
    b0 = (codes & 1) != 0
    b1 = (codes & 2) != 0
    b2 = (codes & 4) != 0
    b3 = (codes & 8) != 0
    a0 = tl.where(b0, tl.load(cen_ptr + 1), tl.load(cen_ptr + 0))
    a1 = tl.where(b0, tl.load(cen_ptr + 3), tl.load(cen_ptr + 2))
    a2 = tl.where(b0, tl.load(cen_ptr + 5), tl.load(cen_ptr + 4))
    a3 = tl.where(b0, tl.load(cen_ptr + 7), tl.load(cen_ptr + 6))
    a4 = tl.where(b0, tl.load(cen_ptr + 9), tl.load(cen_ptr + 8))
    a5 = tl.where(b0, tl.load(cen_ptr + 11), tl.load(cen_ptr + 10))
    a6 = tl.where(b0, tl.load(cen_ptr + 13), tl.load(cen_ptr + 12))
    a7 = tl.where(b0, tl.load(cen_ptr + 15), tl.load(cen_ptr + 14))
    e0 = tl.where(b1, a1, a0)
    e1 = tl.where(b1, a3, a2)
    e2 = tl.where(b1, a5, a4)
    e3 = tl.where(b1, a7, a6)
    f0 = tl.where(b2, e1, e0)
    f1 = tl.where(b2, e3, e2)
    return tl.where(b3, f1, f0)


@triton.jit
def _centroids(codes, cen_ptr, BITS: tl.constexpr, DOT: tl.constexpr):
    """c[codes]: a 16-entry table by the select tree for the decode kernel's 16-bit dots, else a
    gather (decompress's float64 table: there the tree's 16 scalars cost 20-37 more registers on sm_90)."""
    if BITS == 4 and DOT != tl.float32 and DOT != tl.float64:
        return _lut16(codes, cen_ptr)
    return tl.load(cen_ptr + codes)


@triton.jit
def _small_ints(codes, DOT: tl.constexpr):
    """Integer codes 0..255 as exact DOT values; for fp16 by the magic number 1024 (the code
    ORed into the mantissa of 1024.0, minus 1024) instead of an int→float conversion."""
    if DOT == tl.float16:
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    return codes.to(DOT)


@triton.jit
def load_tile(row, h, tmask, W: tl.constexpr, HALF: tl.constexpr, NIBBLE: tl.constexpr, S: tl.constexpr,
              D: tl.constexpr, DP: tl.constexpr, cen_ptr, DOT: tl.constexpr, ALIGNED: tl.constexpr):
    """Element values of one side's tile before the per-token factor (value = f·tile + z, f and
    z from :func:`token_factors`): ``[BN, W]`` in ``DOT``, for the tokens at ``row [BN]`` of head
    ``h`` (rows outside ``tmask`` read 0; columns ≥ D read 0).

    ``S``: the side's :class:`~tqkern.ops.codecs.SideConsts`. ``HALF`` = -1: all DP columns;
    0: even columns; 1: odd columns (4-bit codes only). Lloyd-Max: the centroids ``cen_ptr[code]``
    (a table of ``DOT``'s precision or wider); uniform: the code; FP8: value·2^-8 in fp16/bf16
    (the 2^8 is the factor; codes 0x7F/0xFF read ±1.9375·2^-8, store never writes them), the exact
    value (NaN included) in float32 and float64; raw: the value. ``ALIGNED``: raw fields start at
    even bytes (one 16-bit load per element)."""
    KIND: tl.constexpr = S.KIND
    BITS: tl.constexpr = S.BITS
    PARAM_DTYPE: tl.constexpr = S.PARAM_DTYPE
    A_OFF: tl.constexpr = S.A_OFF
    A_STRIDE: tl.constexpr = S.A_STRIDE
    A_BYTES: tl.constexpr = S.A_BYTES
    base = row + A_OFF + h * A_STRIDE
    if HALF >= 0:
        j = tl.arange(0, W)
        byte = tl.load(base[:, None] + j[None, :], mask=tmask[:, None], other=0).to(tl.int32)
        if NIBBLE:
            codes = (byte >> (4 - 4 * HALF)) & 15
        else:
            codes = (byte >> (4 * HALF)) & 15
    else:
        cols = tl.arange(0, DP)
        dm = cols < D
        if KIND == KIND_FP8:  # FP8 E4M3 → fp16 bits of value·2^-8 (the 2^8 joins the per-token factor)
            code = tl.load(base[:, None] + cols[None, :], mask=tmask[:, None] & dm[None, :], other=0).to(tl.int32)
            if DOT == tl.float32 or DOT == tl.float64:
                return fp8e4m3_bits_to_f32(code).to(DOT)
            bits = ((code & 0x7F) << 7) | ((code & 0x80) << 8)
            return bits.to(tl.int16).to(tl.float16, bitcast=True).to(DOT)
        elif KIND == KIND_RAW:  # raw fp16 / bf16
            m2 = tmask[:, None] & dm[None, :]
            if ALIGNED:
                p16 = base.to(tl.pointer_type(tl.int16))
                w = tl.load(p16[:, None] + cols[None, :], mask=m2, other=0)
                if PARAM_DTYPE == DT_BF16:
                    return w.to(tl.bfloat16, bitcast=True).to(DOT)
                return w.to(tl.float16, bitcast=True).to(DOT)
            lo = tl.load(base[:, None] + 2 * cols[None, :], mask=m2, other=0).to(tl.int64)
            hi = tl.load(base[:, None] + 2 * cols[None, :] + 1, mask=m2, other=0).to(tl.int64)
            return bits_to_f32(lo | (hi << 8), PARAM_DTYPE).to(DOT)
        if (not NIBBLE) and DP == D and BITS <= 8:  # (Raw never gets here; its BITS is 16)
            # LSB bitstream, D a power of two: every 8 codes are BITS whole bytes. Read each byte
            # once, join a group into one word and split it into its 8 codes (the reshape keeps
            # the natural column order d = 8·group + r).
            G8: tl.constexpr = DP // 8
            gi = tl.arange(0, G8)
            WT: tl.constexpr = tl.int64 if BITS > 3 else tl.int32
            w = tl.load(base[:, None] + gi[None, :] * BITS, mask=tmask[:, None], other=0).to(WT)
            for m in tl.static_range(1, BITS):
                w |= tl.load(base[:, None] + gi[None, :] * BITS + m, mask=tmask[:, None], other=0).to(WT) << (8 * m)
            r = tl.arange(0, 8).to(WT)
            codes = tl.reshape((w[:, :, None] >> (r * BITS)[None, None, :]) & ((1 << BITS) - 1),
                               (row.shape[0], DP))
            codes = codes.to(tl.int32)
        else:
            codes = load_packed(base, tmask, BITS, NIBBLE, A_BYTES, DP)
        codes = tl.where(dm[None, :], codes, 0)
        if KIND == KIND_LLOYD_MAX:  # padded columns must read 0 (they enter ‖c[idx]‖)
            return tl.where(dm[None, :], _centroids(codes, cen_ptr, BITS, DOT), 0.0).to(DOT)
    if KIND == KIND_LLOYD_MAX:
        return _centroids(codes, cen_ptr, BITS, DOT).to(DOT)
    return _small_ints(codes, DOT)


@triton.jit
def token_factors(row, h, tmask, S: tl.constexpr, DOT: tl.constexpr, PAR_ALIGNED: tl.constexpr = False):
    """Per-token (factor f, zero z), float32 ``[BN]``, with value = f·tile + z for the tile of
    :func:`load_tile` in ``DOT``: Lloyd-Max: the norm field (vLLM's ‖c[idx]‖ divisor is the
    caller's), z = 0; uniform: (scale, zero); FP8: (2^8, 0) in fp16/bf16, (1, 0) in float32 and
    float64; raw: (1, 0). ``PAR_ALIGNED``: the float fields allow one typed load."""
    KIND: tl.constexpr = S.KIND
    PARAM_DTYPE: tl.constexpr = S.PARAM_DTYPE
    B_OFF: tl.constexpr = S.B_OFF
    B_STRIDE: tl.constexpr = S.B_STRIDE
    C_OFF: tl.constexpr = S.C_OFF
    C_STRIDE: tl.constexpr = S.C_STRIDE
    zero = tl.zeros_like(tmask.to(tl.float32))
    if KIND == KIND_LLOYD_MAX:
        f = load_param(row + B_OFF + h * B_STRIDE, PARAM_DTYPE, tmask, PAR_ALIGNED)
        return f, zero
    elif KIND == KIND_UNIFORM:
        f = load_param(row + B_OFF + h * B_STRIDE, PARAM_DTYPE, tmask, PAR_ALIGNED)
        z = load_param(row + C_OFF + h * C_STRIDE, PARAM_DTYPE, tmask, PAR_ALIGNED)
        return f, z
    elif KIND == KIND_FP8 and DOT != tl.float32 and DOT != tl.float64:
        return zero + 256.0, zero
    else:
        return zero + 1.0, zero


# -- encoders (store) ----------------------------------------------------------------------------
@triton.jit
def _rotate(x_ptr_2d, tok_mask, rot_ptr, D: tl.constexpr, DP: tl.constexpr, KC: tl.constexpr,
            BT: tl.constexpr, DOT_PRECISION: tl.constexpr, mu_ptr_1d, HAS_MU: tl.constexpr):
    """y = (x − μ) @ Π in float32 [BT, DP]; x read from global in KC-wide chunks (Π stays in
    on-chip memory one chunk at a time, so D = 256 fits too)."""
    acc = tl.zeros([BT, DP], tl.float32)
    cols = tl.arange(0, DP)
    for k0 in tl.static_range(0, DP, KC):
        kk = k0 + tl.arange(0, KC)
        km = kk < D
        xk = tl.load(x_ptr_2d + kk[None, :], mask=tok_mask[:, None] & km[None, :], other=0.0).to(tl.float32)
        if HAS_MU:  # (a token read as zeros stays zero)
            xk = tl.where(tok_mask[:, None], xk - tl.load(mu_ptr_1d + kk, mask=km, other=0.0)[None, :], 0.0)
        r = tl.load(rot_ptr + kk[:, None] * D + cols[None, :], mask=km[:, None] & (cols < D)[None, :], other=0.0)
        acc += tl.dot(xk, r, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _load_exact(x_ptr_2d, mu_ptr_1d, HAS_MU: tl.constexpr, tok_mask, D: tl.constexpr, DP: tl.constexpr):
    """x − μ in float64 [BT, DP] (exact for fp16/bf16 x and fp32 μ), zero outside."""
    cols = tl.arange(0, DP)
    dmask = cols < D
    m2 = tok_mask[:, None] & dmask[None, :]
    x = tl.load(x_ptr_2d + cols[None, :], mask=m2, other=0.0).to(tl.float64)
    if HAS_MU:
        x = tl.where(m2, x - tl.load(mu_ptr_1d + cols, mask=dmask, other=0.0).to(tl.float64)[None, :], 0.0)
    return x


@triton.jit
def _uniform_codes(y, lo, hi, BITS: tl.constexpr):
    """⌊(y − lo)·(2^b − 1)/(hi − lo) + 1/2⌋ exactly (÷1e-8 instead when the scale is floored):
    a float32 estimate, then two exact float64 comparisons move it to the right integer."""
    levels: tl.constexpr = (1 << BITS) - 1
    span = hi - lo
    floored = span / levels < 1e-8
    d = y - lo[:, None]
    num = tl.where(floored[:, None], d, d * levels)
    den = tl.where(floored, 1e-8, span)[:, None]
    q = tl.floor(num.to(tl.float32) / den.to(tl.float32) + 0.5).to(tl.float64)
    q = q - ((q - 0.5) * den > num).to(tl.float64) + ((q + 0.5) * den <= num).to(tl.float64)
    return tl.minimum(tl.maximum(q, 0.0), levels).to(tl.int64)


@triton.jit
def _store_halfwords(row, off, bits, mask, cols, ALIGNED: tl.constexpr):
    """Write 16-bit values ``bits [BT, DP]`` at ``row + off + 2·col``."""
    if ALIGNED:
        p16 = (row + off).to(tl.pointer_type(tl.int16))
        tl.store(p16[:, None] + cols[None, :], bits.to(tl.int16), mask=mask)
    else:
        base = row[:, None] + off + 2 * cols[None, :]
        tl.store(base, (bits & 255).to(tl.uint8), mask=mask)
        tl.store(base + 1, ((bits >> 8) & 255).to(tl.uint8), mask=mask)


@triton.jit
def finite_rows(x_ptr_2d, tok_mask, D: tl.constexpr, DP: tl.constexpr):
    """bool [BT]: the token's vector (D elements at ``x_ptr_2d``) holds no NaN or ±inf."""
    cols = tl.arange(0, DP)
    x = tl.load(x_ptr_2d + cols[None, :], mask=tok_mask[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)
    return tl.sum(((x - x) != 0).to(tl.int32), axis=1) == 0  # x − x is NaN exactly for NaN and ±inf


@triton.jit
def _saturates(v, PARAM_DTYPE: tl.constexpr):
    """|v| beyond the largest finite value of a stored float (DT: 0 f16, 1 f32)."""
    if PARAM_DTYPE == DT_F16:
        return tl.abs(v) > 65504.0
    return tl.abs(v) > 3.4028234663852886e38


@triton.jit
def _any_col(cond):
    """bool [BT]: some column of the row of ``cond [BT, DP]`` holds."""
    return tl.max(cond.to(tl.int32), axis=1) > 0


@triton.jit
def flag(cond, BIT: tl.constexpr):
    """BIT if any element of ``cond [BT]`` holds, else 0 (an int32 scalar)."""
    return tl.max(cond.to(tl.int32), axis=0) * BIT


@triton.jit
def encode_side(x_ptr_2d, mu_ptr_1d, HAS_MU: tl.constexpr, IN_BF16: tl.constexpr, row, h, tok_mask, ld_mask,
                rot_ptr, bnd_ptr, cen_ptr, D: tl.constexpr, DP: tl.constexpr, KC: tl.constexpr, BT: tl.constexpr,
                NIBBLE: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGNED: tl.constexpr, S: tl.constexpr):
    """Encode one side (``S``: its :class:`~tqkern.ops.codecs.SideConsts`) of BT tokens of head h
    into its fields: the vectors are read where ``ld_mask`` (zeros elsewhere: the non-finite
    ones), written where ``tok_mask``. Returns the error bits (``SATURATED``) as an int32 scalar."""
    KIND: tl.constexpr = S.KIND
    BITS: tl.constexpr = S.BITS
    ROTATED: tl.constexpr = S.ROTATED
    NORM_CORRECTION: tl.constexpr = S.NORM_CORRECTION
    PARAM_DTYPE: tl.constexpr = S.PARAM_DTYPE
    A_OFF: tl.constexpr = S.A_OFF
    A_STRIDE: tl.constexpr = S.A_STRIDE
    A_BYTES: tl.constexpr = S.A_BYTES
    B_OFF: tl.constexpr = S.B_OFF
    B_STRIDE: tl.constexpr = S.B_STRIDE
    C_OFF: tl.constexpr = S.C_OFF
    C_STRIDE: tl.constexpr = S.C_STRIDE
    cols = tl.arange(0, DP)
    dmask = cols < D
    m2 = ld_mask[:, None] & dmask[None, :]
    w2 = tok_mask[:, None] & dmask[None, :]
    PB: tl.constexpr = 2 + 2 * PARAM_DTYPE  # bytes of a stored f16 / f32
    if KIND == KIND_LLOYD_MAX:
        x = _load_exact(x_ptr_2d, mu_ptr_1d, HAS_MU, ld_mask, D, DP)
        n = tl.sqrt(tl.sum(x * x, axis=1))  # float64: the norm bytes equal the oracle's
        inv = tl.where(n > 0, 1.0 / tl.where(n > 0, n, 1.0), 0.0).to(tl.float32)
        y = _rotate(x_ptr_2d, ld_mask, rot_ptr, D, DP, KC, BT, DOT_PRECISION, mu_ptr_1d, HAS_MU) * inv[:, None]
        idx = tl.zeros([BT, DP], tl.int32)
        for lvl in tl.static_range(BITS):  # binary search over the sorted boundaries; ties go up
            cand = idx + (1 << (BITS - 1 - lvl))
            thr = tl.load(bnd_ptr + cand - 1)
            idx = tl.where(y >= thr, cand, idx)
        idx = tl.where(dmask[None, :], idx, 0)
        store_packed(row + A_OFF + h * A_STRIDE, idx.to(tl.int64), tok_mask, BITS, NIBBLE, A_BYTES, BT, DP)
        if NORM_CORRECTION == NC_STORED:
            c = tl.where(dmask[None, :], tl.load(cen_ptr + idx), 0.0)
            cn = tl.sqrt(tl.sum(c * c, axis=1))
            n = n / tl.where(cn > 0, cn, 1.0)
        store_bytes(row + B_OFF + h * B_STRIDE, f64_to_bits(n, PARAM_DTYPE), PB, tok_mask)
        err = flag(tok_mask & _saturates(n, PARAM_DTYPE), _ERR_SATURATED)
    elif KIND == KIND_UNIFORM:  # asymmetric
        if ROTATED:
            y = _rotate(x_ptr_2d, ld_mask, rot_ptr, D, DP, KC, BT, DOT_PRECISION, mu_ptr_1d, HAS_MU).to(tl.float64)
        else:
            y = _load_exact(x_ptr_2d, mu_ptr_1d, HAS_MU, ld_mask, D, DP)
        lo = tl.min(tl.where(dmask[None, :], y, float("inf")), axis=1)
        hi = tl.max(tl.where(dmask[None, :], y, float("-inf")), axis=1)
        scale = tl.maximum((hi - lo) / ((1 << BITS) - 1), 1e-8)
        q = tl.where(dmask[None, :], _uniform_codes(y, lo, hi, BITS), 0)
        store_packed(row + A_OFF + h * A_STRIDE, q, tok_mask, BITS, NIBBLE, A_BYTES, BT, DP)
        store_bytes(row + B_OFF + h * B_STRIDE, f64_to_bits(scale, PARAM_DTYPE), PB, tok_mask)
        store_bytes(row + C_OFF + h * C_STRIDE, f64_to_bits(lo, PARAM_DTYPE), PB, tok_mask)
        err = flag(tok_mask & (_saturates(scale, PARAM_DTYPE) | _saturates(lo, PARAM_DTYPE)), _ERR_SATURATED)
    elif KIND == KIND_FP8:  # E4M3
        if ROTATED:
            y = _rotate(x_ptr_2d, ld_mask, rot_ptr, D, DP, KC, BT, DOT_PRECISION, mu_ptr_1d, HAS_MU)
        else:
            y = tl.load(x_ptr_2d + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            if HAS_MU:
                y = _load_exact(x_ptr_2d, mu_ptr_1d, HAS_MU, ld_mask, D, DP).to(tl.float32)
        code = f32_to_fp8e4m3_bits(y)
        tl.store(row[:, None] + A_OFF + h * A_STRIDE + cols[None, :], code.to(tl.uint8), mask=w2)
        err = flag(_any_col(w2 & (tl.abs(y) > 448.0)), _ERR_SATURATED)
    else:  # KIND_RAW: fp16 / bf16
        if HAS_MU:
            xr = _load_exact(x_ptr_2d, mu_ptr_1d, HAS_MU, ld_mask, D, DP)
            bits = f32_to_bf16_bits(xr.to(tl.float32)) if PARAM_DTYPE == DT_BF16 else f64_to_f16_bits(xr)
            big = tl.abs(xr) > (3.3895313892515355e38 if PARAM_DTYPE == DT_BF16 else 65504.0)
        else:
            xn = tl.load(x_ptr_2d + cols[None, :], mask=m2, other=0.0)
            big = tl.zeros([BT, DP], tl.int32) != 0
            if (PARAM_DTYPE == DT_BF16) == IN_BF16:  # same dtype: copy the bits
                bits = xn.to(tl.int16, bitcast=True).to(tl.int32)
            elif PARAM_DTYPE == DT_BF16:
                bits = f32_to_bf16_bits(xn.to(tl.float32))
            else:
                bits = f64_to_f16_bits(xn.to(tl.float64))
                big = tl.abs(xn.to(tl.float32)) > 65504.0
        _store_halfwords(row, A_OFF + h * A_STRIDE, bits, w2, cols, ALIGNED)
        err = flag(_any_col(w2 & big), _ERR_SATURATED)
    return err
