"""Split-KV, GQA-shared paged decode over a compressed cache (every codec, both arrangements).

Grid ``(num_seqs, num_kv_heads, num_splits)``. A program owns one KV head and stacks the G query
heads of its GQA group into one ``[GP, D]`` tensor-core tile, so every slot is read and decoded
once for the whole group. It walks its share of the sequence in tiles of ``BN`` tokens with an
online softmax and writes an unnormalised partial (acc, max, sum) to a workspace; a second small
kernel merges the splits by log-sum-exp and rotates the result back (``@ Πᵀ``) when the value
codec is rotated.

Per-token scalars never touch the per-element loop: with a key decoded as ``f·c + z`` (f the
norm, gain, uniform scale or FP8's 2^8; z the uniform zero point) the score is
``f·(q·c) + z·Σq``; the value's f and z are folded into the probabilities the same way. For 4-bit
codes whose nibbles pair up (``lsb`` or ``nibble_high_even`` with D a power of two) the tile is
never interleaved: the two nibbles of each byte give two half-width tiles that meet the even and
odd halves of q (and of the output) in two dots.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from tqkern.errors import ErrorFlag
from tqkern.layouts import PagedLayout
from tqkern.ops.common import bits_to_f32, halfword_aligned, layout_consts, load_bytes, load_packed, load_param
from tqkern.ops.paged_decode._ptx import _LUT_ASM_LSB, _LUT_ASM_NIBBLE, _UNI_ASM_LSB, _UNI_ASM_NIBBLE, _prmt_tables
from tqkern.ops.paged_decode import triton_mma as _tm
from tqkern.ops.paged_decode.triton_mma import (DynamicSmemUnsupported, _launch_paged_decode_mma, ctas_per_sm,
                                                device_plan, disable_cooperative_stages, mma_plan, num_splits_mma,
                                                per_warp_plan, resident_warps)

_ERR_BLOCK = tl.constexpr(int(ErrorFlag.BLOCK_OUT_OF_RANGE))
_ERR_SEQ_LEN = tl.constexpr(int(ErrorFlag.SEQ_LEN_OUT_OF_RANGE))

__all__ = ["_paged_decode_kernel", "_merge_kernel", "_launch_paged_decode", "num_splits_for", "fast_path_plan",
           "decode_path", "rotate_q", "merge_chunks", "check_workspace"]


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
def _centroids(codes, cen_ptr, BITS: tl.constexpr):
    if BITS == 4:
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
def _tile_codes(row, h, tmask, W: tl.constexpr, HALF: tl.constexpr, NIBBLE: tl.constexpr,
                KIND: tl.constexpr, BITS: tl.constexpr, PARAM_DTYPE: tl.constexpr,
                A_OFF: tl.constexpr, A_STRIDE: tl.constexpr, A_BYTES: tl.constexpr, D: tl.constexpr,
                DP: tl.constexpr, cen_ptr, DOT: tl.constexpr, ALIGNED: tl.constexpr):
    """Element values of one tile, before the per-token factor: ``[BN, W]`` in the dot dtype.

    ``HALF`` = -1: all DP columns; 0: even columns; 1: odd columns (4-bit fast path)."""
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
        if KIND == 2:  # FP8 E4M3 → fp16 bits of value·2^-8 (the 2^8 joins the per-token factor)
            code = tl.load(base[:, None] + cols[None, :], mask=tmask[:, None] & dm[None, :], other=0).to(tl.int32)
            bits = ((code & 0x7F) << 7) | ((code & 0x80) << 8)
            return bits.to(tl.int16).to(tl.float16, bitcast=True).to(DOT)
        elif KIND == 3:  # raw fp16 / bf16
            m2 = tmask[:, None] & dm[None, :]
            if ALIGNED:
                p16 = base.to(tl.pointer_type(tl.int16))
                w = tl.load(p16[:, None] + cols[None, :], mask=m2, other=0)
                if PARAM_DTYPE == 2:
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
        if KIND == 0:  # padded columns must read 0 (they enter ‖c[idx]‖)
            return tl.where(dm[None, :], _centroids(codes, cen_ptr, BITS), 0.0).to(DOT)
    if KIND == 0:
        return _centroids(codes, cen_ptr, BITS).to(DOT)
    return _small_ints(codes, DOT)


@triton.jit
def _decode_words(w, cen_ptr, tabs, KIND: tl.constexpr, NIBBLE: tl.constexpr, USE_ASM: tl.constexpr):
    """int32 words ``[BN, NW]`` of 4-bit codes → fp16 values ``[BN, 8·NW]`` in code order.

    KIND 0: centroid c[code]; KIND 1: the integer code. ``USE_ASM`` False (the interpreter) computes
    the same values with shifts and the select tree."""
    BN: tl.constexpr = w.shape[0]
    NW: tl.constexpr = w.shape[1]
    if USE_ASM:
        if KIND == 0:
            asm: tl.constexpr = _LUT_ASM_NIBBLE if NIBBLE else _LUT_ASM_LSB
            p = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                          [w, tabs[0], tabs[1], tabs[2], tabs[3], tabs[4], tabs[5], tabs[6],
                                           tabs[7]], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
        else:
            asm: tl.constexpr = _UNI_ASM_NIBBLE if NIBBLE else _UNI_ASM_LSB
            p = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r", [w], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
        # pairs in code order: [BN, NW, 2, 2] → [BN, 4·NW] (pair 4i + k holds codes 8i + 2k, +1)
        pairs = tl.reshape(tl.join(tl.join(p[0], p[2]), tl.join(p[1], p[3])), (BN, NW * 4))
        # reinterpret each int32 pair as two fp16 (a register move: pack=2 hands the asm the two
        # in-thread copies made by the join, and it returns their 32 bits as two fp16)
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [tl.join(pairs, pairs)], dtype=tl.float16,
                                      is_pure=True, pack=2)
        return tl.reshape(x, (BN, NW * 8))
    r = tl.arange(0, 8)
    if NIBBLE:
        sh = 4 * (r ^ 1)
    else:
        sh = 4 * r
    codes = tl.reshape((w[:, :, None] >> sh[None, None, :]) & 15, (BN, NW * 8))
    if KIND == 0:
        return _lut16(codes, cen_ptr).to(tl.float16)
    return _small_ints(codes, tl.float16)


@triton.jit
def _fast_tile(row, h, tmask, U: tl.constexpr, A_OFF: tl.constexpr, A_STRIDE: tl.constexpr, D: tl.constexpr,
               NIBBLE: tl.constexpr, KIND: tl.constexpr, cen_ptr, tabs, USE_ASM: tl.constexpr):
    """A 4-bit side's tile ``[BN, D]`` fp16 read as 32-bit words.

    U = 4: the field is 4-byte aligned in every row and head. U = 2: rows are 4-byte aligned and
    the field 2-byte aligned (vLLM's 134-byte slots put every other head at offset 2 mod 4): two
    aligned word loads and a funnel shift by this head's misalignment (the second load is masked
    off when the head is aligned; when it is not, its last word ends 2 bytes past the field,
    inside the same row because the row length is a multiple of 4 and the field's end is not).
    U = 1: two 16-bit loads per word."""
    a = A_OFF + h * A_STRIDE
    NW: tl.constexpr = D // 8
    i = tl.arange(0, NW)
    if U == 4:
        p32 = (row + a).to(tl.pointer_type(tl.int32))
        w = tl.load(p32[:, None] + i[None, :], mask=tmask[:, None], other=0)
    elif U == 2:
        mis = a % 4
        p32 = (row + (a - mis)).to(tl.pointer_type(tl.int32))
        lo = tl.load(p32[:, None] + i[None, :], mask=tmask[:, None], other=0)
        need_hi = (i * 0 + mis) != 0  # (a tensor: the interpreter cannot AND a mask with a scalar)
        hi = tl.load(p32[:, None] + i[None, :] + 1, mask=tmask[:, None] & need_hi[None, :], other=0)
        both = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
        w = (both >> (8 * mis)).to(tl.int32)
    else:
        base = row + a
        p16 = base.to(tl.pointer_type(tl.int16))
        lo = tl.load(p16[:, None] + 2 * i[None, :], mask=tmask[:, None], other=0).to(tl.int32) & 0xFFFF
        hi = tl.load(p16[:, None] + 2 * i[None, :] + 1, mask=tmask[:, None], other=0).to(tl.int32)
        w = lo | (hi << 16)
    return _decode_words(w, cen_ptr, tabs, KIND, NIBBLE, USE_ASM)


@triton.jit
def _whole_tile(row, h, tmask, FAST: tl.constexpr, NIBBLE: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                PARAM_DTYPE: tl.constexpr, A_OFF: tl.constexpr, A_STRIDE: tl.constexpr, A_BYTES: tl.constexpr,
                D: tl.constexpr, DP: tl.constexpr, cen_ptr, tabs, DOT: tl.constexpr, ALIGNED: tl.constexpr,
                USE_ASM: tl.constexpr):
    """One side's whole tile ``[BN, DP]`` before its per-token factor: the 4-bit word path when
    ``FAST`` names a read plan, else the general decode."""
    if FAST > 0:
        return _fast_tile(row, h, tmask, FAST, A_OFF, A_STRIDE, D, NIBBLE, KIND, cen_ptr, tabs, USE_ASM)
    return _tile_codes(row, h, tmask, DP, -1, NIBBLE, KIND, BITS, PARAM_DTYPE, A_OFF, A_STRIDE, A_BYTES, D, DP,
                       cen_ptr, DOT, ALIGNED)


@triton.jit
def _half_tiles(row, h, tmask, NIBBLE: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                PARAM_DTYPE: tl.constexpr, A_OFF: tl.constexpr, A_STRIDE: tl.constexpr, A_BYTES: tl.constexpr,
                D: tl.constexpr, DP: tl.constexpr, cen_ptr, DOT: tl.constexpr, ALIGNED: tl.constexpr):
    """A 4-bit side as its even and odd columns, two ``[BN, DP/2]`` tiles (one per nibble)."""
    D2: tl.constexpr = DP // 2
    e = _tile_codes(row, h, tmask, D2, 0, NIBBLE, KIND, BITS, PARAM_DTYPE, A_OFF, A_STRIDE, A_BYTES, D, DP,
                    cen_ptr, DOT, ALIGNED)
    o = _tile_codes(row, h, tmask, D2, 1, NIBBLE, KIND, BITS, PARAM_DTYPE, A_OFF, A_STRIDE, A_BYTES, D, DP,
                    cen_ptr, DOT, ALIGNED)
    return e, o


@triton.jit
def _token_factors(row, h, tmask, KIND: tl.constexpr, PARAM_DTYPE: tl.constexpr, B_OFF: tl.constexpr,
                   B_STRIDE: tl.constexpr, C_OFF: tl.constexpr, C_STRIDE: tl.constexpr,
                   PAR_ALIGNED: tl.constexpr = False):
    """Per-token (factor f, zero z) with value = f·tile + z, float32 ``[BN]``."""
    zero = tl.zeros_like(tmask.to(tl.float32))
    if KIND == 0:  # the norm field (vLLM's ‖c[idx]‖ divisor is applied by the caller)
        f = load_param(row + B_OFF + h * B_STRIDE, PARAM_DTYPE, tmask, PAR_ALIGNED)
        return f, zero
    elif KIND == 1:
        f = load_param(row + B_OFF + h * B_STRIDE, PARAM_DTYPE, tmask, PAR_ALIGNED)
        z = load_param(row + C_OFF + h * C_STRIDE, PARAM_DTYPE, tmask, PAR_ALIGNED)
        return f, z
    elif KIND == 2:
        return zero + 256.0, zero
    else:
        return zero + 1.0, zero


@triton.jit(do_not_specialize=["zero"])
def _paged_decode_kernel(
    q_ptr, cache_ptr, bt_ptr, sl_ptr, kc_ptr, vc_ptr, acc_ptr, ml_ptr,
    max_blocks, sm_scale_log2, zero,
    G: tl.constexpr, GP: tl.constexpr, HQ: tl.constexpr, NUM_SPLITS: tl.constexpr, BN: tl.constexpr,
    BS: tl.constexpr, K_HALVES: tl.constexpr, V_HALVES: tl.constexpr, DOT: tl.constexpr,
    K_ALIGNED: tl.constexpr, V_ALIGNED: tl.constexpr, K_FAST: tl.constexpr, V_FAST: tl.constexpr, USE_ASM: tl.constexpr,
    K_PAR_ALIGNED: tl.constexpr, V_PAR_ALIGNED: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, ROW_BYTES: tl.constexpr, NIBBLE: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_ROTATED: tl.constexpr, K_NORM_CORRECTION: tl.constexpr,
    K_PARAM_DTYPE: tl.constexpr, K_A_OFF: tl.constexpr, K_A_STRIDE: tl.constexpr, K_A_BYTES: tl.constexpr,
    K_B_OFF: tl.constexpr, K_B_STRIDE: tl.constexpr, K_C_OFF: tl.constexpr, K_C_STRIDE: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_ROTATED: tl.constexpr, V_NORM_CORRECTION: tl.constexpr,
    V_PARAM_DTYPE: tl.constexpr, V_A_OFF: tl.constexpr, V_A_STRIDE: tl.constexpr, V_A_BYTES: tl.constexpr,
    V_B_OFF: tl.constexpr, V_B_STRIDE: tl.constexpr, V_C_OFF: tl.constexpr, V_C_STRIDE: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    D2: tl.constexpr = DP // 2
    g = tl.arange(0, GP)
    gm = g < G
    qh = h * G + g  # query heads of this group
    q_row = q_ptr + (s * HQ + qh).to(tl.int64)[:, None] * D  # q is float32 [S, HQ, D], rotated
    cols = tl.arange(0, DP)
    if K_HALVES:
        j = tl.arange(0, D2)
        q_e = tl.load(q_row + 2 * j[None, :], mask=gm[:, None], other=0.0)
        q_o = tl.load(q_row + 2 * j[None, :] + 1, mask=gm[:, None], other=0.0)
        q_sum = tl.sum(q_e, axis=1) + tl.sum(q_o, axis=1)
        q_e = q_e.to(DOT)
        q_o = q_o.to(DOT)
    else:
        q_f = tl.load(q_row + cols[None, :], mask=gm[:, None] & (cols < D)[None, :], other=0.0)
        q_sum = tl.sum(q_f, axis=1)
        q_f = q_f.to(DOT)

    k_tabs = _prmt_tables(kc_ptr, K_KIND if K_FAST > 0 else 1)
    v_tabs = _prmt_tables(vc_ptr, V_KIND if V_FAST > 0 else 1)

    seq_len = tl.minimum(tl.maximum(tl.load(sl_ptr + s), 0), max_blocks * BS)  # (a bad length: clamped)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BN) * BN
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    if V_HALVES:
        acc_e = tl.zeros([GP, D2], tl.float32)
        acc_o = tl.zeros([GP, D2], tl.float32)
    else:
        acc = tl.zeros([GP, DP], tl.float32)
    n_off = tl.arange(0, BN)
    bt_row = bt_ptr + s.to(tl.int64) * max_blocks
    for t0 in range(start, end, BN):
        pos = t0 + n_off
        tmask = pos < end
        blk = tl.load(bt_row + pos // BS, mask=tmask, other=0).to(tl.int64)
        # `zero` (a runtime 0 Triton may not specialize) keeps the compiler from deriving a
        # 16-byte alignment for every row from `pos % BS` (Triton 3.6 carries the divisibility
        # of contiguous groups through the multiply; compute-sanitizer caught the misaligned
        # 16-byte loads this produced for ROW_BYTES = 216).
        row = cache_ptr + (blk * BS + (pos + zero) % BS) * ROW_BYTES  # [BN] token rows

        # -- scores [GP, BN] ------------------------------------------------------------------
        kf, kz = _token_factors(row, h, tmask, K_KIND, K_PARAM_DTYPE, K_B_OFF, K_B_STRIDE, K_C_OFF, K_C_STRIDE,
                                K_PAR_ALIGNED)
        if K_HALVES:
            k_e, k_o = _half_tiles(row, h, tmask, NIBBLE, K_KIND, K_BITS, K_PARAM_DTYPE, K_A_OFF, K_A_STRIDE,
                                     K_A_BYTES, D, DP, kc_ptr, DOT, K_ALIGNED)
            qk = tl.dot(q_e, tl.trans(k_e)) + tl.dot(q_o, tl.trans(k_o))
            if K_NORM_CORRECTION == 1:  # vLLM's _nc: ‖c[idx]‖² of every token by the tensor
                # cores (a ones-row times the squared tile), already broadcast to [GP, BN]:
                # a row reduction over the tile measured ~2 ms at B32x16K.
                ones = tl.full([GP, D2], 1.0, DOT)
                cn2 = tl.dot(ones, tl.trans(k_e * k_e)) + tl.dot(ones, tl.trans(k_o * k_o))
                qk = qk * tl.rsqrt(tl.maximum(cn2, 1e-30))
        else:
            k_f = _whole_tile(row, h, tmask, K_FAST, NIBBLE, K_KIND, K_BITS, K_PARAM_DTYPE, K_A_OFF, K_A_STRIDE,
                              K_A_BYTES, D, DP, kc_ptr, k_tabs, DOT, K_ALIGNED, USE_ASM)
            qk = tl.dot(q_f, tl.trans(k_f))
            if K_NORM_CORRECTION == 1:
                cn2 = tl.dot(tl.full([GP, DP], 1.0, DOT), tl.trans(k_f * k_f))
                qk = qk * tl.rsqrt(tl.maximum(cn2, 1e-30))
        sc = (qk * kf[None, :] + q_sum[:, None] * kz[None, :]) * sm_scale_log2
        sc = tl.where(tmask[None, :], sc, float("-inf"))

        # -- online softmax (base 2) -------------------------------------------------------------
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        # -- values: p·f into the dot (scaled to the tile's largest f), p·z added per row -----
        vf, vz = _token_factors(row, h, tmask, V_KIND, V_PARAM_DTYPE, V_B_OFF, V_B_STRIDE, V_C_OFF, V_C_STRIDE,
                                V_PAR_ALIGNED)
        if V_HALVES:
            v_e, v_o = _half_tiles(row, h, tmask, NIBBLE, V_KIND, V_BITS, V_PARAM_DTYPE, V_A_OFF, V_A_STRIDE,
                                     V_A_BYTES, D, DP, vc_ptr, DOT, V_ALIGNED)
            if V_NORM_CORRECTION == 1:
                ve32 = v_e.to(tl.float32)
                vo32 = v_o.to(tl.float32)
                vf = vf / tl.sqrt(tl.maximum(tl.sum(ve32 * ve32, axis=1) + tl.sum(vo32 * vo32, axis=1), 1e-30))
        else:
            v_f = _whole_tile(row, h, tmask, V_FAST, NIBBLE, V_KIND, V_BITS, V_PARAM_DTYPE, V_A_OFF, V_A_STRIDE,
                              V_A_BYTES, D, DP, vc_ptr, v_tabs, DOT, V_ALIGNED, USE_ASM)
            if V_NORM_CORRECTION == 1:
                vf32 = v_f.to(tl.float32)
                vf = vf / tl.sqrt(tl.maximum(tl.sum(vf32 * vf32, axis=1), 1e-30))
        # p·f goes into the dot, scaled to the tile's largest |f| so fp16 keeps its precision.
        fmax = tl.max(tl.abs(vf), axis=0)
        fmax = tl.where(fmax > 0, fmax, 1.0)
        pv = (p * (vf / fmax)[None, :]).to(DOT)
        pz = tl.sum(p * vz[None, :], axis=1)
        if V_HALVES:
            acc_e = acc_e * alpha[:, None] + tl.dot(pv, v_e) * fmax + pz[:, None]
            acc_o = acc_o * alpha[:, None] + tl.dot(pv, v_o) * fmax + pz[:, None]
        else:
            acc = acc * alpha[:, None] + tl.dot(pv, v_f) * fmax + pz[:, None]

    # -- partial results: acc [S, HQ, NUM_SPLITS, DP], (m, l) [S, HQ, NUM_SPLITS, 2] ---------------
    part = ((s * HQ + qh).to(tl.int64) * NUM_SPLITS + split)
    a_row = acc_ptr + part[:, None] * DP
    if V_HALVES:
        j = tl.arange(0, D2)
        tl.store(a_row + 2 * j[None, :], acc_e, mask=gm[:, None])
        tl.store(a_row + 2 * j[None, :] + 1, acc_o, mask=gm[:, None])
    else:
        tl.store(a_row + cols[None, :], acc, mask=gm[:, None])
    tl.store(ml_ptr + part * 2, m_i, mask=gm)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=gm)


@triton.jit
def _store_merged(o, o_row, rmask, rot_ptr, c0, cols, D: tl.constexpr, CC: tl.constexpr,
                  ROTATE_BACK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Store merged rows ``o`` ([rows, cols]) to output columns ``c0 .. c0 + CC − 1``: with the
    rotate-back ``cols`` are all DP columns and ``out[:, c] = o @ Πᵀ[:, c]`` (``Πᵀ[:, c] = Π[c, :]``,
    64 columns per dot), else ``cols`` are the chunk's columns."""
    if ROTATE_BACK:
        SUB: tl.constexpr = CC if CC < 64 else 64
        for c1 in tl.static_range(0, CC, SUB):
            cs = c0 + c1 + tl.arange(0, SUB)
            rt = tl.load(rot_ptr + cs[None, :] * D + cols[:, None], mask=(cols < D)[:, None] & (cs < D)[None, :],
                         other=0.0)  # [DP, SUB]
            res = tl.dot(o, rt, input_precision=DOT_PRECISION)
            tl.store(o_row + cs[None, :], res.to(o_row.dtype.element_ty), mask=rmask[:, None] & (cs < D)[None, :])
    else:
        tl.store(o_row + cols[None, :], o.to(o_row.dtype.element_ty), mask=rmask[:, None] & (cols < D)[None, :])


@triton.jit
def _merge_kernel(acc_ptr, ml_ptr, rot_ptr, out_ptr, poison_ptr, stride_os, stride_oh,
                  G: tl.constexpr, GP: tl.constexpr, HQ: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  SP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, CC: tl.constexpr,
                  ROTATE_BACK: tl.constexpr, DOT_PRECISION: tl.constexpr, POISON: tl.constexpr):
    """Merge the splits of one (sequence, KV head) by log-sum-exp; out = acc/l (@ Πᵀ). Program
    ``(s, h, j)`` writes output columns ``j·CC .. j·CC + CC − 1`` (with the rotation it merges all
    columns and rotates into its chunk: the chunks spread the rotate-back over more programs)."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    c0 = tl.program_id(2) * CC
    g = tl.arange(0, GP)
    gm = g < G
    qh = h * G + g
    if POISON:  # NaN for a query row holding a NaN or inf (docs/layout.md); loaded first, used last
        poison = tl.load(poison_ptr + (s * HQ + qh), mask=gm, other=0.0)
    sp = tl.arange(0, SP)
    spm = sp < NUM_SPLITS
    part = (s * HQ + qh).to(tl.int64)[:, None] * NUM_SPLITS + sp[None, :]  # [GP, SP]
    pm = gm[:, None] & spm[None, :]
    m = tl.load(ml_ptr + part * 2, mask=pm, other=float("-inf"))
    l = tl.load(ml_ptr + part * 2 + 1, mask=pm, other=0.0)
    m_all = tl.max(m, axis=1)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(pm & (m > float("-inf")), tl.exp2(m - m_safe[:, None]), 0.0)  # [GP, SP]
    l_all = tl.sum(w * l, axis=1)
    inv = tl.where(l_all > 0, 1.0 / tl.where(l_all > 0, l_all, 1.0), 0.0)
    o_row = out_ptr + s.to(tl.int64) * stride_os + qh.to(tl.int64)[:, None] * stride_oh
    cc = c0 + tl.arange(0, CC)
    if ROTATE_BACK:  # out[:, cc] = o @ Πᵀ[:, cc], Πᵀ[:, c] = Π[c, :]
        cols = tl.arange(0, DP)
    else:
        cols = cc
    o = tl.zeros([GP, cols.shape[0]], tl.float32)
    for i in tl.static_range(NUM_SPLITS):
        wi = tl.sum(tl.where(sp[None, :] == i, w, 0.0), axis=1)
        a = tl.load(acc_ptr + ((s * HQ + qh).to(tl.int64) * NUM_SPLITS + i)[:, None] * DP + cols[None, :],
                    mask=gm[:, None], other=0.0)  # not masked by the weight: no wait for (m, l)
        o += tl.where((wi > 0)[:, None], a * wi[:, None], 0.0)
    o = o * inv[:, None]
    if POISON:
        o += poison[:, None]
    _store_merged(o, o_row, gm, rot_ptr, c0, cols, D, CC, ROTATE_BACK, DOT_PRECISION)


@triton.jit
def _merge_rows_kernel(acc_ptr, ml_ptr, rot_ptr, out_ptr, poison_ptr, n_rows, num_splits, stride_os, stride_oh,
                       HQ: tl.constexpr, ROWS: tl.constexpr, SP: tl.constexpr, UNROLL: tl.constexpr, D: tl.constexpr,
                       DP: tl.constexpr, CC: tl.constexpr, ROTATE_BACK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       POISON: tl.constexpr):
    """The merge by blocks of ``ROWS`` query rows (``row = s·HQ + head``, any heads and
    sequences): the rotate-back is a full ``[ROWS, DP] @ [DP, CC]`` tile and Π is read once per
    ROWS rows, instead of once per GQA group padded to 16. Program ``(b, j)`` writes columns
    ``j·CC .. j·CC + CC − 1`` of rows ``b·ROWS ..``; same workspace layout and result as
    :func:`_merge_kernel`. The maxima of all splits are one ``[ROWS, SP]`` load; then splits are
    read ``UNROLL`` at a time, the partials by loads that do not wait for the weights (an empty
    split's weight 0 selects 0, whatever its partial holds)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < n_rows
    c0 = tl.program_id(1) * CC
    if POISON:  # NaN for a query row holding a NaN or inf (docs/layout.md); loaded first, used last
        poison = tl.load(poison_ptr + rows, mask=rm, other=0.0)
    part0 = rows.to(tl.int64) * num_splits
    sp = tl.arange(0, SP)  # the maxima of all splits: one load, not one round trip per split
    m_all = tl.max(tl.load(ml_ptr + (part0[:, None] + sp[None, :]) * 2, mask=rm[:, None] & (sp < num_splits)[None, :],
                           other=float("-inf")), axis=1)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    if ROTATE_BACK:  # out[:, cc] = o @ Πᵀ[:, cc], Πᵀ[:, c] = Π[c, :]
        cols = tl.arange(0, DP)
    else:
        cols = c0 + tl.arange(0, CC)
    o = tl.zeros([ROWS, cols.shape[0]], tl.float32)
    l_all = tl.zeros([ROWS], tl.float32)
    for i0 in range(0, num_splits, UNROLL):
        for j in tl.static_range(UNROLL):
            part = part0 + (i0 + j)
            ok = rm & (tl.full([ROWS], i0 + j, tl.int32) < num_splits)
            m = tl.load(ml_ptr + part * 2, mask=ok, other=float("-inf"))
            l = tl.load(ml_ptr + part * 2 + 1, mask=ok, other=0.0)
            w = tl.where(m > float("-inf"), tl.exp2(m - m_safe), 0.0)
            l_all += w * l
            a = tl.load(acc_ptr + part[:, None] * DP + cols[None, :], mask=(rm & ok)[:, None], other=0.0)
            o += tl.where((w > 0)[:, None], a * w[:, None], 0.0)  # the load does not wait for w
    inv = tl.where(l_all > 0, 1.0 / tl.where(l_all > 0, l_all, 1.0), 0.0)
    o = o * inv[:, None]
    if POISON:
        o += poison[:, None]
    o_row = out_ptr + (rows // HQ).to(tl.int64)[:, None] * stride_os + (rows % HQ).to(tl.int64)[:, None] * stride_oh
    _store_merged(o, o_row, rm, rot_ptr, c0, cols, D, CC, ROTATE_BACK, DOT_PRECISION)


@triton.jit
def _scan_indices(bt_ptr, sl_ptr, err_ptr, safe_ptr, num_seqs, max_blocks, num_blocks, BS: tl.constexpr,
                  SB: tl.constexpr):
    """Make the decode's indices safe before it runs, off its loops: the programs of the grid's
    first dimension share the block table's ``num_seqs·max_blocks`` entries and write each,
    clamped into ``[0, num_blocks − 1]`` as an unsigned number (negative ones become the last
    block), to ``safe_ptr``, the table the decode kernels read; so no index reads outside the
    cache and the kernels' loops stay as they were (a clamp there cost tq4 2.5%, measured). An
    entry in use (position < the sequence's clamped length) outside ``[0, num_blocks)`` sets
    ``BLOCK_OUT_OF_RANGE``, a length outside ``[0, max_blocks·BS]`` ``SEQ_LEN_OUT_OF_RANGE``
    (the kernels clamp lengths themselves), with one atomic per program, only if set."""
    total = num_seqs * max_blocks
    per = tl.cdiv(total, tl.num_programs(0))
    e0 = tl.program_id(0) * per
    cap = max_blocks * BS
    err = tl.program_id(0) * 0
    for i in range(0, per, SB):
        e = e0 + i + tl.arange(0, SB)
        m = (e < e0 + per) & (e < total)
        row = e // max_blocks
        j = e - row * max_blocks
        n = tl.load(sl_ptr + row, mask=m, other=0)  # (both loads in flight at once)
        b = tl.load(bt_ptr + e.to(tl.int64), mask=m, other=0)
        last = tl.maximum(num_blocks - 1, 0).to(tl.uint32)
        tl.store(safe_ptr + e.to(tl.int64), tl.minimum(b.to(tl.uint32, bitcast=True), last).to(tl.int32, bitcast=True),
                 mask=m)
        bad_b = m & (j * BS < tl.minimum(n, cap)) & ((b < 0) | (b >= num_blocks))
        bad_n = m & (j == 0) & ((n < 0) | (n > cap))
        err |= tl.max(bad_b.to(tl.int32), axis=0) * _ERR_BLOCK | tl.max(bad_n.to(tl.int32), axis=0) * _ERR_SEQ_LEN
    tl.atomic_or(err_ptr, err, mask=err != 0, sem="relaxed")


@triton.jit
def _rotate_q_kernel(q_ptr, rot_ptr, out_ptr, poison_ptr, bt_ptr, sl_ptr, err_ptr, safe_ptr, n_rows, stride_qs, stride_qh,
                     num_seqs, max_blocks, num_blocks, HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                     ROWS: tl.constexpr, CC: tl.constexpr, ROTATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     POISON: tl.constexpr, SCAN: tl.constexpr, BS: tl.constexpr, SB: tl.constexpr):
    """``out[r] = float32(q[r]) @ Π`` (or the plain cast) for ROWS query rows ``r = s·HQ + h``: one
    launch instead of a cast and a GEMM. Program ``(b, j)`` writes output columns ``j·CC ..
    j·CC + CC − 1`` of rows ``b·ROWS ..`` (64 columns at a time: a whole ``[DP, DP]`` tile of Π
    overflows shared memory). out: float32 ``[n_rows, D]`` contiguous."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < n_rows
    cols = tl.arange(0, DP)
    cm = cols < D
    if SCAN:  # (first: its loads overlap the q row's)
        if tl.program_id(1) == 0:
            _scan_indices(bt_ptr, sl_ptr, err_ptr, safe_ptr, num_seqs, max_blocks, num_blocks, BS, SB)
    src = q_ptr + (rows // HQ).to(tl.int64)[:, None] * stride_qs + (rows % HQ).to(tl.int64)[:, None] * stride_qh
    x = tl.load(src + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)
    if POISON:  # poison[r] = NaN if q row r holds a NaN or inf, else 0 (x − x is NaN exactly there)
        bad = tl.sum(((x - x) != 0).to(tl.int32), axis=1) > 0
        if tl.program_id(1) == 0:
            tl.store(poison_ptr + rows, tl.where(bad, float("nan"), 0.0), mask=rm)
    dst = out_ptr + rows.to(tl.int64)[:, None] * D
    if ROTATE:
        SUB: tl.constexpr = CC if CC < 64 else 64
        for c1 in tl.static_range(0, CC, SUB):
            cc = tl.program_id(1) * CC + c1 + tl.arange(0, SUB)
            rot = tl.load(rot_ptr + cols[:, None] * D + cc[None, :], mask=cm[:, None] & (cc < D)[None, :], other=0.0)
            tl.store(dst + cc[None, :], tl.dot(x, rot, input_precision=DOT_PRECISION),
                     mask=rm[:, None] & (cc < D)[None, :])
    else:
        tl.store(dst + cols[None, :], x, mask=rm[:, None] & cm[None, :])


def rotate_q(q, rotation, rotate: bool, interpret: bool, rows: int = 16, cols: int = 64, poison=None, scan=None):
    """float32 ``[S, Hq, D]`` contiguous: ``q @ Π`` when ``rotate`` (the key codec is rotated),
    else q cast. ``q``: fp16/bf16/fp32 with a contiguous last dimension; ``rows`` query rows and
    ``cols`` output columns (at most the padded head_dim) per program. Measured on the H100 at
    1024 rows, D = 128: 16 rows × all columns 4.6 µs, 32 rows 9.5 µs, 64 rows 9.8 µs (session 4);
    16 rows × 64 columns: see ``docs/performance.md``. ``poison``: optional float32 ``[S·Hq]``
    that receives NaN for every query row holding a NaN or inf and 0 for the others (the merge
    adds it to the output: :func:`_launch_merge`). ``scan``: optional ``(block_table, seq_lens,
    num_blocks, block_size, errors, safe_table)``: the same launch writes the block table clamped
    to the cache into ``safe_table`` (int32, the table's shape; what the decode kernels read) and
    ORs ``tqkern.errors`` bits into ``errors`` (see :func:`_scan_indices`)."""
    if not isinstance(rows, int) or rows < 16 or rows & (rows - 1):
        raise ValueError(f"rows must be a power of two >= 16, got {rows!r}")
    if not isinstance(cols, int) or cols < 16 or cols & (cols - 1):
        raise ValueError(f"cols must be a power of two >= 16, got {cols!r}")
    s, hq, d = q.shape
    out = torch.empty((s, hq, d), dtype=torch.float32, device=q.device)
    n = s * hq
    dp = max(16, triton.next_power_of_2(d))
    cc = min(cols, dp) if rotate else dp
    if scan is None:
        scan_args, scan_ints, bs = (out, out, out, out), (0, 0, 0), 1
    else:
        bt, sl, num_blocks, bs, errors, safe = scan
        scan_args, scan_ints = (bt, sl, errors, safe), (bt.shape[0], bt.shape[1], num_blocks)
    # entries per scanning program in one tile where it fits (a loop of dependent rounds is latency)
    per_program = triton.cdiv(scan_ints[0] * scan_ints[1], max(1, triton.cdiv(n, rows)))
    sb = min(4096, max(128, triton.next_power_of_2(max(1, per_program))))
    if n:
        _rotate_q_kernel[(triton.cdiv(n, rows), dp // cc)](
            q, rotation, out, out if poison is None else poison, *scan_args, n, q.stride(0), q.stride(1), *scan_ints,
            HQ=hq, D=d, DP=dp, ROWS=rows, CC=cc, ROTATE=rotate, DOT_PRECISION="ieee" if interpret else "tf32x3",
            POISON=poison is not None, SCAN=scan is not None, BS=bs, SB=sb, num_warps=4)
    return out


def num_splits_for(num_seqs: int, num_kv_heads: int, max_len: int, num_sms: int, block_n: int,
                   resident_ctas: int | None = None) -> int:
    """Splits so that ~4 programs per SM exist, never fewer than 4·BN tokens per split.

    With ``resident_ctas`` (programs the GPU holds at once) and long splits (≥ 2048 tokens of
    ``max_len`` each), the count ``k`` up to that one with the fewest waves per unit of work
    (``ceil(programs·k / resident_ctas) / k``; the smallest such ``k``), so that the last wave is
    not a fraction of the GPU. Measured on the H100 (fp16 path, B8×64K: 64 programs per split,
    396 resident): 9 splits (1.45 waves) 770 µs, 6 splits (0.97 waves) 712 µs; shorter splits
    gain nothing from it (SmolLM2 B32×4K: 4 splits, one wave, 45.7 µs; 6 splits 43.2 µs).

    Depends only on shapes (never on ``seq_lens`` values), so a CUDA graph captured for a batch
    shape stays valid whatever lengths it replays with."""
    if resident_ctas is not None and (not isinstance(resident_ctas, int) or resident_ctas < 1):
        raise ValueError(f"resident_ctas must be None or a positive int, got {resident_ctas!r}")
    programs = max(1, num_seqs * num_kv_heads)
    want = max(1, math.ceil(4 * num_sms / programs))
    cap = max(1, max_len // (4 * block_n))
    n = int(min(want, cap, 64))
    if resident_ctas and max_len // n >= 2048:
        n = min(range(1, n + 1), key=lambda k: (math.ceil(programs * k / resident_ctas) / k, k))
    return n


def fast_path_plan(layout) -> dict:
    """Which sides take the 4-bit word path and how their words are read (``K_FAST``/``V_FAST``:
    4 aligned words, 2 funnel-shifted words, 1 16-bit halves, 0 the general path), and whether
    their per-token float fields allow one typed load (``*_PAR_ALIGNED``)."""
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a tqkern.PagedLayout, got {type(layout).__name__}")
    c = layout_consts(layout)
    fmt = layout.format
    d, dp, rb = fmt.head_dim, c["DP"], layout.row_bytes
    raw_bf16 = any(getattr(cd, "dtype", None) == "bfloat16" for cd in (fmt.key, fmt.value))
    plan = {}
    for side, p in (("key", "K"), ("value", "V")):
        codec = getattr(fmt, side)
        a_off, a_stride = c[f"{p}_A_OFF"], c[f"{p}_A_STRIDE"]
        unit = 0
        if codec.kind in ("lloyd_max", "uniform") and codec.bits == 4 and dp == d and not raw_bf16:
            if a_off % 4 == 0 and a_stride % 4 == 0 and rb % 4 == 0:
                unit = 4
            elif a_off % 2 == 0 and a_stride % 2 == 0 and rb % 4 == 0 and d % 8 == 0:
                unit = 2
            elif a_off % 2 == 0 and a_stride % 2 == 0 and rb % 2 == 0:
                unit = 1
        nb = 4 if c[f"{p}_PARAM_DTYPE"] == 1 else 2
        plan[f"{p}_FAST"] = unit
        plan[f"{p}_PAR_ALIGNED"] = all(v % nb == 0 for v in (c[f"{p}_B_OFF"], c[f"{p}_B_STRIDE"], c[f"{p}_C_OFF"],
                                                              c[f"{p}_C_STRIDE"], rb))
    return plan


def _launch_paged_decode(out, q_rot, cache, block_table, seq_lens, layout, tables, *, sm_scale: float,
                         interpret: bool, q_poison=None, workspace=None, num_splits: int | None = None,
                         block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                         path: str = "auto", maxnreg: int | None = None, same_codebooks: bool):
    """Launch decode + merge. ``q_rot`` float32 ``[S, Hq, D]`` contiguous (already rotated when the
    key codec is rotated). ``q_poison``: float32
    ``[S·Hq]`` from :func:`rotate_q` (NaN for a non-finite query row, else 0), added to the output
    rows by the merge; ``None``: no poisoning. ``workspace``: optional float32 tensor with at least
    ``workspace_numel(...)`` elements. ``path``: ``"auto"`` (the warp-MMA kernel of
    :mod:`.triton_mma` where :func:`decode_path` says so, else the word path), ``"mma"`` (that
    kernel, or ``ValueError``), ``"general"`` (this module's kernel: the 4-bit word path where
    :func:`fast_path_plan` has a read plan, else the general decode). ``same_codebooks``
    (required): whether the key and value codebooks are equal (the warp-MMA kernel's one table
    serves both; ``DeviceParams.same_codebooks``). The block ids in
    use must lie in ``[0, cache.shape[0])`` and the lengths in ``[0, max_blocks·block_size]``: the
    frontend passes the clamped table that :func:`rotate_q`'s index scan writes. No other checks."""
    c = layout_consts(layout)
    s, hq, d = q_rot.shape
    hkv = layout.num_kv_heads
    g = hq // hkv
    gp = max(16, triton.next_power_of_2(g))
    dp = c["DP"]
    if path in ("auto", "mma"):
        mma = decode_path(layout, g, interpret=interpret, same_codebooks=same_codebooks,
                          cache_aligned=cache.data_ptr() % 16 == 0,
                          capability=None if interpret else _capability(q_rot.device)) == "mma"
        if path == "mma" and not mma:
            raise ValueError("the warp-MMA decode kernel does not apply to this layout/group/device")
        if mma:
            try:
                acc, ml, num_splits = _launch_mma(q_rot, cache, block_table, seq_lens, layout, tables, g, num_splits,
                                                  workspace, sm_scale)
            except DynamicSmemUnsupported:  # nothing launched yet: the per-warp kernel from now on
                disable_cooperative_stages(q_rot.device)
                acc, ml, num_splits = _launch_mma(q_rot, cache, block_table, seq_lens, layout, tables, g, num_splits,
                                                  workspace, sm_scale)
            _launch_merge(acc, ml, tables["rotation"], out, layout, g, num_splits, interpret, q_poison=q_poison)
            return out
        path = "general"
    if path != "general":
        raise ValueError(f"path must be 'auto', 'mma' or 'general', got {path!r}")
    plan = fast_path_plan(layout)
    if block_n is None:  # measured (H100, B32x16K): 128 best for the word path, 64 for the rest
        block_n = 128 if plan["K_FAST"] or plan["V_FAST"] else 64
    if num_stages is None:  # measured (H100): funnel-shifted words with 2 stages ran 2.5x slower
        num_stages = 1 if 2 in (plan["K_FAST"], plan["V_FAST"]) else 2
    fmt = layout.format
    raw_bf16 = any(getattr(cd, "dtype", None) == "bfloat16" for cd in (fmt.key, fmt.value))

    def fast(side) -> int:
        return plan[f"{side[0].upper()}_FAST"]

    def halves(side) -> bool:
        codec = getattr(fmt, side)
        return (codec.kind in ("lloyd_max", "uniform") and codec.bits == 4 and dp == d and d >= 32
                and not fast(side))
    consts = {k: v for k, v in c.items() if not k.startswith("PAD")}
    kwargs = dict(
        G=g, GP=gp, HQ=hq, BN=block_n, BS=layout.block_size,
        K_HALVES=halves("key"), V_HALVES=halves("value"), DOT=tl.bfloat16 if raw_bf16 else tl.float16,
        K_ALIGNED=halfword_aligned(layout, "key"), V_ALIGNED=halfword_aligned(layout, "value"),
        USE_ASM=not interpret, **plan,
        num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}), **consts,
    )
    max_len = block_table.shape[1] * layout.block_size
    if num_splits is None:
        sms = 1 if interpret else torch.cuda.get_device_properties(q_rot.device).multi_processor_count
        num_splits = num_splits_for(s, hkv, max_len, sms, block_n)
        if not interpret and max_len // num_splits >= 2048:
            key = (layout, hq, path, block_n, num_warps, num_stages, maxnreg, q_rot.device.index or 0)
            ctas = _resident_ctas(key, q_rot, cache, block_table, seq_lens, tables, kwargs, num_splits)
            num_splits = num_splits_for(s, hkv, max_len, sms, block_n, resident_ctas=ctas)
    acc, ml = _workspace(workspace, s, hq, num_splits, dp, q_rot.device)
    _paged_decode_kernel[(s, hkv, num_splits)](
        q_rot, cache, block_table, seq_lens, tables["key_centroids_f32"], tables["value_centroids_f32"], acc, ml,
        block_table.shape[1], sm_scale * 1.4426950408889634, 0, NUM_SPLITS=num_splits,
        **kwargs)
    _launch_merge(acc, ml, tables["rotation"], out, layout, g, num_splits, interpret, q_poison=q_poison)
    return out


_COOP_MIN_TOKENS = 1024  # tokens per split below which one-step cooperative plans may give way
_MMA_LAUNCHES: dict = {}  # (layout, group, shapes, device, stages disabled) -> (plan, num_splits)


def _mma_launch_plan(q_rot, cache, block_table, seq_lens, layout, tables, g, num_splits):
    """The plan and split count of a warp-MMA launch: the device's plan, its split count from the
    shapes (when not given), and the short-split rule; cached per layout, group, shapes and
    device (it depends on nothing else), so a launch does this work once."""
    s, hq, _ = q_rot.shape
    dev = q_rot.device.index or 0
    max_len = block_table.shape[1] * layout.block_size
    key = (layout, g, s, hq, max_len, num_splits, dev, dev in _tm._COOP_DISABLED)
    if key in _MMA_LAUNCHES:
        return _MMA_LAUNCHES[key]
    plan = device_plan(layout, g, q_rot.device)
    if num_splits is None:
        def splits_for(p):
            resident = resident_warps(q_rot, cache, block_table, seq_lens, layout, p, tables["key_centroids_f32"],
                                      group=g, value_centroids_f32=tables["value_centroids_f32"])
            return num_splits_mma(s, layout.num_kv_heads, max_len, resident)
        num_splits = splits_for(plan)
        # Short splits with one-step stages (two CTAs per SM; since session 13 only FP8 keys'
        # plans): the cooperative prologue is not paid back; the per-warp kernel runs instead where
        # it has at least 2 splits of its own (measured, H100: B32x4K turboquant_k8v4 90.1 vs 95.3
        # µs; session 12, with the then one-step plans of 3- and 4-bit keys: turboquant_4bit_nc
        # 75.1 vs 81.5, 3bit_nc 73.3 vs 77.8 -- but turboquant_4bit_nc with 1 split of its own
        # 92.2 vs 84.1: docs/performance.md §45, §47). The two-step stages of 3- and 4-bit keys
        # keep their plan: at B32x4K turboquant_4bit_nc 75.4 vs per-warp 75.0 µs, k3v4_nc 73.0 vs
        # 77.2, 3bit_nc 72.2 vs 73.1; at B128x1K 79.0 vs 92.2, 76.1 vs 80.2, 74.6 vs 76.3.
        if plan.get("COOP") and plan["SUB"] == 1 and max_len < _COOP_MIN_TOKENS * num_splits:
            per_warp = per_warp_plan(plan)
            n = splits_for(per_warp)
            if n >= 2:
                plan, num_splits = per_warp, n
    _MMA_LAUNCHES[key] = plan, num_splits
    return plan, num_splits


def _launch_mma(q_rot, cache, block_table, seq_lens, layout, tables, g, num_splits, workspace, sm_scale):
    """The warp-MMA kernel with the device's plan; returns (acc, ml, num_splits) for the merge."""
    s, hq, _ = q_rot.shape
    plan, num_splits = _mma_launch_plan(q_rot, cache, block_table, seq_lens, layout, tables, g, num_splits)
    acc, ml = _workspace(workspace, s, hq, num_splits, layout_consts(layout)["DP"], q_rot.device)
    _launch_paged_decode_mma(q_rot, cache, block_table, seq_lens, layout, plan, tables["key_centroids_f32"], acc, ml,
                             group=g, num_splits=num_splits, sm_scale=sm_scale,
                             value_centroids_f32=tables["value_centroids_f32"])
    return acc, ml, num_splits


_RESIDENT_CTAS: dict = {}


@functools.lru_cache(maxsize=16)
def _capability_of(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def _capability(device) -> tuple[int, int]:
    """Compute capability of a CUDA ``device`` (cached per device index)."""
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


def _resident_ctas(key, q_rot, cache, block_table, seq_lens, tables, kwargs, num_splits) -> int | None:
    """Programs of the general kernel (compiled for ``kwargs``; cached under ``key``, the launch
    options that determine ``kwargs``, cheap to hash on every launch) that the GPU holds at once,
    from its registers and shared memory; ``None`` if the compiled kernel cannot be inspected
    (the split count then ignores waves: speed, never correctness)."""
    if key not in _RESIDENT_CTAS:
        props = torch.cuda.get_device_properties(q_rot.device)
        try:
            k = _paged_decode_kernel.warmup(
                q_rot, cache, block_table, seq_lens, tables["key_centroids_f32"], tables["value_centroids_f32"],
                q_rot, q_rot, block_table.shape[1], 1.0, 0, NUM_SPLITS=num_splits, grid=(1,), **kwargs)
            _RESIDENT_CTAS[key] = ctas_per_sm(k, kwargs["num_warps"], 0, props) * props.multi_processor_count
        except Exception:  # noqa: BLE001
            _RESIDENT_CTAS[key] = None
    return _RESIDENT_CTAS[key]


def check_workspace(workspace, s: int, hq: int, num_splits: int, dp: int) -> int:
    """ValueError unless ``workspace`` holds ``workspace_numel(s, hq, num_splits, dp)`` float32
    elements; returns that count."""
    need = workspace_numel(s, hq, num_splits, dp)
    if workspace.numel() < need:
        raise ValueError(f"workspace must have at least workspace_numel({s}, {hq}, num_splits={num_splits}, {dp}) = "
                         f"{need} float32 elements, got {workspace.numel()}")
    return need


def _workspace(workspace, s: int, hq: int, num_splits: int, dp: int, device):
    """The (acc, ml) views of a caller's workspace, or of a fresh one."""
    if workspace is None:
        need = workspace_numel(s, hq, num_splits, dp)
        workspace = torch.empty(need, dtype=torch.float32, device=device)
    else:
        need = check_workspace(workspace, s, hq, num_splits, dp)
    return workspace[: s * hq * num_splits * dp], workspace[s * hq * num_splits * dp: need]


def merge_chunks(programs: int, num_sms: int, dp: int) -> int:
    """Output-column chunks per merge program (a (sequence, KV head) pair, or a block of query
    rows): 1, doubled (to at most DP/16) while the programs cannot fill the GPU. With the
    rotate-back every chunk merges all columns again, so chunks pay only when programs are few.
    Measured (H100, TQ4 rotate-back, per-group merge): B8x64K (64 programs) 22.6 µs unchunked;
    B32x16K (256 programs) 11.8 µs unchunked, 30.6 µs in 4; row-block merge at B32x16K (64
    blocks): 1 chunk 6.9 µs, 2 chunks 5.8, 4 chunks 6.1."""
    nch = 1
    while nch < dp // 16 and programs * nch < num_sms:
        nch *= 2
    return nch


def _launch_merge(acc, ml, rotation, out, layout, g: int, num_splits: int, interpret: bool,
                  chunks: int | None = None, impl: str | None = None, rows: int = 16, unroll: int | None = None,
                  q_poison=None):
    """Merge the splits into ``out`` (rotating back when the value codec is rotated). ``impl``:
    ``"rows"`` (:func:`_merge_rows_kernel`, blocks of ``rows`` query rows) or ``"heads"``
    (:func:`_merge_kernel`, one GQA group per program); by default rows with the rotate-back or
    more than 16 splits, else heads. Measured (H100, session 4, docs/performance.md, "Merge and q rotation"):
    with the rotate-back rows are 2x faster (tq4 B32x16K 11.7 → 6.0 µs, B8x64K 24.5 → 14.6 µs);
    without it heads are faster at 8 splits (turboquant_4bit_nc B32x16K 3.0 vs 3.3 µs) and rows
    with every split's load in flight at 33 (B8x64K 7.3 vs 9.3 µs; session 12,
    the same section). ``chunks``: output-column chunks per
    program block (default :func:`merge_chunks`); ``unroll``: splits per loop iteration of the
    row-block kernel (default 8 with the rotate-back, else all of them). ``q_poison``: float32
    ``[S·Hq]`` added to every output row (NaN poisons the row), or ``None``."""
    s, hq, d = out.shape
    dp = layout_consts(layout)["DP"]
    rotate_back = bool(layout.format.value.rotated)
    if impl is None:
        impl = "rows" if rotate_back or num_splits > 16 else "heads"
    if unroll is None:
        unroll = 8 if rotate_back else 64
    if impl not in ("rows", "heads"):
        raise ValueError(f"impl must be 'rows', 'heads' or None, got {impl!r}")
    if not isinstance(rows, int) or rows < 16 or rows & (rows - 1):
        raise ValueError(f"rows must be a power of two >= 16, got {rows!r}")
    precision = "ieee" if interpret else "tf32x3"
    if impl == "rows":
        n = s * hq
        blocks = triton.cdiv(n, rows)
        if chunks is None:
            sms = 1 if interpret else torch.cuda.get_device_properties(out.device).multi_processor_count
            # with the rotate-back each chunk re-merges every column: at most 2 measured best
            # (H100, tq4, session 5: B32x16K 1/2/4 chunks 6.3/4.8/5.4 µs, B8x64K 1/2/4/8 chunks
            # 11.4/10.3/10.5/10.7 µs)
            chunks = min(2, merge_chunks(blocks, sms, dp)) if rotate_back else merge_chunks(blocks, sms, dp)
        if n:
            _merge_rows_kernel[(blocks, chunks)](
                acc, ml, rotation, out, ml if q_poison is None else q_poison, n, num_splits, out.stride(0), out.stride(1),
                HQ=hq, ROWS=rows, SP=max(2, triton.next_power_of_2(num_splits)),
                UNROLL=max(1, min(unroll, num_splits)), D=d, DP=dp, CC=dp // chunks,
                ROTATE_BACK=rotate_back, DOT_PRECISION=precision, POISON=q_poison is not None, num_warps=4)
        return
    gp = max(16, triton.next_power_of_2(g))
    if chunks is None:
        sms = 1 if interpret else torch.cuda.get_device_properties(out.device).multi_processor_count
        chunks = merge_chunks(s * layout.num_kv_heads, sms, dp)
    nch = chunks
    cc = dp // nch
    _merge_kernel[(s, layout.num_kv_heads, nch)](
        acc, ml, rotation, out, ml if q_poison is None else q_poison, out.stride(0), out.stride(1),
        G=g, GP=gp, HQ=hq, NUM_SPLITS=num_splits, SP=max(2, triton.next_power_of_2(num_splits)), D=d, DP=dp,
        CC=cc, ROTATE_BACK=rotate_back, DOT_PRECISION=precision, POISON=q_poison is not None, num_warps=4,
    )


# The warp-MMA kernel's PTX: mma.sync m16n8k16 with fp16 operands, ld.global.nc.L2::256B
# (sm_80); cvt.rn.f16x2.e4m3x2 for FP8 keys (sm_89).
MMA_MIN_CAPABILITY = (8, 0)
MMA_FP8_MIN_CAPABILITY = (8, 9)


def decode_path(layout, group: int, *, same_codebooks: bool, interpret: bool = False,
                cache_aligned: bool = True, capability: tuple[int, int] | None = None) -> str:
    """Which kernel ``path="auto"`` runs: ``"mma"`` (the warp-MMA kernel where
    :func:`.triton_mma.mma_plan` takes the layout, and for 4-bit Lloyd-Max values only with the
    keys' codebook (``same_codebooks``, required: the frontend passes
    ``DeviceParams.same_codebooks``); never under the interpreter, which cannot run its inline
    PTX, nor for a cache not 16-byte aligned, nor on a GPU whose compute ``capability`` (major,
    minor) is below ``MMA_MIN_CAPABILITY`` (``MMA_FP8_MIN_CAPABILITY`` for FP8 keys); ``None``
    skips that check) or ``"general"`` (this module's kernel)."""
    plan = mma_plan(layout, group)
    if interpret or plan is None or not cache_aligned:
        return "general"
    if capability is not None:
        if not isinstance(capability, (tuple, list)) or len(capability) != 2 \
                or not all(isinstance(x, int) for x in capability):
            raise TypeError(f"capability must be a (major, minor) pair of ints, got {capability!r}")
        need = MMA_FP8_MIN_CAPABILITY if plan["K_FP8"] else MMA_MIN_CAPABILITY
        if tuple(capability) < need:
            return "general"
    if plan["V_BITS"] == 4 and not plan["V_UNIFORM"] and not same_codebooks:  # one codebook for K and V
        return "general"
    return "mma"


def workspace_numel(num_seqs: int, num_q_heads: int, num_splits: int, dp: int) -> int:
    """float32 elements of the decode workspace: partial outputs plus (max, sum) per split."""
    return num_seqs * num_q_heads * num_splits * (dp + 2)
