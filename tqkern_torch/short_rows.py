"""Short query rows (decode and speculative: ``q_len ≤ T ≤ SHORT_QUERY_MAX``) of a ``prefill`` call
through the decode kernel: the :func:`~tqkern_torch.prefill` spec computed as two attentions and a
log-sum-exp merge, so the cache is read once per (sequence, KV head), as a decode step reads it.

Sequence s's ``q_len ≤ T`` queries sit at positions ``L − q_len .. L − 1`` (``L = seq_lens[s]``);
padded in front to T rows, padded row ``t`` sits at ``P_t = L − T + t``. Every row sees keys
``0 .. L − T`` (the *prefix*: row 0's own position is its last key), and row t also sees the
*tail* keys ``L − T + 1 + u`` for ``u < t`` (at most T − 1 of them). So, exactly:

* prefix: :func:`~tqkern_torch.paged_decode` over the first ``max(L − T + 1, 0)`` tokens with the T
  padded rows of each query head as extra query heads of its KV head (``Hq·T`` heads, GQA group
  ``G·T``), ``return_lse=True`` (sinks and soft-cap passed through: the sinks counted here only);
* tail: the ≤ T − 1 tail keys of each sequence decompressed (:func:`~tqkern_torch.decompress`,
  rotated back, so the queries stay in their own coordinates) and attended in float32 with the
  causal mask ``u < t``;
* merge: ``o = (e^{λ₁}·o₁ + e^{λ₂}·o₂) / (e^{λ₁} + e^{λ₂})``, ``lse = log(e^{λ₁} + e^{λ₂})``
  (λ the parts' lse; a row with no key in either part gives zeros and −inf, a non-finite query
  row NaN, as the spec says).

Four launches around the decode's own (:mod:`tqkern.ops.prefill.short_rows` holds the two
kernels and the index policy): prep, ``paged_decode``, ``decompress``, merge. Device work only
(no host read): a CUDA graph or ``torch.compile`` can hold it. Triton devices only (CUDA or the
interpreter); elsewhere ``prefill`` runs its oracle.
"""

from __future__ import annotations

from typing import Optional

import torch

from tqkern.ops.prefill.short_rows import (SHORT_QUERY_MAX, _short_rows_merge_kernel, _short_rows_prep_kernel,
                                           short_rows_constexprs)
from tqkern_torch.attention import _decode
from tqkern_torch.errors import error_word
from tqkern_torch.library import layout_key, layout_of
from tqkern_torch.ops import decompress

__all__ = ["SHORT_QUERY_MAX", "short_rows"]

_LOG2E = 1.4426950408889634


def _consts(layout: str, t: int, hq: int) -> dict:
    return short_rows_constexprs(layout_of(layout), t, hq)


def _prep_impl(q: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
               num_blocks: int, layout: str, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q1, prefix lengths, tail slots)`` (:func:`~tqkern.ops.prefill.short_rows._short_rows_prep_kernel`)."""
    c = _consts(layout, t, q.shape[1])
    n, max_blocks = block_table.shape
    q1 = torch.empty(n, c["HKV"] * t * c["G"], c["D"], dtype=q.dtype, device=q.device)
    prefix = torch.empty(n, dtype=torch.int32, device=q.device)
    slots = torch.empty(n, max(t - 1, 1), dtype=torch.int64, device=q.device)
    if n:
        _short_rows_prep_kernel[(n, c["HKV"])](q, query_start_loc, seq_lens, block_table, q1, prefix, slots,
                                               error_word(q.device), q.shape[0], max_blocks, num_blocks, q.stride(0),
                                               q.stride(1), **c, num_warps=4)
    return q1, prefix, slots


prep_op = torch.library.custom_op("tqkern::short_rows_prep", mutates_args=())(_prep_impl)


@prep_op.register_fake
def _(q, query_start_loc, seq_lens, block_table, num_blocks, layout, t):
    c = _consts(layout, t, q.shape[1])
    n = block_table.shape[0]
    return (q.new_empty(n, c["HKV"] * t * c["G"], c["D"]), q.new_empty(n, dtype=torch.int32),
            q.new_empty(n, max(t - 1, 1), dtype=torch.int64))


def _merge_impl(q1: torch.Tensor, o1: torch.Tensor, l1: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_blocks: int, out: torch.Tensor,
                lse: Optional[torch.Tensor], layout: str, t: int, scale: float, logit_softcap: float) -> None:
    """The tail and the merge into ``out``/``lse``
    (:func:`~tqkern.ops.prefill.short_rows._short_rows_merge_kernel`); soft-cap off as 0.0."""
    c = _consts(layout, t, out.shape[1])
    n = seq_lens.shape[0]
    if n:
        _short_rows_merge_kernel[(n, c["HKV"])](q1, o1, l1, k, v, query_start_loc, seq_lens, out,
                                                l1 if lse is None else lse, out.shape[0], max_blocks, out.stride(0),
                                                out.stride(1), scale * _LOG2E, logit_softcap or 1.0,
                                                SOFTCAP=logit_softcap > 0, LSE=lse is not None, **c, num_warps=4)


merge_op = torch.library.custom_op("tqkern::short_rows_merge", mutates_args=("out", "lse"))(_merge_impl)


@merge_op.register_fake
def _(q1, o1, l1, k, v, query_start_loc, seq_lens, max_blocks, out, lse, layout, t, scale, logit_softcap) -> None:
    return None


def short_rows(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, layout, params, *, t: int, scale: float, out: torch.Tensor,
               lse: Optional[torch.Tensor], logit_softcap: Optional[float], sinks: Optional[torch.Tensor],
               zero_rows: bool) -> None:
    """Write ``prefill``'s rows (and ``lse``) for a batch whose every ``q_len ≤ t`` (module
    docstring); arguments as :func:`tqkern_torch.prefill`'s, checked by it (``params`` a
    DeviceParams; the decode runs without ``paged_decode``'s own checks); no window. ``zero_rows``: zero ``out`` first (the bound was not checked: the
    rows of a sequence before its last t, which nothing else writes, read zeros)."""
    hq = q.shape[1]
    hkv = layout.num_kv_heads
    g = hq // hkv
    key = layout_key(layout)
    if zero_rows:
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
    eager = type(q) is torch.Tensor and not torch.compiler.is_compiling()
    prep, merge = (_prep_impl, _merge_impl) if eager else (torch.ops.tqkern.short_rows_prep,
                                                           torch.ops.tqkern.short_rows_merge)
    q1, prefix, slots = prep(q, query_start_loc, seq_lens, block_table, cache.shape[0], key, t)
    s1 = None
    if sinks is not None:  # head h·T·G + t·G + g of q1 is query head h·G + g
        s1 = sinks.view(hkv, 1, g).expand(hkv, t, g).reshape(-1).contiguous()
    o1 = torch.empty_like(q1)
    l1 = torch.empty(q1.shape[:2], dtype=torch.float32, device=q.device)
    if block_table.shape[0]:  # (the decode after prefill's checks, which cover these tensors)
        _decode(q1, cache, block_table, prefix, layout, params, scale, o1, l1, logit_softcap=logit_softcap, sinks=s1)
    if t > 1:
        k, v = decompress(cache, slots.view(-1), layout, params, rotate_back=True)
    else:
        k = v = l1  # (not read)
    merge(q1, o1, l1, k, v, query_start_loc, seq_lens, block_table.shape[1], out, lse, key, t, float(scale),
          0.0 if logit_softcap is None else float(logit_softcap))
