"""Warp-level tensor-core paged decode: 4-, 3- or 5-bit Lloyd-Max or FP8 keys, 4- or 3-bit values.

Every tensor in this kernel holds one value per thread (shape ``[32·WARPS]``), and the inner
loop is inline PTX, so each value is produced in the register where ``mma.sync.m16n8k16``
reads it: nothing goes through shared memory on its way to the tensor cores.

One warp owns one (sequence, KV head, split) and walks its tokens 16 at a time:

* With Lloyd-Max values (``SUB = 2``) one loop iteration takes two 16-token steps under one
  softmax update (one running max over both, one rescale of the output accumulators), the
  register ring holding both steps' data.
* ``S^T = K·Q^T``: the 16 tokens are the MMA's M rows, the G ≤ 8 query heads of the GQA group
  its N columns. Lane ``l`` (``r = l // 4``, ``c = l % 4``) supplies tokens ``r`` and ``r + 8``.
  A fixed permutation of the (rotated) coordinates, applied to q and K alike, leaves every score
  unchanged; the kernel picks the one in which lane ``c`` needs one contiguous chunk of ``D/8``
  bytes of each of its tokens: chunk byte ``j`` gives the fp16 pair of k-tile ``j // 2``.
* Codes become fp16 through a 256-entry table of pairs (``c[low nibble], c[high nibble]``) in
  shared memory, replicated per lane so that no two lanes share a bank: per byte one PRMT, one
  IMAD and one LDS.
* ``O^T = V^T·P^T``: 16 coordinates per M tile; lane ``(r, c)`` supplies ``D/16`` coordinates
  (one chunk of ``D/16`` bytes) of tokens ``2c, 2c+1, 2c+8, 2c+9``. The K dimension of this MMA
  is the tokens, so the nibbles of two tokens' bytes are merged into one byte before the lookup
  (a token pair per coordinate); ``P^T`` moves from the score accumulator to the B operand by
  two ``movmatrix.trans``. Uniform codes skip the table: the code lands in an fp16's mantissa
  as a subnormal ``j·2^-24`` (or ``16j·2^-24`` for the high nibble) and the power of two comes
  back at the end.
* Per-token factors (norm, gain, uniform scale) multiply the scores and P^T; zero points add
  ``Σ p·z`` per head. P^T is scaled by the running maximum of the value factors so that fp16 P
  keeps its precision (the output is rescaled when that maximum grows, as for the softmax max).
* vLLM's decode-time norm correction: ``‖c[idx]‖²`` per token by a second MMA against ones.
* FP8 E4M3 keys: two bytes are one fp16 pair by ``cvt.rn.f16x2.e4m3x2``; lane ``c`` reads words
  ``NW·(4j + c) ..`` of the field (word ``i`` of its chunk = k-tile ``i``), no key factor, and
  with uniform values no table at all.
* 3-bit keys (LSB bitstream): two consecutive codes are a 6-bit field, looked up in a 64-entry
  pair table; lane ``c`` owns codes ``c·D/4 ..``, loaded as whole words from the word boundary
  below its chunk and funnel-shifted into place (no joining lanes). 5-bit keys: the same order,
  one lookup per code in 32 single entries (table entries 64..95), two joined by one LOP3.
* 3-bit values: lane ``r`` owns codes ``r·D/8 ..``; M tile ``i`` takes codes ``2i``, ``2i + 1``.
  Uniform: PRMT + AND per token pair into subnormals ``code·2^(3k mod 8 - 24)``; Lloyd-Max (next
  to 5-bit keys): token-pair entries 0..63 of the value codebook.
* Shifted words (``K_FUN`` / ``V_FUN``): a chunk not at a fixed offset from aligned blocks is
  read as the words that hold it and funnel-shifted; in blocks of an even number of rows a
  row's offset from a word boundary follows the token's parity, so rows of 2 mod 4 bytes work.

A field that is not aligned to the chunk size (vLLM's 134-byte slots) is read as aligned
blocks: lanes take blocks ``1 .. 3`` (``1 .. 7`` for values) of the field's aligned span, and
the last lane joins block 0's tail with block 4's (8's) head byte by byte; the coordinate
permutation accounts for it.

Cooperative stages (``COOP`` stages, :func:`coop_plan`): one CTA per (sequence, split), one warp
per KV head; the CTA copies each step's 16 whole rows (one contiguous range of a block) into a
ring of shared-memory stages with ``cp.async`` and the head-warps issue the same reads against the
stage (``_load_step(..., SMEM=True)``), so the partials are bit-identical to the per-warp kernel's.

Partials (unnormalised acc, base-2 max, sum) go to the workspace of
:func:`tqkern.ops.paged_decode.triton._merge_kernel`, which merges splits and rotates back.
GPU only (inline PTX); the CPU interpreter runs the general kernel instead.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tqkern.layouts import FP8, LloydMax, PagedLayout, Uniform
from tqkern.ops.common import layout_consts, load_param

__all__ = ["_paged_decode_mma_kernel", "_launch_paged_decode_mma", "DynamicSmemUnsupported", "coop_plan",
           "coop_row_stride", "coop_smem_bytes", "device_plan", "disable_cooperative_stages", "mma_plan",
           "num_splits_mma", "per_warp_plan", "resident_warps", "table256_plan"]

_DT = {"float16": 0, "float32": 1, "bfloat16": 2}
LUT_BYTES = tl.constexpr(32768)  # the pair table: 256 entries × 32 lane replicas × 4 bytes
_NBYTES = {0: 2, 1: 4, 2: 2}


# -- inline PTX helpers (each call is one value per thread) -----------------------------------
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
# Uniform codes, byte k of two words a, b: PRMT gathers [a.k, a.k, b.k, b.k]; the masks keep the
# low nibbles (the fp16 pair's mantissas: subnormals j·2^-24) or the high ones (16j·2^-24).
_UNI_ASM = tl.constexpr(
    "{\n.reg .b32 x;\n"
    + "".join(f"prmt.b32 x, $8, $9, 0x{4 + k}{4 + k}{k}{k};\nand.b32 ${k}, x, 0x000F000F;\n"
              f"and.b32 ${4 + k}, x, 0x00F000F0;\n" for k in range(4))
    + "}")


@triton.jit
def _lut_declare(t):
    """Declare the CTA's 32 KB pair table (exactly once per kernel) and return its address."""
    return tl.inline_asm_elementwise(
        ".shared .align 16 .b8 tqk_pair_lut[32768];\nmov.u32 $0, tqk_pair_lut;",  # LUT_BYTES
        "=r,r", [t], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cen16(ptr):
    """The fp16 bits (low half of an int32) of the float32 centroid at ``ptr``."""
    return tl.load(ptr).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _lut_fill(base, t, cen_ptr, NT: tl.constexpr, BITS: tl.constexpr, E256: tl.constexpr = False):
    """Entry ``b`` (fp16 pair of c[b & m], c[(b >> BITS) & m], m = 2^BITS − 1: two consecutive
    codes of an LSB bitstream, or the two nibbles of a byte) into all 32 lane replicas (``b·128 +
    4·lane``; ``b·256 + 4·lane`` for the PRMT-addressed table, ``E256``); then a CTA barrier.
    Returns the table address (lookups depend on it). All 256 entries are written (3-bit codes
    use entries 0..63)."""
    M: tl.constexpr = (1 << BITS) - 1
    for i in tl.static_range(256 // NT):
        b = t + i * NT
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
    for i in tl.static_range(256 // NT):  # (_cen16 written out: through it ptxas renames the
        b = t + i * NT                       # prologue's registers, and this is the SASS measured)
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
def _lut1(idx, lb):
    """The table entry ``idx`` (``lb``: this lane's table base)."""
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 a;\nmad.lo.u32 a, $1, 128, $2;\nld.shared.b32 $0, [a];\n}",
        "=r,r,r", [idx, lb], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _funnel(lo, hi, sh):
    """Bits ``sh .. sh + 31`` of the 64-bit ``hi:lo`` (``sh`` in 0..31)."""
    return tl.inline_asm_elementwise("shf.r.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, sh], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _bits_at(y, POS: tl.constexpr, NB: tl.constexpr):
    """Bits ``POS .. POS + NB - 1`` of the chunk words ``y`` (``NB`` ≤ 8), as an integer."""
    W: tl.constexpr = POS // 32
    OFF: tl.constexpr = POS % 32
    if OFF <= 32 - NB:
        v = y[W] >> OFF
    else:
        v = _funnel(y[W], y[W + 1], tl.zeros_like(y[W]) + OFF)
    return v & ((1 << NB) - 1)


@triton.jit
def _k5_pair(y, p: tl.constexpr, lbk):
    """fp16 pair of key codes ``2p``, ``2p + 1`` (5 bits each, chunk bits ``10p ..``): one lookup
    each in the key entries (``lbk``: this lane's base of entry 64) and one LOP3."""
    e0 = _lut1(_bits_at(y, 10 * p, 5), lbk)
    e1 = _lut1(_bits_at(y, 10 * p + 5, 5), lbk)
    return (e0 & 0xFFFF) | (e1 & -65536)


@triton.jit
def _v3_index(xa, xb, k: tl.constexpr):
    """Pair-table index ``code_a | code_b << 3`` of 3-bit code ``k`` of two tokens (``xa``, ``xb``
    from :func:`_v3_words`: bytes 0..3 and 2..5 of each chunk)."""
    S: tl.constexpr = (3 * k + 2) > 31  # the code's bits beyond word 0: take the word of bytes 2..5
    OFF: tl.constexpr = 3 * k - 16 * S
    return ((xa[S] >> OFF) & 7) | (((xb[S] >> OFF) & 7) << 3)


@triton.jit
def _uni4(wa, wb):
    """Uniform codes of byte k of two tokens' words as subnormal fp16 token pairs: the low
    nibbles (j·2^-24) and the high nibbles (16j·2^-24), 4 each. (The tensor cores multiply fp16
    subnormals exactly; the GPU property tests cover it.)"""
    return tl.inline_asm_elementwise(_UNI_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [wa, wb], dtype=(tl.int32,) * 8,
                                     is_pure=True, pack=1)


@triton.jit
def _uni3(xa, xb, k: tl.constexpr):
    """3-bit uniform code ``k`` (chunk bits ``3k ..``) of two tokens as an fp16 pair of subnormals
    ``code·2^(P-24)``, ``P = 3k mod 8`` (the output scales that back): one PRMT takes the 16-bit
    window at the code's byte from each token (``xa``, ``xb``: the chunk's words as bytes 0..3 and
    2..5) and one AND keeps the code's bits. (PRMT's selector and the mask are constants.)"""
    W: tl.constexpr = (3 * k) // 8
    P: tl.constexpr = (3 * k) % 8
    S: tl.constexpr = (W + (P > 5)) > 3  # the window's last byte beyond byte 3: the word of bytes 2..5
    O: tl.constexpr = W - 2 * S
    O2: tl.constexpr = O + (O < 3)
    SEL: tl.constexpr = O | (O2 << 4) | ((O + 4) << 8) | ((O2 + 4) << 12)
    MASK: tl.constexpr = (7 << P) | (7 << (16 + P))
    z = tl.zeros_like(xa[0])
    return tl.inline_asm_elementwise("{\nprmt.b32 $0, $1, $2, $3;\nand.b32 $0, $0, $4;\n}", "=r,r,r,r,r",
                                     [xa[S], xb[S], z + SEL, z + MASK], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _v3_words(x, NB: tl.constexpr):
    """A token's 3-bit value chunk (``NB`` bytes, aligned words ``x``) as the words of bytes 0..3
    and (NB > 4) 2..5."""
    if NB > 4:
        return x[0], _funnel(x[0], x[1], tl.zeros_like(x[0]) + 16)
    else:
        return (x[0],)


@triton.jit
def _nibble_merge(wa, wb):
    """Two tokens' words → (low nibbles of a | low nibbles of b << 4, high nibbles likewise)."""
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 x;\nshl.b32 x, $3, 4;\nand.b32 x, x, 0xF0F0F0F0;\nand.b32 $0, $2, 0x0F0F0F0F;\n"
        "or.b32 $0, $0, x;\nshr.u32 x, $2, 4;\nand.b32 x, x, 0x0F0F0F0F;\nand.b32 $1, $3, 0xF0F0F0F0;\n"
        "or.b32 $1, $1, x;\n}",
        "=r,=r,r,r", [wa, wb], dtype=(tl.int32,) * 2, is_pure=True, pack=1)


@triton.jit
def _fp8_pairs(w):
    """Four FP8 E4M3 bytes → two fp16 pairs (bytes 0, 1 → the low register; the low byte of each
    pair → the low half). Exact: every E4M3 value is an fp16 value."""
    return tl.inline_asm_elementwise(
        "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\ncvt.rn.f16x2.e4m3x2 $0, lo;\ncvt.rn.f16x2.e4m3x2 $1, hi;\n}",
        "=r,=r,r", [w], dtype=(tl.int32,) * 2, is_pure=True, pack=1)


@triton.jit
def _mma(c, a0, a1, a2, a3, b0, b1):
    """``c += A·B`` for one m16n8k16 tile (fp16 operands, fp32 accumulators ``c`` (4-tuple))."""
    return tl.inline_asm_elementwise(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
        "{$10,$11,$12,$13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c[0], c[1], c[2], c[3]],
        dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def _sq(x):
    return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _pack2(lo, hi):
    """Two float32 → one fp16x2 register (round to nearest)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _p_fragments(p0, p1, p2, p3):
    """Score-accumulator layout (tokens r / r+8, heads 2c, 2c+1) → the B operand of O^T = V^T·P^T
    (tokens 2c, 2c+1 / 2c+8, 2c+9, head r), fp16."""
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 x0, x1;\ncvt.rn.f16x2.f32 x0, $3, $2;\ncvt.rn.f16x2.f32 x1, $5, $4;\n"
        "movmatrix.sync.aligned.m8n8.trans.b16 $0, x0;\nmovmatrix.sync.aligned.m8n8.trans.b16 $1, x1;\n}",
        "=r,=r,f,f,f,f", [p0, p1, p2, p3], dtype=(tl.int32,) * 2, is_pure=True, pack=1)


@triton.jit
def _warp_max_r(x):
    """Max over the 8 lanes that share ``l % 4`` (xor 4, 8, 16)."""
    return tl.inline_asm_elementwise(
        "{\n.reg .f32 y;\nshfl.sync.bfly.b32 y, $1, 4, 0x1f, -1;\nmax.f32 $0, $1, y;\n"
        "shfl.sync.bfly.b32 y, $0, 8, 0x1f, -1;\nmax.f32 $0, $0, y;\n"
        "shfl.sync.bfly.b32 y, $0, 16, 0x1f, -1;\nmax.f32 $0, $0, y;\n}",
        "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _warp_sum_r(x):
    """Sum over the 8 lanes that share ``l % 4``."""
    return tl.inline_asm_elementwise(
        "{\n.reg .f32 y;\nshfl.sync.bfly.b32 y, $1, 4, 0x1f, -1;\nadd.f32 $0, $1, y;\n"
        "shfl.sync.bfly.b32 y, $0, 8, 0x1f, -1;\nadd.f32 $0, $0, y;\n"
        "shfl.sync.bfly.b32 y, $0, 16, 0x1f, -1;\nadd.f32 $0, $0, y;\n}",
        "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


def _ld_asm(nw: int, hint: str, space: str = "global.nc", typ: str = "b32") -> str:
    regs = ", ".join(f"${i}" for i in range(nw))
    vec = {4: ".v4", 2: ".v2", 1: ""}[nw]
    dst = f"{{{regs}}}" if nw > 1 else regs
    return ("{\n.reg .pred p;\n" + f"setp.ne.b32 p, ${nw + 1}, 0;\n"
            + "".join(f"mov.b32 ${i}, 0;\n" for i in range(nw))
            + f"@p ld.{space}{hint}{vec}.{typ} {dst}, [${nw}];\n}}")


# Loads of 1, 2 or 4 words, plain or with an L2 prefetch hint of 256 bytes. (Adding
# L1::no_allocate measured 1-29% slower on the H100 for every format: docs/performance.md §23.)
_LD_ASM = {(nw, h): tl.constexpr(_ld_asm(nw, ".L2::256B" if h else "")) for nw in (1, 2, 4) for h in (0, 1)}
_LD1, _LD2, _LD4 = _LD_ASM[1, 0], _LD_ASM[2, 0], _LD_ASM[4, 0]
_LD1H, _LD2H, _LD4H = _LD_ASM[1, 1], _LD_ASM[2, 1], _LD_ASM[4, 1]


# The same from shared memory (the CTA-cooperative stages), and one 16-bit word zero-extended.
_LDS_ASM = {nw: tl.constexpr(_ld_asm(nw, "", "shared")) for nw in (1, 2, 4)}
_LDS1, _LDS2, _LDS4 = _LDS_ASM[1], _LDS_ASM[2], _LDS_ASM[4]
_LDS16 = tl.constexpr(_ld_asm(1, "", "shared", "u16"))


@triton.jit
def _lds_words(addr, pred, NW: tl.constexpr):
    """NW (1, 2, 4) consecutive 32-bit words at shared address ``addr`` (aligned to 4·NW); zeros
    where ``pred`` is false."""
    p = pred.to(tl.int32)
    if NW == 4:
        return tl.inline_asm_elementwise(_LDS4, "=r,=r,=r,=r,r,r", [addr, p], dtype=(tl.int32,) * 4, is_pure=True,
                                         pack=1)
    elif NW == 2:
        return tl.inline_asm_elementwise(_LDS2, "=r,=r,r,r", [addr, p], dtype=(tl.int32,) * 2, is_pure=True, pack=1)
    else:
        w = tl.inline_asm_elementwise(_LDS1, "=r,r,r", [addr, p], dtype=tl.int32, is_pure=True, pack=1)
        return (w,)


@triton.jit
def _lds_param(addr, PARAM_DTYPE: tl.constexpr, pred):
    """One stored float field (aligned to its size) at shared address ``addr`` → float32; 0 where
    ``pred`` is false."""
    if PARAM_DTYPE == 1:
        return _lds_words(addr, pred, 1)[0].to(tl.float32, bitcast=True)
    bits = tl.inline_asm_elementwise(_LDS16, "=r,r,r", [addr, pred.to(tl.int32)], dtype=tl.int32, is_pure=True,
                                     pack=1).to(tl.int16)
    if PARAM_DTYPE == 2:
        return bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _ld_words(ptr, pred, NW: tl.constexpr, HINT: tl.constexpr, SMEM: tl.constexpr = False):
    """NW (1, 2, 4) consecutive 32-bit words at ``ptr`` (aligned to 4·NW) through the read-only
    path (``SMEM``: at the shared address ``ptr``); zeros where ``pred`` is false."""
    if SMEM:
        res = _lds_words(ptr, pred, NW)
    elif NW == 4:
        res = tl.inline_asm_elementwise(_LD4H if HINT else _LD4, "=r,=r,=r,=r,l,r", [ptr, pred.to(tl.int32)],
                                        dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    elif NW == 2:
        res = tl.inline_asm_elementwise(_LD2H if HINT else _LD2, "=r,=r,l,r", [ptr, pred.to(tl.int32)],
                                        dtype=(tl.int32,) * 2, is_pure=True, pack=1)
    else:
        res = (tl.inline_asm_elementwise(_LD1H if HINT else _LD1, "=r,l,r", [ptr, pred.to(tl.int32)], dtype=tl.int32,
                                         is_pure=True, pack=1),)
    return res


@triton.jit
def _byte_masks(nbytes, NW: tl.constexpr):
    """Per word, 0xFF in every byte whose index (4·word + byte) is below ``nbytes``."""
    res = ()
    for i in tl.static_range(NW):
        m = tl.zeros_like(nbytes)
        for b in tl.static_range(4):
            if b == 3:
                m = m | tl.where(4 * i + b < nbytes, -16777216, 0)  # 0xFF000000 as int32
            else:
                m = m | tl.where(4 * i + b < nbytes, 0xFF << (8 * b), 0)
        res = res + (m,)
    return res


@triton.jit
def _merge_words(prim, sec, masks, NW: tl.constexpr):
    res = ()
    for i in tl.static_range(NW):
        res = res + ((sec[i] & masks[i]) | (prim[i] & ~masks[i]),)
    return res


@triton.jit
def _chunk(rowp, base_off, idx, CHUNK: tl.constexpr, mask_words, pred, pred_sec, NW: tl.constexpr,
           MERGE: tl.constexpr, NLANES: tl.constexpr, HINT: tl.constexpr, SMEM: tl.constexpr = False):
    """This lane's chunk of a field: aligned block ``idx`` (block 0 joined with block NLANES
    byte-wise when ``MERGE``)."""
    prim = _ld_words(rowp + base_off + CHUNK * idx, pred, NW, HINT, SMEM)
    if MERGE:
        sec = _ld_words(rowp + base_off + CHUNK * NLANES, pred_sec, NW, HINT, SMEM)
        return _merge_words(prim, sec, mask_words, NW)
    return prim


@triton.jit
def _fp8_chunk(fieldp, c, pred, NKW: tl.constexpr, NW: tl.constexpr, HINT: tl.constexpr, SMEM: tl.constexpr = False):
    """This lane's ``NKW`` words of an FP8 key field, ``NW`` consecutive words per load: load
    ``j`` reads field words ``NW·(4j + c) ..`` (the 4 lanes of a token read one contiguous run)."""
    res = ()
    for j in tl.static_range(NKW // NW):
        res = res + _ld_words(fieldp + 4 * NW * (4 * j + c), pred, NW, HINT, SMEM)
    return res


@triton.jit
def _ld_span(ptr, mis, ok, NB: tl.constexpr, HINT: tl.constexpr, SMEM: tl.constexpr = False):
    """The words at ``ptr`` (4-byte aligned) that hold bytes ``mis .. mis + NB - 1`` (``mis`` in
    0..3): ``NB // 4 + 1`` single-word loads, each predicated on holding one of those bytes (so
    nothing past them is read); zeros elsewhere. :func:`_shifted` aligns them."""
    res = ()
    for i in tl.static_range((NB + 3) // 4 + 1):
        res = res + _ld_words(ptr + 4 * i, ok & (4 * i < mis + NB), 1, HINT, SMEM)
    return res


@triton.jit
def _shifted(w, sh, N: tl.constexpr):
    """``N`` words of the byte stream ``w`` (from :func:`_ld_span`) starting ``sh`` bits in."""
    res = ()
    for i in tl.static_range(N):
        res = res + (_funnel(w[i], w[i + 1], sh),)
    return res


@triton.jit
def _row_of(cache_ptr, bt_row, pos, end, BS: tl.constexpr, ROW_BYTES: tl.constexpr, ok):
    """Address of token ``pos`` of a sequence; past ``end - 1``, row ``pos % BS`` of the block of
    token ``end - 1`` (a row of the same parity as ``pos``, so that the shifted reads' per-lane
    word offsets still hold; its data is masked off)."""
    p = tl.maximum(tl.minimum(pos, end - 1), 0)
    blk = tl.load(bt_row + p // BS, mask=ok, other=0).to(tl.int64)
    return cache_ptr + (blk * BS + pos % BS) * ROW_BYTES


@triton.jit
def _step_block(bt_row, t0, end, BS: tl.constexpr):
    """The block-table entry of the step at ``t0`` (blocks of at least 16 tokens hold a whole
    step); 0 past the range."""
    if BS >= 16:
        return tl.load(bt_row + tl.maximum(tl.minimum(t0, end - 1), 0) // BS, mask=t0 < end, other=0).to(tl.int64)
    return tl.zeros_like(t0).to(tl.int64)


# -- CTA-cooperative stages (COOP > 0): the CTA copies each step's 16 whole rows -------------------
_CP16_ASM = tl.constexpr("{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n@p cp.async.cg.shared.global [$1], [$2], 16;\n"
                         "mov.b32 $0, $1;\n}")
_WAIT_ASM = {n: tl.constexpr(f"cp.async.wait_group {n};\nbar.sync 0;\nmov.b32 $0, $1;") for n in range(7)}
_WAIT0, _WAIT1, _WAIT2, _WAIT3, _WAIT4, _WAIT5, _WAIT6 = (_WAIT_ASM[n] for n in range(7))


@triton.jit
def _smem_base(t):
    """Address of the kernel's dynamic shared memory (Triton's ``global_smem``; the launcher sizes it)."""
    return tl.inline_asm_elementwise("mov.u32 $0, global_smem;", "=r,r", [t], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _coop_issue(cache_ptr, blks, t0, end, dst, cp_s, t, NT: tl.constexpr, BS: tl.constexpr,
                ROW_BYTES: tl.constexpr, RS: tl.constexpr, SUB: tl.constexpr):
    """The CTA's copies of the ``SUB`` 16-row steps at ``t0`` (blocks ``blks``) into the stage at
    shared address ``dst`` (row ``j`` at ``dst + j·RS``): 16-byte ``cp.async`` chunk ``i = t + k·NT``
    of the step's ``16·ROW_BYTES`` contiguous bytes goes to ``cp_s[k]``; steps at or past ``end``
    copy nothing. Then one commit group per thread."""
    NCP: tl.constexpr = (ROW_BYTES + NT - 1) // NT
    for u in tl.static_range(SUB):
        tu = t0 + 16 * u
        src = cache_ptr + (blks[u] * BS + tu % BS) * ROW_BYTES
        on = tu < end
        for k in tl.static_range(NCP):
            i = t + k * NT
            tl.inline_asm_elementwise(_CP16_ASM, "=r,r,l,r", [dst + (16 * u * RS) + cp_s[k], src + 16 * i,
                                                              (on & (i < ROW_BYTES)).to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
    return tl.inline_asm_elementwise("cp.async.commit_group;\nmov.b32 $0, $1;", "=r,r", [dst], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _coop_wait(stage, N: tl.constexpr):
    """Wait until at most ``N`` of this thread's copy groups are pending, then a CTA barrier (every
    thread's copies of the stage have landed; every warp is done with the stage it read before);
    returns ``stage`` (the stage's reads depend on it)."""
    return tl.inline_asm_elementwise(
        _WAIT0 if N == 0 else _WAIT1 if N == 1 else _WAIT2 if N == 2 else _WAIT3 if N == 3 else _WAIT4 if N == 4
        else _WAIT5 if N == 5 else _WAIT6, "=r,r", [stage], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _stage(stages, lut, j, STG: tl.constexpr, NBELOW: tl.constexpr):
    """Shared address of stage ``j``: ``stages + j·STG`` (``NBELOW < 0``: one contiguous ring);
    with the PRMT-addressed table, stages ``0 .. NBELOW - 1`` from ``stages`` (below the table) and
    the others from the end of the table's 64 KB."""
    if NBELOW < 0:
        return stages + j * STG
    if NBELOW == 0:
        return lut + 65536 + j * STG
    return tl.where(j < NBELOW, stages + j * STG, lut + 65536 + (j - NBELOW) * STG)


@triton.jit
def _step_blocks(bt_row, t0, end, BS: tl.constexpr, SUB: tl.constexpr):
    """The block-table entries of the ``SUB`` 16-token steps at ``t0``."""
    res = ()
    for u in tl.static_range(SUB):
        res = res + (_step_block(bt_row, t0 + 16 * u, end, BS),)
    return res


@triton.jit
def _param(ptr, PARAM_DTYPE: tl.constexpr, pred, SMEM: tl.constexpr):
    """One aligned per-token factor: from global memory, or (``SMEM``) from the shared address ``ptr``."""
    if SMEM:
        res = _lds_param(ptr, PARAM_DTYPE, pred)
    else:
        res = load_param(ptr, PARAM_DTYPE, pred, True)
    return res


@triton.jit
def _load_step(cache_ptr, bt_row, blk, t0, end, r, c, geo, BS: tl.constexpr, ROW_BYTES: tl.constexpr,
               CK: tl.constexpr, CV: tl.constexpr, K_MERGE: tl.constexpr, V_MERGE: tl.constexpr,
               K_DT: tl.constexpr, V_DT: tl.constexpr, V_UNIFORM: tl.constexpr, HINT: tl.constexpr,
               K_FP8: tl.constexpr, K_NW: tl.constexpr, K_BITS: tl.constexpr, K_FUN: tl.constexpr,
               V_FUN: tl.constexpr, SMEM: tl.constexpr = False, RS: tl.constexpr = 0, PART: tl.constexpr = 0):
    """Everything one 16-token step reads (predicated off past the warp's range; from a stage,
    unpredicated: see ``SMEM``); ``blk`` is
    the step's block (:func:`_step_block`, looked up a step earlier) when ``BS >= 16``. FP8 keys
    (``K_FP8``) are read word-wise from their own offset ``ka0`` and have no factor (1); 3-bit keys
    as ``NKW`` words from this lane's aligned offset ``ka0``. Shifted chunks (``K_FUN``,
    ``V_FUN``: ``CK`` / ``CV`` bytes ``k_mis`` / ``v_mis_*`` bytes past the aligned offsets
    ``ka0`` / ``va0`` (even tokens), ``va1`` (odd tokens)) as the words that hold them. ``geo``:
    this lane's field geometry, fixed for the warp (built once in the kernel's prologue). ``SMEM``:
    the step's 16 rows are in a shared-memory stage at address ``blk``, ``RS`` bytes apart (the
    CTA-cooperative kernel); the same reads from there, without predicates (the kernel's loop runs
    no step past the CTA's range, which all its warps share). ``PART``: 0 everything, 1 the keys and
    factors only (the values come back as ``()``), 2 the values only (the cooperative kernel reads
    them from the stage after the softmax update, so that they do not hold registers across the
    scores)."""
    ka0, va0, va1, kb_off, vb_off, vc_off, k_masks, v_masks, k_sec_on, v_sec_on, k_mis, v_mis_e, v_mis_o = geo
    if SMEM:  # a cooperative CTA's warps share one range and its loop runs no step past it: unpredicated reads
        ok = tl.zeros_like(t0) == 0
    else:
        ok = t0 < end
    NKW: tl.constexpr = CK // 4
    NVW: tl.constexpr = CV // 4 if CV >= 4 else 1
    if SMEM or BS >= 16:  # the whole step sits in one block (SMEM: in the stage at blk, rows RS apart)
        if SMEM:
            row0 = blk
        else:
            row0 = cache_ptr + (blk * BS + t0 % BS) * ROW_BYTES
        STRIDE: tl.constexpr = RS if SMEM else ROW_BYTES
        rk0 = row0 + r * STRIDE
        rk1 = row0 + (r + 8) * STRIDE
        rv0 = row0 + (2 * c) * STRIDE
        rv1 = row0 + (2 * c + 1) * STRIDE
        rv2 = row0 + (2 * c + 8) * STRIDE
        rv3 = row0 + (2 * c + 9) * STRIDE
    else:
        rk0 = _row_of(cache_ptr, bt_row, t0 + r, end, BS, ROW_BYTES, ok)
        rk1 = _row_of(cache_ptr, bt_row, t0 + r + 8, end, BS, ROW_BYTES, ok)
        rv0 = _row_of(cache_ptr, bt_row, t0 + 2 * c, end, BS, ROW_BYTES, ok)
        rv1 = _row_of(cache_ptr, bt_row, t0 + 2 * c + 1, end, BS, ROW_BYTES, ok)
        rv2 = _row_of(cache_ptr, bt_row, t0 + 2 * c + 8, end, BS, ROW_BYTES, ok)
        rv3 = _row_of(cache_ptr, bt_row, t0 + 2 * c + 9, end, BS, ROW_BYTES, ok)
    ki = (c + 1) % 4
    vi = (r + 1) % 8
    if SMEM:  # the join's second word unconditionally (its byte masks are 0 where a lane needs none; a read
        ks = ok  # past the stage's last row stays inside the ring, the table or the 64-byte pad above them)
        vs = ok
    else:
        ks = ok & k_sec_on
        vs = ok & v_sec_on
    k0 = ()
    k1 = ()
    if PART == 2:
        pass
    elif K_FP8:
        k0 = _fp8_chunk(rk0 + ka0, c, ok, NKW, K_NW, HINT, SMEM)
        k1 = _fp8_chunk(rk1 + ka0, c, ok, NKW, K_NW, HINT, SMEM)
    elif K_BITS == 3:
        for i in tl.static_range(NKW):
            k0 = k0 + _ld_words(rk0 + ka0 + 4 * i, ok, 1, HINT, SMEM)
            k1 = k1 + _ld_words(rk1 + ka0 + 4 * i, ok, 1, HINT, SMEM)
    elif K_FUN:
        k0 = _ld_span(rk0 + ka0, k_mis, ok, CK, HINT, SMEM)
        k1 = _ld_span(rk1 + ka0, k_mis, ok, CK, HINT, SMEM)
    else:
        k0 = _chunk(rk0, ka0, ki, CK, k_masks, ok, ks, NKW, K_MERGE, 4, HINT, SMEM)
        k1 = _chunk(rk1, ka0, ki, CK, k_masks, ok, ks, NKW, K_MERGE, 4, HINT, SMEM)
    v0 = ()
    v1 = ()
    v2 = ()
    v3 = ()
    if PART == 1:
        pass
    elif V_FUN:
        v0 = _ld_span(rv0 + va0, v_mis_e, ok, CV, HINT, SMEM)
        v1 = _ld_span(rv1 + va1, v_mis_o, ok, CV, HINT, SMEM)
        v2 = _ld_span(rv2 + va0, v_mis_e, ok, CV, HINT, SMEM)
        v3 = _ld_span(rv3 + va1, v_mis_o, ok, CV, HINT, SMEM)
    else:
        v0 = _chunk(rv0, va0, vi, CV, v_masks, ok, vs, NVW, V_MERGE, 8, HINT, SMEM)
        v1 = _chunk(rv1, va0, vi, CV, v_masks, ok, vs, NVW, V_MERGE, 8, HINT, SMEM)
        v2 = _chunk(rv2, va0, vi, CV, v_masks, ok, vs, NVW, V_MERGE, 8, HINT, SMEM)
        v3 = _chunk(rv3, va0, vi, CV, v_masks, ok, vs, NVW, V_MERGE, 8, HINT, SMEM)
    fac = ()
    if PART != 2:
        vf0 = _param(rk0 + vb_off, V_DT, ok, SMEM)
        vf1 = _param(rk1 + vb_off, V_DT, ok, SMEM)
        if K_FP8:
            kf0 = tl.zeros_like(vf0) + 1.0
            kf1 = kf0
        else:
            kf0 = _param(rk0 + kb_off, K_DT, ok, SMEM)
            kf1 = _param(rk1 + kb_off, K_DT, ok, SMEM)
        if V_UNIFORM:
            vz0 = _param(rk0 + vc_off, V_DT, ok, SMEM)
            vz1 = _param(rk1 + vc_off, V_DT, ok, SMEM)
        else:
            vz0 = tl.zeros_like(vf0)
            vz1 = vz0
        fac = (kf0, kf1, vf0, vf1, vz0, vz1)
    return k0, k1, v0, v1, v2, v3, fac


@triton.jit
def _scores(k0, k1, qf, lb, ones, k_sh, NKW: tl.constexpr, K_NC: tl.constexpr, K_FP8: tl.constexpr,
            K_BITS: tl.constexpr, NKT: tl.constexpr, K_FUN: tl.constexpr, E256: tl.constexpr = False):
    """S^T (tokens r, r+8 × heads 2c, 2c+1) and, for decode-time norm correction, ‖c‖² of the
    same tokens (all columns equal). FP8 keys: word ``i`` of the chunk is k-tile ``i`` (its
    bytes 0, 1 the MMA columns 2c, 2c+1; bytes 2, 3 the columns 2c+8, 2c+9). 3-bit keys: the
    chunk words shifted by ``k_sh`` bits, code pair ``p`` (bits ``6p ..``) one table entry; k-tile
    ``i`` takes pairs ``2i`` (columns 2c, 2c+1) and ``2i + 1`` (2c+8, 2c+9)."""
    z = tl.zeros_like(lb.to(tl.float32))
    s = (z, z, z, z)  # two independent accumulation chains (even / odd k-tiles)
    t = (z, z, z, z)
    n = (z, z, z, z)
    if K_FP8:
        for i in tl.static_range(NKW):
            pw = _fp8_pairs(k0[i])
            px = _fp8_pairs(k1[i])
            if i % 2 == 0:
                s = _mma(s, pw[0], px[0], pw[1], px[1], qf[2 * i], qf[2 * i + 1])
            else:
                t = _mma(t, pw[0], px[0], pw[1], px[1], qf[2 * i], qf[2 * i + 1])
    elif K_BITS == 3 or K_BITS == 5:  # code pair p: coordinates c·D/4 + 2p, + 1
        x = _shifted(k0, k_sh, NKW - (K_BITS == 3))  # 3-bit: one word loaded beyond the chunk
        y = _shifted(k1, k_sh, NKW - (K_BITS == 3))
        lbk = lb + 64 * 128  # 5-bit: the single-code entries
        for i in tl.static_range(NKT):
            if K_BITS == 5:  # two single-code lookups per pair
                a0 = _k5_pair(x, 2 * i, lbk)
                a1 = _k5_pair(y, 2 * i, lbk)
                a2 = _k5_pair(x, 2 * i + 1, lbk)
                a3 = _k5_pair(y, 2 * i + 1, lbk)
            else:  # one pair lookup (6-bit field)
                a0 = _lut1(_bits_at(x, 12 * i, 6), lb)
                a1 = _lut1(_bits_at(y, 12 * i, 6), lb)
                a2 = _lut1(_bits_at(x, 12 * i + 6, 6), lb)
                a3 = _lut1(_bits_at(y, 12 * i + 6, 6), lb)
            if i % 2 == 0:
                s = _mma(s, a0, a1, a2, a3, qf[2 * i], qf[2 * i + 1])
            else:
                t = _mma(t, a0, a1, a2, a3, qf[2 * i], qf[2 * i + 1])
            if K_NC:
                n = _mma(n, _sq(a0), _sq(a1), _sq(a2), _sq(a3), ones, ones)
    else:
        if K_FUN:  # the chunk's words from the words that hold it
            k0 = _shifted(k0, k_sh, NKW)
            k1 = _shifted(k1, k_sh, NKW)
        for i in tl.static_range(NKW):
            pw = _lut4(k0[i], lb, E256)  # chunk bytes 4i..4i+3 of token r
            px = _lut4(k1[i], lb, E256)  # ... of token r + 8
            s = _mma(s, pw[0], px[0], pw[1], px[1], qf[4 * i], qf[4 * i + 1])
            t = _mma(t, pw[2], px[2], pw[3], px[3], qf[4 * i + 2], qf[4 * i + 3])
            if K_NC:
                n = _mma(n, _sq(pw[0]), _sq(px[0]), _sq(pw[1]), _sq(px[1]), ones, ones)
                n = _mma(n, _sq(pw[2]), _sq(px[2]), _sq(pw[3]), _sq(px[3]), ones, ones)
    return (s[0] + t[0], s[1] + t[1], s[2] + t[2], s[3] + t[3]), n


@triton.jit
def _values(o, v0, v1, v2, v3, pb0, pb1, lb, v_sh_e, v_sh_o, NVW: tl.constexpr, CV: tl.constexpr,
            V_UNIFORM: tl.constexpr, V_FUN: tl.constexpr, V_BITS: tl.constexpr, NMT: tl.constexpr,
            E256: tl.constexpr = False):
    """O^T += V^T·P^T over the lane's chunk (4-bit: M tile i ← chunk byte i; 3-bit: M tile i ←
    codes 2i (row r) and 2i + 1 (row r + 8) of the chunk). Shifted chunks (``V_FUN``) are
    aligned first (even tokens by ``v_sh_e`` bits, odd ones by ``v_sh_o``)."""
    TPW: tl.constexpr = 4 if CV >= 4 else CV  # M tiles per 32-bit word of the chunk
    res = ()
    if V_FUN:  # the chunks' words from the words that hold them (3-bit values: always)
        v0 = _shifted(v0, v_sh_e, (CV + 3) // 4)
        v1 = _shifted(v1, v_sh_o, (CV + 3) // 4)
        v2 = _shifted(v2, v_sh_e, (CV + 3) // 4)
        v3 = _shifted(v3, v_sh_o, (CV + 3) // 4)
    if V_BITS == 3:
        xa = _v3_words(v0, CV)
        xb = _v3_words(v1, CV)
        xc = _v3_words(v2, CV)
        xd = _v3_words(v3, CV)
        for i in tl.static_range(NMT):
            if V_UNIFORM:
                a0 = _uni3(xa, xb, 2 * i)
                a1 = _uni3(xa, xb, 2 * i + 1)
                a2 = _uni3(xc, xd, 2 * i)
                a3 = _uni3(xc, xd, 2 * i + 1)
            else:  # Lloyd-Max: the pair table's entries 0..63 (token pairs of 3-bit codes)
                a0 = _lut1(_v3_index(xa, xb, 2 * i), lb)
                a1 = _lut1(_v3_index(xa, xb, 2 * i + 1), lb)
                a2 = _lut1(_v3_index(xc, xd, 2 * i), lb)
                a3 = _lut1(_v3_index(xc, xd, 2 * i + 1), lb)
            acc = _mma((o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]), a0, a1, a2, a3, pb0, pb1)
            res = res + (acc[0], acc[1], acc[2], acc[3])
    else:
        for w in tl.static_range(NVW):
            if V_UNIFORM:
                ab = _uni4(v0[w], v1[w])
                cd = _uni4(v2[w], v3[w])
                lo_ab = (ab[0], ab[1], ab[2], ab[3])
                hi_ab = (ab[4], ab[5], ab[6], ab[7])
                lo_cd = (cd[0], cd[1], cd[2], cd[3])
                hi_cd = (cd[4], cd[5], cd[6], cd[7])
            else:
                m_ab = _nibble_merge(v0[w], v1[w])
                m_cd = _nibble_merge(v2[w], v3[w])
                lo_ab = _lut4(m_ab[0], lb, E256)
                hi_ab = _lut4(m_ab[1], lb, E256)
                lo_cd = _lut4(m_cd[0], lb, E256)
                hi_cd = _lut4(m_cd[1], lb, E256)
            for k in tl.static_range(TPW):  # M tile 4w + k
                acc = _mma((o[16 * w + 4 * k], o[16 * w + 4 * k + 1], o[16 * w + 4 * k + 2], o[16 * w + 4 * k + 3]),
                           lo_ab[k], hi_ab[k], lo_cd[k], hi_cd[k], pb0, pb1)
                res = res + (acc[0], acc[1], acc[2], acc[3])
    return res


@triton.jit
def _scaled_scores(sv, cn, fac, ok0, ok1, sm_scale_log2, K_NC: tl.constexpr):
    """Base-2 scores of tokens r (``ok0``) and r + 8 (``ok1``), heads 2c / 2c+1: the key factors
    (and the decode-time norm correction) applied, −inf past the range."""
    f0 = fac[0] * sm_scale_log2
    f1 = fac[1] * sm_scale_log2
    if K_NC:
        f0 = f0 * tl.rsqrt(tl.maximum(cn[0], 1e-30))
        f1 = f1 * tl.rsqrt(tl.maximum(cn[2], 1e-30))
    return (tl.where(ok0, sv[0] * f0, float("-inf")), tl.where(ok0, sv[1] * f0, float("-inf")),
            tl.where(ok1, sv[2] * f1, float("-inf")), tl.where(ok1, sv[3] * f1, float("-inf")))


@triton.jit
def _rescale(o, be, bo, NMT: tl.constexpr):
    """O^T columns 2c (×be) and 2c+1 (×bo). (Skipping this when every factor is 1, by a
    warp-uniform branch, measured 2-3% slower on the H100: the branch splits ptxas's scheduling
    region in the middle of the loop.)"""
    res = ()
    for i in tl.static_range(NMT):
        res = res + (o[4 * i] * be, o[4 * i + 1] * bo, o[4 * i + 2] * be, o[4 * i + 3] * bo)
    return res


@triton.jit
def _dim_of(f, e, NIBBLE: tl.constexpr):
    """Coordinate of nibble ``e`` (0 low, 1 high) of field byte ``f``."""
    if NIBBLE:
        return 2 * f + 1 - e
    return 2 * f + e


@triton.jit
def _paged_decode_mma_kernel(
    q_ptr, cache_ptr, bt_ptr, sl_ptr, cen_ptr, vcen_ptr, acc_ptr, ml_ptr,
    num_seqs, max_blocks, sm_scale_log2, NUM_SPLITS,
    G: tl.constexpr, HKV: tl.constexpr, HQ: tl.constexpr, WARPS: tl.constexpr,
    BS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, ROW_BYTES: tl.constexpr, NIBBLE: tl.constexpr,
    K_A_OFF: tl.constexpr, K_A_STRIDE: tl.constexpr, K_B_OFF: tl.constexpr, K_B_STRIDE: tl.constexpr,
    K_DT: tl.constexpr, K_NC: tl.constexpr,
    V_UNIFORM: tl.constexpr, V_A_OFF: tl.constexpr, V_A_STRIDE: tl.constexpr, V_B_OFF: tl.constexpr,
    V_B_STRIDE: tl.constexpr, V_C_OFF: tl.constexpr, V_C_STRIDE: tl.constexpr, V_DT: tl.constexpr,
    K_MERGE: tl.constexpr, V_MERGE: tl.constexpr, K_FP8: tl.constexpr = False, K_NW: tl.constexpr = 1,
    K_BITS: tl.constexpr = 4, K_FUN: tl.constexpr = False, V_FUN: tl.constexpr = False, V_BITS: tl.constexpr = 4,
    PREFETCH: tl.constexpr = 1, HINT: tl.constexpr = 0, SUB: tl.constexpr = 1,
    COOP: tl.constexpr = 0, RS: tl.constexpr = 0, SMEM_OFF: tl.constexpr = 0, LUT_AT: tl.constexpr = 0,
    NLOW: tl.constexpr = 0, LATE_V: tl.constexpr = 0,
):
    NT: tl.constexpr = 32 * WARPS
    K3: tl.constexpr = K_BITS == 3
    K5: tl.constexpr = K_BITS == 5
    # Key bytes a lane loads per token: 4-bit D/8 (2 per k-tile), FP8 D/4, 3-bit its 3D/32-byte
    # chunk in whole words from the aligned address below it, plus one word for the shift; 5-bit
    # its 5D/32-byte chunk (shifted words, K_FUN).
    CK: tl.constexpr = ((D // 8) * (1 + K_FP8) * (1 - K3 - K5) + 4 * ((3 * D + 127) // 128 + 1) * K3
                        + (5 * D // 32) * K5)
    NEED_LUT: tl.constexpr = not (K_FP8 and V_UNIFORM)  # FP8 keys and uniform values need no table
    # value chunk bytes per lane and token: 4-bit 1 per M tile, 3-bit 2 codes per M tile
    CV: tl.constexpr = D // 16 if V_BITS == 4 else 3 * D // 64
    NKW: tl.constexpr = (CK + 3) // 4
    NVW: tl.constexpr = CV // 4 if CV >= 4 else 1
    NMT: tl.constexpr = D // 16
    LV: tl.constexpr = LATE_V * (COOP > 0)  # values read after the update: cooperative stages only
    t = tl.arange(0, NT)
    lane = t % 32
    r = lane // 4
    c = lane % 4

    # -- this warp's work item: KV head fastest, then split, then sequence --------------------
    total = num_seqs * (HKV * NUM_SPLITS)
    item = tl.program_id(0) * WARPS + t // 32
    live = item < total
    item = tl.minimum(item, total - 1)
    h = item % HKV
    split = (item // HKV) % NUM_SPLITS
    s = item // (HKV * NUM_SPLITS)
    seq_len = tl.minimum(tl.load(sl_ptr + s), max_blocks * BS)
    per = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), 16) * 16
    start = split * per
    end = tl.where(live, tl.minimum(start + per, seq_len), start)
    n_steps = tl.max(tl.maximum(tl.cdiv(end - start, 16), 0), axis=0)  # the CTA's longest range
    bt_row = bt_ptr + s.to(tl.int64) * max_blocks

    # -- pair table (its address), the cooperative stages' first copies, the table's fill ----------
    if NEED_LUT:
        if LUT_AT:  # the PRMT-addressed table at the shared address LUT_AT (low 16 bits 0)
            lut = (_smem_base(t) & -65536) + LUT_AT
        elif COOP:  # the start of the dynamic region, past Triton's scratch
            lut = _smem_base(t) + SMEM_OFF
        else:
            lut = _lut_declare(t)
    else:
        lut = t * 0  # (unused)
    if COOP:
        # CTA-cooperative stages (the CTA's warps are the KV heads of one sequence and split):
        # a ring of COOP stages of SUB steps' whole rows in dynamic shared memory, filled by
        # cp.async COOP - 1 iterations ahead; thread t copies 16-byte chunks t, t + NT, ... of
        # each step's 16 contiguous rows (to row i // (ROW_BYTES / 16) of the stage, RS bytes apart).
        # The first COOP - 1 stages are issued before the table is filled (their DRAM latency
        # overlaps the fill).
        STG: tl.constexpr = 16 * SUB * RS
        NCP: tl.constexpr = (ROW_BYTES + NT - 1) // NT
        # (LUT_AT: stages 0 .. NLOW - 1 below the table, the others right above its 64 KB)
        stages = _smem_base(t) + (SMEM_OFF + LUT_BYTES * NEED_LUT * (LUT_AT == 0))
        NBELOW: tl.constexpr = NLOW if (LUT_AT > 0 and NLOW < COOP) else -1
        cp_s = ()
        for k in tl.static_range(NCP):
            ci = t + k * NT
            if RS == ROW_BYTES:
                cp_s = cp_s + (16 * ci,)
            else:
                cp_s = cp_s + ((ci // (ROW_BYTES // 16)) * RS + (ci % (ROW_BYTES // 16)) * 16,)
        for j in tl.static_range(COOP - 1):
            _coop_issue(cache_ptr, _step_blocks(bt_row, start + 16 * SUB * j, end, BS, SUB), start + 16 * SUB * j,
                        end, _stage(stages, lut, j, STG, NBELOW), cp_s, t, NT, BS, ROW_BYTES, RS, SUB)
    if NEED_LUT:
        if K5:
            lut = _lut_fill_k5(lut, t, cen_ptr, vcen_ptr, NT, not V_UNIFORM)
        else:
            lut = _lut_fill(lut, t, cen_ptr, NT, K_BITS, LUT_AT > 0)
        lb = lut + lane * 4
    else:
        lb = lane * 4

    # -- field geometry (aligned spans, byte masks for the joining lane) ---------------------------
    ka = K_A_OFF + h * K_A_STRIDE
    va = V_A_OFF + h * V_A_STRIDE
    # Rows of 2 mod 4 bytes (blocks of an even number of them; steps start at multiples of 16):
    # a token row starts (its index · ROW_BYTES) mod 4 bytes past a word boundary, so the
    # shifts below are constant per lane (keys: tokens r, r + 8; values: even / odd tokens).
    k_row = (r * ROW_BYTES) % 4
    if K_FP8:  # FP8 keys are read word-wise from ka itself
        k_mis = ka * 0
        ka0 = ka
        k_sh = ka * 0
    elif K3 or K_FUN:  # this lane's chunk (3-bit: 3D/32 bytes, else CK) from the word below it
        k_lane = ka + (3 * D // 32 if K3 else CK) * c
        k_mis = (k_lane + k_row) & 3
        ka0 = k_lane - k_mis
        k_sh = k_mis * 8
    else:
        k_mis = ka % CK
        ka0 = ka - k_mis
        k_sh = ka * 0
    if V_FUN:  # this lane's chunk: field bytes CV·r .., from the word below it
        v_lane = va + CV * r
        v_mis_e = v_lane & 3
        v_mis_o = (v_lane + ROW_BYTES) & 3
        va0 = v_lane - v_mis_e
        va1 = v_lane - v_mis_o
        v_mis = va * 0
    else:
        v_mis = va % CV
        va0 = va - v_mis
        va1 = va0
        v_mis_e = v_mis
        v_mis_o = v_mis
    k_masks = _byte_masks(tl.where(c == 3, k_mis, 0), NKW)
    v_masks = _byte_masks(tl.where(r == 7, v_mis, 0), NVW)
    k_sec_on = (c == 3) & (k_mis > 0)
    v_sec_on = (r == 7) & (v_mis > 0)
    kb_off = K_B_OFF + h * K_B_STRIDE
    vb_off = V_B_OFF + h * V_B_STRIDE
    vc_off = V_C_OFF + h * V_C_STRIDE
    geo = (ka0, va0, va1, kb_off, vb_off, vc_off, k_masks, v_masks, k_sec_on, v_sec_on, k_mis, v_mis_e, v_mis_o)

    # -- q as the B operand of S^T = K·Q^T: head r, the coordinates of this lane's key chunk ------
    q_row = q_ptr + ((s * HQ + h * G + r) * D).to(tl.int64)
    q_ok = live & (r < G)
    qf = ()
    if K3 or K5:  # code pair p of the chunk: coordinates c·D/4 + 2p, + 1
        for p in tl.static_range(D // 8):
            x0 = tl.load(q_row + c * (D // 4) + 2 * p, mask=q_ok, other=0.0)
            x1 = tl.load(q_row + c * (D // 4) + 2 * p + 1, mask=q_ok, other=0.0)
            qf = qf + (_pack2(x0, x1),)
    elif K_FP8:  # word i of the chunk (field word fw, coordinates 4fw .. 4fw + 3): two pairs
        for i in tl.static_range(NKW):
            fw = K_NW * (4 * (i // K_NW) + c) + i % K_NW
            for e in tl.static_range(2):
                x0 = tl.load(q_row + 4 * fw + 2 * e, mask=q_ok, other=0.0)
                x1 = tl.load(q_row + 4 * fw + 2 * e + 1, mask=q_ok, other=0.0)
                qf = qf + (_pack2(x0, x1),)
    else:
        for j in tl.static_range(CK):
            if K_FUN:
                f = CK * c + j
            else:
                f = (CK * (c + 1) + j - k_mis) % (4 * CK)
            x0 = tl.load(q_row + _dim_of(f, 0, NIBBLE), mask=q_ok, other=0.0)
            x1 = tl.load(q_row + _dim_of(f, 1, NIBBLE), mask=q_ok, other=0.0)
            qf = qf + (_pack2(x0, x1),)
    ones = tl.full([NT], 0x3C003C00, tl.int32)

    # -- state -----------------------------------------------------------------------------------
    zf = tl.zeros([NT], tl.float32)
    o = ()
    for i in tl.static_range(NMT):
        o = o + (zf, zf, zf, zf)
    m_e = zf - 1e30  # running max (base-2 scores) of heads 2c and 2c+1
    m_o = zf - 1e30
    l_e = zf
    l_o = zf
    z_e = zf  # Σ p·zero (uniform values)
    z_o = zf
    vmax = zf  # running max of the value factors (P^T is scaled by 1/vmax)

    # Software pipeline: the K/V data of the next PREFETCH steps is in flight in registers (a
    # ring), and the block-table entry of the step after those is looked up one iteration
    # earlier still, so that the loads never wait on the table. PREFETCH = 1 measured fastest on
    # the H100: ptxas sinks a deeper ring's loads to the end of the iteration anyway.
    if COOP:  # (the first COOP - 1 stages were issued before the pair table was filled)
        nxt = _step_blocks(bt_row, start + 16 * SUB * (COOP - 1), end, BS, SUB)
    else:
        blk = _step_block(bt_row, start, end, BS)
        ring = ()
        for j in tl.static_range(PREFETCH):
            ring = ring + (_load_step(cache_ptr, bt_row, blk, start + 16 * j, end, r, c, geo, BS, ROW_BYTES, CK, CV,
                                      K_MERGE, V_MERGE, K_DT, V_DT, V_UNIFORM, HINT, K_FP8, K_NW, K_BITS, K_FUN,
                                      V_FUN),)
            blk = _step_block(bt_row, start + 16 * (j + 1), end, BS)
    for it in range(0, tl.cdiv(n_steps, SUB)):
        # SUB 16-token steps under one softmax update: their scores first, then one running
        # max (scores and value factors), one rescale of the output, then their values.
        t0 = start + it * (16 * SUB)
        if COOP:  # this iteration's stage has landed; refill the one read last iteration
            sb = _coop_wait(_stage(stages, lut, it % COOP, STG, NBELOW), COOP - 2)
            tc = t0 + 16 * SUB * (COOP - 1)
            _coop_issue(cache_ptr, nxt, tc, end,
                        _stage(stages, lut, (it + COOP - 1) % COOP, STG, NBELOW), cp_s, t, NT, BS,
                        ROW_BYTES, RS, SUB)
            nxt = _step_blocks(bt_row, tc + 16 * SUB, end, BS, SUB)
        steps = ()
        mx_e = zf
        mx_o = zf
        mx_v = zf
        for u in tl.static_range(SUB):
            if COOP:
                k0, k1, v0, v1, v2, v3, fac = _load_step(cache_ptr, bt_row, sb + 16 * u * RS, t0 + 16 * u, end, r, c,
                                                         geo, BS, ROW_BYTES, CK, CV, K_MERGE, V_MERGE, K_DT, V_DT,
                                                         V_UNIFORM, HINT, K_FP8, K_NW, K_BITS, K_FUN, V_FUN, True, RS,
                                                         LV)
            else:
                k0, k1, v0, v1, v2, v3, fac = ring[0]
                tn = t0 + 16 * (PREFETCH + u)
                ring = ring[1:] + (_load_step(cache_ptr, bt_row, blk, tn, end, r, c, geo, BS, ROW_BYTES, CK, CV,
                                              K_MERGE, V_MERGE, K_DT, V_DT, V_UNIFORM, HINT, K_FP8, K_NW, K_BITS,
                                              K_FUN, V_FUN),)
                blk = _step_block(bt_row, tn + 16, end, BS)
            ok0 = (t0 + 16 * u + r) < end
            ok1 = (t0 + 16 * u + r + 8) < end
            sv, cn = _scores(k0, k1, qf, lb, ones, k_sh, NKW, K_NC, K_FP8, K_BITS, D // 16, K_FUN, LUT_AT > 0)
            s0, s1, s2, s3 = _scaled_scores(sv, cn, fac, ok0, ok1, sm_scale_log2, K_NC)
            vf0 = tl.where(ok0, fac[2], 0.0)
            vf1 = tl.where(ok1, fac[3], 0.0)
            if u == 0:
                mx_e = tl.maximum(s0, s2)
                mx_o = tl.maximum(s1, s3)
                mx_v = tl.maximum(tl.abs(vf0), tl.abs(vf1))
            else:
                mx_e = tl.maximum(mx_e, tl.maximum(s0, s2))
                mx_o = tl.maximum(mx_o, tl.maximum(s1, s3))
                mx_v = tl.maximum(mx_v, tl.maximum(tl.abs(vf0), tl.abs(vf1)))
            steps = steps + ((v0, v1, v2, v3, s0, s1, s2, s3, vf0, vf1, fac, ok0, ok1),)
        mn_e = tl.maximum(m_e, _warp_max_r(mx_e))
        mn_o = tl.maximum(m_o, _warp_max_r(mx_o))
        a_e = tl.exp2(m_e - mn_e)
        a_o = tl.exp2(m_o - mn_o)
        for u in tl.static_range(SUB):
            v0, v1, v2, v3, s0, s1, s2, s3, vf0, vf1, fac, ok0, ok1 = steps[u]
            if LV:  # this step's values from the stage, now
                _, _, v0, v1, v2, v3, _ = _load_step(cache_ptr, bt_row, sb + 16 * u * RS, t0 + 16 * u, end, r, c,
                                                     geo, BS, ROW_BYTES, CK, CV, K_MERGE, V_MERGE, K_DT, V_DT,
                                                     V_UNIFORM, HINT, K_FP8, K_NW, K_BITS, K_FUN, V_FUN, True, RS,
                                                     2)
            p0 = tl.exp2(s0 - mn_e)
            p1 = tl.exp2(s1 - mn_o)
            p2 = tl.exp2(s2 - mn_e)
            p3 = tl.exp2(s3 - mn_o)
            if u == 0:  # the running sums carry the correction factors once
                l_e = l_e * a_e + (p0 + p2)
                l_o = l_o * a_o + (p1 + p3)
            else:
                l_e = l_e + (p0 + p2)
                l_o = l_o + (p1 + p3)
            if V_UNIFORM:
                vz0 = tl.where(ok0, fac[4], 0.0)
                vz1 = tl.where(ok1, fac[5], 0.0)
                if u == 0:
                    z_e = z_e * a_e + (p0 * vz0 + p2 * vz1)
                    z_o = z_o * a_o + (p1 * vz0 + p3 * vz1)
                else:
                    z_e = z_e + (p0 * vz0 + p2 * vz1)
                    z_o = z_o + (p1 * vz0 + p3 * vz1)
            if u == 0:  # one rescale of the output per update
                vn = tl.maximum(vmax, _warp_max_r(mx_v))
                ratio = tl.where(vn > 0, vmax / tl.where(vn > 0, vn, 1.0), 1.0)
                inv = tl.where(vn > 0, 1.0 / tl.where(vn > 0, vn, 1.0), 0.0)
                vmax = vn
                o = _rescale(o, a_e * ratio, a_o * ratio, NMT)
            w0 = vf0 * inv
            w1 = vf1 * inv
            pb = _p_fragments(p0 * w0, p1 * w0, p2 * w1, p3 * w1)
            o = _values(o, v0, v1, v2, v3, pb[0], pb[1], lb, v_mis_e * 8, v_mis_o * 8, NVW, CV, V_UNIFORM, V_FUN,
                        V_BITS, NMT, LUT_AT > 0)
        m_e = mn_e
        m_o = mn_o

    # -- partial results: acc [S, HQ, NUM_SPLITS, DP], (m, l) [S, HQ, NUM_SPLITS, 2] --------------
    l_e = _warp_sum_r(l_e)
    l_o = _warp_sum_r(l_o)
    if V_UNIFORM:
        z_e = _warp_sum_r(z_e)
        z_o = _warp_sum_r(z_o)
    if V_UNIFORM:
        sc_lo = vmax * 16777216.0  # 2^24: the low nibbles were subnormals j·2^-24
        sc_hi = vmax * 1048576.0  # 2^20: the high nibbles 16j·2^-24
    else:
        sc_lo = vmax
        sc_hi = vmax
    part_e = (s * HQ + h * G + 2 * c).to(tl.int64) * NUM_SPLITS + split
    part_o = part_e + NUM_SPLITS
    ok_e = live & (2 * c < G)
    ok_o = live & (2 * c + 1 < G)
    for i in tl.static_range(NMT):
        if V_BITS == 3:  # codes 2i, 2i + 1 of the lane's chunk; uniform code k was code·2^(3k mod 8 - 24)
            d_lo = r * (D // 8) + 2 * i
            d_hi = d_lo + 1
            if V_UNIFORM:
                s_lo = vmax * (16777216.0 / (1 << ((6 * i) % 8)))
                s_hi = vmax * (16777216.0 / (1 << ((6 * i + 3) % 8)))
            else:
                s_lo = sc_lo
                s_hi = sc_hi
        else:
            if V_FUN:
                f = CV * r + i
            else:
                f = (CV * (r + 1) + i - v_mis) % (8 * CV)
            d_lo = _dim_of(f, 0, NIBBLE)
            d_hi = _dim_of(f, 1, NIBBLE)
            s_lo = sc_lo
            s_hi = sc_hi
        tl.store(acc_ptr + part_e * DP + d_lo, o[4 * i] * s_lo + z_e, mask=ok_e)
        tl.store(acc_ptr + part_o * DP + d_lo, o[4 * i + 1] * s_lo + z_o, mask=ok_o)
        tl.store(acc_ptr + part_e * DP + d_hi, o[4 * i + 2] * s_hi + z_e, mask=ok_e)
        tl.store(acc_ptr + part_o * DP + d_hi, o[4 * i + 3] * s_hi + z_o, mask=ok_o)
    first = r == 0
    tl.store(ml_ptr + part_e * 2, tl.where(l_e > 0, m_e, float("-inf")), mask=ok_e & first)
    tl.store(ml_ptr + part_e * 2 + 1, l_e, mask=ok_e & first)
    tl.store(ml_ptr + part_o * 2, tl.where(l_o > 0, m_o, float("-inf")), mask=ok_o & first)
    tl.store(ml_ptr + part_o * 2 + 1, l_o, mask=ok_o & first)


# The cooperative plans launch through a second wrapper of the same function that specializes no
# argument (no "== 1" or 16-divisibility variants): exactly one compiled kernel per constexpr set,
# so that its dynamic shared memory is sized once, before its binary is first loaded.
_paged_decode_coop_kernel = triton.jit(
    _paged_decode_mma_kernel.fn,
    do_not_specialize=["q_ptr", "cache_ptr", "bt_ptr", "sl_ptr", "cen_ptr", "vcen_ptr", "acc_ptr", "ml_ptr", "num_seqs",
                       "max_blocks", "sm_scale_log2", "NUM_SPLITS"])


# -- host side ------------------------------------------------------------------------------------
def mma_plan(layout: PagedLayout, group: int) -> dict | None:
    """Constexprs of the warp-MMA kernel for ``layout`` and GQA ``group``, or ``None`` where it
    does not apply (then the general kernel runs).

    It applies when keys are 4-bit Lloyd-Max codes, 3- or 5-bit Lloyd-Max codes (LSB bit order)
    or FP8, and values are 4- or 3-bit uniform codes, 4-bit Lloyd-Max codes next to 4-bit keys
    (no decode-time norm correction; the launcher also requires the keys' codebook, see
    ``tqkern.ops.paged_decode.triton.decode_path``) or 3-bit Lloyd-Max codes next to 5-bit keys;
    ``head_dim`` 64 or 128; ``group ≤ 8``; rows of an even number of bytes (2 mod 4 only in
    blocks of an even number of rows and not with FP8 keys); FP8 key fields at 4-byte offsets;
    a 3-bit key field's over-read word inside the row; norms, scales and zeros aligned to their
    size in every row."""
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a tqkern.PagedLayout, got {type(layout).__name__}")
    plan = _mma_plan(layout, group)
    return None if plan is None else dict(plan)


_PER_WARP_SUB = {True: 1, False: 2}  # the per-warp kernel's steps per softmax update, by "values uniform"


@functools.lru_cache(maxsize=256)
def _mma_plan(layout: PagedLayout, group: int) -> tuple | None:
    fmt = layout.format
    key, value = fmt.key, fmt.value
    d = fmt.head_dim
    k_fp8 = isinstance(key, FP8)
    k3 = isinstance(key, LloydMax) and key.bits == 3 and fmt.bit_order == "lsb"
    k5 = isinstance(key, LloydMax) and key.bits == 5 and fmt.bit_order == "lsb"
    if not ((isinstance(key, LloydMax) and key.bits == 4) or k_fp8 or k3 or k5):
        return None
    v_uniform = isinstance(value, Uniform)
    v_lm = isinstance(value, LloydMax) and value.norm_correction != "decode"
    if not ((v_lm and value.bits in (3, 4)) or (v_uniform and value.bits in (3, 4))):
        return None
    # The one table holds 4-bit key pairs (and then 4-bit Lloyd-Max value pairs of the same
    # codebook), 3-bit key pairs, or 5-bit key codes next to 3-bit Lloyd-Max value pairs.
    if v_lm and not ((value.bits == 4 and isinstance(key, LloydMax) and key.bits == 4) or (value.bits == 3 and k5)):
        return None
    if d not in (64, 128) or not 1 <= group <= 8:
        return None
    rb = layout.row_bytes
    # Rows of 2 mod 4 bytes: a row's offset from a word boundary must follow from the token's
    # position alone (blocks of an even number of rows), and FP8 keys are read as aligned words.
    if rb % 2 or (rb % 4 and (layout.block_size % 2 or k_fp8)):
        return None
    ck, cv = d // 8, d // 16
    c = layout_consts(layout)
    # 4-bit key chunks not at fixed offsets from aligned blocks, and 5-bit keys: shifted words
    k_fun = k5 or (not (k_fp8 or k3) and rb % ck != 0)
    # 3-bit values: always shifted (3D/64-byte chunks). With 3-bit keys, values that would be
    # joined are shifted too (measured 4-5% faster on the H100: docs/performance.md §25).
    v_fun = value.bits == 3 or rb % cv != 0 or (k3 and bool(c["V_A_OFF"] % cv or c["V_A_STRIDE"] % cv))
    last_key = c["K_A_OFF"] + (layout.num_kv_heads - 1) * c["K_A_STRIDE"]
    if k3 and last_key + 3 * (3 * d // 32) + 4 * ((3 * d + 127) // 128 + 1) > rb:
        return None  # 3-bit keys: a lane's whole words (one beyond its chunk) must stay in the row
    k_nw = 1
    if k_fp8:  # word loads of the key field: as wide as its alignment allows
        if (c["K_A_OFF"] | c["K_A_STRIDE"]) % 4:
            return None
        k_nw = next(n for n in (4, 2, 1) if (c["K_A_OFF"] | c["K_A_STRIDE"] | rb) % (4 * n) == 0)
    k_dt = _DT["float32" if k_fp8 else key.norm_dtype]  # FP8 keys have no factor: K_DT is unused
    k_bits = 8 if k_fp8 else key.bits
    v_dt = _DT[value.param_dtype if v_uniform else value.norm_dtype]
    factors = [(c["V_B_OFF"], v_dt), (c["V_B_STRIDE"], v_dt), (c["V_C_OFF"], v_dt), (c["V_C_STRIDE"], v_dt),
               (rb, v_dt)]
    if not k_fp8:
        factors += [(c["K_B_OFF"], k_dt), (c["K_B_STRIDE"], k_dt), (rb, k_dt)]
    if any(off % _NBYTES[dt] for off, dt in factors):
        return None
    plan = dict(
        D=d, DP=c["DP"], ROW_BYTES=rb, NIBBLE=fmt.bit_order == "nibble_high_even",
        K_A_OFF=c["K_A_OFF"], K_A_STRIDE=c["K_A_STRIDE"], K_B_OFF=c["K_B_OFF"], K_B_STRIDE=c["K_B_STRIDE"],
        K_DT=k_dt, K_NC=not k_fp8 and key.norm_correction == "decode", K_FP8=k_fp8, K_NW=k_nw, K_BITS=k_bits,
        # Two 16-token steps per softmax update for Lloyd-Max values (measured on the H100, every
        # benchmark shape: tq4 -1.7 to -4.9%, tqkern_k5v3 -1.6 to -2.6%; uniform values: mixed or slower).
        SUB=_PER_WARP_SUB[v_uniform],
        V_UNIFORM=v_uniform, V_A_OFF=c["V_A_OFF"], V_A_STRIDE=c["V_A_STRIDE"], V_B_OFF=c["V_B_OFF"],
        V_B_STRIDE=c["V_B_STRIDE"], V_C_OFF=c["V_C_OFF"], V_C_STRIDE=c["V_C_STRIDE"], V_DT=v_dt,
        K_MERGE=key.bits == 4 and not k_fun and bool(c["K_A_OFF"] % ck or c["K_A_STRIDE"] % ck),
        V_MERGE=not v_fun and bool(c["V_A_OFF"] % cv or c["V_A_STRIDE"] % cv),
        K_FUN=k_fun, V_FUN=v_fun, V_BITS=value.bits,
    )
    # CTA-cooperative stages where they apply and CTAs have at least 4 warps (each CTA fills its
    # own table), measured on the H100 (docs/performance.md §37-39, §47): Lloyd-Max values 4
    # stages of two steps (one CTA per SM); uniform values next to table-decoded keys 2 stages of
    # two steps per softmax update (two CTAs per SM; 3-7% faster than 3 stages of one step: the
    # values are read from the stage after the update, so two steps no longer spill); FP8 keys 3
    # stages of one step (two steps gained nothing). :func:`device_plan` drops them where the
    # device's shared memory is smaller.
    coop = None
    if layout.num_kv_heads >= 4:
        sub, stages = (2, 4) if not v_uniform else (1, 3) if k_fp8 else (2, 2)
        coop = coop_plan(dict(plan, SUB=sub), layout, stages)
    return tuple((coop or plan).items())


def per_warp_plan(plan: dict) -> dict:
    """``plan`` without cooperative stages (the per-warp kernel, each warp reading its own fields),
    with the per-warp kernel's steps per softmax update (uniform values: one; a cooperative plan
    may take two)."""
    if not isinstance(plan, dict):
        raise TypeError(f"plan must be a dict from mma_plan, got {type(plan).__name__}")
    out = {k: v for k, v in plan.items() if k not in ("COOP", "RS", "SMEM_OFF", "LUT_AT", "NLOW", "LATE_V")}
    if plan.get("COOP"):
        out["SUB"] = _PER_WARP_SUB[bool(plan["V_UNIFORM"])]
    return out


def device_plan(layout: PagedLayout, group: int, device) -> dict | None:
    """:func:`mma_plan` for a launch on ``device``: without cooperative stages where a CTA of that
    device cannot have the shared memory they need, or after :func:`disable_cooperative_stages`."""
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {type(device).__name__}")
    plan = mma_plan(layout, group)
    if plan is None or not plan.get("COOP"):
        return plan
    index = device.index or 0
    if index in _COOP_DISABLED or coop_smem_bytes(plan) > _smem_optin(index):
        return per_warp_plan(plan)
    return plan


@functools.lru_cache(maxsize=16)
def _smem_optin(index: int) -> int:
    """Shared memory one CTA may use on CUDA device ``index`` (0 where torch does not say)."""
    return int(getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0))


_COOP_SMEM_OFF = 1024  # the cooperative stages start here in the dynamic region (below: Triton's own scratch)
_COOP_PAD = 64  # slack past the last stage
_SMEM_OPTIN = 232448  # dynamic shared memory one CTA may use on sm_90 (227 KB)
_SMEM_PER_SM = 233472  # shared memory of one sm_90 multiprocessor (228 KB, the per-CTA reservations included)
# The dynamic region's shared address as sm_90 places it (past the 1 KB reserved per CTA): the
# PRMT-addressed table's layout below assumes the region starts at most this far in.
_SMEM_BASE = 0x400


def coop_plan(plan: dict, layout: PagedLayout, stages: int = 2) -> dict | None:
    """``plan`` with CTA-cooperative stages (``COOP = stages``): one CTA per (sequence, split) with
    one warp per KV head, whose threads copy each step's 16 whole rows (all heads) into a ring of
    ``stages`` shared-memory stages with ``cp.async`` (coalesced 16-byte chunks), and every head-warp
    reads its fields from there. ``None`` where it does not apply: blocks not a multiple of 16
    tokens, a KV-head count that is not a power of two up to 16 (a CTA's warps), or stages (plus
    the pair table) beyond one CTA's shared memory. The stages live in the kernel's dynamic shared memory, which the
    launcher sizes (see :func:`coop_smem_bytes`). A plan of 4-bit keys whose CTA has the SM to
    itself anyway takes the PRMT-addressed table where it fits (:func:`table256_plan`). The values
    are read from the stage after each softmax update (``LATE_V = 1``, unless ``plan`` sets it):
    they then hold no registers across the scores."""
    if not isinstance(plan, dict):
        raise TypeError(f"plan must be a dict from mma_plan, got {type(plan).__name__}")
    if not isinstance(stages, int) or not 2 <= stages <= 8:
        raise ValueError(f"stages must be an int in 2..8, got {stages!r}")
    hkv = layout.num_kv_heads
    if layout.block_size % 16 or hkv > 16 or hkv & (hkv - 1):
        return None
    out = dict(plan, COOP=stages, RS=coop_row_stride(layout.row_bytes), SMEM_OFF=_COOP_SMEM_OFF,
               LATE_V=plan.get("LATE_V", 1))
    if coop_smem_bytes(out) > _SMEM_OPTIN:
        return None
    # One CTA per SM anyway (4-bit Lloyd-Max keys, whose table lookups are most of the loop): the
    # PRMT-addressed table if it fits beside the stages
    if out["K_BITS"] == 4 and coop_smem_bytes(out) + _SMEM_RESERVED > _SMEM_PER_SM // 2:
        out = table256_plan(out) or out
    return out


def table256_plan(plan: dict) -> dict | None:
    """A cooperative ``plan`` with the PRMT-addressed pair table (``LUT_AT``: entries 256 bytes
    apart from a shared address whose low 16 bits are 0, so that a byte's entry address is one
    PRMT of the code byte into this lane's base instead of a PRMT and an IMAD). The table takes 64
    KB at ``LUT_AT``; stages ``0 .. NLOW - 1`` lie below it (from ``SMEM_OFF``), the others right
    above it. ``None`` if no such layout fits one CTA's shared memory, or the plan's keys are not
    4-bit codes (3- and 5-bit keys index the table differently)."""
    if not isinstance(plan, dict) or not plan.get("COOP"):
        raise TypeError(f"plan must be a cooperative plan (a dict from coop_plan), got {plan!r:.80}")
    if plan["K_BITS"] != 4:
        return None
    stg = 16 * plan["SUB"] * plan["RS"]
    for at in (0x10000, 0x20000, 0x30000):
        nlow = min(plan["COOP"], max(0, (at - _SMEM_BASE - plan["SMEM_OFF"]) // stg))
        out = dict(plan, LUT_AT=at, NLOW=nlow)
        if coop_smem_bytes(out) <= _SMEM_OPTIN:
            return out
    return None


def coop_smem_bytes(plan: dict) -> int:
    """Dynamic shared memory of a cooperative plan's launch: Triton's scratch, the pair table, the
    stages, slack. (The table moves into the dynamic region with the stages: with a static table
    beside a dynamic region under 48 KB, no opt-in for more than 48 KB in all would be set.)"""
    if not isinstance(plan, dict) or not plan.get("COOP"):
        raise TypeError(f"plan must be a cooperative plan (a dict from coop_plan), got {plan!r:.80}")
    stg = 16 * plan["SUB"] * plan["RS"]
    if plan.get("LUT_AT"):  # up to the last stage above the table, counted from shared address 0
        return plan["LUT_AT"] + 65536 + (plan["COOP"] - plan["NLOW"]) * stg + _COOP_PAD
    return plan["SMEM_OFF"] + _LUT_BYTES * _needs_lut(plan) + plan["COOP"] * stg + _COOP_PAD


class DynamicSmemUnsupported(RuntimeError):
    """The compiled cooperative kernel's dynamic shared memory cannot be sized safely (an unknown
    Triton metadata layout, or Triton's scratch reaching into the stages)."""


_COOP_DISABLED: set = set()  # device indices on which a sizing failed: per-warp plans from then on


def disable_cooperative_stages(device) -> None:
    """Make :func:`device_plan` return per-warp plans for ``device`` from now on (the launcher calls
    this when :class:`DynamicSmemUnsupported` is raised, then launches the per-warp plan)."""
    _COOP_DISABLED.add(device.index or 0)


def _size_dynamic_smem(kernel, plan: dict) -> None:
    """Give the compiled cooperative kernel ``kernel`` its dynamic shared memory before its binary
    is loaded: Triton sizes a launch's dynamic shared memory (and, on load, the >48 KB opt-in)
    from ``metadata.shared``, which counts only Triton's own scratch; the stages are addressed by
    inline PTX past that scratch (``SMEM_OFF``)."""
    want = coop_smem_bytes(plan)
    md = kernel.metadata
    if md.shared == want:
        return
    if md.shared > plan["SMEM_OFF"]:
        raise DynamicSmemUnsupported(f"Triton's shared scratch ({md.shared} bytes) overlaps the stages at "
                                     f"{plan['SMEM_OFF']}")
    packed = getattr(kernel, "packed_metadata", None)
    if getattr(kernel, "module", None) is not None or not (isinstance(packed, tuple) and len(packed) == 3
                                                           and packed[2] == md.shared and hasattr(md, "_replace")):
        raise DynamicSmemUnsupported("cannot size this Triton version's dynamic shared memory (metadata layout "
                                     "unknown)")
    kernel.metadata = md._replace(shared=want)
    kernel.packed_metadata = packed[:2] + (want,)


def num_splits_mma(num_seqs: int, num_kv_heads: int, max_len: int, resident_warps: int) -> int:
    """Splits (one warp each) so that the launch is one full wave of ``resident_warps`` (the
    warps the GPU holds at once for this kernel), each split at least 256 tokens of the longest
    possible sequence, at most 64. Depends only on shapes (CUDA-graph safe).

    One wave measured best on the H100 (TQ4, B32×16K: 8 splits = 0.97 waves 245 µs; 16 splits
    = 1.94 waves 265 µs; 17 splits = 2.06 waves 301 µs)."""
    pairs = max(1, num_seqs * num_kv_heads)
    return int(max(1, min(resident_warps // pairs, max_len // 256, 64)))


def coop_row_stride(row_bytes: int) -> int:
    """Bytes between rows in a cooperative stage: rows of a multiple of 16 bytes padded to 16 mod
    32 (the value reads of a warp, 4 rows 2 apart, then fall in 4 different 32-byte bank groups);
    other rows unpadded (the stage is then a plain copy of the step's bytes)."""
    if not isinstance(row_bytes, int) or isinstance(row_bytes, bool) or row_bytes < 1:
        raise ValueError(f"row_bytes must be a positive int, got {row_bytes!r}")
    if row_bytes % 16:
        return row_bytes
    return row_bytes + (16 - row_bytes % 32) % 32


_LUT_BYTES, _SMEM_RESERVED = LUT_BYTES.value, 1024  # the pair table (inline PTX) and the per-CTA reservation


def _needs_lut(plan: dict) -> bool:
    """Whether the kernel declares the pair table (mirrors ``NEED_LUT`` in the kernel)."""
    return not (plan.get("K_FP8") and plan["V_UNIFORM"])


def _kernel_args(q_rot, cache, block_table, seq_lens, layout, plan, key_centroids_f32, acc, ml, group, num_splits,
                 sm_scale, warps, prefetch, hint, maxnreg=None, value_centroids_f32=None):
    s, hq, _ = q_rot.shape
    if plan.get("COOP"):  # one warp per KV head of a (sequence, split)
        warps = layout.num_kv_heads
    if prefetch is None:  # the ring holds the steps of one iteration (measured: SUB = 2 with 1 step slower)
        prefetch = plan["SUB"]
    # The value codebook is read only for 3-bit Lloyd-Max values next to 5-bit keys.
    vcen = value_centroids_f32 if plan["K_BITS"] == 5 and not plan["V_UNIFORM"] else key_centroids_f32
    args = (q_rot, cache, block_table, seq_lens, key_centroids_f32, vcen, acc, ml, s, block_table.shape[1],
            sm_scale * 1.4426950408889634, num_splits)
    kwargs = dict(G=group, HKV=layout.num_kv_heads, HQ=hq, WARPS=warps, BS=layout.block_size, PREFETCH=prefetch,
                  HINT=hint, **plan, num_warps=warps, num_stages=1)
    if maxnreg is None and plan.get("COOP"):  # two CTAs of 8 warps per SM
        maxnreg = 128
    if maxnreg is None:  # measured (H100): capped at 128 registers ~2% faster for aligned fields (no spill
        # inside the loop); with joined fields the kernel needs ~168 and a cap spills in the loop;
        # two steps per iteration (SUB = 2) hold a two-step ring: 168 (12 warps/SM) measured fastest
        maxnreg = 0 if plan["K_MERGE"] or plan["V_MERGE"] else 168 if plan["SUB"] == 2 else 128
    if maxnreg:
        kwargs["maxnreg"] = maxnreg
    return args, kwargs


def ctas_per_sm(kernel, warps: int, extra_smem: int, props) -> int:
    """CTAs of ``warps`` warps of a compiled Triton kernel that one SM holds at once: from its
    registers, its shared memory (plus ``extra_smem`` bytes declared outside Triton and the
    per-CTA reservation), the 64 warps and 32 CTAs per SM."""
    kernel._init_handles()  # loads the binary: n_regs
    per_warp = -(-int(kernel.n_regs) * 32 // 256) * 256
    smem = extra_smem + _SMEM_RESERVED + int(getattr(kernel.metadata, "shared", 0))
    smem_sm = int(getattr(props, "shared_memory_per_multiprocessor", 233472))
    return max(1, min(65536 // (per_warp * warps), smem_sm // smem, 64 // warps, 32))


_RESIDENT: dict = {}
_COOP_READY: set = set()


def _compile_key(q_rot, layout, plan, group, warps, prefetch, hint, maxnreg) -> tuple:
    """What a launch's compiled kernel depends on (cheap to hash: this runs on every launch); the
    key of :data:`_RESIDENT` and :data:`_COOP_READY`."""
    return (layout, tuple(plan.items()), group, q_rot.shape[1], warps, prefetch, hint, maxnreg,
            q_rot.device.index or 0)


def _compiled(args, kwargs, plan, key):
    """The compiled kernel of a launch (cooperative plans: with their dynamic shared memory sized,
    once per ``key``)."""
    if plan.get("COOP"):
        k = _paged_decode_coop_kernel.warmup(*args, grid=(1,), **kwargs)
        _size_dynamic_smem(k, plan)
        _COOP_READY.add(key)
        return k
    return _paged_decode_mma_kernel.warmup(*args, grid=(1,), **kwargs)


def resident_warps(q_rot, cache, block_table, seq_lens, layout, plan, key_centroids_f32, *, group: int,
                   warps: int = 4, prefetch: int | None = None, hint: int = 1, maxnreg: int | None = None,
                   value_centroids_f32=None) -> int:
    """Warps of this launch's compiled kernel that the GPU holds at once (from its registers and
    shared memory; compiled once, cached); a conservative 8 per SM if the compiled kernel cannot
    be inspected (that costs speed, never correctness)."""
    dev = q_rot.device.index or 0
    key = _compile_key(q_rot, layout, plan, group, warps, prefetch, hint, maxnreg)
    if key not in _RESIDENT:
        args, kwargs = _kernel_args(q_rot, cache, block_table, seq_lens, layout, plan, key_centroids_f32, q_rot,
                                    q_rot, group, 1, 1.0, warps, prefetch, hint, maxnreg, value_centroids_f32)
        props = torch.cuda.get_device_properties(dev)
        warps = kwargs["num_warps"]
        try:
            k = _compiled(args, kwargs, plan, key)  # (cooperative: the table is in metadata.shared)
            ctas = ctas_per_sm(k, warps, 0 if plan.get("COOP") else _LUT_BYTES * _needs_lut(plan), props)
        except Exception:  # noqa: BLE001
            if plan.get("COOP"):  # a cooperative plan must be sized before it can launch at all
                raise
            ctas = max(1, 8 // warps)
        _RESIDENT[key] = ctas * warps * props.multi_processor_count
    return _RESIDENT[key]


def _launch_paged_decode_mma(q_rot, cache, block_table, seq_lens, layout, plan, key_centroids_f32, acc, ml, *,
                             group: int, num_splits: int, sm_scale: float, warps: int = 4,
                             prefetch: int | None = None,
                             hint: int = 1, maxnreg: int | None = None, value_centroids_f32=None):
    """Launch the warp-MMA decode (partials only; the caller merges). ``value_centroids_f32`` is
    required for 3-bit Lloyd-Max values (5-bit keys). No checks."""
    s = q_rot.shape[0]
    total = s * layout.num_kv_heads * num_splits
    args, kwargs = _kernel_args(q_rot, cache, block_table, seq_lens, layout, plan, key_centroids_f32, acc, ml, group,
                                num_splits, sm_scale, warps, prefetch, hint, maxnreg, value_centroids_f32)
    if plan.get("COOP"):
        key = _compile_key(q_rot, layout, plan, group, warps, prefetch, hint, maxnreg)
        if key not in _COOP_READY:
            _compiled(args, kwargs, plan, key)
        _paged_decode_coop_kernel[(s * num_splits,)](*args, **kwargs)
    else:
        _paged_decode_mma_kernel[(triton.cdiv(total, warps),)](*args, **kwargs)
