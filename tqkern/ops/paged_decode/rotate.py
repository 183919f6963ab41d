"""Before the decode: the query rotation ``q @ Π`` (or the fp32 cast) in one launch, which also
scans the block table once (clamped indices for the decode kernels, error bits for bad ones):
:func:`rotate_q`, :func:`_rotate_q_kernel`, :func:`_scan_indices`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkern.errors import ErrorFlag
from tqkern.ops.common import _fwht_tile
from tqkern.ops.paged_decode.side_plans import q_transform, scan_split

__all__ = ["_rotate_q_kernel", "rotate_q"]


_ERR_BLOCK = tl.constexpr(int(ErrorFlag.BLOCK_OUT_OF_RANGE))
_ERR_SEQ_LEN = tl.constexpr(int(ErrorFlag.SEQ_LEN_OUT_OF_RANGE))


@triton.jit
def _scan_indices(bt_ptr, sl_ptr, err_ptr, safe_ptr, num_seqs, max_blocks, num_blocks, p, n_p, BS: tl.constexpr,
                  SB: tl.constexpr):
    """Make the decode's indices safe before it runs, off its loops: ``n_p`` scanning programs
    (this one is ``p``) share the block table's ``num_seqs·max_blocks`` entries and write each,
    clamped into ``[0, num_blocks − 1]`` as an unsigned number (negative ones become the last
    block), to ``safe_ptr``, the table the decode kernels read; so no index reads outside the
    cache and the kernels' loops stay as they were (a clamp there cost tq4 2.5%, measured). An
    entry in use (position < the sequence's clamped length) outside ``[0, num_blocks)`` sets
    ``BLOCK_OUT_OF_RANGE``, a length outside ``[0, max_blocks·BS]`` ``SEQ_LEN_OUT_OF_RANGE``
    (the kernels clamp lengths themselves), with one atomic per program, only if set."""
    total = num_seqs * max_blocks
    per = tl.cdiv(total, n_p)
    e0 = p * per
    cap = max_blocks * BS
    err = p * 0
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
                     num_seqs, max_blocks, num_blocks, rot_programs, HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                     ROWS: tl.constexpr, CC: tl.constexpr, ROTATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     POISON: tl.constexpr, SCAN: tl.constexpr, BS: tl.constexpr, SB: tl.constexpr,
                     FWHT: tl.constexpr = False, LOG2D: tl.constexpr = 0, PDL: tl.constexpr = False):
    """``out[r] = float32(q[r]) @ Π`` (or the plain cast) for ROWS query rows ``r = s·HQ + h``: one
    launch instead of a cast and a GEMM. Program ``(b, j)`` writes output columns ``j·CC ..
    j·CC + CC − 1`` of rows ``b·ROWS ..`` (64 columns at a time: a whole ``[DP, DP]`` tile of Π
    overflows shared memory). With ``FWHT`` (a signed Sylvester ``Π = diag(s)·H/√D`` at ``D = DP =
    2^LOG2D``; ``CC = DP``) by the in-register Walsh–Hadamard transform instead of a product:
    ``q @ Π = H·(q ⊙ Π[:, 0])`` in float32 (``Π[i, 0] = s_i/√D``). out: float32 ``[n_rows, D]``
    contiguous. With ``SCAN``, the programs from ``rot_programs`` on in the grid's first dimension
    scan the block table instead (:func:`_scan_indices`), beside the rotation rather than before it
    in the same program (which cost tq4 up to 1.3% at B32×4K, measured)."""
    if PDL:  # the decode (launched with programmatic dependent launch) may start its prologue now
        tl.extra.cuda.gdc_launch_dependents()
    if tl.program_id(0) >= rot_programs:
        if SCAN:
            _scan_indices(bt_ptr, sl_ptr, err_ptr, safe_ptr, num_seqs, max_blocks, num_blocks,
                          (tl.program_id(0) - rot_programs) * tl.num_programs(1) + tl.program_id(1),
                          (tl.num_programs(0) - rot_programs) * tl.num_programs(1), BS, SB)
    else:
        _rotate_rows(q_ptr, rot_ptr, out_ptr, poison_ptr, n_rows, stride_qs, stride_qh, HQ, D, DP, ROWS, CC, ROTATE,
                     DOT_PRECISION, POISON, FWHT, LOG2D)


@triton.jit
def _rotate_rows(q_ptr, rot_ptr, out_ptr, poison_ptr, n_rows, stride_qs, stride_qh, HQ: tl.constexpr,
                 D: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr, CC: tl.constexpr, ROTATE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, POISON: tl.constexpr, FWHT: tl.constexpr, LOG2D: tl.constexpr):
    """The rotation part of :func:`_rotate_q_kernel` for program ``(b, j)``."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < n_rows
    cols = tl.arange(0, DP)
    cm = cols < D
    src = q_ptr + (rows // HQ).to(tl.int64)[:, None] * stride_qs + (rows % HQ).to(tl.int64)[:, None] * stride_qh
    x = tl.load(src + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)
    if POISON:  # poison[r] = NaN if q row r holds a NaN or inf, else 0 (x − x is NaN exactly there)
        bad = tl.sum(((x - x) != 0).to(tl.int32), axis=1) > 0
        if tl.program_id(1) == 0:
            tl.store(poison_ptr + rows, tl.where(bad, float("nan"), 0.0), mask=rm)
    dst = out_ptr + rows.to(tl.int64)[:, None] * D
    if ROTATE and FWHT:  # (D = DP, one program per row block)
        y = _fwht_tile(x * tl.load(rot_ptr + cols * D)[None, :], ROWS, DP, LOG2D)
        tl.store(dst + cols[None, :], y, mask=rm[:, None])
    elif ROTATE:
        SUB: tl.constexpr = CC if CC < 64 else 64
        for c1 in tl.static_range(0, CC, SUB):
            cc = tl.program_id(1) * CC + c1 + tl.arange(0, SUB)
            rot = tl.load(rot_ptr + cols[:, None] * D + cc[None, :], mask=cm[:, None] & (cc < D)[None, :], other=0.0)
            tl.store(dst + cc[None, :], tl.dot(x, rot, input_precision=DOT_PRECISION),
                     mask=rm[:, None] & (cc < D)[None, :])
    else:
        tl.store(dst + cols[None, :], x, mask=rm[:, None] & cm[None, :])


def rotate_q(q, rotation, rotate: bool, interpret: bool, rows: int = 16, cols: int = 64, poison=None, scan=None,
             signed_sylvester: bool = False):
    """float32 ``[S, Hq, D]`` contiguous: ``q @ Π`` when ``rotate`` (the key codec is rotated),
    else q cast. ``q``: fp16/bf16/fp32 with a contiguous last dimension; ``rows`` query rows and
    ``cols`` output columns (at most the padded head_dim) per program. Measured on the H100 at
    1024 rows, D = 128: 16 rows × all columns 4.6 µs, 32 rows 9.5 µs, 64 rows 9.8 µs (session 4);
    16 rows × 64 columns: see ``docs/performance.md``. ``poison``: optional float32 ``[S·Hq]``
    that receives NaN for every query row holding a NaN or inf and 0 for the others (the merge
    adds it to the output: :func:`.merge._launch_merge`). ``scan``: optional ``(block_table, seq_lens,
    num_blocks, block_size, errors, safe_table)``: the same launch writes the block table clamped
    to the cache into ``safe_table`` (int32, the table's shape; what the decode kernels read) and
    ORs ``tqkern.errors`` bits into ``errors`` (see :func:`_scan_indices`). ``signed_sylvester``:
    ``rotation`` is ``diag(s)·H/√D`` (``DeviceParams.signed_sylvester``); at a power-of-two head_dim
    the rotation is then the Walsh–Hadamard transform, all columns a program (``cols`` ignored)."""
    if not isinstance(rows, int) or rows < 16 or rows & (rows - 1):
        raise ValueError(f"rows must be a power of two >= 16, got {rows!r}")
    if not isinstance(cols, int) or cols < 16 or cols & (cols - 1):
        raise ValueError(f"cols must be a power of two >= 16, got {cols!r}")
    s, hq, d = q.shape
    out = torch.empty((s, hq, d), dtype=torch.float32, device=q.device)
    n = s * hq
    dp = max(16, triton.next_power_of_2(d))
    fwht = q_transform(rotate, signed_sylvester, d)
    cc = min(cols, dp) if rotate and not fwht else dp
    if scan is None:
        scan_args, scan_ints, bs = (out, out, out, out), (0, 0, 0), 1
    else:
        bt, sl, num_blocks, bs, errors, safe = scan
        scan_args, scan_ints = (bt, sl, errors, safe), (bt.shape[0], bt.shape[1], num_blocks)
    sb, scan_programs = scan_split(scan_ints[0] * scan_ints[1], dp // cc)
    rot_programs = triton.cdiv(n, rows)
    if n:
        _rotate_q_kernel[(rot_programs + scan_programs, dp // cc)](
            q, rotation, out, out if poison is None else poison, *scan_args, n, q.stride(0), q.stride(1), *scan_ints,
            rot_programs, HQ=hq, D=d, DP=dp, ROWS=rows, CC=cc, ROTATE=rotate, DOT_PRECISION="ieee" if interpret else "tf32x3",
            POISON=poison is not None, SCAN=scan is not None, BS=bs, SB=sb, FWHT=fwht,
            LOG2D=d.bit_length() - 1 if fwht else 0, num_warps=4)
    return out
