"""Varlen causal prefill over a compressed paged cache: the NumPy oracle and spec of ``prefill``.

``prefill(q, cache, block_table, seq_lens, query_start_loc, layout, params, *, scale=None)``:

    q                [num_tokens, Hq, D]        float (float16/32/64): the new tokens' queries
    cache            layout.cache_shape(num_blocks)   uint8
    block_table      [num_seqs, max_blocks]     int32
    seq_lens         [num_seqs]                 int32: total length, new tokens included
    query_start_loc  [num_seqs + 1]             int32: 0 = qsl[0] ≤ qsl[1] ≤ … ≤ qsl[-1] = num_tokens
    out              [num_tokens, Hq, D]        float64

Sequence s owns the queries ``q[qsl[s] : qsl[s+1]]`` (``q_len_s`` of them, ``q_len_s ≤
seq_lens[s]``). Its new tokens have *already been stored* in the paged cache, at positions
``seq_lens[s] − q_len_s .. seq_lens[s] − 1``; positions before them are the cached prefix.
New token i (0-based) sits at position ``p = seq_lens[s] − q_len_s + i`` and attends to cache
positions ``0 .. p``: causal masking aligned to the bottom-right corner. Every key and value is
read from the paged cache (decompressed), the new tokens' own included, so prefill sees exactly
the bytes a later decode step sees.

The maths is that of :mod:`tqkern.ops.paged_decode.reference` with a causal mask, per sequence
(and its options: ``window_left``, ``logit_softcap``, ``sinks``, ``return_lse``):

    K̂, V̂ = decompress(slots of positions 0 .. seq_lens[s] − 1)   (codec spaces, no rotate-back)
    q_k   = q[qsl[s]:qsl[s+1]] @ Π   if format.key.rotated   else the queries as given
    o     = attention(q_k, K̂, V̂, scale=scale, causal=True)       (bottom-right aligned)
    out[qsl[s]:qsl[s+1]] = o @ Πᵀ    if format.value.rotated else o

A sequence with ``q_len_s == 0`` contributes no rows. Splitting a prefill into chunks (first
chunk with ``seq_lens[s] − q_len_s + c`` as its length, then the rest) gives the same rows as one
call, because each row only depends on its own position. ``scale`` defaults to ``1/√D``.

Validation as in ``paged_decode`` (``q`` named by its role ``num_tokens``), plus
``query_start_loc``: int32 (``TypeError``), shape ``[num_seqs + 1]``, ``qsl[0] == 0``,
non-decreasing, ``qsl[-1] == num_tokens`` and ``q_len_s ≤ seq_lens[s]`` (``ValueError``).

Non-finite values, as in ``paged_decode``: a query row holding a NaN or ±inf gives a **NaN**
output row and touches no other row; a cache written by ``store`` holds no non-finite key or
value. Bad indices: as in ``paged_decode`` (this oracle rejects them; kernels clamp and flag).
"""

from __future__ import annotations

import numpy as np

from tqkern.layouts import PagedLayout
from tqkern.ops.attention.reference import attention, check_options, resolve_scale
from tqkern.ops.paged_decode.reference import (
    _check_paged,
    _from_value_space,
    _int32,
    _sequences_kv,
    poison_nonfinite_rows,
    _to_key_space,
)
from tqkern.params import TQParams

__all__ = ["prefill"]


def _check_varlen(q, cache, block_table, seq_lens, query_start_loc, layout, params):
    """Validation shared by ``prefill`` and ``int8_prefill``; returns the arrays."""
    q, cache, bt, sl = _check_paged(q, cache, block_table, seq_lens, layout, params, "num_tokens")
    qsl = _int32("query_start_loc", query_start_loc, 1)
    n = bt.shape[0]
    if qsl.shape != (n + 1,):
        raise ValueError(f"query_start_loc must have shape ({n + 1},) (num_seqs + 1), got {qsl.shape}")
    if qsl[0] != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {qsl[0]}")
    q_lens = np.diff(qsl.astype(np.int64))
    if np.any(q_lens < 0):
        raise ValueError(f"query_start_loc must be non-decreasing, got {qsl.tolist()}")
    if qsl[-1] != q.shape[0]:
        raise ValueError(f"query_start_loc[-1] must be num_tokens = {q.shape[0]} (q.shape[0]), got {qsl[-1]}")
    bad = np.nonzero(q_lens > sl)[0]
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"query_start_loc[{s + 1}] - query_start_loc[{s}] (q_len) must be <= "
                         f"seq_lens[{s}] = {sl[s]}, got {q_lens[s]}")
    return q, cache, bt, sl, qsl


def prefill(q, cache, block_table, seq_lens, query_start_loc, layout: PagedLayout, params: TQParams, *,
            scale=None, window_left=None, logit_softcap=None, sinks=None, return_lse: bool = False):
    """New tokens of several sequences attending causally to their paged cache (see module docstring).

    Args:
        q: float ``[num_tokens, num_q_heads, head_dim]``.
        cache: uint8 ``layout.cache_shape(num_blocks)``, already holding the new tokens.
        block_table: int32 ``[num_seqs, max_blocks]``.
        seq_lens: int32 ``[num_seqs]``, lengths including the new tokens.
        query_start_loc: int32 ``[num_seqs + 1]``, offsets of each sequence's queries in ``q``.
        layout: the cache's :class:`~tqkern.layouts.PagedLayout`.
        params: the format's :class:`~tqkern.params.TQParams`.
        scale: score multiplier, default ``1/√head_dim``.
        window_left, logit_softcap, sinks: as in :func:`~tqkern.ops.attention.reference.attention`
            (positions are those of the whole sequence).
        return_lse: also return ``lse`` float64 ``[num_tokens, num_q_heads]``.

    Returns:
        float64 ``[num_tokens, num_q_heads, head_dim]``, or ``(out, lse)`` with ``return_lse``.
    """
    q, cache, bt, sl, qsl = _check_varlen(q, cache, block_table, seq_lens, query_start_loc, layout, params)
    sc = resolve_scale(scale, layout.head_dim)
    opts = check_options(window_left, logit_softcap, sinks, q.shape[1])
    out = np.zeros(q.shape, np.float64)
    lse = np.zeros(q.shape[:2], np.float64)
    for s, (k, v) in enumerate(_sequences_kv(cache, layout, params, bt, sl)):
        a, b = int(qsl[s]), int(qsl[s + 1])
        o, lse[a:b] = attention(_to_key_space(q[a:b], params), k, v, scale=sc, causal=True,
                                window_left=opts.window_left, logit_softcap=opts.logit_softcap, sinks=opts.sinks,
                                return_lse=True)
        out[a:b] = _from_value_space(o, params)
    out = poison_nonfinite_rows(out, q)
    if return_lse:
        return out, poison_nonfinite_rows(lse[..., None], q)[..., 0]
    return out
