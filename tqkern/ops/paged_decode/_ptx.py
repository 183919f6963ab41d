"""Inline-PTX pieces shared by the decode kernels: the 16-entry centroid lookup by byte permutes
and the magic-number decode of 4-bit integer codes."""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.ops.codecs import KIND_LLOYD_MAX

__all__ = ["_LUT_ASM_LSB", "_LUT_ASM_NIBBLE", "_UNI_ASM_LSB", "_UNI_ASM_NIBBLE", "_prmt_tables"]


# One 32-bit word = 8 codes, decoded by byte permutes.
# Nibble r of a word holds code 8·i + r (lsb) or 8·i + (r ^ 1) (nibble_high_even). Each asm
# returns the word's 8 values as four fp16 pairs in code order (slots 2k, 2k+1 in one register),
# so nothing is unpacked and re-packed on the way to the tensor cores.
#
# Lloyd-Max (16-entry table): the fp16 bits of the 16 centroids are split into eight 4-byte
# tables (low bytes of entries 0-3, 4-7, 8-11, 12-15, then the high bytes). For 4 codes (16 bits
# = 4 nibbles, a prmt selector once bit 3 is masked off) two permutes pick the low bytes from
# entries 0-7 and from 8-15, a third chooses between them byte by byte (selector k + 4·bit3),
# the same for the high bytes, and two more interleave low/high bytes into two fp16 pairs:
# ~11 integer instructions per 4 codes, no memory traffic.
def _lut_asm(nibble: bool) -> str:
    i0, i1 = ("0x4051", "0x6273") if nibble else ("0x5140", "0x7362")
    half = """
and.b32 s, {w}, 0x7777;
shr.u32 b, {w}, 1;
and.b32 b, b, 0x4444;
or.b32 b, b, 0x3210;
prmt.b32 l0, $5, $6, s;
prmt.b32 l1, $7, $8, s;
prmt.b32 h0, $9, $10, s;
prmt.b32 h1, $11, $12, s;
prmt.b32 lo, l0, l1, b;
prmt.b32 hi, h0, h1, b;
prmt.b32 {o0}, lo, hi, {i0};
prmt.b32 {o1}, lo, hi, {i1};
"""
    return ("{\n.reg .b32 w2, s, b, l0, l1, h0, h1, lo, hi;\n"
            + half.format(w="$4", o0="$0", o1="$1", i0=i0, i1=i1)
            + "shr.u32 w2, $4, 16;\n"
            + half.format(w="w2", o0="$2", o1="$3", i0=i0, i1=i1) + "}\n")


# Integer codes (uniform): the two nibbles of byte k are placed in the mantissas of a 1024.0
# pair (one as n, one as 16·n: a byte permute and one mask), then one fp16x2 FMA scales and
# subtracts exactly: 3 instructions per 2 codes.
def _uni_asm(nibble: bool) -> str:
    mask, scale, add = ("0x000F00F0", "0x3C002C00", "0xE400D400") if nibble else \
        ("0x00F0000F", "0x2C003C00", "0xD400E400")
    body = "{\n.reg .b32 x, m, sc, ad;\nmov.b32 m, 0x64006400;\n" + f"mov.b32 sc, {scale};\nmov.b32 ad, {add};\n"
    for k in range(4):
        body += (f"prmt.b32 x, $4, 0, 0x4{k}4{k};\nand.b32 x, x, {mask};\nor.b32 x, x, m;\n"
                 f"fma.rn.f16x2 ${k}, x, sc, ad;\n")
    return body + "}\n"


_LUT_ASM_LSB = tl.constexpr(_lut_asm(False))
_LUT_ASM_NIBBLE = tl.constexpr(_lut_asm(True))
_UNI_ASM_LSB = tl.constexpr(_uni_asm(False))
_UNI_ASM_NIBBLE = tl.constexpr(_uni_asm(True))


@triton.jit
def _byte_table(cen_ptr, FIRST: tl.constexpr, HIGH: tl.constexpr):
    """Bytes (low or high) of the fp16 bits of centroids FIRST..FIRST+3, packed in one int32."""
    e = tl.arange(0, 4)
    bits = tl.load(cen_ptr + FIRST + e).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    if HIGH:
        bits = bits >> 8
    return tl.sum((bits & 255) << (8 * e), axis=0)


@triton.jit
def _prmt_tables(cen_ptr, KIND: tl.constexpr):
    """The eight byte tables of a 16-entry codebook (zeros when KIND is not Lloyd-Max)."""
    if KIND == KIND_LLOYD_MAX:
        return (_byte_table(cen_ptr, 0, False), _byte_table(cen_ptr, 4, False), _byte_table(cen_ptr, 8, False),
                _byte_table(cen_ptr, 12, False), _byte_table(cen_ptr, 0, True), _byte_table(cen_ptr, 4, True),
                _byte_table(cen_ptr, 8, True), _byte_table(cen_ptr, 12, True))
    z = tl.zeros([], tl.int32)
    return z, z, z, z, z, z, z, z
