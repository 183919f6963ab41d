"""The merge of a split-KV decode's partials (unnormalised acc, base-2 max, sum per split) by
log-sum-exp into the output, rotating back (``@ Πᵀ``) when the value codec is rotated:
:func:`_merge_rows_kernel` (blocks of query rows), :func:`_merge_row_kernel` (one query row, its
splits as one tile: few rows of many splits; from 256 splits it may leave the rotate-back to
:func:`_rotate_back_kernel`) or :func:`_merge_kernel` (one GQA group per program), launched by
:func:`_launch_merge`. Both decode kernels (:mod:`.general`,
:mod:`.mma_kernel`) write the workspace these read.

Two attention options are the merge's alone, so they apply after either kernel (constexprs:
off, the merge compiles as without them): ``SINKS`` adds each query head's sink logit σ to the
denominator (``2^(σ·log2 e − m)``, no value), ``LSE`` writes the row's natural-log normaliser
``(m + log2 l)·ln 2`` (−inf for a row without keys or sink; NaN for a poisoned row).

The rotate-back of a signed Sylvester ``Π = diag(s)·H/√D`` at a power-of-two head_dim (``FWHT``,
the row-block and group merges) is the in-register Walsh–Hadamard transform:
``(o @ Πᵀ)[c] = Π[c, 0]·(H·o)[c]``; every program then transforms all columns of its rows and
stores its chunk's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkern.ops.common import _fwht_tile, layout_consts
from tqkern.ops.paged_decode.side_plans import (fwht_constexprs, merge_chunks, merge_impl, row_chunks,
                                                row_merge_chunks, row_merge_unroll, row_split_block, transform_fits)

__all__ = ["_merge_kernel", "_merge_rows_kernel", "_merge_row_kernel", "_rotate_back_kernel", "_launch_merge",
           "merge_chunks"]

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _with_sink(m_all, sink_ptr, heads, hmask, SINKS: tl.constexpr):
    """The rows' maxima (base 2) with their heads' sink logits, and those logits in base 2."""
    if SINKS:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * _LOG2E
        return tl.maximum(m_all, sink), sink
    return m_all, m_all


@triton.jit
def _store_lse(lse_ptr, rows, rmask, m_safe, l_all, poison, c0, POISON: tl.constexpr):
    """lse = (m + log2 l)·ln 2 of each row (−inf where l = 0), from the first column chunk only."""
    lse = tl.where(l_all > 0, (m_safe + tl.log2(tl.where(l_all > 0, l_all, 1.0))) * _LN2, float("-inf"))
    if POISON:
        lse += poison
    tl.store(lse_ptr + rows, lse, mask=rmask & ((rows * 0 + c0) == 0))


@triton.jit
def _store_merged(o, o_row, rmask, rot_ptr, c0, cols, D: tl.constexpr, CC: tl.constexpr,
                  ROTATE_BACK: tl.constexpr, DOT_PRECISION: tl.constexpr, R: tl.constexpr = 16,
                  FWHT: tl.constexpr = False, LOG2D: tl.constexpr = 0):
    """Store merged rows ``o`` ([R, cols]) to output columns ``c0 .. c0 + CC − 1``: with the
    rotate-back ``cols`` are all DP columns and ``out[:, c] = o @ Πᵀ[:, c]`` (``Πᵀ[:, c] = Π[c, :]``,
    64 columns per dot; with ``FWHT`` (D = DP) ``Π[c, 0]·(H·o)[c]``), else ``cols`` are the chunk's
    columns."""
    if ROTATE_BACK and FWHT:
        y = _fwht_tile(o, R, D, LOG2D) * tl.load(rot_ptr + cols * D)[None, :]
        tl.store(o_row + cols[None, :], y.to(o_row.dtype.element_ty),
                 mask=rmask[:, None] & ((cols >= c0) & (cols < c0 + CC))[None, :])
    elif ROTATE_BACK:
        SUB: tl.constexpr = CC if CC < 64 else 64 if CC <= 128 else 32
        for c1 in tl.static_range(0, CC, SUB):
            cs = c0 + c1 + tl.arange(0, SUB)
            rt = tl.load(rot_ptr + cs[None, :] * D + cols[:, None], mask=(cols < D)[:, None] & (cs < D)[None, :],
                         other=0.0)  # [DP, SUB]
            res = tl.dot(o, rt, input_precision=DOT_PRECISION)
            tl.store(o_row + cs[None, :], res.to(o_row.dtype.element_ty), mask=rmask[:, None] & (cs < D)[None, :])
    else:
        tl.store(o_row + cols[None, :], o.to(o_row.dtype.element_ty), mask=rmask[:, None] & (cols < D)[None, :])


@triton.jit
def _merge_kernel(acc_ptr, ml_ptr, rot_ptr, out_ptr, poison_ptr, sink_ptr, lse_ptr, stride_os, stride_oh,
                  G: tl.constexpr, GP: tl.constexpr, HQ: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  SP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, CC: tl.constexpr,
                  ROTATE_BACK: tl.constexpr, DOT_PRECISION: tl.constexpr, POISON: tl.constexpr,
                  SINKS: tl.constexpr = False, LSE: tl.constexpr = False, FWHT: tl.constexpr = False,
                  LOG2D: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Merge the splits of one (sequence, KV head) by log-sum-exp; out = acc/l (@ Πᵀ). Program
    ``(s, h, j)`` writes output columns ``j·CC .. j·CC + CC − 1`` (with the rotation it merges all
    columns and rotates into its chunk: the chunks spread the rotate-back over more programs)."""
    if PDL:  # launched early (programmatic dependent launch): the partials once the decode completes
        tl.extra.cuda.gdc_wait()
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
    m_all, sink = _with_sink(tl.max(m, axis=1), sink_ptr, qh, gm, SINKS)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(pm & (m > float("-inf")), tl.exp2(m - m_safe[:, None]), 0.0)  # [GP, SP]
    l_all = tl.sum(w * l, axis=1)
    if SINKS:
        l_all += tl.exp2(sink - m_safe)
    inv = tl.where(l_all > 0, 1.0 / tl.where(l_all > 0, l_all, 1.0), 0.0)
    o_row = out_ptr + s.to(tl.int64) * stride_os + qh.to(tl.int64)[:, None] * stride_oh
    cc = c0 + tl.arange(0, CC)
    if ROTATE_BACK:  # out[:, cc] = o @ Πᵀ[:, cc], Πᵀ[:, c] = Π[c, :]
        cols = tl.arange(0, DP)
    else:
        cols = cc
    o = tl.zeros([GP, cols.shape[0]], tl.float32)
    if D < DP:  # the workspace's pad columns hold whatever the decode kernel left there (none: the warp-MMA one)
        am = gm[:, None] & (cols < D)[None, :]
    else:
        am = gm[:, None]
    for i in tl.static_range(NUM_SPLITS):
        wi = tl.sum(tl.where(sp[None, :] == i, w, 0.0), axis=1)
        a = tl.load(acc_ptr + ((s * HQ + qh).to(tl.int64) * NUM_SPLITS + i)[:, None] * DP + cols[None, :],
                    mask=am, other=0.0)  # not masked by the weight: no wait for (m, l)
        o += tl.where((wi > 0)[:, None], a * wi[:, None], 0.0)
    o = o * inv[:, None]
    if POISON:
        o += poison[:, None]
    if LSE:
        _store_lse(lse_ptr, s * HQ + qh, gm, m_safe, l_all, poison if POISON else l_all, c0, POISON)
    _store_merged(o, o_row, gm, rot_ptr, c0, cols, D, CC, ROTATE_BACK, DOT_PRECISION, GP, FWHT, LOG2D)


@triton.jit
def _merge_rows_kernel(acc_ptr, ml_ptr, rot_ptr, out_ptr, poison_ptr, sink_ptr, lse_ptr, n_rows, num_splits,
                       stride_os, stride_oh,
                       HQ: tl.constexpr, ROWS: tl.constexpr, SP: tl.constexpr, UNROLL: tl.constexpr, D: tl.constexpr,
                       DP: tl.constexpr, CC: tl.constexpr, ROTATE_BACK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       POISON: tl.constexpr, SINKS: tl.constexpr = False, LSE: tl.constexpr = False,
                       FWHT: tl.constexpr = False, LOG2D: tl.constexpr = 0, PDL: tl.constexpr = False):
    """The merge by blocks of ``ROWS`` query rows (``row = s·HQ + head``, any heads and
    sequences): the rotate-back is a full ``[ROWS, DP] @ [DP, CC]`` tile and Π is read once per
    ROWS rows, instead of once per GQA group padded to 16. Program ``(b, j)`` writes columns
    ``j·CC .. j·CC + CC − 1`` of rows ``b·ROWS ..``; same workspace layout and result as
    :func:`_merge_kernel`. The maxima of all splits are one ``[ROWS, SP]`` load; then splits are
    read ``UNROLL`` at a time, the partials by loads that do not wait for the weights (an empty
    split's weight 0 selects 0, whatever its partial holds)."""
    if PDL:  # launched early (programmatic dependent launch): the partials once the decode completes
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < n_rows
    c0 = tl.program_id(1) * CC
    if POISON:  # NaN for a query row holding a NaN or inf (docs/layout.md); loaded first, used last
        poison = tl.load(poison_ptr + rows, mask=rm, other=0.0)
    part0 = rows.to(tl.int64) * num_splits
    sp = tl.arange(0, SP)  # the maxima of all splits: one load, not one round trip per split
    m_all = tl.max(tl.load(ml_ptr + (part0[:, None] + sp[None, :]) * 2, mask=rm[:, None] & (sp < num_splits)[None, :],
                           other=float("-inf")), axis=1)
    m_all, sink = _with_sink(m_all, sink_ptr, rows % HQ, rm, SINKS)
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
            if D < DP:  # (pad columns: never read)
                a = tl.load(acc_ptr + part[:, None] * DP + cols[None, :], mask=(rm & ok)[:, None] & (cols < D)[None, :],
                            other=0.0)
            else:
                a = tl.load(acc_ptr + part[:, None] * DP + cols[None, :], mask=(rm & ok)[:, None], other=0.0)
            o += tl.where((w > 0)[:, None], a * w[:, None], 0.0)  # the load does not wait for w
    if SINKS:
        l_all += tl.exp2(sink - m_safe)
    inv = tl.where(l_all > 0, 1.0 / tl.where(l_all > 0, l_all, 1.0), 0.0)
    o = o * inv[:, None]
    if POISON:
        o += poison[:, None]
    if LSE:
        _store_lse(lse_ptr, rows, rm, m_safe, l_all, poison if POISON else l_all, c0, POISON)
    o_row = out_ptr + (rows // HQ).to(tl.int64)[:, None] * stride_os + (rows % HQ).to(tl.int64)[:, None] * stride_oh
    _store_merged(o, o_row, rm, rot_ptr, c0, cols, D, CC, ROTATE_BACK, DOT_PRECISION, ROWS, FWHT, LOG2D)


@triton.jit
def _merge_row_kernel(acc_ptr, ml_ptr, rot_ptr, out_ptr, poison_ptr, sink_ptr, lse_ptr, num_splits,
                      stride_os, stride_oh,
                      HQ: tl.constexpr, SP: tl.constexpr, SB: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                      CC: tl.constexpr, ROTATE_BACK: tl.constexpr, POISON: tl.constexpr,
                      SINKS: tl.constexpr = False, LSE: tl.constexpr = False, PDL: tl.constexpr = False):
    """The merge of one query row (``row = s·HQ + head``) per program, for few rows of many splits
    (batch 1): the splits are read ``SB`` at a time as one ``[SB, columns]`` load, so one row's
    partials stream through many SMs instead of a 16-row block's through one. Program ``(row, j)``
    writes columns ``j·CC .. j·CC + CC − 1``; with the rotate-back it merges all DP columns and
    forms ``out[c] = Σ_j Π[c, j]·o[j]`` for its chunk in float32 FMAs (a 1-row ``tl.dot`` would
    pad to 16 rows; the Walsh–Hadamard transform of a ``[1, DP]`` row lost to it, session 39:
    :func:`.side_plans.merge_transform`). The weighted partials accumulate as an ``[SB, columns]``
    tile, summed over its splits once after the loop (not once per load: a cross-warp reduction),
    and the rotate-back's first slice of Π is loaded before the loop. Measured (H200, session 58
    probe, CUDA graphs, ``paged_decode`` before → after, µs): Qwen2.5-7B 1×64K (128 splits) k5v4h
    40.2 / 40.5 → 38.5, tqkern_k5v3 43.7 → 41.7, tq4 37.7 → 35.7, turboquant_4bit_nc (no rotate-back,
    one load) 34.1 → 34.1; Llama-3-8B 1×128K k5v4h 94.9 / 96.3 → 94.1, tq4 72.8 → 70.8. Same
    workspace layout and result as :func:`_merge_kernel` (to rounding)."""
    if PDL:  # launched early (programmatic dependent launch): the partials once the decode completes
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0)
    c0 = tl.program_id(1) * CC
    part0 = r.to(tl.int64) * num_splits
    sp = tl.arange(0, SP)
    spm = sp < num_splits
    m = tl.load(ml_ptr + (part0 + sp) * 2, mask=spm, other=float("-inf"))
    l = tl.load(ml_ptr + (part0 + sp) * 2 + 1, mask=spm, other=0.0)
    m_all = tl.max(m, axis=0)
    if SINKS:
        sink = tl.load(sink_ptr + r % HQ) * _LOG2E
        m_all = tl.maximum(m_all, sink)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.sum(tl.where(m > float("-inf"), tl.exp2(m - m_safe), 0.0) * l, axis=0)
    if SINKS:
        l_all += tl.exp2(sink - m_safe)
    inv = tl.where(l_all > 0, 1.0 / tl.where(l_all > 0, l_all, 1.0), 0.0)
    if ROTATE_BACK:
        cols = tl.arange(0, DP)
        SUB: tl.constexpr = CC if CC * DP <= 4096 else 4096 // DP
        cs0 = c0 + tl.arange(0, SUB)
        rt0 = tl.load(rot_ptr + cs0[:, None] * D + cols[None, :], mask=(cs0 < D)[:, None] & (cols < D)[None, :],
                      other=0.0)  # Π[cs0, :], the first (at DP <= 128 the only) slice: in flight over the loop
    else:
        cols = c0 + tl.arange(0, CC)
    o2 = tl.zeros([SB, cols.shape[0]], tl.float32)
    for i0 in range(0, num_splits, SB):
        si = i0 + tl.arange(0, SB)
        ok = si < num_splits
        mi = tl.load(ml_ptr + (part0 + si) * 2, mask=ok, other=float("-inf"))
        wi = tl.where(mi > float("-inf"), tl.exp2(mi - m_safe), 0.0)
        a = tl.load(acc_ptr + (part0 + si)[:, None] * DP + cols[None, :], mask=ok[:, None] & (cols < D)[None, :],
                    other=0.0)  # pad columns never read; an empty split's partial selected away below
        o2 += tl.where((wi > 0)[:, None], a * wi[:, None], 0.0)
    o = tl.sum(o2, axis=0) * inv
    if POISON:  # NaN for a query row holding a NaN or inf (docs/layout.md)
        poison = tl.load(poison_ptr + r)
        o += poison
    if LSE:
        lse = tl.where(l_all > 0, (m_safe + tl.log2(tl.where(l_all > 0, l_all, 1.0))) * _LN2, float("-inf"))
        if POISON:
            lse += poison
        if c0 == 0:
            tl.store(lse_ptr + r, lse)
    o_row = out_ptr + (r // HQ).to(tl.int64) * stride_os + (r % HQ).to(tl.int64) * stride_oh
    if ROTATE_BACK:
        tl.store(o_row + cs0, tl.sum(rt0 * o[None, :], axis=1).to(o_row.dtype.element_ty), mask=cs0 < D)
        for c1 in tl.static_range(SUB, CC, SUB):
            cs = c0 + c1 + tl.arange(0, SUB)
            rt = tl.load(rot_ptr + cs[:, None] * D + cols[None, :], mask=(cs < D)[:, None] & (cols < D)[None, :],
                         other=0.0)  # Π[cs, :]
            tl.store(o_row + cs, tl.sum(rt * o[None, :], axis=1).to(o_row.dtype.element_ty), mask=cs < D)
    else:
        tl.store(o_row + cols, o.to(o_row.dtype.element_ty), mask=cols < D)


@triton.jit
def _rotate_back_kernel(o_ptr, rot_ptr, out_ptr, n_rows, stride_or, stride_os, stride_oh, HQ: tl.constexpr,
                        D: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr, CC: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, FWHT: tl.constexpr = False, LOG2D: tl.constexpr = 0,
                        PDL: tl.constexpr = False):
    """The rotate-back as a launch of its own, after a one-row merge that wrote each merged row
    ``o`` unrotated (float32, row ``r`` at ``o_ptr + r·stride_or``; columns from D on never read):
    ``out[r] = o[r] @ Πᵀ`` for ``ROWS`` rows ``r = s·HQ + head`` per program, program ``(b, j)``
    storing columns ``j·CC .. j·CC + CC − 1`` (by :func:`_store_merged`: a ``[ROWS, DP] @ [DP, 64]``
    product, or with ``FWHT`` the Walsh–Hadamard transform of all columns, ``CC = DP``). A NaN row
    (poisoned by the merge) stays NaN in every column; rows do not mix."""
    if PDL:  # launched early (programmatic dependent launch): the merged rows once the merge completes
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < n_rows
    cols = tl.arange(0, DP)
    o = tl.load(o_ptr + rows.to(tl.int64)[:, None] * stride_or + cols[None, :], mask=rm[:, None] & (cols < D)[None, :],
                other=0.0)
    o_row = out_ptr + (rows // HQ).to(tl.int64)[:, None] * stride_os + (rows % HQ).to(tl.int64)[:, None] * stride_oh
    _store_merged(o, o_row, rm, rot_ptr, tl.program_id(1) * CC, cols, D, CC, True, DOT_PRECISION, ROWS, FWHT, LOG2D)


def _launch_merge(acc, ml, rotation, out, layout, g: int, num_splits: int, interpret: bool,
                  chunks: int | None = None, impl: str | None = None, rows: int = 16, unroll: int | None = None,
                  q_poison=None, sinks=None, lse=None, fwht: bool = False, apart: bool = False):
    """Merge the splits into ``out`` (rotating back when the value codec is rotated; with ``fwht`` by
    the Walsh–Hadamard transform: ``rotation`` signed Sylvester, a power-of-two head_dim ≥ 16; the
    decode's plan takes it where :func:`.side_plans.merge_transform` says). ``impl``:
    ``"rows"`` (:func:`_merge_rows_kernel`, blocks of ``rows`` query rows), ``"row"``
    (:func:`_merge_row_kernel`, one query row per program) or ``"heads"`` (:func:`_merge_kernel`,
    one GQA group per program); by default :func:`.side_plans.merge_impl` (measured there; with the
    rotate-back and few splits rows are 2x faster than heads, H100, session 4: tq4 B32x16K 11.7 →
    6.0 µs). ``chunks``: output-column chunks per program (default :func:`.side_plans.row_chunks`,
    :func:`.side_plans.row_merge_chunks` or :func:`merge_chunks`); ``unroll``: splits per loop
    iteration of the row-block kernel (default 8 with the rotate-back, else all of them). ``q_poison``: float32
    ``[S·Hq]`` added to every output row (NaN poisons the row), or ``None``. ``sinks``: float32
    ``[Hq]`` sink logits (natural log), or ``None``; ``lse``: float32 ``[S, Hq]`` written with
    each row's normaliser, or ``None``. ``apart`` (``"row"`` with a rotated value codec): the merge
    writes the merged rows unrotated over ``acc`` (row ``r`` over its split 0's partial) and
    :func:`_rotate_back_kernel` rotates them into ``out`` (by the transform with ``fwht``)."""
    s, hq, d = out.shape
    dp = layout_consts(layout)["DP"]
    rotate_back = bool(layout.format.value.rotated)
    sms = 1 if interpret else torch.cuda.get_device_properties(out.device).multi_processor_count
    if impl is None:
        impl = merge_impl(rotate_back, num_splits)
    if unroll is None:
        unroll = row_merge_unroll(rotate_back)
    if impl not in ("rows", "row", "heads"):
        raise ValueError(f"impl must be 'rows', 'row', 'heads' or None, got {impl!r}")
    if not isinstance(rows, int) or rows < 16 or rows & (rows - 1):
        raise ValueError(f"rows must be a power of two >= 16, got {rows!r}")
    precision = "ieee" if interpret else "tf32x3"
    if fwht and not transform_fits(rotate_back, True, d):
        raise ValueError(f"fwht needs a rotated value codec at a power-of-two head_dim >= 16, got head_dim {d}"
                         f" (value codec rotated: {rotate_back})")
    if apart and (impl != "row" or not rotate_back):
        raise ValueError(f"apart applies to the 'row' merge of a rotated value codec, got impl {impl!r} "
                         f"(value codec rotated: {rotate_back})")
    if fwht and impl == "row" and not apart:
        raise ValueError("fwht applies to the 'rows' and 'heads' merges, not 'row' (but with apart)")
    tx = fwht_constexprs(fwht, d)
    if impl == "row":
        in_merge = rotate_back and not apart
        if chunks is None:
            chunks = row_chunks(s * hq, sms, dp, in_merge)
        # apart: row r merged into acc's row r·splits (its split 0's partial, read only by the program
        # that overwrites it, after its loop)
        dst, strides = (acc, (hq * num_splits * dp, num_splits * dp)) if apart else (out, out.stride()[:2])
        if s * hq:
            sp = max(2, triton.next_power_of_2(num_splits))
            _merge_row_kernel[(s * hq, chunks)](
                acc, ml, rotation, dst, ml if q_poison is None else q_poison, ml if sinks is None else sinks,
                ml if lse is None else lse, num_splits, *strides,
                HQ=hq, SP=sp, SB=row_split_block(num_splits, dp, chunks, in_merge), D=d, DP=dp,
                CC=dp // chunks, ROTATE_BACK=in_merge, POISON=q_poison is not None, SINKS=sinks is not None,
                LSE=lse is not None, num_warps=4)
            if apart:
                cc = dp if fwht else min(64, dp)
                _rotate_back_kernel[(triton.cdiv(s * hq, 16), dp // cc)](
                    acc, rotation, out, s * hq, num_splits * dp, out.stride(0), out.stride(1), HQ=hq, D=d, DP=dp,
                    ROWS=16, CC=cc, DOT_PRECISION=precision, num_warps=4, **tx)
        return
    if impl == "rows":
        n = s * hq
        blocks = triton.cdiv(n, rows)
        if chunks is None:
            chunks = row_merge_chunks(blocks, sms, dp, rotate_back)
        if n:
            _merge_rows_kernel[(blocks, chunks)](
                acc, ml, rotation, out, ml if q_poison is None else q_poison, ml if sinks is None else sinks,
                ml if lse is None else lse, n, num_splits, out.stride(0), out.stride(1),
                HQ=hq, ROWS=rows, SP=max(2, triton.next_power_of_2(num_splits)),
                UNROLL=max(1, min(unroll, num_splits)), D=d, DP=dp, CC=dp // chunks,
                ROTATE_BACK=rotate_back, DOT_PRECISION=precision, POISON=q_poison is not None,
                SINKS=sinks is not None, LSE=lse is not None, num_warps=4, **tx)
        return
    gp = max(16, triton.next_power_of_2(g))
    if chunks is None:
        chunks = merge_chunks(s * layout.num_kv_heads, sms, dp)
    nch = chunks
    cc = dp // nch
    _merge_kernel[(s, layout.num_kv_heads, nch)](
        acc, ml, rotation, out, ml if q_poison is None else q_poison, ml if sinks is None else sinks,
        ml if lse is None else lse, out.stride(0), out.stride(1),
        G=g, GP=gp, HQ=hq, NUM_SPLITS=num_splits, SP=max(2, triton.next_power_of_2(num_splits)), D=d, DP=dp,
        CC=cc, ROTATE_BACK=rotate_back, DOT_PRECISION=precision, POISON=q_poison is not None,
        SINKS=sinks is not None, LSE=lse is not None, num_warps=4, **tx,
    )
