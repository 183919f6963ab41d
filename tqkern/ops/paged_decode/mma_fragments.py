"""Register-level pieces of the warp-MMA decode kernel (:mod:`.mma_kernel`), one value per
thread (``[32·WARPS]``), mostly inline PTX: the code decoders (4-, 3- and 5-bit Lloyd-Max pairs
through the pair table of :mod:`.mma_table`, 2- and 3-bit value pairs, uniform codes as subnormal
fp16, FP8 pairs) that turn a lane's words into fp16 MMA fragments, ``mma.sync`` and the warp
reductions, the per-step math (scores, values, their scaling and soft-cap, the rescale). The
kernel's global reads of q and writes of a split's partials: :mod:`.mma_io`."""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.ops.paged_decode.mma_table import _entry_offset, _funnel, _lut1, _lut4, _lut_at, _lut_pair_at


# -- inline PTX helpers (each call is one value per thread) -----------------------------------
# Uniform codes, byte k of two words a, b: PRMT gathers [a.k, a.k, b.k, b.k]; the masks keep the
# low nibbles (the fp16 pair's mantissas: subnormals j·2^-24) or the high ones (16j·2^-24).
_UNI_ASM = tl.constexpr(
    "{\n.reg .b32 x;\n"
    + "".join(f"prmt.b32 x, $8, $9, 0x{4 + k}{4 + k}{k}{k};\nand.b32 ${k}, x, 0x000F000F;\n"
              f"and.b32 ${4 + k}, x, 0x00F000F0;\n" for k in range(4))
    + "}")


@triton.jit
def _k5_pair(y, p: tl.constexpr, lane4, kb):
    """fp16 pair of key codes ``2p``, ``2p + 1`` (5 bits each, chunk bits ``10p ..``): one lookup
    each in the key entries (``kb``: their base; ``lane4``: 4·lane) and one PRMT."""
    return _lut_pair_at(_entry_offset(y, 10 * p, 5, lane4), _entry_offset(y, 10 * p + 5, 5, lane4), kb)


@triton.jit
def _v3_index(xa, xb, k: tl.constexpr):
    """Pair-table index ``code_a | code_b << 3`` of 3-bit code ``k`` of two tokens (``xa``, ``xb``
    from :func:`_v3_words`: the chunk's 32-bit windows at bytes 0, 2, 4, ...): the first window
    that holds the code's bits ``3k .. 3k + 2``. (Shifting each code straight to its bits of the
    entry's byte offset, as :func:`~.mma_table._entry_offset` does, compiled to 8–16 more SASS
    instructions here: S59, offline.)"""
    S: tl.constexpr = ((3 * k - 14) // 16) * ((3 * k + 2) > 31)
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
    window at the code's byte from each token (``xa``, ``xb``: the chunk's 32-bit windows at bytes
    0, 2, 4, ... from :func:`_v3_words`, the first that holds the code's bytes) and one AND keeps
    the code's bits. (PRMT's selector and the mask are constants.)"""
    W: tl.constexpr = (3 * k) // 8
    P: tl.constexpr = (3 * k) % 8
    T: tl.constexpr = W + (P > 5)  # the code's last byte
    S: tl.constexpr = ((T - 2) // 2) * (T > 3)  # the window of bytes 2S .. 2S + 3 holds bytes W .. T
    O: tl.constexpr = W - 2 * S
    O2: tl.constexpr = O + (O < 3)
    SEL: tl.constexpr = O | (O2 << 4) | ((O + 4) << 8) | ((O2 + 4) << 12)
    MASK: tl.constexpr = (7 << P) | (7 << (16 + P))
    z = tl.zeros_like(xa[0])
    return tl.inline_asm_elementwise("{\nprmt.b32 $0, $1, $2, $3;\nand.b32 $0, $0, $4;\n}", "=r,r,r,r,r",
                                     [xa[S], xb[S], z + SEL, z + MASK], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _v3_words(x, NC: tl.constexpr):
    """A token's chunk of ``NC`` 3-bit value codes (aligned words ``x``) as the 32-bit windows at
    bytes 0, 2, 4, ... that :func:`_v3_index` and :func:`_uni3` read (the words, and between two
    words a funnel shift by 16 bits): through the window of the last code."""
    NWIN: tl.constexpr = ((3 * NC - 17) // 16) * ((3 * NC - 1) > 31) + 1
    res = (x[0],)
    for j in tl.static_range(1, NWIN):
        if j % 2 == 0:
            res = res + (x[j // 2],)
        else:
            res = res + (_funnel(x[j // 2], x[j // 2 + 1], tl.zeros_like(x[0]) + 16),)
    return res


@triton.jit
def _v2_merge(wa, wb):
    """Two tokens' 2-bit value chunks (one word each: code ``k`` at bits ``2k``) → pair-table
    indices ``code_a | code_b << 2`` of their even codes (nibble ``i``: code ``2i``) and of their
    odd codes (nibble ``i``: code ``2i + 1``)."""
    even = (wa & 0x33333333) | ((wb & 0x33333333) << 2)
    odd = ((wa >> 2) & 0x33333333) | (wb & -858993460)  # 0xCCCCCCCC
    return even, odd


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


def _xor_reduce_asm(op: str) -> str:
    """PTX reducing ``$1`` with ``op`` (``max.f32`` / ``add.f32``) over the 8 lanes that share
    ``l % 4`` (butterfly xor 4, 8, 16) into ``$0``."""
    return ("{\n.reg .f32 y;\n"
            f"shfl.sync.bfly.b32 y, $1, 4, 0x1f, -1;\n{op} $0, $1, y;\n"
            f"shfl.sync.bfly.b32 y, $0, 8, 0x1f, -1;\n{op} $0, $0, y;\n"
            f"shfl.sync.bfly.b32 y, $0, 16, 0x1f, -1;\n{op} $0, $0, y;\n}}")


_MAX8_ASM = tl.constexpr(_xor_reduce_asm("max.f32"))
_SUM8_ASM = tl.constexpr(_xor_reduce_asm("add.f32"))


@triton.jit
def _warp_max_r(x):
    """Max over the 8 lanes that share ``l % 4`` (xor 4, 8, 16)."""
    return tl.inline_asm_elementwise(_MAX8_ASM, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _warp_sum_r(x):
    """Sum over the 8 lanes that share ``l % 4``."""
    return tl.inline_asm_elementwise(_SUM8_ASM, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _shifted(w, sh, N: tl.constexpr):
    """``N`` words of the byte stream ``w`` (from :func:`.mma_loads._ld_span`) starting ``sh`` bits in."""
    res = ()
    for i in tl.static_range(N):
        res = res + (_funnel(w[i], w[i + 1], sh),)
    return res


@triton.jit
def _mma2(s, s2, a0, a1, a2, a3, qf, i: tl.constexpr, j: tl.constexpr, NQ: tl.constexpr, QT: tl.constexpr):
    """One decoded A fragment against the B fragments ``qf[i], qf[j]`` of each of the ``QT`` query
    column tiles (tile 1's at ``NQ + i``, ``NQ + j``): the decode work is shared by both tiles."""
    s = _mma(s, a0, a1, a2, a3, qf[i], qf[j])
    if QT == 2:
        s2 = _mma(s2, a0, a1, a2, a3, qf[NQ + i], qf[NQ + j])
    return s, s2


@triton.jit
def _scores(k0, k1, qf, kb, lane4, ones, k_sh, NKW: tl.constexpr, K_NC: tl.constexpr, K_FP8: tl.constexpr,
            K_BITS: tl.constexpr, NKT: tl.constexpr, K_FUN: tl.constexpr, E256: tl.constexpr = False,
            NQ: tl.constexpr = 0, QT: tl.constexpr = 1, KP: tl.constexpr = 0):
    """S^T (tokens r, r+8 × heads 2c, 2c+1) of each query column tile (``QT`` of them: the second's
    B fragments are ``qf[NQ ..]``; for ``QT = 1`` the second result repeats the first) and, for
    decode-time norm correction, ‖c‖² of the same tokens (all columns equal). FP8 keys: word
    ``i`` of the chunk is k-tile ``i`` (its bytes 0, 1 the MMA columns 2c, 2c+1; bytes 2, 3 the
    columns 2c+8, 2c+9). 3-bit keys: the chunk words shifted by ``k_sh`` bits, code pair ``p``
    (bits ``6p ..``) one table entry; k-tile ``i`` takes pairs ``2i`` (columns 2c, 2c+1) and
    ``2i + 1`` (2c+8, 2c+9). ``kb``: the base of the table's key entries (entry ``K_AT`` of the
    plan; 5-bit keys: their 32 single-code entries, or the 1024 code pairs); ``lane4``: this lane's
    bytes within an entry (4-bit keys read ``kb + lane4``; 3- and 5-bit fields are looked up by
    :func:`~.mma_table._entry_offset`)."""
    z = tl.zeros_like(lane4.to(tl.float32))
    s = (z, z, z, z)  # two independent accumulation chains (even / odd k-tiles)
    t = (z, z, z, z)
    s2 = (z, z, z, z)  # (the second column tile's)
    t2 = (z, z, z, z)
    n = (z, z, z, z)
    if K_FP8:
        for i in tl.static_range(NKW):
            pw = _fp8_pairs(k0[i])
            px = _fp8_pairs(k1[i])
            if i % 2 == 0:
                s, s2 = _mma2(s, s2, pw[0], px[0], pw[1], px[1], qf, 2 * i, 2 * i + 1, NQ, QT)
            else:
                t, t2 = _mma2(t, t2, pw[0], px[0], pw[1], px[1], qf, 2 * i, 2 * i + 1, NQ, QT)
    elif K_BITS == 3 or K_BITS == 5:  # code pair p: coordinates c·D/4 + 2p, + 1
        x = _shifted(k0, k_sh, NKW - (K_BITS == 3))  # 3-bit: one word loaded beyond the chunk
        y = _shifted(k1, k_sh, NKW - (K_BITS == 3))
        for i in tl.static_range(NKT):
            if K_BITS == 5 and KP:  # one lookup per pair of codes (the table's 1024 code pairs)
                a0 = _lut_at(_entry_offset(x, 20 * i, 10, lane4), kb)
                a1 = _lut_at(_entry_offset(y, 20 * i, 10, lane4), kb)
                a2 = _lut_at(_entry_offset(x, 20 * i + 10, 10, lane4), kb)
                a3 = _lut_at(_entry_offset(y, 20 * i + 10, 10, lane4), kb)
            elif K_BITS == 5:  # two single-code lookups per pair
                a0 = _k5_pair(x, 2 * i, lane4, kb)
                a1 = _k5_pair(y, 2 * i, lane4, kb)
                a2 = _k5_pair(x, 2 * i + 1, lane4, kb)
                a3 = _k5_pair(y, 2 * i + 1, lane4, kb)
            else:  # one pair lookup (6-bit field)
                a0 = _lut_at(_entry_offset(x, 12 * i, 6, lane4), kb)
                a1 = _lut_at(_entry_offset(y, 12 * i, 6, lane4), kb)
                a2 = _lut_at(_entry_offset(x, 12 * i + 6, 6, lane4), kb)
                a3 = _lut_at(_entry_offset(y, 12 * i + 6, 6, lane4), kb)
            if i % 2 == 0:
                s, s2 = _mma2(s, s2, a0, a1, a2, a3, qf, 2 * i, 2 * i + 1, NQ, QT)
            else:
                t, t2 = _mma2(t, t2, a0, a1, a2, a3, qf, 2 * i, 2 * i + 1, NQ, QT)
            if K_NC:
                n = _mma(n, _sq(a0), _sq(a1), _sq(a2), _sq(a3), ones, ones)
    else:
        if K_FUN:  # the chunk's words from the words that hold it
            k0 = _shifted(k0, k_sh, NKW)
            k1 = _shifted(k1, k_sh, NKW)
        lb = kb + lane4  # this lane's base of the key entries
        for i in tl.static_range(NKW):
            pw = _lut4(k0[i], lb, E256)  # chunk bytes 4i..4i+3 of token r
            px = _lut4(k1[i], lb, E256)  # ... of token r + 8
            s, s2 = _mma2(s, s2, pw[0], px[0], pw[1], px[1], qf, 4 * i, 4 * i + 1, NQ, QT)
            t, t2 = _mma2(t, t2, pw[2], px[2], pw[3], px[3], qf, 4 * i + 2, 4 * i + 3, NQ, QT)
            if K_NC:
                n = _mma(n, _sq(pw[0]), _sq(px[0]), _sq(pw[1]), _sq(px[1]), ones, ones)
                n = _mma(n, _sq(pw[2]), _sq(px[2]), _sq(pw[3]), _sq(px[3]), ones, ones)
    sv = (s[0] + t[0], s[1] + t[1], s[2] + t[2], s[3] + t[3])
    if QT == 2:
        return sv, (s2[0] + t2[0], s2[1] + t2[1], s2[2] + t2[2], s2[3] + t2[3]), n
    return sv, sv, n


@triton.jit
def _acc2(o, o2, res, res2, b: tl.constexpr, a0, a1, a2, a3, pb0, pb1, pc0, pc1, QT: tl.constexpr):
    """M tile at ``o[b .. b + 3]``: one decoded A fragment against each column tile's P^T."""
    acc = _mma((o[b], o[b + 1], o[b + 2], o[b + 3]), a0, a1, a2, a3, pb0, pb1)
    res = res + (acc[0], acc[1], acc[2], acc[3])
    if QT == 2:
        acc = _mma((o2[b], o2[b + 1], o2[b + 2], o2[b + 3]), a0, a1, a2, a3, pc0, pc1)
        res2 = res2 + (acc[0], acc[1], acc[2], acc[3])
    return res, res2


@triton.jit
def _values(o, o2, v0, v1, v2, v3, pb0, pb1, pc0, pc1, lb, vb, lane4, v_sh_e, v_sh_o, NVW: tl.constexpr,
            CV: tl.constexpr, V_UNIFORM: tl.constexpr, V_FUN: tl.constexpr, V_BITS: tl.constexpr, NMT: tl.constexpr,
            E256: tl.constexpr = False, QT: tl.constexpr = 1):
    """O^T += V^T·P^T over the lane's chunk (4-bit: M tile i ← chunk byte i; 3- and 2-bit: M tile
    i ← codes 2i (row r) and 2i + 1 (row r + 8) of the chunk), for each query column tile (``QT = 2``:
    ``o2 += V^T·(pc0, pc1)`` with the same decoded fragments; else ``o2``/``pc*`` are not read).
    Shifted chunks (``V_FUN``) are aligned first (even tokens by ``v_sh_e`` bits, odd ones by
    ``v_sh_o``). ``lb``: this lane's base of the table (value pairs at entry 0); ``vb``: the
    table's base, ``lane4``: 4·lane (2-bit pairs are looked up by :func:`~.mma_table._entry_offset`).
    Returns ``(o, o2)``."""
    TPW: tl.constexpr = 4 if CV >= 4 else CV  # M tiles per 32-bit word of the chunk
    res = ()
    res2 = ()
    if V_FUN:  # the chunks' words from the words that hold them (3-bit values: always)
        v0 = _shifted(v0, v_sh_e, (CV + 3) // 4)
        v1 = _shifted(v1, v_sh_o, (CV + 3) // 4)
        v2 = _shifted(v2, v_sh_e, (CV + 3) // 4)
        v3 = _shifted(v3, v_sh_o, (CV + 3) // 4)
    if V_BITS == 2:  # Lloyd-Max: the pair table's entries 0..15 (token pairs of 2-bit codes); word w of the
        for w in tl.static_range((NMT + 7) // 8):  # chunk holds M tiles 8w .. 8w + 7 (head_dim 256: two words)
            ev_ab, od_ab = _v2_merge(v0[w], v1[w])
            ev_cd, od_cd = _v2_merge(v2[w], v3[w])
            for i in tl.static_range(8):
                if 8 * w + i < NMT:
                    a0 = _lut_at(_entry_offset((ev_ab,), 4 * i, 4, lane4), vb)
                    a1 = _lut_at(_entry_offset((od_ab,), 4 * i, 4, lane4), vb)
                    a2 = _lut_at(_entry_offset((ev_cd,), 4 * i, 4, lane4), vb)
                    a3 = _lut_at(_entry_offset((od_cd,), 4 * i, 4, lane4), vb)
                    res, res2 = _acc2(o, o2, res, res2, 4 * (8 * w + i), a0, a1, a2, a3, pb0, pb1, pc0, pc1, QT)
    elif V_BITS == 3:
        xa = _v3_words(v0, 2 * NMT)
        xb = _v3_words(v1, 2 * NMT)
        xc = _v3_words(v2, 2 * NMT)
        xd = _v3_words(v3, 2 * NMT)
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
            res, res2 = _acc2(o, o2, res, res2, 4 * i, a0, a1, a2, a3, pb0, pb1, pc0, pc1, QT)
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
            for k in tl.static_range(TPW):  # M tile 4w + k (head_dim 96: the last word holds two)
                if 4 * w + k < NMT:
                    res, res2 = _acc2(o, o2, res, res2, 16 * w + 4 * k, lo_ab[k], hi_ab[k], lo_cd[k], hi_cd[k], pb0,
                                      pb1, pc0, pc1, QT)
    if QT == 2:
        return res, res2
    return res, o2


@triton.jit
def _scaled_scores(sv, cn, fac, ok0, ok1, sm_scale_log2, K_NC: tl.constexpr, SOFTCAP: tl.constexpr, softcap_scale,
                   softcap_cap):
    """Base-2 scores of tokens r (``ok0``) and r + 8 (``ok1``), heads 2c / 2c+1: the key factors
    (and the decode-time norm correction) applied, −inf outside the range. ``SOFTCAP``: the
    logit a becomes c·tanh(a/c), in base 2 ``softcap_cap·tanh`` with ``softcap_cap = c·log2(e)``
    and y = ``softcap_scale``·(the dot) = 2·log2(e)·a/c, as the general kernel computes it."""
    mul = softcap_scale if SOFTCAP else sm_scale_log2
    f0 = fac[0] * mul
    f1 = fac[1] * mul
    if K_NC:
        f0 = f0 * tl.rsqrt(tl.maximum(cn[0], 1e-30))
        f1 = f1 * tl.rsqrt(tl.maximum(cn[2], 1e-30))
    a0 = sv[0] * f0
    a1 = sv[1] * f0
    a2 = sv[2] * f1
    a3 = sv[3] * f1
    if SOFTCAP:
        a0 = _softcap(a0, softcap_cap)
        a1 = _softcap(a1, softcap_cap)
        a2 = _softcap(a2, softcap_cap)
        a3 = _softcap(a3, softcap_cap)
    return (tl.where(ok0, a0, float("-inf")), tl.where(ok0, a1, float("-inf")),
            tl.where(ok1, a2, float("-inf")), tl.where(ok1, a3, float("-inf")))


@triton.jit
def _softcap(y, cap):
    """``cap·tanh(a/c)`` of ``y = 2·log2(e)·a/c``: with t = 2^−|y| = e^(−2|a|/c), tanh(|a|/c) =
    (1 − t)/(1 + t), signed (no overflow for any y; the general kernel's form)."""
    t = tl.exp2(-tl.abs(y))
    th = (1.0 - t) / (1.0 + t)
    return tl.where(y < 0, -th, th) * cap


@triton.jit
def _accumulate(x_e, x_o, a_e, a_o, add_e, add_o, FIRST: tl.constexpr):
    """Running per-column sums (columns 2c, 2c+1) plus this step's terms, rescaled by the softmax
    correction factors ``a_e``/``a_o`` on the first step of an update (``FIRST``)."""
    if FIRST:
        return x_e * a_e + add_e, x_o * a_o + add_o
    return x_e + add_e, x_o + add_o


@triton.jit
def _rescale(o, be, bo, NMT: tl.constexpr):
    """O^T columns 2c (×be) and 2c+1 (×bo). (Skipping this when every factor is 1, by a
    warp-uniform branch, measured 2-3% slower on the H100: the branch splits ptxas's scheduling
    region in the middle of the loop.)"""
    res = ()
    for i in tl.static_range(NMT):
        res = res + (o[4 * i] * be, o[4 * i + 1] * bo, o[4 * i + 2] * be, o[4 * i + 3] * bo)
    return res
