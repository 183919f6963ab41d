"""The warp-MMA decode kernel's pair table in shared memory (:mod:`.mma_kernel`): its declaration,
its fills (pairs of a codebook's fp16 centroids, or single codes, each entry replicated for the 32
lanes so that no two lanes share a bank) and its lookups (a word's 4 bytes, one index, or one
field of a lane's chunk shifted straight into an entry's byte offset). Where
the entries sit (the keys' from ``MmaPlan.K_AT``, value pairs of their own codebook below them):
:mod:`.mma_plans`."""

from __future__ import annotations

import triton
import triton.language as tl

LUT_BYTES = tl.constexpr(32768)  # the pair table: 256 entries × 32 lane replicas × 4 bytes


# Fill: entry b (an fp16 pair) into its 32 lane replicas, 128 contiguous bytes at b·128 (or, for
# the PRMT-addressed table, b·256: the other 128 bytes of each entry unused).
# Thread b writes its 16-byte pieces in the order (k + b) mod 8, so that the 8 threads of a store
# phase (consecutive b) hit 8 different 16-byte bank groups (in order k they would all hit one).
def _fill_asm(stride: int) -> str:
    return ("{\n.reg .b32 a, o, p;\n" + f"mad.lo.u32 a, $2, {stride}, $1;\n"
            + "".join(f"add.u32 o, $2, {k};\nand.b32 o, o, 7;\nmad.lo.u32 p, o, 16, a;\n"
                      "st.shared.v4.b32 [p], {$3, $3, $3, $3};\n" for k in range(8))
            + "mov.b32 $0, $1;\n}")


_FILL_ASM = tl.constexpr(_fill_asm(128))
_FILL256_ASM = tl.constexpr(_fill_asm(256))


_DECLARE_32K = tl.constexpr(".shared .align 16 .b8 tqk_pair_lut[32768];\nmov.u32 $0, tqk_pair_lut;")  # LUT_BYTES
_DECLARE_36K = tl.constexpr(".shared .align 16 .b8 tqk_pair_lut[36864];\nmov.u32 $0, tqk_pair_lut;")  # 288 entries
_DECLARE_40K = tl.constexpr(".shared .align 16 .b8 tqk_pair_lut[40960];\nmov.u32 $0, tqk_pair_lut;")  # 320 entries


@triton.jit
def _lut_declare(t, NBYTES: tl.constexpr = 32768):
    """Declare the CTA's pair table of ``NBYTES`` (32 KB: 256 entries; 36 or 40 KB: 288 or 320,
    see :func:`lut_entries`) exactly once per kernel and return its address."""
    if NBYTES == 40960:
        return tl.inline_asm_elementwise(_DECLARE_40K, "=r,r", [t], dtype=tl.int32, is_pure=False, pack=1)
    elif NBYTES == 36864:
        return tl.inline_asm_elementwise(_DECLARE_36K, "=r,r", [t], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise(_DECLARE_32K, "=r,r", [t], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cen16(ptr):
    """The fp16 bits (low half of an int32) of the float32 centroid at ``ptr``."""
    return tl.load(ptr).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _fill_entry(t, i: tl.constexpr, NT: tl.constexpr, N: tl.constexpr = 256):
    """The entry (0 .. N − 1) thread ``t`` of ``NT`` writes in fill round ``i`` of an ``N``-entry
    table or section (``NT`` and ``N`` powers of two): ``t + i·NT``, or ``t mod N`` where there are
    more threads than entries (a 16-warp CTA's 512 threads over 256 entries, or a small section),
    whose threads then write each entry more than once, with the same value."""
    if NT > N:
        return t % N
    return t + i * NT


@triton.jit
def _lut_fill(base, t, cen_ptr, NT: tl.constexpr, BITS: tl.constexpr, E256: tl.constexpr = False):
    """Entry ``b`` (fp16 pair of c[b & m], c[(b >> BITS) & m], m = 2^BITS − 1: two consecutive
    codes of an LSB bitstream, or the two nibbles of a byte) into all 32 lane replicas (``b·128 +
    4·lane``; ``b·256 + 4·lane`` for the PRMT-addressed table, ``E256``); then a CTA barrier.
    Returns the table address (lookups depend on it). All 256 entries are written (3-bit codes
    use entries 0..63), also by a CTA of more than 256 threads."""
    M: tl.constexpr = (1 << BITS) - 1
    for i in tl.static_range((256 + NT - 1) // NT):
        b = _fill_entry(t, i, NT)
        lo = _cen16(cen_ptr + (b & M))
        hi = _cen16(cen_ptr + ((b >> BITS) & M))
        base = tl.inline_asm_elementwise(_FILL256_ASM if E256 else _FILL_ASM, "=r,r,r,r",
                                         [base, b, lo | (hi << 16)], dtype=tl.int32, is_pure=False, pack=1)
    return tl.inline_asm_elementwise("bar.sync 0;\nmov.b32 $0, $1;", "=r,r", [base], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _lut_fill_k5(base, t, kcen_ptr, vcen_ptr, NT: tl.constexpr, V_LM: tl.constexpr):
    """The table for 5-bit keys: entries ``64 + j`` hold ``(ck[j], ck[j])`` (one key code per
    lookup), entries ``b < 64`` the value pairs ``(cv[b & 7], cv[b >> 3])`` of 3-bit Lloyd-Max
    values (``V_LM``; zeros otherwise: uniform values need no table), in the layout of
    :func:`_lut_fill`; then a CTA barrier."""
    for i in tl.static_range((256 + NT - 1) // NT):  # (_cen16 written out: through it ptxas renames
        b = _fill_entry(t, i, NT)                       # the prologue's registers, and this is the SASS measured)
        kc = tl.load(kcen_ptr + ((b - 64) & 31)).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        if V_LM:
            lo = tl.load(vcen_ptr + (b & 7)).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            hi = tl.load(vcen_ptr + ((b >> 3) & 7)).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            e = tl.where(b < 64, lo | (hi << 16), kc | (kc << 16))
        else:
            e = kc | (kc << 16)
        base = tl.inline_asm_elementwise(_FILL_ASM, "=r,r,r,r", [base, b, e], dtype=tl.int32, is_pure=False, pack=1)
    return tl.inline_asm_elementwise("bar.sync 0;\nmov.b32 $0, $1;", "=r,r", [base], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _lut_fill_at(base, t, cen_ptr, NT: tl.constexpr, BITS: tl.constexpr, AT: tl.constexpr, N: tl.constexpr,
                 SINGLE: tl.constexpr = False):
    """Entries ``AT .. AT + N − 1`` (``N`` a power of two) of the table in :func:`_lut_fill`'s
    layout: entry ``AT + j`` the fp16 pair ``(c[j & m], c[(j >> BITS) & m])`` (``m = 2^BITS − 1``),
    or ``(c[j], c[j])`` (``SINGLE``: one code per lookup). No barrier (:func:`_lut_barrier`): the
    sections of one table are disjoint, so several fills share one. Where ``NT > N`` threads
    write an entry more than once, with the same value (:func:`_fill_entry`)."""
    M: tl.constexpr = (1 << BITS) - 1
    for i in tl.static_range((N + NT - 1) // NT):
        j = _fill_entry(t, i, NT, N)
        lo = _cen16(cen_ptr + (j if SINGLE else j & M))
        hi = lo if SINGLE else _cen16(cen_ptr + ((j >> BITS) & M))
        base = tl.inline_asm_elementwise(_FILL_ASM, "=r,r,r,r", [base, j + AT, lo | (hi << 16)], dtype=tl.int32,
                                         is_pure=False, pack=1)
    return base


@triton.jit
def _lut_barrier(base):
    """A CTA barrier after the table's fills; returns the table address (lookups depend on it)."""
    return tl.inline_asm_elementwise("bar.sync 0;\nmov.b32 $0, $1;", "=r,r", [base], dtype=tl.int32,
                                     is_pure=False, pack=1)


# Lookups of a word's 4 bytes: PRMT (the byte) + IMAD (·128 + this lane's base) + LDS each.
_LUT4_ASM = tl.constexpr(
    "{\n.reg .b32 b0, b1, b2, b3;\n"
    "prmt.b32 b0, $4, 0, 0x4440;\nprmt.b32 b1, $4, 0, 0x4441;\n"
    "prmt.b32 b2, $4, 0, 0x4442;\nprmt.b32 b3, $4, 0, 0x4443;\n"
    "mad.lo.u32 b0, b0, 128, $5;\nmad.lo.u32 b1, b1, 128, $5;\n"
    "mad.lo.u32 b2, b2, 128, $5;\nmad.lo.u32 b3, b3, 128, $5;\n"
    "ld.shared.b32 $0, [b0];\nld.shared.b32 $1, [b1];\nld.shared.b32 $2, [b2];\nld.shared.b32 $3, [b3];\n}")
# The PRMT-addressed table (entries 256 bytes apart at a shared address whose low 16 bits are 0):
# the address of byte k's entry is this lane's base with byte k of the word as its byte 1 — one
# PRMT (bytes: base.0 = 4·lane, w.k, base.2, base.3) instead of a PRMT and an IMAD.
_LUT4_256_ASM = tl.constexpr(
    "{\n.reg .b32 b0, b1, b2, b3;\n"
    "prmt.b32 b0, $4, $5, 0x7604;\nprmt.b32 b1, $4, $5, 0x7614;\n"
    "prmt.b32 b2, $4, $5, 0x7624;\nprmt.b32 b3, $4, $5, 0x7634;\n"
    "ld.shared.b32 $0, [b0];\nld.shared.b32 $1, [b1];\nld.shared.b32 $2, [b2];\nld.shared.b32 $3, [b3];\n}")


@triton.jit
def _lut4(w, lb, E256: tl.constexpr = False):
    """The table entries of the 4 bytes of word ``w`` (``lb``: this lane's table base; ``E256``:
    the PRMT-addressed table)."""
    return tl.inline_asm_elementwise(_LUT4_256_ASM if E256 else _LUT4_ASM, "=r,=r,=r,=r,r,r", [w, lb],
                                     dtype=(tl.int32,) * 4, is_pure=True, pack=1)


@triton.jit
def _funnel(lo, hi, sh):
    """Bits ``sh .. sh + 31`` of the 64-bit ``hi:lo`` (``sh`` in 0..31)."""
    return tl.inline_asm_elementwise("shf.r.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, sh], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _entry_offset(y, POS: tl.constexpr, NB: tl.constexpr, lane4):
    """``f·128 + 4·lane`` for the field ``f`` at bits ``POS .. POS + NB − 1`` of the chunk words
    ``y`` (``NB`` ≤ 10; ``lane4``: ``4·lane``): this lane's byte offset of table entry ``f`` from
    the entries' base. The field is shifted straight to bit 7 (a funnel shift where it straddles
    two words), then masked and ORed with the lane's bytes in one LOP3, so a lookup is SHF + LOP3 +
    LDS where an index and an entry address were SHF + SGXT + IMAD + LDS."""
    W: tl.constexpr = POS // 32
    OFF: tl.constexpr = POS % 32
    if OFF > 32 - NB:
        v = _funnel(y[W], y[W + 1], tl.zeros_like(y[W]) + (OFF - 7))
    elif OFF >= 7:
        v = y[W] >> (OFF - 7)  # (arithmetic: the sign's copies land above the mask)
    else:
        v = y[W] << (7 - OFF)
    return (v & (((1 << NB) - 1) << 7)) | lane4


@triton.jit
def _lut_at(off, base):
    """The table entry at byte offset ``off`` (:func:`_entry_offset`) from the entries' base
    ``base`` (a shared address ptxas knows: it becomes the load's immediate)."""
    return tl.inline_asm_elementwise("{\n.reg .b32 a;\nadd.u32 a, $1, $2;\nld.shared.b32 $0, [a];\n}",
                                     "=r,r,r", [off, base], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _lut_pair_at(off0, off1, base):
    """The fp16 pair (low half of entry ``off0``, high half of entry ``off1``) of two single-code
    entries (:func:`_lut_at`): two loads and one PRMT."""
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 a, b, x, y;\nadd.u32 a, $1, $3;\nadd.u32 b, $2, $3;\n"
        "ld.shared.b32 x, [a];\nld.shared.b32 y, [b];\nprmt.b32 $0, x, y, 0x7610;\n}",
        "=r,r,r,r", [off0, off1, base], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _lut1(idx, lb):
    """The table entry ``idx`` (``lb``: this lane's table base)."""
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 a;\nmad.lo.u32 a, $1, 128, $2;\nld.shared.b32 $0, [a];\n}",
        "=r,r,r", [idx, lb], dtype=tl.int32, is_pure=True, pack=1)
