"""Triton building blocks shared by the kernels (the map from a layout to kernel constexprs is
:mod:`tqkern.ops.codecs`; its names are re-exported here).

Float encodings are done with integer arithmetic on the IEEE bits, so the GPU and the CPU
interpreter (which cannot run bf16 or fp8 arithmetic) produce the same bytes, and so f64 → f16
is one correct rounding (no double rounding through f32). The rules are those of
:mod:`tqkern.numerics`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.layouts import PagedLayout
from tqkern.ops.codecs import (
    DT_BF16,
    DT_F16,
    DT_F32,
    KIND_FP8,
    KIND_LLOYD_MAX,
    KIND_RAW,
    KIND_UNIFORM,
    NC_DECODE,
    NC_NONE,
    NC_STORED,
    SideConsts,
    layout_args,
    layout_consts,
    side_consts,
)

__all__ = [
    # re-exported from tqkern.ops.codecs
    "DT_BF16", "DT_F16", "DT_F32", "KIND_FP8", "KIND_LLOYD_MAX", "KIND_RAW", "KIND_UNIFORM",
    "NC_DECODE", "NC_NONE", "NC_STORED", "SideConsts", "layout_args", "layout_consts", "side_consts",
    # building blocks
    "halfword_aligned", "transform_applies", "_fwht_tile", "pow2_f32", "row_scales", "f64_to_f16_bits",
    "f32_to_bf16_bits", "f32_to_fp8e4m3_bits", "f64_to_bits", "store_bytes", "load_bytes", "bits_to_f32",
    "fp8e4m3_bits_to_f32",
    "store_packed", "load_packed", "load_param",
]


def halfword_aligned(layout: PagedLayout, side: str) -> bool:
    """Whether every head's data field of ``side`` starts at an even byte (16-bit access)."""
    c = side_consts(layout, side)
    return c.A_OFF % 2 == 0 and c.A_STRIDE % 2 == 0 and layout.row_bytes % 2 == 0


# -- the Walsh–Hadamard transform (a signed Sylvester rotation Π = diag(s)·H/√D) ------------------
def transform_applies(signed_sylvester: bool, head_dim: int) -> bool:
    """Whether a rotation can be applied or undone by the in-register Walsh–Hadamard transform
    (``decompress``, the tiled prefill's gather, the decode's q rotation): a signed Sylvester ``Π``
    (``DeviceParams.signed_sylvester``) at a power-of-two ``head_dim``."""
    return signed_sylvester and head_dim & (head_dim - 1) == 0


@triton.jit
def _fwht_tile(y, BT: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr):
    """``H·y`` along the last axis of ``y [BT, D]`` (Sylvester order, unnormalised): stage ``st``
    pairs columns ``2^st`` apart, ``(a, b) → (a + b, a − b)``."""
    for st in tl.static_range(LOG2D):
        y = tl.reshape(y, [BT, D // (2 << st), 2, 1 << st])
        y = tl.permute(y, [0, 1, 3, 2])
        a, b = tl.split(y)
        y = tl.join(a + b, a - b)
        y = tl.permute(y, [0, 1, 3, 2])
        y = tl.reshape(y, [BT, D])
    return y


# -- powers of two -------------------------------------------------------------------------------
@triton.jit
def pow2_f32(k):
    """2^k in float32 for int32 ``k`` in [−126, 127] (exact)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def row_scales(mx):
    """``(sa, sb)``, float32 powers of two whose product 2^k_r takes a row's largest magnitude ``mx``
    (float32 ``[BV]``) into [2^13, 2^14) (k_r = 140 where it is zero or subnormal), in two factors so
    that each is a normal float32 (k_r in [−114, 140])."""
    e = (mx.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent
    k = 140 - tl.minimum(e, 254)
    a = k >> 1
    return pow2_f32(a), pow2_f32(k - a)


# -- float → bits -------------------------------------------------------------------------------
@triton.jit
def f64_to_f16_bits(v):
    """float64 → IEEE half bits (int32, low 16 bits): nearest-even, saturating at ±65504; the sign
    bit is the input's (−0.0 → 0x8000, as NumPy's conversion in the oracle gives)."""
    neg = v.to(tl.int64, bitcast=True) < 0
    a = tl.minimum(tl.abs(v), 65504.0)
    bits = a.to(tl.int64, bitcast=True)
    r = bits + ((1 << 41) - 1) + ((bits >> 42) & 1)
    normal = (((r >> 52) - 1023 + 15) << 10) | ((r >> 42) & 0x3FF)
    magic = 4503599627370496.0  # 2^52: adding it rounds to an integer, ties to even
    sub = ((a * 16777216.0 + magic) - magic).to(tl.int64)
    code = tl.where(a >= 6.103515625e-05, normal, sub)
    code = tl.where(a != a, 0x7E00, code)
    return (code | tl.where(neg, 0x8000, 0)).to(tl.int32)


@triton.jit
def f32_to_f16_sat(v, SIGNED: tl.constexpr = True):
    """float32 → float16 by the hardware's nearest-even rounding after clamping to ±65504 (to 65504
    only where not ``SIGNED``: v ≥ 0): of a float32 value, the bytes :func:`f64_to_f16_bits` gives
    it (one rounding, subnormals kept, the sign of −0.0 kept)."""
    if SIGNED:
        v = tl.maximum(v, -65504.0)
    return tl.minimum(v, 65504.0).to(tl.float16, fp_downcast_rounding="rtne")


@triton.jit
def f32_to_bf16_bits(v):
    """float32 → bfloat16 bits (int32, low 16 bits): nearest-even, saturating at ±(2 − 2^-7)·2^127."""
    c = tl.minimum(tl.maximum(v, -3.3895313892515355e38), 3.3895313892515355e38)
    u = c.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    raw = v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    r = tl.where(v != v, (raw >> 16) | 0x40, r)
    return (r & 0xFFFF).to(tl.int32)


@triton.jit
def f32_to_fp8e4m3_bits(v):
    """float32 → float8_e4m3fn bits (int32, low 8 bits): nearest-even, saturating at ±448; the sign
    bit is the input's (−0.0 → 0x80, as the hardware conversion and the oracle give)."""
    neg = v.to(tl.int32, bitcast=True) < 0
    a = tl.minimum(tl.abs(v), 448.0)
    u = a.to(tl.int32, bitcast=True)
    r = u + 0x7FFFF + ((u >> 20) & 1)
    normal = (r >> 20) - (120 << 3)
    magic = 8388608.0  # 2^23
    sub = ((a * 512.0 + magic) - magic).to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub)
    code = tl.where(v != v, 0x7F, code)
    return code | tl.where(neg, 0x80, 0)


@triton.jit
def f64_to_bits(v, DT: tl.constexpr):
    """float64 → bits of a stored float field (DT: 0 f16, 1 f32), as int64; both saturate."""
    if DT == 0:
        return f64_to_f16_bits(v).to(tl.int64)
    else:
        v = tl.minimum(tl.maximum(v, -3.4028234663852886e38), 3.4028234663852886e38)
        return v.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF


@triton.jit
def store_bytes(ptr, bits, NBYTES: tl.constexpr, mask):
    """Write the low NBYTES bytes of integer ``bits`` little-endian at ``ptr`` (any alignment)."""
    for m in tl.static_range(NBYTES):
        tl.store(ptr + m, ((bits >> (8 * m)) & 255).to(tl.uint8), mask=mask)


@triton.jit
def load_bytes(ptr, NBYTES: tl.constexpr, mask):
    """Read NBYTES little-endian bytes at ``ptr`` into an int64."""
    out = tl.load(ptr, mask=mask, other=0).to(tl.int64)
    for m in tl.static_range(1, NBYTES):
        out |= tl.load(ptr + m, mask=mask, other=0).to(tl.int64) << (8 * m)
    return out


@triton.jit
def bits_to_f32(bits, DT: tl.constexpr):
    """Bits of a stored float field (DT: 0 f16, 1 f32, 2 bf16) → float32 (exact)."""
    if DT == 1:
        return bits.to(tl.int32).to(tl.float32, bitcast=True)
    elif DT == 2:
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def fp8e4m3_bits_to_f32(code):
    """float8_e4m3fn bits (int32) → float32 (exact; 0x7F/0xFF → NaN)."""
    e = (code >> 3) & 15
    m = (code & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    mag = tl.where((code & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((code & 0x80) != 0, -mag, mag)


# -- packed codes -------------------------------------------------------------------------------
@triton.jit
def _word_part(s, J: tl.constexpr, M: tl.constexpr, SB: tl.constexpr, NSUB: tl.constexpr):
    """The bits of sub-group ``J`` (``s``: its SB-bit value, stream bits ``J·SB ..``) that fall in
    32-bit word ``M`` of their 32-code group, in place there; 0 where none do."""
    OFF: tl.constexpr = J * SB - 32 * M
    if J >= NSUB or OFF >= 32 or OFF + SB <= 0:
        return 0
    elif OFF >= 0:
        return s << OFF  # bits past the word's top fall off (they are the next word's)
    else:
        return s >> (-OFF)


@triton.jit
def _store_words(row, codes, mask_t, BITS: tl.constexpr, NBYTES: tl.constexpr, BT: tl.constexpr,
                 DP: tl.constexpr, HALF: tl.constexpr):
    """LSB-first packing of ``codes [BT, DP]`` for BITS in 3, 5, 6, 7 (DP a multiple of 32), in
    int32: each group of 32 codes is BITS 32-bit words. Sub-groups of S codes (S·BITS ≤ 32 bits,
    Σ code_k << BITS·k) are split apart and each word ORs the ≤ 3 sub-groups it overlaps; a word
    is written as two 16-bit stores (``HALF``: the field starts at an even byte and NBYTES is even)
    or four byte stores. Same bytes as 8-code groups in int64."""
    S: tl.constexpr = 8 if BITS * 8 <= 32 else 4
    NSUB: tl.constexpr = 32 // S
    SB: tl.constexpr = S * BITS
    G: tl.constexpr = DP // 32
    sh = tl.arange(0, S) * BITS
    sub = tl.sum(tl.reshape(codes.to(tl.int32), (BT, G, NSUB, S)) << sh[None, None, None, :], axis=3)
    if NSUB == 4:  # sub-group j = 2·i1 + i0 of the [.., 2, 2] view: split the last axis first
        a, b = tl.split(tl.reshape(sub, (BT, G, 2, 2)))
        s0, s2 = tl.split(a)
        s1, s3 = tl.split(b)
        s4 = s0  # (s4 .. s7 unused: NSUB = 4)
        s5 = s0
        s6 = s0
        s7 = s0
    else:  # j = 4·i2 + 2·i1 + i0
        a, b = tl.split(tl.reshape(sub, (BT, G, 2, 2, 2)))
        a0, a1 = tl.split(a)
        b0, b1 = tl.split(b)
        s0, s4 = tl.split(a0)
        s2, s6 = tl.split(a1)
        s1, s5 = tl.split(b0)
        s3, s7 = tl.split(b1)
    gi = tl.arange(0, G)
    for m in tl.static_range(BITS):
        w = (_word_part(s0, 0, m, SB, NSUB) | _word_part(s1, 1, m, SB, NSUB) | _word_part(s2, 2, m, SB, NSUB)
             | _word_part(s3, 3, m, SB, NSUB) | _word_part(s4, 4, m, SB, NSUB) | _word_part(s5, 5, m, SB, NSUB)
             | _word_part(s6, 6, m, SB, NSUB) | _word_part(s7, 7, m, SB, NSUB))
        off = gi * (4 * BITS) + 4 * m  # the word's first byte in the field
        if HALF:
            p16 = row.to(tl.pointer_type(tl.int16))
            for q in tl.static_range(2):
                tl.store(p16[:, None] + (off // 2 + q)[None, :], ((w >> (16 * q)) & 0xFFFF).to(tl.int16),
                         mask=mask_t[:, None] & (off + 2 * q < NBYTES)[None, :])
        else:
            for q in tl.static_range(4):
                tl.store(row[:, None] + (off + q)[None, :], ((w >> (8 * q)) & 255).to(tl.uint8),
                         mask=mask_t[:, None] & (off + q < NBYTES)[None, :])


@triton.jit
def store_packed(row, codes, mask_t, BITS: tl.constexpr, NIBBLE: tl.constexpr, NBYTES: tl.constexpr,
                 BT: tl.constexpr, DP: tl.constexpr, ALIGNED: tl.constexpr = False):
    """Pack ``codes [BT, DP]`` (integers, zero beyond head_dim) and write NBYTES bytes at ``row [BT]``.

    LSB-first: every 8 codes form one ``BITS·8``-bit group g = Σ code_k << (BITS·k), written as
    BITS bytes. Nibble order: byte j = code_2j << 4 | code_2j+1. Bit widths that do not divide a
    byte (3, 5, 6, 7) pack 32 codes into BITS int32 words (:func:`_store_words`; ``ALIGNED``: the
    field starts at an even byte, so words go out as 16-bit stores) where DP ≥ 32; else int32
    groups where they fit (BITS ≤ 4), int64 beyond."""
    if NIBBLE:
        pairs = tl.reshape(codes.to(tl.int32), (BT, DP // 2, 2))
        sh = tl.arange(0, 2)
        byte = tl.sum(pairs << (4 - 4 * sh)[None, None, :], axis=2)
        j = tl.arange(0, DP // 2)
        tl.store(row[:, None] + j[None, :], byte.to(tl.uint8), mask=mask_t[:, None] & (j < NBYTES)[None, :])
    elif 8 % BITS != 0 and DP % 32 == 0:
        _store_words(row, codes, mask_t, BITS, NBYTES, BT, DP, ALIGNED and NBYTES % 2 == 0)
    elif 8 % BITS == 0:  # 1, 2, 4, 8 bits: whole codes per byte, one contiguous byte row
        P: tl.constexpr = 8 // BITS
        per = tl.reshape(codes.to(tl.int32), (BT, DP // P, P))
        sh = tl.arange(0, P) * BITS
        byte = tl.sum(per << sh[None, None, :], axis=2)
        j = tl.arange(0, DP // P)
        tl.store(row[:, None] + j[None, :], byte.to(tl.uint8), mask=mask_t[:, None] & (j < NBYTES)[None, :])
    else:
        WT: tl.constexpr = tl.int32 if BITS <= 4 else tl.int64
        groups = tl.reshape(codes.to(WT), (BT, DP // 8, 8))
        sh = tl.arange(0, 8).to(WT) * BITS
        g = tl.sum(groups << sh[None, None, :], axis=2)
        gi = tl.arange(0, DP // 8)
        for m in tl.static_range(BITS):
            off = gi * BITS + m
            tl.store(row[:, None] + off[None, :], ((g >> (8 * m)) & 255).to(tl.uint8),
                     mask=mask_t[:, None] & (off < NBYTES)[None, :])


@triton.jit
def load_packed(row, mask_t, BITS: tl.constexpr, NIBBLE: tl.constexpr, NBYTES: tl.constexpr,
                DP: tl.constexpr):
    """Read packed codes at ``row [BT]`` → int32 ``[BT, DP]`` (codes beyond the field read 0)."""
    j = tl.arange(0, DP)
    if NIBBLE:
        ok = (j // 2) < NBYTES
        byte = tl.load(row[:, None] + (j // 2)[None, :], mask=mask_t[:, None] & ok[None, :], other=0).to(tl.int32)
        return (byte >> (4 - 4 * (j % 2))[None, :]) & 15
    else:
        first = (j * BITS) // 8
        shift = (j * BITS) % 8
        ok0 = first < NBYTES
        ok1 = (first + 1) < NBYTES
        b0 = tl.load(row[:, None] + first[None, :], mask=mask_t[:, None] & ok0[None, :], other=0).to(tl.int32)
        b1 = tl.load(row[:, None] + (first + 1)[None, :], mask=mask_t[:, None] & ok1[None, :], other=0).to(tl.int32)
        return ((b0 | (b1 << 8)) >> shift[None, :]) & ((1 << BITS) - 1)


@triton.jit
def load_param(ptr, PARAM_DTYPE: tl.constexpr, tmask, ALIGNED: tl.constexpr):
    """One stored float field per token → float32; a single typed load when ``ALIGNED``."""
    PB: tl.constexpr = 4 if PARAM_DTYPE == 1 else 2  # f32: 4 bytes; f16, bf16: 2
    if ALIGNED:
        if PB == 4:
            return tl.load(ptr.to(tl.pointer_type(tl.float32)), mask=tmask, other=0.0)
        bits = tl.load(ptr.to(tl.pointer_type(tl.int16)), mask=tmask, other=0)
        if PARAM_DTYPE == 2:
            return bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
        return bits.to(tl.float16, bitcast=True).to(tl.float32)
    return bits_to_f32(load_bytes(ptr, PB, tmask), PARAM_DTYPE)
