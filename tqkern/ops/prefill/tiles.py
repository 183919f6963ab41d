"""The tiled prefill's plan and its combine kernel (no torch): long query rows attend to a bounded
half-precision workspace of gathered keys and values, piece by piece, with the partial results
merged by their log-sum-exp.

Why. Prefill is bound by its tensor-core products, not by reading the cache: decoding the codes
inside the attention loop (the fused kernel, :mod:`.kernel`) keeps the loads out of the software
pipeline and the registers spilling. A key range decoded once into fp16/bf16 and handed to a dense
attention kernel moves the decoding out of the loop at the cost of one pass over those keys.

The plan (:func:`plan_tiles`, host integers in, a frozen :class:`TilePlan` out). Sequence s has
``S`` keys and ``q`` new tokens at positions ``P = S − q .. S − 1``; query ``p`` sees keys
``k ≤ p`` (and ``k ≥ p − window_left`` with a window). Its pieces, each one dense call over keys
``[start, start + length)``:

- the new tokens ``[P, S)``, causal: a square block, where top-left and bottom-right alignment
  agree (dense kernels differ on which they implement);
- the cached prefix ``[0, P)`` in pieces of at most ``x`` keys, newest first, unmasked: every
  prefix key is ≤ P, so every query of s sees all of it;
- with a window, one piece ``[max(0, P − window_left), S)`` instead, bottom-right aligned (the
  window's dense kernel aligns both masks bottom-right).

Round r holds piece r of every sequence that has one, packed from workspace row 0: one gather
launch fills a round. ``x`` is the largest multiple of 64 whose pieces, summed over the sequences,
fit in ``budget_rows`` (the whole prefix when it fits: one prefix round). Peak workspace: round 0
(``Σ q`` rows: the new tokens' keys, ``(2·Hkv/Hq)·`` the size of q, in its dtype; with a window,
``Σ (q + window)``) or a prefix round (≤ ``budget_rows``, at least 64 per sequence); never the
decompressed prefix. Sequences without queries get no piece.

The combine (:func:`_combine_kernel`): per query row and head, the running result
``(o_a, lse_a)`` and a new piece ``(o_b, lse_b)`` (and, at a sequence's last piece, a sink logit)
merge as ``o = (e^{lse_a−m}·o_a + e^{lse_b−m}·o_b) / Σ``, ``lse = m + log Σ``, ``m`` the largest
and ``Σ`` the sum of the weights. No piece is empty, so a finite query row gets a finite lse from
every piece; a non-finite lse means the query row held a NaN or inf, and the row is written NaN
(output and lse), as the oracle says, whatever output the dense kernel gave it (a row of −inf
scores may come back as zeros).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional

import triton
import triton.language as tl

__all__ = ["Piece", "TilePlan", "plan_tiles", "_combine_kernel", "_poison_rows_kernel", "_runs_kernel",
           "PIECE_ALIGN"]

PIECE_ALIGN = 64  # prefix pieces are a multiple of this many keys (a gather tile)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One dense attention call: sequence ``seq``'s keys ``[start, start + length)`` (workspace
    rows ``row .. row + length − 1`` of its round) for all its queries; ``causal`` (bottom-right;
    square for a new-token piece) or unmasked; ``first`` / ``last``: the sequence's first / last
    piece."""

    seq: int
    start: int
    length: int
    row: int
    causal: bool
    first: bool
    last: bool


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """The rounds of one tiled prefill (module docstring).

    Attributes:
        rounds: round 0 (the new tokens) first, then the prefix pieces, newest first; each a
            tuple of pieces in sequence order, none empty.
        piece_rows: ``x``, the longest prefix piece (0 without a prefix round).
        window_left: the window (None: none).
    """

    rounds: tuple[tuple[Piece, ...], ...]
    piece_rows: int
    window_left: Optional[int]

    @property
    def workspace_rows(self) -> int:
        """Rows of the K and V workspaces (the largest round)."""
        return max((sum(p.length for p in r) for r in self.rounds), default=0)

    def describe(self) -> str:
        """One line: rounds, pieces, prefix piece length, workspace rows."""
        n = sum(len(r) for r in self.rounds)
        return (f"tiled prefill: {len(self.rounds)} round(s), {n} piece(s), prefix pieces of <= {self.piece_rows} "
                f"keys, workspace {self.workspace_rows} rows")


def _int_list(name: str, xs: Sequence[int]) -> list[int]:
    out = [int(x) for x in xs]
    if any(x < 0 for x in out):
        raise ValueError(f"{name} must be >= 0, got {out}")
    return out


def plan_tiles(q_lens: Sequence[int], seq_lens: Sequence[int], *, budget_rows: int,
               window_left: Optional[int] = None) -> TilePlan:
    """The tiled prefill's rounds for these lengths (host ints; module docstring).

    Args:
        q_lens, seq_lens: per sequence, ``0 ≤ q_len ≤ seq_len``.
        budget_rows: workspace rows a prefix round may take (≥ 1; at least 64 per sequence).
        window_left: keys more than this many positions left of a query are masked.
    """
    ql = _int_list("q_lens", q_lens)
    sl = _int_list("seq_lens", seq_lens)
    if len(ql) != len(sl):
        raise ValueError(f"q_lens and seq_lens must have one entry per sequence, got {len(ql)} and {len(sl)}")
    for s, (q, n) in enumerate(zip(ql, sl)):
        if q > n:
            raise ValueError(f"q_lens[{s}] must be <= seq_lens[{s}] = {n}, got {q}")
    if isinstance(budget_rows, bool) or not isinstance(budget_rows, int) or budget_rows < 1:
        raise ValueError(f"budget_rows must be an int >= 1, got {budget_rows!r}")
    if window_left is not None and (isinstance(window_left, bool) or not isinstance(window_left, int)
                                    or window_left < 0):
        raise ValueError(f"window_left must be None or an int >= 0, got {window_left!r}")
    seqs = [s for s, q in enumerate(ql) if q]
    pieces: dict[int, list[tuple[int, int, bool]]] = {}
    x = 0
    if window_left is not None:
        for s in seqs:
            a = max(0, sl[s] - ql[s] - window_left)
            pieces[s] = [(a, sl[s] - a, True)]
    else:
        pre = {s: sl[s] - ql[s] for s in seqs}
        if any(pre.values()):
            x = max(pre.values()) if sum(pre.values()) <= budget_rows else _largest_piece(list(pre.values()),
                                                                                        budget_rows)
        for s in seqs:
            p = pre[s]
            pieces[s] = [(p, ql[s], True)] + [(max(0, p - (i + 1) * x), min(x, p - i * x), False)
                                              for i in range(-(-p // x) if x else 0)]
    rounds = []
    for r in range(max((len(v) for v in pieces.values()), default=0)):
        row, cur = 0, []
        for s in seqs:
            if r < len(pieces[s]):
                a, m, c = pieces[s][r]
                cur.append(Piece(s, a, m, row, c, r == 0, r == len(pieces[s]) - 1))
                row += m
        rounds.append(tuple(cur))
    return TilePlan(rounds=tuple(rounds), piece_rows=x, window_left=window_left)


def _largest_piece(pre: list[int], budget: int) -> int:
    """The largest multiple of :data:`PIECE_ALIGN` ``x`` with ``Σ min(p, x) ≤ budget`` (at least one
    unit: a budget below one unit per sequence still makes progress)."""
    lo, hi = 1, max(pre) // PIECE_ALIGN + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(p, mid * PIECE_ALIGN) for p in pre) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * PIECE_ALIGN


@triton.jit
def _runs_kernel(sl_ptr, qsl_ptr, runs_ptr, n_seqs, x, window_left, cap, HAS_WINDOW: tl.constexpr):
    """Round ``r = program_id(0)``'s runs ``(seq, start, length, row)`` (int32 ``[rounds, n_seqs,
    4]``) from the device lengths, the plan's rules (module docstring) with prefix pieces of ``x``:
    the host plan's pieces, in sequence order, with ``length = 0`` for a sequence without a piece
    in this round. Made on the device so that a captured CUDA graph copies nothing from the host.
    Lengths are clamped (``0 ≤ q ≤ seq_len ≤ cap``): device values that disagree with the host's
    give wrong rows, never a position outside the block-table row (the gather also masks)."""
    r = tl.program_id(0)
    out = runs_ptr + r * n_seqs * 4
    row = r * 0
    for s in range(n_seqs):
        n = tl.minimum(tl.maximum(tl.load(sl_ptr + s), 0), cap)
        q = tl.minimum(tl.maximum(tl.load(qsl_ptr + s + 1) - tl.load(qsl_ptr + s), 0), n)
        p = n - q
        if HAS_WINDOW:
            a = tl.maximum(p - window_left, 0)
            m = tl.where(r == 0, n - a, 0)
        else:
            i = tl.maximum(r - 1, 0)
            a = tl.where(r == 0, p, tl.maximum(p - (i + 1) * x, 0))
            m = tl.where(r == 0, q, tl.maximum(tl.minimum(x, p - i * x), 0))
        m = tl.where(q > 0, m, 0)
        tl.store(out + 4 * s, s)
        tl.store(out + 4 * s + 1, tl.where(m > 0, a, 0))
        tl.store(out + 4 * s + 2, m)
        tl.store(out + 4 * s + 3, row)
        row += m


@triton.jit
def _combine_kernel(a_ptr, a_lse, b_ptr, b_lse, sink_ptr, dst_ptr, lse_out, n_rows, stride_at, stride_ah,
                    stride_bt, stride_bh, stride_dt, stride_dh, la_st, la_sh, lb_st, lb_sh, lo_st, lo_sh,
                    HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr, HAS_A: tl.constexpr,
                    HAS_SINK: tl.constexpr):
    """Rows ``r = t·HQ + h`` (``r < n_rows``) of one sequence: ``dst[t, h], lse_out[t, h] =
    merge((a, a_lse), (b, b_lse), sink)`` (``HAS_A`` False: ``b`` alone, a sequence's first piece);
    each lse a float32 ``[t, h]`` view with its own strides (``dst``/``lse_out`` may be ``a``/
    ``a_lse``). A piece is never empty, so a finite query row has a finite lse in every piece: a
    non-finite one (the query held a NaN or inf) makes the row NaN, output and lse."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    live = r < n_rows
    t = (r // HQ).to(tl.int64)
    h = r % HQ
    cols = tl.arange(0, DP)
    m2 = live[:, None] & (cols < D)[None, :]
    lb = tl.load(b_lse + t * lb_st + h * lb_sh, mask=live, other=0.0)
    bad = (lb != lb) | (tl.abs(lb) == float("inf"))
    m = lb
    if HAS_A:
        la = tl.load(a_lse + t * la_st + h * la_sh, mask=live, other=0.0)
        bad |= (la != la) | (tl.abs(la) == float("inf"))
        m = tl.maximum(m, la)
    if HAS_SINK:
        sk = tl.load(sink_ptr + h, mask=live, other=0.0)
        m = tl.maximum(m, sk)
    m = tl.where(bad, 0.0, m)
    wb = tl.where(bad, 0.0, tl.exp(lb - m))
    tot = wb
    ob = tl.load(b_ptr + (t * stride_bt + h * stride_bh)[:, None] + cols[None, :], mask=m2, other=0.0)
    o = ob.to(tl.float32) * wb[:, None]
    if HAS_A:
        wa = tl.where(bad, 0.0, tl.exp(la - m))
        tot += wa
        oa = tl.load(a_ptr + (t * stride_at + h * stride_ah)[:, None] + cols[None, :], mask=m2, other=0.0)
        o += oa.to(tl.float32) * wa[:, None]
    if HAS_SINK:
        tot += tl.exp(sk - m)
    inv = tl.where(bad, float("nan"), 1.0 / tl.where(tot > 0, tot, 1.0))
    lse = tl.where(bad, float("nan"), m + tl.log(tl.where(tot > 0, tot, 1.0)))
    tl.store(dst_ptr + (t * stride_dt + h * stride_dh)[:, None] + cols[None, :],
             (o * inv[:, None]).to(dst_ptr.dtype.element_ty), mask=m2)
    tl.store(lse_out + t * lo_st + h * lo_sh, lse, mask=live)


@triton.jit
def _poison_rows_kernel(o_ptr, lse_ptr, n_rows, stride_ot, stride_oh, stride_lt, stride_lh, HQ: tl.constexpr,
                        D: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr, SUB: tl.constexpr):
    """The combine's rule for a dense call's own result (a call that is the whole prefill, no
    merge): rows ``r = t·HQ + h`` with a non-finite ``lse[t, h]`` (the query held a NaN or inf; a
    dense kernel may give such a row zeros and −inf) become NaN, output and lse, in place. A
    program reads the lse of ``BR`` rows (few programs: at 16 rows a program, 8 × 2K tokens took
    32K programs and ~2% of the prefill); only where one is non-finite does it write, ``SUB`` rows
    at a time."""
    base = tl.program_id(0) * BR
    r = base + tl.arange(0, BR)
    lv = tl.load(lse_ptr + (r // HQ).to(tl.int64) * stride_lt + (r % HQ) * stride_lh, mask=r < n_rows, other=0.0)
    if tl.max(((lv != lv) | (tl.abs(lv) == float("inf"))).to(tl.int32), axis=0) > 0:  # rare
        cols = tl.arange(0, DP)
        for i in range(0, BR, SUB):
            rs = base + i + tl.arange(0, SUB)
            t = (rs // HQ).to(tl.int64)
            h = rs % HQ
            lp = lse_ptr + t * stride_lt + h * stride_lh
            x = tl.load(lp, mask=rs < n_rows, other=0.0)
            bad = (rs < n_rows) & ((x != x) | (tl.abs(x) == float("inf")))
            tl.store(lp, tl.full([SUB], float("nan"), tl.float32), mask=bad)
            tl.store(o_ptr + (t * stride_ot + h * stride_oh)[:, None] + cols[None, :],
                     tl.full([SUB, DP], float("nan"), o_ptr.dtype.element_ty), mask=bad[:, None] & (cols < D)[None, :])
