"""Prefill launcher: a :class:`~.plan.PrefillPlan` (from :func:`.plan.plan_prefill`) turned into two
launches — the q rotation with the block-table scan (the decode's
:func:`~tqkern.ops.paged_decode.rotate._rotate_q_kernel`) and :func:`.kernel._prefill_kernel` —
and run: :func:`prefill_launch`. The frontend (``tqkern_torch.prefill``) validates first.

Peak extra memory: the float32 rotated queries, one float32 per query row (the poison) and the
clamped block table, all ``O(num_tokens·Hq·D + num_seqs·max_blocks)``; the decompressed prefix is
never materialised (each program decodes one ``[BN, D]`` K and V tile at a time).
"""

from __future__ import annotations

import torch
import triton.language as tl

from tqkern.layouts import PagedLayout
from tqkern.ops.int8_prefill.reference import EXACT_QUERY_MAX
from tqkern.ops.paged_decode.rotate import _rotate_q_kernel
from tqkern.ops.paged_decode.triton import device_caps
from tqkern.ops.prefill.kernel import _prefill_kernel
from tqkern.ops.prefill.plan import PrefillPlan, plan_prefill

__all__ = ["prefill_launch", "prefill_args", "plan_for"]

_LOG2E = 1.4426950408889634
_ANY = 2**31 - 1  # no upper bound on a launch's q_len


def _up16(n: int) -> int:
    """``n`` float32 elements rounded up to whole 16-byte units (so every carved view is aligned)."""
    return -(-n // 4) * 4


def plan_for(layout: PagedLayout, q, *, window_left, logit_softcap, sinks, return_lse: bool,
             int8: bool = False) -> PrefillPlan:
    """The plan for ``q`` (its head count and device) and these options (``int8``: ``int8_prefill``)."""
    return plan_prefill(layout, q.shape[1], device_caps(q.device), window=window_left is not None,
                        softcap=logit_softcap is not None, sinks=sinks is not None, lse=return_lse, int8=int8)


def prefill_args(plan: PrefillPlan) -> dict:
    """The prefill kernel's constexprs and compile options, as Triton's launch takes them."""
    cx = dict(plan.constexprs)
    cx["DOT"] = tl.bfloat16 if plan.dot == "bf16" else tl.float16
    return dict(cx, num_warps=plan.num_warps, num_stages=plan.num_stages)


def prefill_launch(out, lse, q, cache, block_table, seq_lens, query_start_loc, layout: PagedLayout, tables, errors,
                   num_blocks: int, *, scale: float, window_left=None, logit_softcap=None, sinks=None,
                   int8: bool = False):
    """One varlen prefill into ``out`` (and ``lse``, float32 ``[num_tokens, Hq]``, when given).

    ``q``: ``[num_tokens, Hq, D]`` fp16/bf16/fp32, last dimension contiguous, ``num_tokens ≥ 1``;
    ``cache`` at least one block (``num_blocks``: the caller's real block count, 0 for an empty
    cache, into which the scan clamps ids); ``tables``: ``rotation`` and ``key_centroids_f32`` /
    ``value_centroids_f32``; ``errors``: the int32 error word; ``sinks``: float32 ``[Hq]`` or
    ``None``; ``int8``: ``int8_prefill``'s spec: Q·Kᵀ on int8 codes for sequences of more than
    ``EXACT_QUERY_MAX`` new tokens, and a second launch of the kernel without int8 codes for the
    shorter ones (the ``key_int8_table`` passed as ``key_centroids_f32`` begins with the float32
    centroids). No other checks: the frontend validated everything."""
    t, hq, d = q.shape
    n_seq, mb = block_table.shape
    plan = plan_for(layout, q, window_left=window_left, logit_softcap=logit_softcap, sinks=sinks,
                    return_lse=lse is not None, int8=int8)
    n_q, n_p = _up16(t * hq * d), _up16(t * hq)
    buf = torch.empty(n_q + n_p + _up16(n_seq * mb), dtype=torch.float32, device=q.device)
    q_rot = buf[: t * hq * d].view(t, hq, d)
    poison = buf[n_q: n_q + t * hq]
    safe = buf[n_q + n_p: n_q + n_p + n_seq * mb].view(torch.int32).view(n_seq, mb)
    rp = plan.rotate_plan(t, n_seq, mb)
    _rotate_q_kernel[rp.grid](q, tables["rotation"], q_rot, poison, block_table, seq_lens, errors, safe, t * hq,
                              q.stride(0), q.stride(1), n_seq, mb, num_blocks, rp.programs,
                              **rp.constexprs(hq, d, layout.block_size, plan.caps.interpret), num_warps=4)
    bands = [(plan, 0, _ANY)]
    if int8:  # the short sequences take prefill's exact scores (int8_prefill's spec)
        exact = plan_for(layout, q, window_left=window_left, logit_softcap=logit_softcap, sinks=sinks,
                         return_lse=lse is not None)
        bands = [(exact, 0, EXACT_QUERY_MAX), (plan, EXACT_QUERY_MAX + 1, _ANY)]
    for p, lo, hi in bands:
        _prefill_kernel[p.grid(t, n_seq)](
            q_rot, poison, cache, safe, seq_lens, query_start_loc, tables["key_centroids_f32"],
            tables["value_centroids_f32"], tables["rotation"], poison if sinks is None else sinks,
            out, poison if lse is None else lse, n_seq, t, mb, out.stride(0), out.stride(1), scale * _LOG2E,
            1.0 if logit_softcap is None else float(logit_softcap),
            0 if window_left is None else min(int(window_left), 2**31 - 1), 0, lo, hi,
            **prefill_args(p))
    return out
