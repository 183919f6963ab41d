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

Options (constexprs, off by default: the plain kernel): ``WINDOW`` walks only the last
``window_left + 1`` keys, split across the programs; ``SOFTCAP`` caps the scaled logits. Sinks
and the lse are the merge's (:mod:`.merge`).

This module holds that kernel (``path="general"``; every layout, and the CPU interpreter) and its
4-bit word decoders (every other field is read by :mod:`tqkern.ops.fields`, shared with decompress); its read plan, split count and launch: :mod:`.triton`; the merge: :mod:`.merge`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.ops.codecs import KIND_LLOYD_MAX, KIND_UNIFORM, NC_DECODE
from tqkern.ops.fields import _lut16, _small_ints, load_tile, token_factors
from tqkern.ops.paged_decode._ptx import _LUT_ASM_LSB, _LUT_ASM_NIBBLE, _UNI_ASM_LSB, _UNI_ASM_NIBBLE, _prmt_tables

__all__ = ["_paged_decode_kernel"]


@triton.jit
def _decode_words(w, cen_ptr, tabs, KIND: tl.constexpr, NIBBLE: tl.constexpr, USE_ASM: tl.constexpr):
    """int32 words ``[BN, NW]`` of 4-bit codes → fp16 values ``[BN, 8·NW]`` in code order.

    Lloyd-Max: centroid c[code]; uniform: the integer code. ``USE_ASM`` False (the interpreter) computes
    the same values with shifts and the select tree."""
    BN: tl.constexpr = w.shape[0]
    NW: tl.constexpr = w.shape[1]
    if USE_ASM:
        if KIND == KIND_LLOYD_MAX:
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
    if KIND == KIND_LLOYD_MAX:
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
def _whole_tile(row, h, tmask, FAST: tl.constexpr, NIBBLE: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
                DP: tl.constexpr, cen_ptr, tabs, DOT: tl.constexpr, ALIGNED: tl.constexpr, USE_ASM: tl.constexpr):
    """One side's whole tile ``[BN, DP]`` before its per-token factor: the 4-bit word path when
    ``FAST`` names a read plan, else the shared loader (:func:`tqkern.ops.fields.load_tile`)."""
    if FAST > 0:
        return _fast_tile(row, h, tmask, FAST, S.A_OFF, S.A_STRIDE, D, NIBBLE, S.KIND, cen_ptr, tabs, USE_ASM)
    return load_tile(row, h, tmask, DP, -1, NIBBLE, S, D, DP, cen_ptr, DOT, ALIGNED)


@triton.jit
def _value_weights(p, vf, vz, DOT: tl.constexpr):
    """P·V's operands from probabilities ``p [rows, BN]`` and the value tile's per-token scale
    ``vf`` and offset ``vz``: ``pv = p·f / max|f|`` in ``DOT`` (scaled to the tile's largest |f|
    so fp16 keeps its precision), that maximum, and each row's ``Σ p·z``; the tile adds to the
    accumulator as ``dot(pv, V̂)·fmax + pz``."""
    fmax = tl.max(tl.abs(vf), axis=0)
    fmax = tl.where(fmax > 0, fmax, 1.0)
    pv = (p * (vf / fmax)[None, :]).to(DOT)
    pz = tl.sum(p * vz[None, :], axis=1)
    return pv, fmax, pz


@triton.jit
def _half_tiles(row, h, tmask, NIBBLE: tl.constexpr, S: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, cen_ptr,
                DOT: tl.constexpr, ALIGNED: tl.constexpr):
    """A 4-bit side as its even and odd columns, two ``[BN, DP/2]`` tiles (one per nibble)."""
    D2: tl.constexpr = DP // 2
    e = load_tile(row, h, tmask, D2, 0, NIBBLE, S, D, DP, cen_ptr, DOT, ALIGNED)
    o = load_tile(row, h, tmask, D2, 1, NIBBLE, S, D, DP, cen_ptr, DOT, ALIGNED)
    return e, o


@triton.jit(do_not_specialize=["zero", "window_left"])
def _paged_decode_kernel(
    q_ptr, cache_ptr, bt_ptr, sl_ptr, kc_ptr, vc_ptr, acc_ptr, ml_ptr,
    max_blocks, sm_scale_log2, zero, window_left, softcap_scale, softcap_cap,
    G: tl.constexpr, GP: tl.constexpr, HQ: tl.constexpr, NUM_SPLITS: tl.constexpr, BN: tl.constexpr,
    BS: tl.constexpr, K_HALVES: tl.constexpr, V_HALVES: tl.constexpr, DOT: tl.constexpr,
    K_ALIGNED: tl.constexpr, V_ALIGNED: tl.constexpr, K_FAST: tl.constexpr, V_FAST: tl.constexpr, USE_ASM: tl.constexpr,
    K_PAR_ALIGNED: tl.constexpr, V_PAR_ALIGNED: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, ROW_BYTES: tl.constexpr, NIBBLE: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """``WINDOW``: only the last ``window_left + 1`` keys, shared by the splits (a split past
    them writes an empty partial: max −inf, sum 0, which the merge skips). ``SOFTCAP``: the
    scaled logit a becomes ``c·tanh(a/c)``; ``softcap_scale = 2·scale·log2(e)/c`` and
    ``softcap_cap = c·log2(e)`` (logits are base 2 here). Off, both compile to the plain kernel."""
    if PDL:  # launched early (programmatic dependent launch): q and the clamped table once the rotation completes
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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

    k_tabs = _prmt_tables(kc_ptr, K.KIND if K_FAST > 0 else KIND_UNIFORM)
    v_tabs = _prmt_tables(vc_ptr, V.KIND if V_FAST > 0 else KIND_UNIFORM)

    seq_len = tl.minimum(tl.maximum(tl.load(sl_ptr + s), 0), max_blocks * BS)  # (a bad length: clamped)
    if WINDOW:  # keys first .. seq_len − 1, the query at seq_len − 1 (window_left < 2^30)
        first = tl.maximum(seq_len - 1 - window_left, 0)
        per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BN) * BN
        start = first + split * per_split
    else:
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
        kf, kz = token_factors(row, h, tmask, K, DOT, K_PAR_ALIGNED)
        if K_HALVES:
            k_e, k_o = _half_tiles(row, h, tmask, NIBBLE, K, D, DP, kc_ptr, DOT, K_ALIGNED)
            qk = tl.dot(q_e, tl.trans(k_e)) + tl.dot(q_o, tl.trans(k_o))
            if K.NORM_CORRECTION == NC_DECODE:  # vLLM's _nc: ‖c[idx]‖² of every token by the tensor
                # cores (a ones-row times the squared tile), already broadcast to [GP, BN]:
                # a row reduction over the tile measured ~2 ms at B32x16K.
                ones = tl.full([GP, D2], 1.0, DOT)
                cn2 = tl.dot(ones, tl.trans(k_e * k_e)) + tl.dot(ones, tl.trans(k_o * k_o))
                qk = qk * tl.rsqrt(tl.maximum(cn2, 1e-30))
        else:
            k_f = _whole_tile(row, h, tmask, K_FAST, NIBBLE, K, D, DP, kc_ptr, k_tabs, DOT, K_ALIGNED, USE_ASM)
            qk = tl.dot(q_f, tl.trans(k_f))
            if K.NORM_CORRECTION == NC_DECODE:
                cn2 = tl.dot(tl.full([GP, DP], 1.0, DOT), tl.trans(k_f * k_f))
                qk = qk * tl.rsqrt(tl.maximum(cn2, 1e-30))
        if SOFTCAP:  # c·log2(e)·tanh(a/c); y = 2·log2(e)·a/c, tanh(|a/c|) = (1 − 2^−|y|)/(1 + 2^−|y|): no overflow
            y = (qk * kf[None, :] + q_sum[:, None] * kz[None, :]) * softcap_scale
            t = tl.exp2(-tl.abs(y))
            th = (1.0 - t) / (1.0 + t)
            sc = tl.where(y < 0, -th, th) * softcap_cap
        else:
            sc = (qk * kf[None, :] + q_sum[:, None] * kz[None, :]) * sm_scale_log2
        sc = tl.where(tmask[None, :], sc, float("-inf"))

        # -- online softmax (base 2) -------------------------------------------------------------
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        # -- values: p·f into the dot (scaled to the tile's largest f), p·z added per row -----
        vf, vz = token_factors(row, h, tmask, V, DOT, V_PAR_ALIGNED)
        if V_HALVES:
            v_e, v_o = _half_tiles(row, h, tmask, NIBBLE, V, D, DP, vc_ptr, DOT, V_ALIGNED)
            if V.NORM_CORRECTION == NC_DECODE:
                ve32 = v_e.to(tl.float32)
                vo32 = v_o.to(tl.float32)
                vf = vf / tl.sqrt(tl.maximum(tl.sum(ve32 * ve32, axis=1) + tl.sum(vo32 * vo32, axis=1), 1e-30))
        else:
            v_f = _whole_tile(row, h, tmask, V_FAST, NIBBLE, V, D, DP, vc_ptr, v_tabs, DOT, V_ALIGNED, USE_ASM)
            if V.NORM_CORRECTION == NC_DECODE:
                vf32 = v_f.to(tl.float32)
                vf = vf / tl.sqrt(tl.maximum(tl.sum(vf32 * vf32, axis=1), 1e-30))
        pv, fmax, pz = _value_weights(p, vf, vz, DOT)
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
