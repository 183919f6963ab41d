"""Attention over a compressed paged cache: ``paged_decode``."""

from __future__ import annotations

import numbers
from typing import Optional

import numpy as np
import torch

from tqkern.errors import ErrorFlag
from tqkern.layouts import PagedLayout
from tqkern.ops.attention.reference import check_options, resolve_scale
from tqkern.ops.paged_decode import reference as paged_decode_ref
from tqkern.ops.paged_decode.plan import check_num_splits
from tqkern_torch._validate import check_flag, check_tensor, use_triton
from tqkern_torch.errors import check_errors, error_word
from tqkern_torch.library import _host_params, layout_key, layout_of
from tqkern_torch.ops import _check_cache, _check_layout, _device_params

__all__ = ["paged_decode", "plan_decode"]


def _lengths_checked_on_host(block_table, seq_lens, num_blocks: int, block_size: int) -> None:
    cap = block_table.shape[1] * block_size
    if seq_lens.numel() == 0:
        return
    if int(seq_lens.min()) < 0 or int(seq_lens.max()) > cap:
        raise ValueError(f"seq_lens must be in [0, max_blocks * block_size = {cap}], "
                         f"got range [{int(seq_lens.min())}, {int(seq_lens.max())}]")
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * block_size < seq_lens[:, None]
    ids = block_table[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_table entries in use must be in [0, num_blocks = {num_blocks}), "
                         f"got range [{int(ids.min())}, {int(ids.max())}]")


def paged_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 layout: PagedLayout, params, *, scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
                 workspace: Optional[torch.Tensor] = None, num_splits: Optional[int] = None,
                 check_lengths: bool = False, debug: bool = False, window_left: Optional[int] = None,
                 logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                 return_lse: bool = False):
    """One decode step: each sequence's query attends to its compressed cache.

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]`` float16 or bfloat16 (original coordinates).
        cache: uint8 ``layout.cache_shape(num_blocks)``.
        block_table: ``[num_seqs, max_blocks]`` int32. seq_lens: ``[num_seqs]`` int32 in
            ``[0, max_blocks·block_size]``; a length of 0 gives a zero output.
        layout, params: the cache's layout and its parameters: DeviceParams (``to_device``, once)
            or TQParams (copied to the device at every call, each copy a stream synchronisation).
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        out: optional output of q's shape and dtype (written, and returned).
        workspace: optional float32 scratch of at least
            ``tqkern.ops.paged_decode.triton.workspace_numel(num_seqs, Hq, num_splits, DP)``
            elements (DP: head_dim rounded up to a power of two, at least 16) from a 16-byte
            aligned address, for CUDA-graph capture; pass ``num_splits`` with it (the default
            split count depends on the GPU).
        num_splits: split-KV count in [1, 1024]; default from the shapes (never from ``seq_lens`` values).
        check_lengths: debug mode: check ``seq_lens`` and the used ``block_table`` entries on
            the host before the launch and raise ``ValueError`` naming them (a device sync and
            several small kernels; skipped while ``torch.compile`` traces or a CUDA graph is
            captured). Off by default: the kernels never read outside the cache whatever the
            indices hold, clamp a bad length, and record what they met in the error word
            (:func:`tqkern_torch.check_errors`).
        debug: check the error word right after the call (a device sync) and raise
            :class:`tqkern_torch.TQKernError` if any kernel reported something.
        window_left: sliding window: the query sits at position ``seq_lens[s] − 1`` and sees only
            its last ``window_left + 1`` keys (an int ≥ 0), or ``None`` (all keys).
        logit_softcap: ``c > 0`` caps each scaled logit ``a = scale·q·k`` as ``c·tanh(a/c)``
            (Gemma-2), or ``None``.
        sinks: float32 ``[num_q_heads]`` on q's device, one logit per query head that joins the
            softmax denominator (``exp(sinks[h])``) and attends to nothing (GPT-OSS), or
            ``None``. Must be finite (not checked: that would read the device).
        return_lse: also return the natural-log softmax normaliser of every row, sinks
            included (``−inf`` for an empty sequence without sinks).

    The options follow the oracle, :mod:`tqkern.ops.paged_decode.reference`. A window or a
    soft-cap runs the general decode kernel (the warp-MMA kernel does not apply them); sinks and
    the lse are applied by the merge after either kernel.

    Non-finite values: a query row holding a NaN or inf gives a NaN output row, and a NaN lse
    (``docs/layout.md``).

    Returns:
        ``[num_seqs, num_q_heads, head_dim]`` in q's dtype; with ``return_lse`` the pair
        ``(out, lse)``, lse float32 ``[num_seqs, num_q_heads]``.
    """
    layout = _check_layout(layout)
    _check_query(q, layout, "num_seqs")
    dev = q.device
    _check_cache(cache, layout, dev)
    check_tensor(block_table, "block_table", shape=(q.shape[0], None), dtypes=(torch.int32,), device=dev,
                 contiguous=True)
    check_tensor(seq_lens, "seq_lens", shape=(q.shape[0],), dtypes=(torch.int32,), device=dev, contiguous=True)
    if q.shape[0] and block_table.shape[1] < 1:
        raise ValueError(f"block_table must have at least one column, got {list(block_table.shape)}")
    if out is not None:
        check_tensor(out, "out", shape=tuple(q.shape), dtypes=(q.dtype,), device=dev, last_contiguous=True)
    if workspace is not None:
        check_tensor(workspace, "workspace", dtypes=(torch.float32,), device=dev, contiguous=True)
    check_num_splits(num_splits)
    if workspace is not None and num_splits is not None:
        from tqkern.ops.common import layout_consts
        from tqkern.ops.paged_decode.triton import check_workspace

        check_workspace(workspace, q.shape[0], q.shape[1], num_splits, layout_consts(layout)["DP"])
    scale = resolve_scale(scale, layout.head_dim)
    window_left, logit_softcap = _check_options(window_left, logit_softcap, sinks, return_lse, q.shape[1], dev)
    check_lengths, debug = check_flag(check_lengths, "check_lengths"), check_flag(debug, "debug")
    if check_lengths and not _tracing_or_capturing(dev):
        _lengths_checked_on_host(block_table, seq_lens, cache.shape[0], layout.block_size)
    p = _device_params(params, layout, dev)
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev) if return_lse else None
    if q.shape[0] == 0:
        return (out, lse) if return_lse else out
    _decode(q, cache, block_table, seq_lens, layout, p, float(scale), out, lse, workspace=workspace,
            num_splits=num_splits, window_left=window_left, logit_softcap=logit_softcap, sinks=sinks)
    if debug:
        check_errors(dev)
    return (out, lse) if return_lse else out


def _decode(q, cache, block_table, seq_lens, layout: PagedLayout, p, scale: float, out, lse, *, workspace=None,
            num_splits=None, window_left=None, logit_softcap=None, sinks=None) -> None:
    """:func:`paged_decode` after its checks (``p`` a DeviceParams, ``num_seqs ≥ 1``): the op,
    through its body in eager mode. Callers that validated the same tensors already (``prefill``'s
    short-row path) call it directly."""
    args = (q, cache, block_table, seq_lens, p.rotation, p.key_centroids, p.value_centroids, p.key_centroids_f32,
            p.value_centroids_f32, out, workspace, layout_key(layout), scale, num_splits or 0, p.same_codebooks)
    args += (-1 if window_left is None else window_left, 0.0 if logit_softcap is None else logit_softcap, sinks, lse,
             p.signed_sylvester)
    if type(q) is torch.Tensor and not torch.compiler.is_compiling():
        _paged_decode_impl(*args)  # eager: the op's body without the dispatcher's layers (host time)
    else:
        torch.ops.tqkern.paged_decode(*args)


def _check_options(window_left, logit_softcap, sinks, return_lse, num_q_heads: int, dev: torch.device):
    """Validate the attention options (errors name the argument, expected and actual); returns
    ``(window_left, logit_softcap)`` as int / float or ``None``."""
    if window_left is not None and (isinstance(window_left, bool) or not isinstance(window_left, numbers.Integral)):
        raise TypeError(f"window_left must be None or an int >= 0, got {type(window_left).__name__}")
    if sinks is not None:
        check_tensor(sinks, "sinks", shape=(num_q_heads,), dtypes=(torch.float32,), device=dev, contiguous=True)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    opts = check_options(window_left, logit_softcap, None, num_q_heads)  # (ValueError / TypeError naming them)
    return opts.window_left, opts.logit_softcap


def plan_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, layout: PagedLayout, params, *,
                num_splits: Optional[int] = None, window_left: Optional[int] = None,
                logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None, return_lse: bool = False):
    """The :class:`tqkern.ops.paged_decode.plan.DecodePlan` that :func:`paged_decode` runs for
    tensors of these shapes on this device, with these options: which kernel, its constexprs and
    grid, the split count, the rotation and merge launches, the workspace size
    (``plan.describe()`` prints it).
    On a GPU this plans, compiles and caches the launches exactly as the first call would (so a
    later call only looks them up); on a CPU it is the interpreter's plan."""
    layout = _check_layout(layout)
    check_tensor(q, "q", dtypes=(torch.float16, torch.bfloat16))
    if q.dim() != 3 or q.shape[0] < 1 or q.shape[2] != layout.head_dim or q.shape[1] % layout.num_kv_heads:
        raise ValueError(f"q must have shape [num_seqs >= 1, k * {layout.num_kv_heads}, {layout.head_dim}], "
                         f"got {list(q.shape)}")
    _check_cache(cache, layout, q.device)
    check_tensor(block_table, "block_table", shape=(q.shape[0], None), dtypes=(torch.int32,), device=q.device,
                 contiguous=True)
    if block_table.shape[1] < 1:
        raise ValueError(f"block_table must have at least one column, got {list(block_table.shape)}")
    window_left, logit_softcap = _check_options(window_left, logit_softcap, sinks, return_lse, q.shape[1], q.device)
    p = _device_params(params, layout, q.device)
    from tqkern.ops.paged_decode.plan import DeviceCaps
    from tqkern.ops.paged_decode.plan import plan_decode as _plan
    from tqkern.ops.paged_decode.triton import decode_options, prepare

    options = decode_options(window_left, logit_softcap, sinks, True if return_lse else None)
    if not use_triton(q.device) or q.device.type != "cuda":
        return _plan(layout, q.shape[0], q.shape[1], block_table.shape[1], DeviceCaps.interpreter(),
                     same_codebooks=p.same_codebooks, num_splits=num_splits, options=options,
                     signed_sylvester=p.signed_sylvester)

    q_rot = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    seq_lens = torch.zeros(q.shape[0], dtype=torch.int32, device=q.device)
    tables = {"rotation": p.rotation, "key_centroids_f32": p.key_centroids_f32,
              "value_centroids_f32": p.value_centroids_f32}
    return prepare(layout, q_rot, cache, block_table, seq_lens, tables, same_codebooks=p.same_codebooks,
                   num_splits=num_splits, options=options, signed_sylvester=p.signed_sylvester).plan


def _tracing_or_capturing(dev: torch.device) -> bool:
    """Host checks read tensor values: never while ``torch.compile`` traces or a CUDA graph is captured."""
    if torch.compiler.is_compiling():
        return True
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _paged_decode_impl(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      rotation: torch.Tensor, key_centroids: torch.Tensor, value_centroids: torch.Tensor,
                      key_centroids_f32: torch.Tensor, value_centroids_f32: torch.Tensor, out: torch.Tensor,
                      workspace: Optional[torch.Tensor], layout: str, scale: float, num_splits: int,
                      same_codebooks: bool, window_left: int, logit_softcap: float, sinks: Optional[torch.Tensor],
                      lse: Optional[torch.Tensor], signed_sylvester: bool) -> None:
    """The op's body (``torch.ops.tqkern.paged_decode``): options off as ``window_left = −1``,
    ``logit_softcap = 0.0``, ``sinks``/``lse`` ``None`` (``lse`` is written when given);
    ``signed_sylvester``: ``rotation`` is ``diag(s)·H/√D`` (``DeviceParams.signed_sylvester``:
    the kernels may rotate q by the Walsh–Hadamard transform). No argument has a default: torch
    2.11 drops a mutated argument left at its default from the boxed call and then fails
    (IndexError) indexing it for its version counter."""
    lay = layout_of(layout)
    errors = error_word(q.device)
    cache, num_blocks = _cache_or_stand_in(cache)
    if use_triton(q.device):
        from tqkern.ops.paged_decode.triton import paged_decode_launch

        # one launch rotates q, marks its non-finite rows, and writes the block table clamped to
        # the cache (flagging bad entries): the decode kernels read only that table
        tables = {"rotation": rotation, "key_centroids_f32": key_centroids_f32,
                  "value_centroids_f32": value_centroids_f32}
        paged_decode_launch(out, q if q.stride(2) == 1 else q.contiguous(), cache, block_table, seq_lens, lay, tables,
                            errors, num_blocks, sm_scale=scale, same_codebooks=same_codebooks, workspace=workspace,
                            num_splits=num_splits or None, window_left=None if window_left < 0 else window_left,
                            logit_softcap=logit_softcap or None, sinks=sinks, lse=lse,
                            signed_sylvester=signed_sylvester)
        return
    # The NumPy oracle rejects bad indices; the kernels' policy is applied here first: lengths
    # clamped, bad block entries in use clamped into [0, num_blocks) as unsigned numbers (flagged).
    bt, sl, flags = _kernel_indices(block_table.numpy(), seq_lens.numpy(), num_blocks, lay.block_size)
    errors.bitwise_or_(int(flags))
    params = _host_params(lay, rotation, key_centroids, value_centroids, None)
    res, res_lse = paged_decode_ref.paged_decode(
        q.float().numpy(), cache.numpy(), bt, sl, lay, params, scale=scale,
        window_left=None if window_left < 0 else window_left, logit_softcap=logit_softcap or None,
        sinks=None if sinks is None else sinks.numpy(), return_lse=True)
    out.copy_(torch.from_numpy(res).to(out.dtype))
    if lse is not None:
        lse.copy_(torch.from_numpy(res_lse).to(lse.dtype))


def _check_query(q, layout: PagedLayout, rows: str) -> None:
    """q: float16/bfloat16 ``[rows, num_q_heads, head_dim]`` with num_q_heads a positive multiple of
    the layout's KV heads (``rows`` names the first dimension in the message)."""
    h, d = layout.num_kv_heads, layout.head_dim
    check_tensor(q, "q", dtypes=(torch.float16, torch.bfloat16))
    if q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q must have shape [{rows}, num_q_heads, {d}], got {list(q.shape)}")
    if q.shape[1] == 0 or q.shape[1] % h:
        raise ValueError(f"q.shape[1] (num_q_heads) must be a positive multiple of num_kv_heads = {h}, "
                         f"got {q.shape[1]}")


def _cache_or_stand_in(cache: torch.Tensor):
    """``(cache, num_blocks)``: an empty cache has no block to clamp a bad entry to, so a zero
    block stands in (the scan then flags every entry in use); ``num_blocks`` is the real count."""
    if cache.shape[0] == 0:
        return torch.zeros((1, *cache.shape[1:]), dtype=cache.dtype, device=cache.device), 0
    return cache, cache.shape[0]


def _kernel_indices(block_table: np.ndarray, seq_lens: np.ndarray, num_blocks: int, block_size: int):
    """``(block_table, seq_lens, flags)`` as the kernels see them: lengths clamped into
    ``[0, max_blocks·block_size]``, entries in use outside ``[0, num_blocks)`` clamped into it
    as unsigned 32-bit numbers (negative ones become ``num_blocks − 1``)."""
    cap = block_table.shape[1] * block_size
    flags = ErrorFlag(0)
    sl = np.clip(seq_lens, 0, cap).astype(np.int32)
    if np.any(sl != seq_lens):
        flags |= ErrorFlag.SEQ_LEN_OUT_OF_RANGE
    used = np.arange(block_table.shape[1])[None, :] * block_size < sl[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if np.any(bad):
        flags |= ErrorFlag.BLOCK_OUT_OF_RANGE
    clamped = np.minimum(block_table.astype(np.int64) & 0xFFFFFFFF, max(num_blocks - 1, 0))
    return np.where(bad, clamped, block_table).astype(np.int32), sl, flags


paged_decode_op = torch.library.custom_op("tqkern::paged_decode", mutates_args=("out", "workspace", "lse"))(
    _paged_decode_impl)


@paged_decode_op.register_fake
def _(q, cache, block_table, seq_lens, rotation, key_centroids, value_centroids, key_centroids_f32,
      value_centroids_f32, out, workspace, layout, scale, num_splits, same_codebooks, window_left, logit_softcap,
      sinks, lse, signed_sylvester) -> None:
    return None
