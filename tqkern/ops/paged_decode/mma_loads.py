"""The reads of the warp-MMA decode kernel (:mod:`.mma_kernel`): one 16-token step's words of a
lane's key and value chunks, from global memory (``ld.global.nc``) or from a cooperative stage in
shared memory (``ld.shared``), with joined (``*_MERGE``) and shifted (``*_FUN``) fields and the
per-token factors (:func:`_load_step`, the one call per step); and the CTA-cooperative stage ring
(``cp.async`` copies of a step's whole rows into shared memory, and the waits on them)."""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from tqkern.ops.common import load_param


def _ld_asm(nw: int, hint: str, space: str = "global.nc", typ: str = "b32") -> str:
    regs = ", ".join(f"${i}" for i in range(nw))
    vec = {4: ".v4", 2: ".v2", 1: ""}[nw]
    dst = f"{{{regs}}}" if nw > 1 else regs
    return ("{\n.reg .pred p;\n" + f"setp.ne.b32 p, ${nw + 1}, 0;\n"
            + "".join(f"mov.b32 ${i}, 0;\n" for i in range(nw))
            + f"@p ld.{space}{hint}{vec}.{typ} {dst}, [${nw}];\n}}")


# Loads of 1, 2 or 4 words, plain or with an L2 prefetch hint of 256 bytes. (Adding
# L1::no_allocate measured 1-29% slower on the H100 for every format: docs/performance.md §23.)
class LaneGeometry(NamedTuple):
    """One lane's field geometry, fixed for the warp (built once in the kernel's prologue, read by
    every :func:`_load_step`): the first key word (``ka0``) and value words of even / odd tokens
    (``va0`` / ``va1``), the per-token factor offsets (``kb_off``, ``vb_off``, ``vc_off``), the byte
    masks and second-word switches of misaligned chunks, and the misalignments (``k_mis``,
    ``v_mis_e``, ``v_mis_o``)."""

    ka0: object
    va0: object
    va1: object
    kb_off: object
    vb_off: object
    vc_off: object
    k_masks: object
    v_masks: object
    k_sec_on: object
    v_sec_on: object
    k_mis: object
    v_mis_e: object
    v_mis_o: object


_LD_ASM = {(nw, h): tl.constexpr(_ld_asm(nw, ".L2::256B" if h else "")) for nw in (1, 2, 4) for h in (0, 1)}
_LD1, _LD2, _LD4 = _LD_ASM[1, 0], _LD_ASM[2, 0], _LD_ASM[4, 0]
_LD1H, _LD2H, _LD4H = _LD_ASM[1, 1], _LD_ASM[2, 1], _LD_ASM[4, 1]


# The same from shared memory (the CTA-cooperative stages), and one 16-bit word zero-extended.
_LDS_ASM = {nw: tl.constexpr(_ld_asm(nw, "", "shared")) for nw in (1, 2, 4)}
_LDS1, _LDS2, _LDS4 = _LDS_ASM[1], _LDS_ASM[2], _LDS_ASM[4]
_LDS16 = tl.constexpr(_ld_asm(1, "", "shared", "u16"))


@triton.jit
def _lds_words(addr, pred, NW: tl.constexpr):
    """NW consecutive 32-bit words at shared address ``addr`` (aligned to 4·NW for NW = 2, 4; any
    other NW, e.g. head_dim 96's 3-word key chunks: NW single-word loads, 4-byte aligned); zeros
    where ``pred`` is false."""
    p = pred.to(tl.int32)
    if NW == 4:
        return tl.inline_asm_elementwise(_LDS4, "=r,=r,=r,=r,r,r", [addr, p], dtype=(tl.int32,) * 4, is_pure=True,
                                         pack=1)
    elif NW == 2:
        return tl.inline_asm_elementwise(_LDS2, "=r,=r,r,r", [addr, p], dtype=(tl.int32,) * 2, is_pure=True, pack=1)
    res = ()
    for i in tl.static_range(NW):
        res = res + (tl.inline_asm_elementwise(_LDS1, "=r,r,r", [addr + 4 * i, p], dtype=tl.int32, is_pure=True,
                                               pack=1),)
    return res


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
    """NW consecutive 32-bit words at ``ptr`` (aligned to 4·NW for NW = 2, 4; 16 for 8) through the
    read-only path (``SMEM``: at the shared address ``ptr``); zeros where ``pred`` is false. (8: two
    loads of 4, head_dim 256's 32-byte 4-bit key chunks; any other NW, e.g. head_dim 96's 12-byte
    4-bit key chunks where they sit at aligned offsets: NW single-word loads, 4-byte aligned.)"""
    if SMEM and NW == 8:
        res = _lds_words(ptr, pred, 4) + _lds_words(ptr + 16, pred, 4)
    elif SMEM:
        res = _lds_words(ptr, pred, NW)
    elif NW == 8:
        res = (tl.inline_asm_elementwise(_LD4H if HINT else _LD4, "=r,=r,=r,=r,l,r", [ptr, pred.to(tl.int32)],
                                         dtype=(tl.int32,) * 4, is_pure=True, pack=1)
               + tl.inline_asm_elementwise(_LD4H if HINT else _LD4, "=r,=r,=r,=r,l,r", [ptr + 16, pred.to(tl.int32)],
                                           dtype=(tl.int32,) * 4, is_pure=True, pack=1))
    elif NW == 4:
        res = tl.inline_asm_elementwise(_LD4H if HINT else _LD4, "=r,=r,=r,=r,l,r", [ptr, pred.to(tl.int32)],
                                        dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    elif NW == 2:
        res = tl.inline_asm_elementwise(_LD2H if HINT else _LD2, "=r,=r,l,r", [ptr, pred.to(tl.int32)],
                                        dtype=(tl.int32,) * 2, is_pure=True, pack=1)
    else:
        res = ()
        for i in tl.static_range(NW):
            res = res + (tl.inline_asm_elementwise(_LD1H if HINT else _LD1, "=r,l,r", [ptr + 4 * i, pred.to(tl.int32)],
                                                   dtype=tl.int32, is_pure=True, pack=1),)
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
    nothing past them is read); zeros elsewhere. :func:`.mma_fragments._shifted` aligns them."""
    res = ()
    for i in tl.static_range((NB + 3) // 4 + 1):
        res = res + _ld_words(ptr + 4 * i, ok & (4 * i < mis + NB), 1, HINT, SMEM)
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
def _coop_first_stages(cache_ptr, bt_row, start, end, stages, lut, cp_s, t, NT: tl.constexpr, BS: tl.constexpr,
                       ROW_BYTES: tl.constexpr, RS: tl.constexpr, CS: tl.constexpr, STG: tl.constexpr,
                       NBELOW: tl.constexpr, COOP: tl.constexpr):
    """Issue the ring's first ``COOP - 1`` stages (steps ``CS`` at a time from ``start``) before the
    loop: :func:`_coop_issue` of each into its :func:`_stage`."""
    for j in tl.static_range(COOP - 1):
        _coop_issue(cache_ptr, _step_blocks(bt_row, start + 16 * CS * j, end, BS, CS), start + 16 * CS * j, end,
                    _stage(stages, lut, j, STG, NBELOW), cp_s, t, NT, BS, ROW_BYTES, RS, CS)


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
    this lane's :class:`LaneGeometry`, fixed for the warp (built once in the kernel's prologue). ``SMEM``:
    the step's 16 rows are in a shared-memory stage at address ``blk``, ``RS`` bytes apart (the
    CTA-cooperative kernel); the same reads from there, without predicates (the kernel's loop runs
    no step past the CTA's range, which all its warps share). ``PART``: 0 everything, 1 the keys and
    factors only (the values come back as ``()``), 2 the values only (the cooperative kernel reads
    them from the stage after the softmax update, so that they do not hold registers across the
    scores)."""
    ka0, va0, va1, kb_off, vb_off, vc_off = geo.ka0, geo.va0, geo.va1, geo.kb_off, geo.vb_off, geo.vc_off
    k_masks, v_masks, k_sec_on, v_sec_on = geo.k_masks, geo.v_masks, geo.k_sec_on, geo.v_sec_on
    k_mis, v_mis_e, v_mis_o = geo.k_mis, geo.v_mis_e, geo.v_mis_o
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
