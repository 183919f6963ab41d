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
    f32_to_f16_sat,
    f32_to_fp8e4m3_bits,
    f64_to_bits,
    f64_to_f16_bits,
    fp8e4m3_bits_to_f32,
    load_packed,
    load_param,
    store_bytes,
    store_packed,
)

__all__ = ["load_tile", "token_factors", "encode_side", "finite_rows", "flag", "tree_search", "half_bounds",
           "symmetric_codes"]

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
def _uniform_codes(y, lo, hi, BITS: tl.constexpr):
    """⌊(y − lo)·(2^b − 1)/(hi − lo) + 1/2⌋ exactly (÷1e-8 instead when the scale is floored),
    float64 ``y`` and ``lo``, ``hi`` broadcastable to it (a tile's ``[BV, 1]``, or per element): an
    estimate (d times the row's float64 ratio: within one of the answer), then two exact float64
    comparisons move it to the right integer. int64, clamped to [0, 2^b − 1]. (Until session 78 the
    estimate was a float32 quotient of num and den, and num = (y − lo)·(2^b − 1) overflows float32
    for bf16 rows from ~2^124: every such code came out 2^b − 1.)"""
    levels: tl.constexpr = (1 << BITS) - 1
    span = hi - lo
    floored = span / levels < 1e-8
    d = y - lo
    num = tl.where(floored, d, d * levels)
    den = tl.where(floored, 1e-8, span)
    q = tl.floor(d * tl.where(floored, 1e8, levels / tl.where(floored, 1.0, span)) + 0.5)
    q = q - ((q - 0.5) * den > num).to(tl.float64) + ((q + 0.5) * den <= num).to(tl.float64)
    return tl.minimum(tl.maximum(q, 0.0), levels).to(tl.int64)


@triton.jit
def _uniform_codes_f32(y, lo, hi, D: tl.constexpr, BITS: tl.constexpr):
    """:func:`_uniform_codes` for float32 ``y [BV, DP]``, ``lo``, ``hi [BV]`` (values exactly
    representable in float32), in float32 and checked. With t = (y − lo)·r, r = fl32((2^b − 1)/(hi − lo))
    (or 1e8 when the scale is floored; from spans of 2^120, t = (y·2^-8 − lo·2^-8)·2^8·r, as
    y − lo may overflow), q = rint(t) by the magic number 1.5·2^23 and g = t − q:
    t is within (2^b − 1)·2^-22 of the exact quotient τ (three float32 roundings), so
    |g| < 1/2 − (2^b − 1)·2^-20 proves ⌊τ + 1/2⌋ = q (and 0 ≤ q ≤ 2^b − 1). A tile where some
    column below D fails the test takes the float64 path (rows that are not written hold zeros:
    g = 0). int32."""
    levels: tl.constexpr = (1 << BITS) - 1
    tol: tl.constexpr = 0.5 - levels * 2.0**-20
    magic: tl.constexpr = 12582912.0  # 1.5·2^23: s = magic + rint(t) for 0 ≤ t < 2^22
    lo64 = lo.to(tl.float64)
    hi64 = hi.to(tl.float64)
    span = hi64 - lo64  # exact: both are float32 values
    floored = span / levels < 1e-8
    # spans from 2^120 (bf16 or float32 rows only): y − lo may overflow float32, so both are scaled
    # by h = 2^-8 first (y·h exactly in the fma; lo·h loses at most 2^-150, far inside the margin)
    big = span >= 2.0**120
    r = (tl.where(floored, 1e8, levels / tl.where(floored, 1.0, span)) * tl.where(big, 256.0, 1.0)).to(tl.float32)
    h = tl.where(big, 2.0**-8, 1.0).to(tl.float32)
    t = tl.fma(y, h[:, None], -(lo * h)[:, None]) * r[:, None]
    s = t + magic
    g = tl.abs(t - (s - magic))
    if y.shape[1] != D:
        g = tl.where((tl.arange(0, y.shape[1]) < D)[None, :], g, 0.0)
    codes = (s.to(tl.int32, bitcast=True) - 0x4B400000)
    if tl.max(tl.max(g, axis=1), axis=0) >= tol:
        codes = _uniform_codes(y.to(tl.float64), lo64[:, None], hi64[:, None], BITS).to(tl.int32)
    return codes


@triton.jit
def _pick2(p, b, base: tl.constexpr, step: tl.constexpr):
    """``b[base + p·step]`` for a bool tensor p and a tuple of scalars b (one select)."""
    return tl.where(p, b[base + step], b[base])


@triton.jit
def _pick4(p0, p1, b, base: tl.constexpr, step: tl.constexpr):
    """``b[base + (2·p0 + p1)·step]`` by a select tree on scalars."""
    return tl.where(p0, _pick2(p1, b, base + 2 * step, step), _pick2(p1, b, base, step))


@triton.jit
def _pick8(p0, p1, p2, b, base: tl.constexpr, step: tl.constexpr):
    return tl.where(p0, _pick4(p1, p2, b, base + 4 * step, step), _pick4(p1, p2, b, base, step))


@triton.jit
def _pick16(p0, p1, p2, p3, b, base: tl.constexpr, step: tl.constexpr):
    return tl.where(p0, _pick8(p1, p2, p3, b, base + 8 * step, step), _pick8(p1, p2, p3, b, base, step))


@triton.jit
def tree_search(y, b, NB: tl.constexpr):
    """Number of the sorted scalars ``b`` (a tuple of ``2^NB − 1``, NB ≤ 5) ≤ y (a tie goes up),
    int32 like ``y``'s shape, by binary search: level l compares y with the scalar half way into
    the range its l decided bits leave, chosen by a select tree on those bits (2^l − 1 selects at
    level l, no memory access per element, so the search keeps ``y``'s register layout)."""
    tl.static_assert(NB <= 5)
    idx = (y != y).to(tl.int32) * 0
    if NB >= 1:
        h0: tl.constexpr = 1 << (NB - 1)
        p0 = y >= b[h0 - 1]
        idx = p0.to(tl.int32) << (NB - 1)
    if NB >= 2:
        h1: tl.constexpr = h0 >> 1
        p1 = y >= _pick2(p0, b, h1 - 1, 2 * h1)
        idx += p1.to(tl.int32) << (NB - 2)
    if NB >= 3:
        h2: tl.constexpr = h0 >> 2
        p2 = y >= _pick4(p0, p1, b, h2 - 1, 2 * h2)
        idx += p2.to(tl.int32) << (NB - 3)
    if NB >= 4:
        h3: tl.constexpr = h0 >> 3
        p3 = y >= _pick8(p0, p1, p2, b, h3 - 1, 2 * h3)
        idx += p3.to(tl.int32) << (NB - 4)
    if NB >= 5:
        h4: tl.constexpr = h0 >> 4
        p4 = y >= _pick16(p0, p1, p2, p3, b, h4 - 1, 2 * h4)
        idx += p4.to(tl.int32)
    return idx


@triton.jit
def _lloyd_max_codes(y, bnd_ptr, BITS: tl.constexpr):
    """Number of the sorted boundaries ``bnd_ptr[0 .. 2^b − 2]`` ≤ y (a tie goes up), int32 like
    ``y``'s shape: the top (up to 5) levels of the binary search by :func:`tree_search` over the
    boundaries they can reach (every ``2^(b − 5)``-th, loaded as scalars), deeper levels gather
    from the table."""
    NB: tl.constexpr = BITS if BITS < 5 else 5
    S: tl.constexpr = 1 << (BITS - NB)
    b = ()
    for k in tl.static_range(1, 1 << NB):
        b = b + (tl.load(bnd_ptr + k * S - 1),)
    idx = tree_search(y, b, NB) << (BITS - NB)
    for lvl in tl.static_range(NB, BITS):
        cand = idx + (1 << (BITS - 1 - lvl))
        idx = tl.where(y >= tl.load(bnd_ptr + cand - 1), cand, idx)
    return idx


@triton.jit
def half_bounds(bnd_ptr, BITS: tl.constexpr):
    """The ``2^(BITS−1) − 1`` positive boundaries of an antisymmetric table (``b[2^(BITS−1) − 1]
    = 0``), as scalars."""
    H0: tl.constexpr = 1 << (BITS - 1)
    b = ()
    for j in tl.static_range(H0 - 1):
        b = b + (tl.load(bnd_ptr + H0 + j),)
    return b


@triton.jit
def symmetric_codes(y, b, BITS: tl.constexpr):
    """Lloyd-Max codes for an antisymmetric boundary table (positive half ``b``, BITS ≤ 5):
    ``idx`` = the positive boundaries ≤ |y| (:func:`tree_search`, one level and
    half the selects fewer than the search of the whole table), then ``2^(BITS−1) + idx`` for
    y ≥ 0 and ``2^(BITS−1) − 1 − idx`` below (both as ``idx`` XOR a constant). It equals the
    search over the whole table but where |y| equals a boundary: a tie, inside the oracle's
    uncertainty window. int32."""
    H0: tl.constexpr = 1 << (BITS - 1)
    idx = tree_search(tl.abs(y), b, BITS - 1)
    return idx ^ tl.where(y >= 0, H0, H0 - 1)


@triton.jit
def _store_halfwords(base, bits, mask, cols, ALIGNED: tl.constexpr):
    """Write 16-bit values ``bits [BV, DP]`` at ``base + 2·col`` (``base [BV]`` byte pointers)."""
    if ALIGNED:
        p16 = base.to(tl.pointer_type(tl.int16))
        tl.store(p16[:, None] + cols[None, :], bits.to(tl.int16), mask=mask)
    else:
        base = base[:, None] + 2 * cols[None, :]
        tl.store(base, (bits & 255).to(tl.uint8), mask=mask)
        tl.store(base + 1, ((bits >> 8) & 255).to(tl.uint8), mask=mask)


@triton.jit
def finite_rows(x):
    """bool [BV]: the row of ``x [BV, DP]`` (float) holds no NaN or ±inf: x − x is 0 for a
    finite x and NaN otherwise, and a sum of zeros is 0 unless one is NaN (in x's own dtype:
    paired half-precision ops on the GPU)."""
    z = tl.sum(x - x, axis=1)
    return z == z


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
def encode_side(x, mu, y, row, h, tok_mask, bnd_ptr, cen_ptr, HAS_MU: tl.constexpr, IN_BF16: tl.constexpr,
                D: tl.constexpr, DP: tl.constexpr, NIBBLE: tl.constexpr, ALIGNED: tl.constexpr, HW_FP8: tl.constexpr,
                S: tl.constexpr, SYM: tl.constexpr = False, ys=1.0, YS: tl.constexpr = False):
    """Encode one side (``S``: its :class:`~tqkern.ops.codecs.SideConsts`) of a tile of vectors
    (one per row; row r is head ``h[r]`` of the token whose cache row starts at ``row[r]``) into
    its fields, written where ``tok_mask [BV]``. Returns the error bits (``SATURATED``), int32.

    ``x [BV, DP]``: the vectors in their input dtype (fp16/bf16), zero outside the vectors that
    are read and beyond head_dim; ``mu`` float32 ``[BV, DP]``: the key offset of each row, zero
    where ``x`` is (used when ``HAS_MU``); ``y`` float32 ``[BV, DP]``: ``(x − μ) @ Π`` (used
    when ``S.ROTATED``). Norms, scales and uniform codes are exact (float64 sums, float32
    estimates checked exactly); codes from ``y`` follow the float32 rotation. ``HW_FP8``: FP8
    bytes by the hardware conversion (round to nearest even, after clamping to ±448: the same
    bytes as :func:`~tqkern.ops.common.f32_to_fp8e4m3_bits`, which the interpreter runs). ``SYM``:
    the side's Lloyd-Max boundary table is antisymmetric (codes of at most 5 bits), searched by
    :func:`symmetric_codes` over its positive half. ``YS``: ``y`` holds the rotated rows times
    ``ys`` (float64 ``[BV]``, powers of two; a Lloyd-Max side divides them out with the norm, so rows
    of any scale, subnormal ones too, find their codes; other kinds divide them out first)."""
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
    BV: tl.constexpr = x.shape[0]
    cols = tl.arange(0, DP)
    dmask = cols < D
    w2 = tok_mask[:, None] & dmask[None, :]
    PB: tl.constexpr = 2 + 2 * PARAM_DTYPE  # bytes of a stored f16 / f32
    if YS and ROTATED and KIND != KIND_LLOYD_MAX:
        y = y * (1.0 / ys).to(tl.float32)[:, None]
    if KIND == KIND_LLOYD_MAX:
        x64 = x.to(tl.float64)
        if HAS_MU:
            x64 = x64 - mu.to(tl.float64)
        n = tl.sqrt(tl.sum(x64 * x64, axis=1))  # float64: the norm bytes equal the oracle's
        if YS:
            n_y = n * ys
        else:
            n_y = n
        inv = tl.where(n > 0, 1.0 / tl.where(n > 0, n_y, 1.0), 0.0).to(tl.float32)
        if SYM:
            idx = symmetric_codes(y * inv[:, None], half_bounds(bnd_ptr, BITS), BITS)
        else:
            idx = _lloyd_max_codes(y * inv[:, None], bnd_ptr, BITS)
        idx = tl.where(dmask[None, :], idx, 0)
        store_packed(row + A_OFF + h * A_STRIDE, idx, tok_mask, BITS, NIBBLE, A_BYTES, BV, DP, ALIGNED)
        if NORM_CORRECTION == NC_STORED:
            c = tl.where(dmask[None, :], tl.load(cen_ptr + idx), 0.0)
            cn = tl.sqrt(tl.sum(c * c, axis=1))
            n = n / tl.where(cn > 0, cn, 1.0)
        store_bytes(row + B_OFF + h * B_STRIDE, f64_to_bits(n, PARAM_DTYPE), PB, tok_mask)
        err = flag(tok_mask & _saturates(n, PARAM_DTYPE), _ERR_SATURATED)
    elif KIND == KIND_UNIFORM:  # asymmetric
        if ROTATED or not HAS_MU:  # y (or x) exactly in float32: float32 codes, checked
            yv = y if ROTATED else x.to(tl.float32)
            lo32 = tl.min(tl.where(dmask[None, :], yv, float("inf")), axis=1)
            hi32 = tl.max(tl.where(dmask[None, :], yv, float("-inf")), axis=1)
            q = _uniform_codes_f32(yv, lo32, hi32, D, BITS)
            lo = lo32.to(tl.float64)
            hi = hi32.to(tl.float64)
        else:  # x − μ: float64 throughout
            y64 = x.to(tl.float64) - mu.to(tl.float64)
            lo = tl.min(tl.where(dmask[None, :], y64, float("inf")), axis=1)
            hi = tl.max(tl.where(dmask[None, :], y64, float("-inf")), axis=1)
            q = _uniform_codes(y64, lo[:, None], hi[:, None], BITS)
        scale = tl.maximum((hi - lo) / ((1 << BITS) - 1), 1e-8)
        q = tl.where(dmask[None, :], q, 0)
        store_packed(row + A_OFF + h * A_STRIDE, q, tok_mask, BITS, NIBBLE, A_BYTES, BV, DP, ALIGNED)
        store_bytes(row + B_OFF + h * B_STRIDE, f64_to_bits(scale, PARAM_DTYPE), PB, tok_mask)
        store_bytes(row + C_OFF + h * C_STRIDE, f64_to_bits(lo, PARAM_DTYPE), PB, tok_mask)
        err = flag(tok_mask & (_saturates(scale, PARAM_DTYPE) | _saturates(lo, PARAM_DTYPE)), _ERR_SATURATED)
    elif KIND == KIND_FP8:  # E4M3
        if ROTATED:
            yv = y
        elif HAS_MU:
            yv = x.to(tl.float32) - mu  # one rounding of the exact x − μ
        else:
            yv = x.to(tl.float32)
        if HW_FP8:
            code = tl.minimum(tl.maximum(yv, -448.0), 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
            code = code.to(tl.uint8, bitcast=True)
        else:
            code = f32_to_fp8e4m3_bits(yv).to(tl.uint8)
        tl.store((row + A_OFF + h * A_STRIDE)[:, None] + cols[None, :], code, mask=w2)
        err = flag(_any_col(w2 & (tl.abs(yv) > 448.0)), _ERR_SATURATED)
    else:  # KIND_RAW: fp16 / bf16
        if HAS_MU:
            xr = x.to(tl.float64) - mu.to(tl.float64)
            bits = f32_to_bf16_bits(xr.to(tl.float32)) if PARAM_DTYPE == DT_BF16 else f64_to_f16_bits(xr)
            big = tl.abs(xr) > (3.3895313892515355e38 if PARAM_DTYPE == DT_BF16 else 65504.0)
        else:
            big = tl.zeros([BV, DP], tl.int32) != 0
            if (PARAM_DTYPE == DT_BF16) == IN_BF16:  # same dtype: copy the bits
                bits = x.to(tl.int16, bitcast=True).to(tl.int32)
            elif PARAM_DTYPE == DT_BF16:
                bits = f32_to_bf16_bits(x.to(tl.float32))
            else:  # bf16 in, fp16 stored: bf16 is exact in float32, so one hardware rounding to fp16
                # (nearest even, subnormals kept) after the clamp gives f64_to_f16_bits's bits
                xf = x.to(tl.float32)
                bits = f32_to_f16_sat(xf).to(tl.int16, bitcast=True).to(tl.int32)
                big = tl.abs(xf) > 65504.0
        _store_halfwords(row + A_OFF + h * A_STRIDE, bits, w2, cols, ALIGNED)
        err = flag(_any_col(w2 & big), _ERR_SATURATED)
    return err
