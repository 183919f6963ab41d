"""Prefill of the ``"tqkern"`` transformers attention through :func:`tqkern_torch.prefill`.

Two pieces, used by :mod:`tqkern_torch.transformers`:

* :func:`causal_mask`, the ``AttentionMaskInterface["tqkern"]`` entry. For a prefill (more than
  one query) under a plain causal or sliding-window causal mask it returns a :class:`CausalMask`:
  the 2D padding mask and the offsets, no ``[batch, 1, q_len, kv_len]`` tensor (at 32K tokens
  that tensor is a gigabyte per batch row). Anything else (one query, custom or packed masks,
  traced offsets) gets what ``sdpa_mask`` returns.
* :func:`prefill_attention`: a prefill over a :class:`~tqkern_torch.kv_cache.TQCacheLayer`
  under such a mask, through :func:`tqkern_torch.prefill` (the tiled path on CUDA: each cached
  key decoded once into a bounded workspace; memory never the decompressed sequence). Left padding
  is dropped first (each row re-paged from its first real token, an exact byte copy); each row's
  real queries become one varlen sequence and the padded query positions read zeros.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

from tqkern_torch.kv_cache import prefix_starts
from tqkern_torch.prefill import prefill

__all__ = ["CausalMask", "VarlenRows", "causal_mask", "prefill_attention"]


def _and_parts(fn) -> Optional[tuple]:
    """The mask functions combined by ``transformers.masking_utils.and_masks``, or None."""
    cells = getattr(fn, "__closure__", None) or ()
    parts = [c.cell_contents for c in cells if isinstance(c.cell_contents, tuple)]
    return parts[0] if len(parts) == 1 else None


def _reference_codes():
    """Code objects of transformers' sliding-window causal mask function (and_masks of the
    overlay and the causal function), checked to mean ``q − w < kv ≤ q``; None when this
    transformers builds it otherwise (then only the plain causal mask is recognised)."""
    try:
        ref = sliding_window_causal_mask_function(3)
        parts = _and_parts(ref)
        if parts is None or len(parts) != 2 or parts[1] is not causal_mask_function:
            return None
        q = torch.arange(8)[:, None]
        kv = torch.arange(8)[None, :]
        got = ref(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, kv)
        if not torch.equal(got.expand(8, 8), (kv <= q) & (kv > q - 3)):
            return None
        return ref.__code__, parts[0].__code__
    except Exception:  # a transformers whose masks are built differently: recognise less
        return None


_SLIDING = _reference_codes()


def _window_of(mask_function, local_size) -> tuple[bool, Optional[int]]:
    """``(recognised, window)``: the plain causal mask (window None) or transformers' sliding
    window causal mask of ``local_size`` tokens."""
    if mask_function is causal_mask_function:
        return True, None
    if _SLIDING is None or local_size is None or getattr(mask_function, "__code__", None) is not _SLIDING[0]:
        return False, None
    parts = _and_parts(mask_function)
    if parts is None or len(parts) != 2 or parts[1] is not causal_mask_function:
        return False, None
    overlay = parts[0]
    cells = [c.cell_contents for c in (overlay.__closure__ or ())]
    if overlay.__code__ is not _SLIDING[1] or cells != [local_size]:
        return False, None
    return True, int(local_size)


class VarlenRows(NamedTuple):
    """A padded prefill as :func:`tqkern_torch.prefill`'s varlen batch: row ``b`` pages from
    logical position ``starts[b]``; its real queries (the last ``q_len``) are one sequence."""

    starts: torch.Tensor  # int64 [B], on the mask's device
    starts_host: list
    query_start_loc: torch.Tensor  # int32 [B + 1], on the device
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor  # int32 [B]: length − starts
    index: Optional[torch.Tensor]  # rows of the [B·Tq] queries that are real, None when all are


class CausalMask:
    """A causal (optionally sliding-window) mask with a padding mask, not materialised.

    Query ``i`` of row ``b`` sits at position ``q_offset + i`` and may attend key position
    ``kv_offset + j`` when ``j`` is at or before it, within ``window`` tokens of it (if set), and
    ``padding[b, j]`` holds (if set). :meth:`dense` builds what ``sdpa_mask`` would have returned
    (``None`` where it would skip the mask), once.

    ``ndim`` and ``shape`` are those of the dense mask: ``generate`` builds the masks of a
    compileable cache before the forward and hands them back to the model's mask creation, which
    passes a 4D mask through (the ``"tqkern"`` entry returns a given CausalMask as it is)."""

    ndim = 4

    def __init__(self, kwargs: dict, window: Optional[int], padding: Optional[torch.Tensor]):
        self.shape = torch.Size((int(kwargs["batch_size"]), 1, int(kwargs["q_length"]), int(kwargs["kv_length"])))
        self.q_length, self.kv_length = int(kwargs["q_length"]), int(kwargs["kv_length"])
        self.q_offset, self.kv_offset = int(kwargs["q_offset"]), int(kwargs["kv_offset"])
        # the offsets as they are now: a cache's live length tensor (a compileable cache's
        # get_seq_length) grows in place at the layers' updates, before dense() builds the mask
        self._kwargs = dict(kwargs, q_offset=self.q_offset, kv_offset=self.kv_offset)
        self.window = window
        self.padding = padding
        self._dense: Optional[tuple] = None
        self._starts: dict = {}

    def dense(self) -> Optional[torch.Tensor]:
        """``sdpa_mask``'s 4D boolean mask (True = attend), or None (causal, nothing masked)."""
        if self._dense is None:
            self._dense = (sdpa_mask(**self._kwargs),)
        return self._dense[0]

    def left_padding(self, length: int) -> Optional[tuple[torch.Tensor, list[int]]]:
        """Per row, the number of leading padded positions among the first ``length`` when the
        padding masks exactly such a prefix (int64 ``[batch]`` on the mask's device, and as host
        ints; zeros without padding), else None. Computed once per ``length`` (one sync): the
        layers of a forward share the mask."""
        if length not in self._starts:
            self._starts[length] = self._left_padding(length)
        return self._starts[length]

    def varlen_rows(self, length: int, q_length: int) -> Optional[VarlenRows]:
        """The varlen batch of ``q_length`` queries ending at position ``length`` under this
        mask's left padding (None where the padding is no prefix or fills a row), built once."""
        key = ("rows", length, q_length)
        if key not in self._starts:
            padding = self.left_padding(length)
            self._starts[key] = None if padding is None else self._rows(length, q_length, *padding)
        return self._starts[key]

    def _rows(self, length: int, tq: int, starts: torch.Tensor, starts_host: list) -> Optional[VarlenRows]:
        if max(starts_host) >= length:
            return None
        lengths = [length - s for s in starts_host]
        q_lens = [min(tq, n) for n in lengths]
        qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        index = None
        if any(n != tq for n in q_lens):  # each row's real queries: its last q_len
            index = torch.cat([torch.arange(r * tq + tq - n, (r + 1) * tq) for r, n in enumerate(q_lens)])
            index = index.to(starts.device)
        return VarlenRows(starts, starts_host, qsl.to(starts.device), qsl, torch.tensor(lengths, dtype=torch.int32),
                          index)

    def _left_padding(self, length: int) -> Optional[tuple[torch.Tensor, list[int]]]:
        if self.padding is None:
            b = self._kwargs["batch_size"]
            return torch.zeros(b, dtype=torch.long, device=self._kwargs["device"]), [0] * b
        starts = prefix_starts(self.padding[:, :length].bool())
        return None if starts is None else (starts, starts.tolist())


def causal_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                mask_function=causal_mask_function, attention_mask: Optional[torch.Tensor] = None,
                local_size: Optional[int] = None, allow_is_causal_skip: bool = True, use_vmap: bool = False,
                device="cpu", **kwargs):
    """``AttentionMaskInterface["tqkern"]``: a :class:`CausalMask` for a prefill under a plain or
    sliding-window causal mask, else ``sdpa_mask(...)`` (same arguments)."""
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, local_size=local_size,
                allow_is_causal_skip=allow_is_causal_skip, use_vmap=use_vmap, device=device, **kwargs)
    if isinstance(attention_mask, CausalMask):  # built already (generate's masks for a compileable cache)
        return attention_mask
    known, window = _window_of(mask_function, local_size)
    if q_length <= 1 or use_vmap or not known or torch.compiler.is_compiling():  # (traced offsets: compiling)
        return sdpa_mask(**args)
    padding = None
    if attention_mask is not None:
        padding = attention_mask.bool()
        if (extra := kv_length + int(kv_offset) - padding.shape[-1]) > 0:
            padding = torch.nn.functional.pad(padding, (0, extra))
        padding = padding[:, int(kv_offset):]
    return CausalMask(args, window, padding)


def prefill_attention(layer, query: torch.Tensor, mask: CausalMask, scale: float,
                      softcap: Optional[float]) -> Optional[torch.Tensor]:
    """Attention of a prefill's ``query [B, Hq, Tq, D]`` over ``layer``'s cache (the new tokens
    stored already) through :func:`tqkern_torch.prefill`, as ``[B, Tq, Hq, D]`` in query's dtype,
    padded query positions zero. None (nothing done) where the mask is not causal over the
    layer's positions with left padding only, or the layer's dropped prefix differs from it:
    the caller then takes the dense path. With the layer's exact prefix (``TQCache(exact_prefix=)``)
    the output is corrected through ``prefill``'s log-sum-exp, with the same window and soft-cap."""
    b, hq, tq, d = query.shape
    length = layer.seq_len
    exact = layer.exact
    if mask.kv_offset != 0 or mask.q_offset + tq != length or mask.q_length != tq:
        return None
    if softcap is not None and layer.mu is not None:  # the cap of q·(k − μ) is not that of q·k
        return None
    rows = mask.varlen_rows(length, tq)
    if rows is None or not layer.page_from(rows.starts, rows.starts_host):
        return None
    q = query.transpose(1, 2).reshape(b * tq, hq, d)  # row b·Tq + i: query i of batch row b
    if rows.index is not None:
        q = q[rows.index]
    q = q.to(layer.store_dtype).contiguous()
    window_left = None if mask.window is None else mask.window - 1
    out = prefill(q, layer.pool, layer.block_table, layer.seq_lens, rows.query_start_loc, layer.layout,
                  layer.device_params, scale=scale, window_left=window_left,
                  logit_softcap=softcap, query_start_loc_cpu=rows.query_start_loc_cpu, seq_lens_cpu=rows.seq_lens_cpu,
                  check_inputs=False, return_lse=exact is not None)
    out, lse = out if exact is not None else (out, None)
    if rows.index is not None:  # padded query positions: zero output (and lse)
        full = torch.zeros((b * tq, hq, d), dtype=out.dtype, device=out.device)
        full[rows.index] = out
        out = full
        if lse is not None:
            full = torch.zeros((b * tq, hq), dtype=lse.dtype, device=lse.device)
            full[rows.index] = lse
            lse = full
    out = out.reshape(b, tq, hq, d)
    if exact is not None:  # paged position of query i of row b: length − tq + i − starts[b] (< 0: padding)
        q_pos = torch.arange(length - tq, length, device=out.device)[None, :] - layer.starts[:, None]
        out = exact.correct(layer, query.to(layer.store_dtype), out, lse.reshape(b, tq, hq), scale, q_pos,
                            window_left=window_left, logit_softcap=softcap)
    return out.to(query.dtype)
