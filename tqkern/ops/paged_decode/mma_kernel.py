"""Warp-level tensor-core paged decode: 4-, 3- or 5-bit Lloyd-Max or FP8 keys, 4-, 3- or 2-bit values.

Every tensor in this kernel holds one value per thread (shape ``[32·WARPS]``), and the inner
loop is inline PTX, so each value is produced in the register where ``mma.sync.m16n8k16``
reads it: nothing goes through shared memory on its way to the tensor cores.

One warp owns one (sequence, KV head, split) and walks its tokens 16 at a time:

* With Lloyd-Max values (``SUB = 2``) one loop iteration takes two 16-token steps under one
  softmax update (one running max over both, one rescale of the output accumulators), the
  register ring holding both steps' data.
* ``S^T = K·Q^T``: the 16 tokens are the MMA's M rows, the G ≤ 8 query heads of the GQA group
  its N columns. A larger group runs as ``GS`` groups of G (:func:`.mma_plans.head_groups`):
  ``HKV`` then counts (KV head, query-head group) pairs and warp item ``h`` reads KV head ``h // GS``. Lane ``l`` (``r = l // 4``, ``c = l % 4``) supplies tokens ``r`` and ``r + 8``.
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
  one lookup per code in 32 single entries (from ``K_AT``), two joined by one PRMT; or, with the
  code-pair table (``KP``, :func:`.coop_variants.code_pair_plan`: 1024 entries from ``K_AT``, in a
  cooperative plan's dynamic shared memory), one lookup per 10-bit pair. A 3- or 5-bit field is
  shifted straight into its entry's byte offset (:func:`.mma_table._entry_offset`).
* 3-bit values: lane ``r`` owns codes ``r·D/8 ..``; M tile ``i`` takes codes ``2i``, ``2i + 1``.
  Uniform: PRMT + AND per token pair into subnormals ``code·2^(3k mod 8 - 24)``; Lloyd-Max:
  token-pair entries 0..63 of the value codebook. 2-bit Lloyd-Max values the same way, two LOP3s
  per token pair making every code pair's 4-bit index (entries 0..15).
* Values with a codebook of their own (Lloyd-Max values next to keys of another codebook or bit
  width) take the table's first entries; the keys' entries then start at ``K_AT`` (64, or 256
  after 4-bit value pairs), and the table grows past 256 entries where it must (36 or 40 KB).
* Shifted words (``K_FUN`` / ``V_FUN``): a chunk not at a fixed offset from aligned blocks is
  read as the words that hold it and funnel-shifted; in blocks of an even number of rows a
  row's offset from a word boundary follows the token's parity, so rows of 2 mod 4 bytes work.

A field that is not aligned to the chunk size (vLLM's 134-byte slots) is read as aligned
blocks: lanes take blocks ``1 .. 3`` (``1 .. 7`` for values) of the field's aligned span, and
the last lane joins block 0's tail with block 4's (8's) head byte by byte; the coordinate
permutation accounts for it.

Cooperative stages (``COOP`` stages, :func:`.mma_plans.coop_plan`): one CTA per (sequence, split),
one warp per KV head; the CTA copies each step's 16 whole rows (one contiguous range of a block) into a
ring of shared-memory stages with ``cp.async`` and the head-warps issue the same reads against the
stage (``_load_step(..., SMEM=True)``), so the partials are bit-identical to the per-warp kernel's.
With one or two KV heads (``WS > 1``, :func:`.coop_variants.shared_head_plan`) the CTA's ``HKV·WS`` warps
share each head: a stage holds ``SUB·WS`` steps, and warp ``sub`` of a head takes steps
``sub·SUB ..`` of every stage, its partial stored as split ``CTA split · WS + sub`` (the merge
combines them like any splits). The CTA then keeps ``(COOP - 1)·WS`` times a per-warp step's bytes
in flight, where the per-warp kernel keeps one step a warp.

Early launch (``PDL``, :func:`.plan.use_pdl`: programmatic dependent launch at grids of few CTAs):
the kernel starts while the q rotation runs, fills its pair table, then waits for the rotation
(``griddepcontrol.wait``) before it reads q or the clamped block table (so a cooperative plan's first
stages are issued after the fill, not before it), and lets the merge launch.

Partials (unnormalised acc, base-2 max, sum) go to the workspace of
:func:`tqkern.ops.paged_decode.merge._merge_kernel`, which merges splits and rotates back.
GPU only (inline PTX); the CPU interpreter runs the general kernel instead.

This module holds the kernel only. Its pieces: :mod:`.mma_table` (the pair table),
:mod:`.mma_fragments` (the code decoders, the MMA, the per-step math), :mod:`.mma_io` (the partials'
16-byte stores) and :mod:`.mma_loads` (a step's reads, the cooperative stages); its plans (the
constexprs): :mod:`.mma_plans`; its launcher: :mod:`.mma_launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.ops.paged_decode.mma_fragments import (_accumulate, _p_fragments, _rescale, _scaled_scores, _scores,
                                                   _values, _warp_max_r)
from tqkern.ops.paged_decode.mma_io import _q_pairs, _store_partials
from tqkern.ops.paged_decode.mma_table import _lut_barrier, _lut_declare, _lut_fill, _lut_fill_at, _lut_fill_k5
from tqkern.ops.paged_decode.mma_loads import (LaneGeometry, _byte_masks, _coop_first_stages, _coop_issue, _coop_wait,
                                               _load_step,
                                               _smem_base, _stage, _step_block, _step_blocks)

__all__ = ["_paged_decode_mma_kernel", "_paged_decode_coop_kernel"]


@triton.jit(do_not_specialize=["window_left"])
def _paged_decode_mma_kernel(
    q_ptr, cache_ptr, bt_ptr, sl_ptr, cen_ptr, vcen_ptr, acc_ptr, ml_ptr,
    num_seqs, max_blocks, sm_scale_log2, NUM_SPLITS, window_left, softcap_scale, softcap_cap,
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
    NLOW: tl.constexpr = 0, LATE_V: tl.constexpr = 0, GS: tl.constexpr = 1, QT: tl.constexpr = 1,
    K_AT: tl.constexpr = 0, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, WS: tl.constexpr = 1,
    KP: tl.constexpr = 0, PDL: tl.constexpr = False,
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
    # The table's key entries start at K_AT (MmaPlan.K_AT): 256 4-bit pairs, 64 3-bit pairs or 32
    # 5-bit codes; below them, Lloyd-Max value pairs of the value codebook (if any).
    KN: tl.constexpr = 256 if K_BITS == 4 else (64 if K_BITS == 3 else ((1024 if KP else 32) if K5 else 0))
    LUTB: tl.constexpr = 128 * (K_AT + KN if K_AT + KN > 256 else 256)
    # value chunk per lane and token: D/8 codes (4-bit: 1 byte per M tile, 3- and 2-bit: 2 codes per
    # M tile), CVB bits; CV bytes hold them (3-bit codes at head_dim 96: 36 bits, half of the lanes'
    # chunks start at bit 4 of a byte, VNIB: 5 bytes)
    CVB: tl.constexpr = (D // 8) * V_BITS
    VNIB: tl.constexpr = CVB % 8 != 0
    CV: tl.constexpr = (CVB + 4 * VNIB + 7) // 8
    NKW: tl.constexpr = (CK + 3) // 4
    NVW: tl.constexpr = (CV + 3) // 4 if V_BITS == 4 else (CV // 4 if CV >= 4 else 1)  # (D96: 6-byte chunks)
    NMT: tl.constexpr = D // 16
    LV: tl.constexpr = LATE_V * (COOP > 0)  # values read after the update: cooperative stages only
    CS: tl.constexpr = SUB * WS  # 16-token steps per iteration (and per cooperative stage) of the CTA
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
    if WS > 1:  # WS warps share each KV head of the CTA's range: split = CTA split · WS + sub; warp
        # sub takes steps sub·SUB .. of every stage (its partial: those tokens)
        nsp = NUM_SPLITS // WS
        csplit = split // WS
        wo = (split % WS) * (16 * SUB)
    else:
        nsp = NUM_SPLITS
        csplit = split
        wo = 0
    if WINDOW:  # keys first .. seq_len − 1 (the query at seq_len − 1; window_left < 2^30), split from
        # the step holding the first (steps start at multiples of 16); the keys before it masked
        first = tl.maximum(seq_len - 1 - window_left, 0)
        base = first - first % 16
        per = tl.cdiv(tl.cdiv(seq_len - base, nsp), 16) * 16
        start = base + csplit * per
    else:
        first = seq_len * 0
        per = tl.cdiv(tl.cdiv(seq_len, nsp), 16) * 16
        start = csplit * per
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
            lut = _lut_declare(t, LUTB)
    else:
        lut = t * 0  # (unused)
    if COOP:
        # CTA-cooperative stages (the CTA's warps are the KV heads of one sequence and split):
        # a ring of COOP stages of SUB steps' whole rows in dynamic shared memory, filled by
        # cp.async COOP - 1 iterations ahead; thread t copies 16-byte chunks t, t + NT, ... of
        # each step's 16 contiguous rows (to row i // (ROW_BYTES / 16) of the stage, RS bytes apart).
        # The first COOP - 1 stages are issued before the table is filled (their DRAM latency
        # overlaps the fill).
        STG: tl.constexpr = 16 * CS * RS
        NCP: tl.constexpr = (ROW_BYTES + NT - 1) // NT
        # (LUT_AT: stages 0 .. NLOW - 1 below the table, the others right above its 64 KB)
        stages = _smem_base(t) + (SMEM_OFF + LUTB * NEED_LUT * (LUT_AT == 0))
        NBELOW: tl.constexpr = NLOW if (LUT_AT > 0 and NLOW < COOP) else -1
        cp_s = ()
        for k in tl.static_range(NCP):
            ci = t + k * NT
            if RS == ROW_BYTES:
                cp_s = cp_s + (16 * ci,)
            else:
                cp_s = cp_s + ((ci // (ROW_BYTES // 16)) * RS + (ci % (ROW_BYTES // 16)) * 16,)
        if not PDL:
            _coop_first_stages(cache_ptr, bt_row, start, end, stages, lut, cp_s, t, NT, BS, ROW_BYTES, RS, CS, STG,
                               NBELOW, COOP)
    if NEED_LUT:
        if K5 and K_AT == 64 and V_BITS != 2 and not KP:  # 3-bit value pairs (or none) at 0, key codes at 64
            lut = _lut_fill_k5(lut, t, cen_ptr, vcen_ptr, NT, not V_UNIFORM)
        elif K_AT == 0:  # key pairs (4-bit Lloyd-Max values: the same pairs)
            lut = _lut_fill(lut, t, cen_ptr, NT, K_BITS, LUT_AT > 0)
        else:  # value pairs of the value codebook at 0, the keys' entries at K_AT
            if not V_UNIFORM:
                lut = _lut_fill_at(lut, t, vcen_ptr, NT, V_BITS, 0, 1 << (2 * V_BITS))
            lut = _lut_fill_at(lut, t, cen_ptr, NT, K_BITS, K_AT, KN, K5 and not KP)  # (KP: 5-bit code pairs)
            lut = _lut_barrier(lut)
        lb = lut + lane * 4
    else:
        lb = lane * 4
    if PDL:  # launched early (programmatic dependent launch): the table was filled while the q
        # rotation ran; its outputs (q, the clamped block table) are read only after it completes
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        if COOP:
            _coop_first_stages(cache_ptr, bt_row, start, end, stages, lut, cp_s, t, NT, BS, ROW_BYTES, RS, CS, STG,
                               NBELOW, COOP)
    kbase = lut + K_AT * 128  # the key entries' base (a lane's: + lane * 4)

    # -- field geometry (aligned spans, byte masks for the joining lane) ---------------------------
    kvh = h // GS  # this warp's KV head (h: a (KV head, query-head group) pair)
    ka = K_A_OFF + kvh * K_A_STRIDE
    va = V_A_OFF + kvh * V_A_STRIDE
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
    if V_FUN:  # this lane's chunk: field bits CVB·r .., from the word below it
        v_lane = va + (CVB * r) // 8
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
    if VNIB:  # (the shifts of the value chunks: whole bytes, and the chunk's first bit in its byte)
        v_sh_e = v_mis_e * 8 + (CVB * r) % 8
        v_sh_o = v_mis_o * 8 + (CVB * r) % 8
    else:
        v_sh_e = v_mis_e * 8
        v_sh_o = v_mis_o * 8
    k_masks = _byte_masks(tl.where(c == 3, k_mis, 0), NKW)
    v_masks = _byte_masks(tl.where(r == 7, v_mis, 0), NVW)
    k_sec_on = (c == 3) & (k_mis > 0)
    v_sec_on = (r == 7) & (v_mis > 0)
    kb_off = K_B_OFF + kvh * K_B_STRIDE
    vb_off = V_B_OFF + kvh * V_B_STRIDE
    vc_off = V_C_OFF + kvh * V_C_STRIDE
    geo = LaneGeometry(ka0, va0, va1, kb_off, vb_off, vc_off, k_masks, v_masks, k_sec_on, v_sec_on, k_mis, v_mis_e,
                       v_mis_o)

    # -- q as the B operand of S^T = K·Q^T: head r of each query column tile (QT of them: heads
    # (h·QT + j)·G + r), the coordinates of this lane's key chunk; tile j's fragments at qf[NQ·j ..]
    NQ: tl.constexpr = D // 8 if (K3 or K5) else (2 * NKW if K_FP8 else CK)
    # (q_rot is float32, rows 16-byte aligned: a lane's pairs are read 16 bytes at a time from an
    # even pair; 4-bit key chunks read in place start at pair (CK·(c + 1) − k_mis) mod 4·CK, even
    # as every KV head's field is at an even byte: mma_plans.mma_plan shifts the others)
    tl.static_assert(K3 or K5 or K_FP8 or K_FUN or (K_A_OFF % 2 == 0 and K_A_STRIDE % 2 == 0))
    q_ok = live & (r < G)
    qf = ()
    for qt in tl.static_range(QT):
        q_row = q_ptr + ((s * HQ + (h * QT + qt) * G + r) * D).to(tl.int64)
        if K3 or K5:  # code pair p of the chunk: coordinates c·D/4 + 2p, + 1
            for p in tl.static_range(0, D // 8, 2):
                qf = qf + _q_pairs(q_row + c * (D // 4) + 2 * p, q_ok, False)
        elif K_FP8:  # word i of the chunk (field word fw, coordinates 4fw .. 4fw + 3): two pairs
            for i in tl.static_range(NKW):
                fw = K_NW * (4 * (i // K_NW) + c) + i % K_NW
                qf = qf + _q_pairs(q_row + 4 * fw, q_ok, False)
        else:  # pairs j, j + 1 of the chunk: field bytes f, f + 1 (f even)
            for j in tl.static_range(0, CK, 2):
                if K_FUN:
                    f = CK * c + j
                else:
                    f = (CK * (c + 1) + j - k_mis) % (4 * CK)
                qf = qf + _q_pairs(q_row + 2 * f, q_ok, NIBBLE)
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
    o2 = o  # the second query column tile's state (QT = 2; shares vmax)
    m_e2 = m_e
    m_o2 = m_o
    l_e2 = zf
    l_o2 = zf
    z_e2 = zf
    z_o2 = zf

    # Software pipeline: the K/V data of the next PREFETCH steps is in flight in registers (a
    # ring), and the block-table entry of the step after those is looked up one iteration
    # earlier still, so that the loads never wait on the table. PREFETCH = 1 measured fastest on
    # the H100: ptxas sinks a deeper ring's loads to the end of the iteration anyway.
    if COOP:  # (the first COOP - 1 stages were issued before the pair table was filled)
        nxt = _step_blocks(bt_row, start + 16 * CS * (COOP - 1), end, BS, CS)
    else:
        blk = _step_block(bt_row, start, end, BS)
        ring = ()
        for j in tl.static_range(PREFETCH):
            ring = ring + (_load_step(cache_ptr, bt_row, blk, start + 16 * j, end, r, c, geo, BS, ROW_BYTES, CK, CV,
                                      K_MERGE, V_MERGE, K_DT, V_DT, V_UNIFORM, HINT, K_FP8, K_NW, K_BITS, K_FUN,
                                      V_FUN),)
            blk = _step_block(bt_row, start + 16 * (j + 1), end, BS)
    for it in range(0, tl.cdiv(n_steps, CS)):
        # SUB 16-token steps under one softmax update: their scores first, then one running
        # max (scores and value factors), one rescale of the output, then their values.
        tb = start + it * (16 * CS)  # the iteration's (the stage's) first token
        t0 = tb + wo  # this warp's first step of it
        if COOP:  # this iteration's stage has landed; refill the one read last iteration
            sb = _coop_wait(_stage(stages, lut, it % COOP, STG, NBELOW), COOP - 2)
            tc = tb + 16 * CS * (COOP - 1)
            _coop_issue(cache_ptr, nxt, tc, end,
                        _stage(stages, lut, (it + COOP - 1) % COOP, STG, NBELOW), cp_s, t, NT, BS,
                        ROW_BYTES, RS, CS)
            nxt = _step_blocks(bt_row, tc + 16 * CS, end, BS, CS)
            if WS > 1:
                sb = sb + wo * RS  # this warp's steps in the stage
        steps = ()
        mx_e = zf
        mx_o = zf
        mx_v = zf
        mx_e2 = zf
        mx_o2 = zf
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
            if WINDOW:
                ok0 = ok0 & (t0 + 16 * u + r >= first)
                ok1 = ok1 & (t0 + 16 * u + r + 8 >= first)
            sv, sv2, cn = _scores(k0, k1, qf, kbase, lane * 4, ones, k_sh, NKW, K_NC, K_FP8, K_BITS, D // 16,
                                  K_FUN, LUT_AT > 0, NQ, QT, KP)
            s0, s1, s2, s3 = _scaled_scores(sv, cn, fac, ok0, ok1, sm_scale_log2, K_NC, SOFTCAP, softcap_scale,
                                            softcap_cap)
            e0, e1, e2, e3 = _scaled_scores(sv2, cn, fac, ok0, ok1, sm_scale_log2, K_NC, SOFTCAP, softcap_scale,
                                            softcap_cap)  # (QT = 2: tile 1)
            vf0 = tl.where(ok0, fac[2], 0.0)
            vf1 = tl.where(ok1, fac[3], 0.0)
            if u == 0:
                mx_e = tl.maximum(s0, s2)
                mx_o = tl.maximum(s1, s3)
                mx_v = tl.maximum(tl.abs(vf0), tl.abs(vf1))
                if QT == 2:
                    mx_e2 = tl.maximum(e0, e2)
                    mx_o2 = tl.maximum(e1, e3)
            else:
                mx_e = tl.maximum(mx_e, tl.maximum(s0, s2))
                mx_o = tl.maximum(mx_o, tl.maximum(s1, s3))
                mx_v = tl.maximum(mx_v, tl.maximum(tl.abs(vf0), tl.abs(vf1)))
                if QT == 2:
                    mx_e2 = tl.maximum(mx_e2, tl.maximum(e0, e2))
                    mx_o2 = tl.maximum(mx_o2, tl.maximum(e1, e3))
            steps = steps + ((v0, v1, v2, v3, s0, s1, s2, s3, vf0, vf1, fac, ok0, ok1, e0, e1, e2, e3),)
        mn_e = tl.maximum(m_e, _warp_max_r(mx_e))
        mn_o = tl.maximum(m_o, _warp_max_r(mx_o))
        a_e = tl.exp2(m_e - mn_e)
        a_o = tl.exp2(m_o - mn_o)
        mn_e2 = m_e2
        mn_o2 = m_o2
        a_e2 = zf
        a_o2 = zf
        if QT == 2:
            mn_e2 = tl.maximum(m_e2, _warp_max_r(mx_e2))
            mn_o2 = tl.maximum(m_o2, _warp_max_r(mx_o2))
            a_e2 = tl.exp2(m_e2 - mn_e2)
            a_o2 = tl.exp2(m_o2 - mn_o2)
        for u in tl.static_range(SUB):
            v0, v1, v2, v3, s0, s1, s2, s3, vf0, vf1, fac, ok0, ok1, e0, e1, e2, e3 = steps[u]
            if LV:  # this step's values from the stage, now
                _, _, v0, v1, v2, v3, _ = _load_step(cache_ptr, bt_row, sb + 16 * u * RS, t0 + 16 * u, end, r, c,
                                                     geo, BS, ROW_BYTES, CK, CV, K_MERGE, V_MERGE, K_DT, V_DT,
                                                     V_UNIFORM, HINT, K_FP8, K_NW, K_BITS, K_FUN, V_FUN, True, RS,
                                                     2)
            p0 = tl.exp2(s0 - mn_e)
            p1 = tl.exp2(s1 - mn_o)
            p2 = tl.exp2(s2 - mn_e)
            p3 = tl.exp2(s3 - mn_o)
            # the running sums carry the correction factors once (the update's first step)
            l_e, l_o = _accumulate(l_e, l_o, a_e, a_o, p0 + p2, p1 + p3, u == 0)
            pe0 = p0
            pe1 = p1
            pe2 = p2
            pe3 = p3
            if QT == 2:
                pe0 = tl.exp2(e0 - mn_e2)
                pe1 = tl.exp2(e1 - mn_o2)
                pe2 = tl.exp2(e2 - mn_e2)
                pe3 = tl.exp2(e3 - mn_o2)
                l_e2, l_o2 = _accumulate(l_e2, l_o2, a_e2, a_o2, pe0 + pe2, pe1 + pe3, u == 0)
            if V_UNIFORM:
                vz0 = tl.where(ok0, fac[4], 0.0)
                vz1 = tl.where(ok1, fac[5], 0.0)
                z_e, z_o = _accumulate(z_e, z_o, a_e, a_o, p0 * vz0 + p2 * vz1, p1 * vz0 + p3 * vz1, u == 0)
                if QT == 2:
                    z_e2, z_o2 = _accumulate(z_e2, z_o2, a_e2, a_o2, pe0 * vz0 + pe2 * vz1, pe1 * vz0 + pe3 * vz1,
                                             u == 0)
            if u == 0:  # one rescale of the output per update
                vn = tl.maximum(vmax, _warp_max_r(mx_v))
                ratio = tl.where(vn > 0, vmax / tl.where(vn > 0, vn, 1.0), 1.0)
                inv = tl.where(vn > 0, 1.0 / tl.where(vn > 0, vn, 1.0), 0.0)
                vmax = vn
                o = _rescale(o, a_e * ratio, a_o * ratio, NMT)
                if QT == 2:
                    o2 = _rescale(o2, a_e2 * ratio, a_o2 * ratio, NMT)
            w0 = vf0 * inv
            w1 = vf1 * inv
            pb = _p_fragments(p0 * w0, p1 * w0, p2 * w1, p3 * w1)
            pc = pb
            if QT == 2:
                pc = _p_fragments(pe0 * w0, pe1 * w0, pe2 * w1, pe3 * w1)
            o, o2 = _values(o, o2, v0, v1, v2, v3, pb[0], pb[1], pc[0], pc[1], lb, lut, lane * 4, v_sh_e, v_sh_o,
                            NVW, CV, V_UNIFORM, V_FUN, V_BITS, NMT, LUT_AT > 0, QT)
        m_e = mn_e
        m_o = mn_o
        m_e2 = mn_e2
        m_o2 = mn_o2

    # -- partial results: acc [S, HQ, NUM_SPLITS, DP], (m, l) [S, HQ, NUM_SPLITS, 2] --------------
    # (16-byte stores of runs from multiples of 4, _store_partials: 4-bit value chunks read in place
    # rotate by an even v_mis in every KV head, mma_plans.mma_plan)
    tl.static_assert(V_BITS != 4 or V_FUN or (V_A_OFF % 2 == 0 and V_A_STRIDE % 2 == 0))
    for qt in tl.static_range(QT):
        if qt == 0:
            _store_partials(acc_ptr, ml_ptr, o, m_e, m_o, l_e, l_o, z_e, z_o, vmax, (s * HQ + h * QT * G + 2 * c),
                            split, live, r, c, v_mis, NUM_SPLITS, G, D, DP, NIBBLE, V_UNIFORM, V_BITS, V_FUN, CV, NMT)
        else:
            _store_partials(acc_ptr, ml_ptr, o2, m_e2, m_o2, l_e2, l_o2, z_e2, z_o2, vmax,
                            (s * HQ + (h * QT + 1) * G + 2 * c), split, live, r, c, v_mis, NUM_SPLITS, G, D, DP,
                            NIBBLE, V_UNIFORM, V_BITS, V_FUN, CV, NMT)


# The cooperative plans launch through a second wrapper of the same function that specializes no
# argument (no "== 1" or 16-divisibility variants): exactly one compiled kernel per constexpr set,
# so that its dynamic shared memory is sized once, before its binary is first loaded.
_paged_decode_coop_kernel = triton.jit(
    _paged_decode_mma_kernel.fn,
    do_not_specialize=["q_ptr", "cache_ptr", "bt_ptr", "sl_ptr", "cen_ptr", "vcen_ptr", "acc_ptr", "ml_ptr", "num_seqs",
                       "max_blocks", "sm_scale_log2", "NUM_SPLITS", "window_left", "softcap_scale", "softcap_cap"])
