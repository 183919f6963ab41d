"""The warp-MMA decode kernel's (:mod:`.mma_kernel`) traffic outside the cache, one value per
thread: q's fragments read 16 bytes at a time (:func:`_q_pairs`), a lane's coordinates
(:func:`_dim_of`) and the store of a split's partials as 16-byte runs (:func:`_store_partials`)."""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.ops.paged_decode.mma_fragments import _pack2, _warp_sum_r
from tqkern.ops.paged_decode.mma_loads import _ld_words


@triton.jit
def _q_pairs(ptr, ok, SWAP: tl.constexpr):
    """The q fragments of coordinates (0, 1) and (2, 3) at ``ptr`` (four float32, 16-byte
    aligned): two fp16x2 registers, the first coordinate low (``SWAP``: high, nibble order);
    zeros where ``ok`` is false. One 16-byte load (not four 4-byte ones)."""
    w = _ld_words(ptr, ok, 4, 0)
    x0 = w[0].to(tl.float32, bitcast=True)
    x1 = w[1].to(tl.float32, bitcast=True)
    x2 = w[2].to(tl.float32, bitcast=True)
    x3 = w[3].to(tl.float32, bitcast=True)
    if SWAP:
        return _pack2(x1, x0), _pack2(x3, x2)
    return _pack2(x0, x1), _pack2(x2, x3)


@triton.jit
def _dim_of(f, e, NIBBLE: tl.constexpr):
    """Coordinate of nibble ``e`` (0 low, 1 high) of field byte ``f``."""
    if NIBBLE:
        return 2 * f + 1 - e
    return 2 * f + e


_ST4 = tl.constexpr("{\n.reg .pred p;\nsetp.ne.b32 p, $6, 0;\n@p st.global.v4.b32 [$1], {$2, $3, $4, $5};\n"
                    "mov.b32 $0, 0;\n}")


@triton.jit
def _store4(ptr, x0, x1, x2, x3, pred):
    """One 16-byte store of four float32 values at ``ptr`` (16-byte aligned) where ``pred`` holds."""
    w0 = x0.to(tl.int32, bitcast=True)
    w1 = x1.to(tl.int32, bitcast=True)
    w2 = x2.to(tl.int32, bitcast=True)
    w3 = x3.to(tl.int32, bitcast=True)
    tl.inline_asm_elementwise(_ST4, "=r,l,r,r,r,r,r", [ptr, w0, w1, w2, w3, pred.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _store_partials(acc_ptr, ml_ptr, o, m_e, m_o, l_e, l_o, z_e, z_o, vmax, head_e, split, live, r, c, v_mis,
                    NUM_SPLITS, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NIBBLE: tl.constexpr,
                    V_UNIFORM: tl.constexpr, V_BITS: tl.constexpr, V_FUN: tl.constexpr, CV: tl.constexpr,
                    NMT: tl.constexpr):
    """One query column tile's partials: O^T (heads ``head_e`` = query head of column 2c, and the
    next), its running max and sum (reduced over the warp here) for this split.

    Lane (r, c) holds coordinates ``d_lo``, ``d_hi`` of M tile i (i < D/16) for both heads: one run
    of D/8 coordinates, consecutive mod D from a multiple of 4 (2- and 3-bit values and shifted
    values: from ``r·D/8``; 4-bit values read in place: from ``2·((CV·(r + 1) − v_mis) mod 8·CV)``,
    ``v_mis`` even and D a multiple of 32, so that no 4 of them wrap), written as D/32 16-byte
    stores per head. (One 4-byte store per value, whose 32 lanes land in 32 sectors, cost a
    batch-1 call 2.2–6.2 µs of its 10–18 at 0 tokens a split on the H200: session 64.)"""
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
    part_e = head_e.to(tl.int64) * NUM_SPLITS + split
    part_o = part_e + NUM_SPLITS
    ok_e = live & (2 * c < G)
    ok_o = live & (2 * c + 1 < G)
    run_e = ()  # the run's values in coordinate order (heads 2c, 2c + 1)
    run_o = ()
    for i in tl.static_range(NMT):
        if V_BITS != 4:  # codes 2i, 2i + 1 of the lane's chunk; uniform code k was code·2^(3k mod 8 - 24)
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
        # coordinates 2i and 2i + 1 of the run: (d_lo, d_hi), swapped in nibble order
        lo_e = o[4 * i] * s_lo + z_e
        lo_o = o[4 * i + 1] * s_lo + z_o
        hi_e = o[4 * i + 2] * s_hi + z_e
        hi_o = o[4 * i + 3] * s_hi + z_o
        if NIBBLE and V_BITS == 4:
            run_e = run_e + (hi_e, lo_e)
            run_o = run_o + (hi_o, lo_o)
        else:
            run_e = run_e + (lo_e, hi_e)
            run_o = run_o + (lo_o, hi_o)
        if i == 0:
            d_run = tl.minimum(d_lo, d_hi)
    tl.static_assert(D % 32 == 0)
    for k in tl.static_range(D // 32):
        if V_BITS == 4 and not V_FUN:  # (runs of chunks read in place wrap at D; the others end below it)
            dk = (d_run + 4 * k) % D
        else:
            dk = d_run + 4 * k
        _store4(acc_ptr + part_e * DP + dk, run_e[4 * k], run_e[4 * k + 1], run_e[4 * k + 2], run_e[4 * k + 3], ok_e)
        _store4(acc_ptr + part_o * DP + dk, run_o[4 * k], run_o[4 * k + 1], run_o[4 * k + 2], run_o[4 * k + 3], ok_o)
    first = r == 0
    tl.store(ml_ptr + part_e * 2, tl.where(l_e > 0, m_e, float("-inf")), mask=ok_e & first)
    tl.store(ml_ptr + part_e * 2 + 1, l_e, mask=ok_e & first)
    tl.store(ml_ptr + part_o * 2, tl.where(l_o > 0, m_o, float("-inf")), mask=ok_o & first)
    tl.store(ml_ptr + part_o * 2 + 1, l_o, mask=ok_o & first)
