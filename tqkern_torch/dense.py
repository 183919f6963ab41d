"""A dense (non-paged) compressed KV cache: ``[batch, tokens, num_kv_heads, slot_bytes]`` uint8, for
stacks without a page table.

Such a tensor is a paged cache of the ``"slot"`` arrangement whose blocks are consecutive: viewed as
``[batch · tokens / bs, bs, H, slot_bytes]`` with the identity block table ``table[b, j] = b ·
tokens / bs + j`` (``bs``: the largest power of two ≤ 1024 that divides ``tokens``), so every op runs
the paged kernels unchanged, on a view (no copy):

- :func:`dense_store`: write new tokens' K/V at given positions of each row;
- :func:`dense_decode`: one query per row over its first ``lengths[b]`` tokens (``paged_decode``);
- :func:`dense_attention`: ``Lq`` queries per row, the last ``Lq`` positions of each row's
  ``lengths[b]`` tokens, bottom-right causal (``prefill``, or ``paged_decode`` for one query) or
  with a boolean mask (``decompress`` + torch SDPA: it materialises the rows' K/V in float32).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tqkern.errors import ErrorFlag
from tqkern.layouts import KVFormat, PagedLayout
from tqkern.ops.attention.reference import resolve_scale
from tqkern_torch._validate import check_even_address, check_tensor
from tqkern_torch.attention import _tracing_or_capturing, paged_decode
from tqkern_torch.errors import error_word
from tqkern_torch.ops import _device_params, decompress, store
from tqkern_torch.prefill import prefill

__all__ = ["dense_layout", "dense_store", "dense_decode", "dense_attention"]


def _block_size(tokens: int) -> int:
    bs = 1
    while bs < 1024 and tokens % (2 * bs) == 0:
        bs *= 2
    return bs


def dense_layout(fmt: KVFormat, num_kv_heads: int, tokens: int) -> PagedLayout:
    """The paged layout a dense cache of ``tokens`` tokens per row is viewed as (slot arrangement)."""
    _check_format(fmt)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    return PagedLayout(format=fmt, num_kv_heads=num_kv_heads, block_size=_block_size(tokens), arrangement="slot")


def _check_format(fmt) -> None:
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"fmt must be a tqkern.KVFormat, got {type(fmt).__name__}")


def _view(kv: torch.Tensor, fmt: KVFormat):
    """(paged view, layout, identity block table) of a dense cache."""
    _check_format(fmt)
    check_tensor(kv, "kv", dtypes=(torch.uint8,), contiguous=True)
    check_even_address(kv, "kv")
    if kv.dim() != 4 or kv.shape[3] != fmt.slot_bytes or kv.shape[1] < 1:
        raise ValueError(f"kv must have shape [batch, tokens >= 1, num_kv_heads, {fmt.slot_bytes}], "
                         f"got {list(kv.shape)}")
    b, t, h, _ = kv.shape
    layout = dense_layout(fmt, h, t)
    per_row = t // layout.block_size
    table = torch.arange(b * per_row, dtype=torch.int32, device=kv.device).view(b, per_row)
    return kv.view(b * per_row, layout.block_size, h, fmt.slot_bytes), layout, table


def _check_lengths(lengths, kv, name="lengths"):
    check_tensor(lengths, name, shape=(kv.shape[0],), dtypes=(torch.int32,), device=kv.device, contiguous=True)


def dense_store(kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: torch.Tensor, fmt: KVFormat,
                params) -> torch.Tensor:
    """Compress ``key``/``value`` ``[batch, n, H, D]`` (float16/bfloat16) into rows of ``kv`` at
    positions ``start[b] .. start[b] + n − 1`` (``start`` int32 ``[batch]``); positions past the
    row's end are skipped (and flagged, as ``store`` does for slots past a cache). Returns ``kv``."""
    paged, layout, _ = _view(kv, fmt)
    b, t, h, _ = kv.shape
    for name, x in (("key", key), ("value", value)):
        check_tensor(x, name, dtypes=(torch.float16, torch.bfloat16), device=kv.device)
        if x.dim() != 4 or x.shape[0] != b or x.shape[2] != h or x.shape[3] != fmt.head_dim:
            raise ValueError(f"{name} must have shape [{b}, n, {h}, {fmt.head_dim}], got {list(x.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {list(key.shape)}, got {list(value.shape)}")
    _check_lengths(start, kv, "start")
    n = key.shape[1]
    pos = start.long()[:, None] + torch.arange(n, device=kv.device)[None, :]
    # a position outside the row becomes a slot past the cache: store skips it and flags it
    slots = torch.where((pos >= 0) & (pos < t), torch.arange(b, device=kv.device)[:, None] * t + pos, b * t)
    store(paged, key.reshape(b * n, h, fmt.head_dim), value.reshape(b * n, h, fmt.head_dim),
          slots.reshape(-1), layout, params)
    return kv


def dense_decode(q: torch.Tensor, kv: torch.Tensor, lengths: torch.Tensor, fmt: KVFormat, params, *,
                 scale: Optional[float] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``paged_decode`` of ``q [batch, Hq, D]`` over the first ``lengths[b]`` tokens of each row of
    the dense cache ``kv`` (identity block table; a view, no copy)."""
    paged, layout, table = _view(kv, fmt)
    _check_lengths(lengths, kv)
    return paged_decode(q, paged, table, lengths, layout, params, scale=scale, out=out)


def dense_attention(q: torch.Tensor, kv: torch.Tensor, lengths: torch.Tensor, fmt: KVFormat, params, *,
                    scale: Optional[float] = None, mask: Optional[torch.Tensor] = None,
                    lengths_cpu: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``q [batch, Hq, Lq, D]`` over each row's first ``lengths[b]`` tokens: query
    ``i`` sits at position ``lengths[b] − Lq + i`` and sees the tokens up to it (bottom-right causal),
    or, with ``mask`` (bool ``[batch, 1 or Hq, Lq, tokens]``, True = attend), exactly the masked
    ones among the first ``lengths[b]``. A query row with no visible token gives zeros (the
    oracles' rule). Returns q's shape and dtype.

    Paths: ``Lq == 1`` without a mask runs :func:`dense_decode`; causal calls whose every length
    lies in ``[Lq, tokens]`` run :func:`~tqkern_torch.prefill` over the identity block table (the
    decode kernel for ``Lq ≤ 8``, else the tiled path: K/V decoded a tile at a time, never whole
    rows); the rest (a mask, a row shorter than ``Lq``, a length out of range) decompress the rows
    (float32, rotated back) for torch SDPA. The lengths are read on the host for that choice:
    ``lengths_cpu`` (int32/int64 ``[batch]``, a host copy of ``lengths``, as serving stacks keep
    one) or, without it, a copy of ``lengths`` (a device sync) — except while ``torch.compile``
    traces or a CUDA graph is captured, when causal calls of several queries take the decompress
    path."""
    paged, layout, table = _view(kv, fmt)  # checked once here: the decode path calls paged_decode itself
    check_tensor(q, "q", dtypes=(torch.float16, torch.bfloat16), device=kv.device)
    if q.dim() != 4 or q.shape[0] != kv.shape[0] or q.shape[3] != fmt.head_dim:
        raise ValueError(f"q must have shape [{kv.shape[0]}, Hq, Lq, {fmt.head_dim}], got {list(q.shape)}")
    _check_lengths(lengths, kv)
    if lengths_cpu is not None:
        check_tensor(lengths_cpu, "lengths_cpu", shape=(kv.shape[0],), dtypes=(torch.int32, torch.int64),
                     device=torch.device("cpu"))
    b, hq, lq, d = q.shape
    sc = resolve_scale(scale, d)
    if mask is None and lq == 1:
        return paged_decode(q[:, :, 0], paged, table, lengths, layout, params, scale=sc)[:, :, None]
    if hq % kv.shape[2]:
        raise ValueError(f"q.shape[1] (Hq) must be a multiple of num_kv_heads = {kv.shape[2]}, got {hq}")
    if mask is None and lq:
        host = lengths_cpu if lengths_cpu is not None else None if _tracing_or_capturing(kv.device) else lengths.cpu()
        if host is not None and bool(((host >= lq) & (host <= kv.shape[1])).all()):
            return _causal_by_prefill(q, paged, table, lengths, host, layout, params, sc)
    t, h = kv.shape[1], kv.shape[2]
    # a length outside [0, tokens] is clamped and flagged, as the decode path does (no host sync)
    bad = ((lengths < 0) | (lengths > t)).any()
    error_word(kv.device).bitwise_or_(bad.to(torch.int32) * int(ErrorFlag.SEQ_LEN_OUT_OF_RANGE))
    p = _device_params(params, layout, kv.device)
    pos = torch.arange(t, device=kv.device)
    ids = torch.where(pos[None, :] < lengths.long()[:, None], torch.arange(b, device=kv.device)[:, None] * t + pos, -1)
    # [b·t, H, D] float32; the key is that of key − μ: μ shifts all scores of a query equally
    k, v = decompress(paged, ids.reshape(-1), layout, p, rotate_back=True)
    k = k.view(b, t, h, d).transpose(1, 2)
    v = v.view(b, t, h, d).transpose(1, 2)
    visible = pos[None, :] < lengths.long()[:, None]  # [b, t]
    if mask is None:
        qpos = lengths.long()[:, None] - lq + torch.arange(lq, device=kv.device)[None, :]  # [b, lq]
        allowed = (pos[None, None, :] <= qpos[:, :, None]) & visible[:, None, :]  # [b, lq, t]
        allowed = allowed[:, None]
    else:
        check_tensor(mask, "mask", dtypes=(torch.bool,), device=kv.device)
        if mask.dim() != 4 or mask.shape[0] != b or mask.shape[1] not in (1, hq) or mask.shape[2:] != (lq, t):
            raise ValueError(f"mask must have shape [{b}, 1 or {hq}, {lq}, {t}], got {list(mask.shape)}")
        allowed = mask & visible[:, None, None, :]
    o = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=allowed, scale=sc, enable_gqa=hq != h)
    qf = q.float()
    o = torch.where(allowed.any(dim=-1, keepdim=True), o, 0.0)  # rows with nothing visible: zeros,
    return (o + (qf - qf).sum(dim=-1, keepdim=True)).to(q.dtype)  # but NaN for a non-finite query row


def _causal_by_prefill(q, paged, table, lengths, host, layout, params, scale) -> torch.Tensor:
    """:func:`dense_attention`'s causal rows through ``prefill`` (every host length in ``[Lq,
    tokens]``, checked by the caller): row b's ``Lq`` queries are the last of its ``lengths[b]``."""
    b, hq, lq, d = q.shape
    qsl_cpu = torch.arange(b + 1, dtype=torch.int32) * lq
    rows = q.transpose(1, 2).reshape(b * lq, hq, d)  # (a copy: token-major)
    out = prefill(rows, paged, table, lengths, qsl_cpu.to(q.device), layout, params, scale=scale, max_query_len=lq,
                  query_start_loc_cpu=qsl_cpu, seq_lens_cpu=host.to(torch.int32), check_inputs=False)
    return out.view(b, lq, hq, d).transpose(1, 2).contiguous()
