"""The compileable cache layer of the transformers integration, :class:`TQStaticCacheLayer`
(``TQCache(model, max_cache_len=N)``): a :class:`~tqkern_torch.kv_cache.TQCacheLayer` of fixed
capacity whose decode step is tensor work only (``torch.compile``, CUDA graphs)."""

from __future__ import annotations

import dataclasses

from typing import Optional, Sequence

import torch

from tqkern.params import TQParams
from tqkern_torch.kv_cache import _TAG, TQCacheLayer, _allowed, prefix_starts
from tqkern_torch.ops import allocate_cache, store

__all__ = ["TQStaticCacheLayer"]


class TQStaticCacheLayer(TQCacheLayer):
    """A :class:`TQCacheLayer` of fixed capacity for ``torch.compile`` and CUDA graphs
    (``TQCache(model, max_cache_len=N)``): transformers' ``generate`` then compiles the decode step
    (``CompileConfig``, by default ``mode="reduce-overhead"``) and replays it as a CUDA graph.

    Allocated once, at the first update: ``max_cache_len`` paged positions per batch row, row
    ``b`` in blocks ``b·W .. b·W + W − 1`` (``W = ⌈max_cache_len / block_size⌉``, an identity
    block table), marked as static addresses. A decode step (one new token) is tensor work only:
    the token goes to slot ``b·W·block_size + seq_lens[b]`` and ``seq_lens`` and
    ``cumulative_length`` grow in place; no Python number changes, so the compiled step is
    replayed unchanged. A token past the capacity is not stored (its slot is −1) and the next
    ``paged_decode`` records ``SEQ_LEN_OUT_OF_RANGE`` in the error word
    (:func:`tqkern_torch.check_errors`); a prefill past it raises ``ValueError``.

    Left padding is dropped at the prefill, not at the first decode step: before the prefill's
    attention through the prefill kernels (:meth:`page_from`), or after its dense attention,
    where :meth:`drop_padding` reads the mask's last query row and re-pages each row from its
    first attended position (an exact copy of slot bytes inside the row). Decode steps then run
    ``paged_decode`` on every step, whatever the mask (a sliding window as ``window_left``,
    soft-capping as ``logit_softcap``), so the mask transformers builds is not read. Prefill (more
    than one new token) runs eagerly as in :class:`TQCacheLayer`; it reads the stored length from
    the device (a sync per layer) unless nothing was stored since the allocation or :meth:`reset`
    (:attr:`empty`): a fresh cache's prefill syncs on nothing. (Decode steps replayed as CUDA graphs
    advance the length without running Python, so the first update after a reset must run it, as
    ``generate``'s eager first forward does.) With ``exact_prefix`` the first
    prefill ends with :meth:`~tqkern_torch.exact_prefix.ExactPrefix.freeze` (the prefix's paged
    positions and reconstruction, static addresses); each decode step then corrects
    ``paged_decode``'s output through its log-sum-exp, window and soft-cap included."""

    is_compileable = True

    def __init__(self, params: TQParams, num_kv_heads: int, max_cache_len: int, block_size: int = 16, *,
                 estimate_key_offset: bool = False, prefill: str = "auto", exact_prefix: int = 0):
        super().__init__(params, num_kv_heads, block_size, estimate_key_offset=estimate_key_offset, prefill=prefill,
                         exact_prefix=exact_prefix)
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
        if exact_prefix > max_cache_len:
            raise ValueError(f"exact_prefix must be <= max_cache_len = {max_cache_len}, got {exact_prefix}")
        self.max_cache_len = max_cache_len
        self.width = -(-max_cache_len // block_size)  # blocks per row
        self.dropped = False
        self.empty = True  # nothing stored since the allocation or reset(): the length is 0, no read

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        rows, width, bs = self.batch_size, self.width, self.layout.block_size
        self.pool = allocate_cache(self.layout, rows * width, self.device)
        self.block_table = torch.arange(rows * width, dtype=torch.int32, device=self.device).reshape(rows, width)
        self.blocks_used = rows * width
        self.row_base = torch.arange(rows, dtype=torch.int32, device=self.device) * (width * bs)  # slot of position 0
        self.cumulative_length = torch.zeros((), dtype=torch.int64, device=self.device)
        if not torch.compiler.is_compiling():  # fixed addresses: the CUDA graph reads them in place
            tables = [getattr(self.device_params, f.name) for f in dataclasses.fields(self.device_params)]
            for t in [self.pool, self.block_table, self.seq_lens, self.row_base, self.cumulative_length, self.mu,
                      *tables]:
                if isinstance(t, torch.Tensor):
                    torch._dynamo.mark_static_address(t)

    def _reserve(self, length: int) -> None:
        cap = self.width * self.layout.block_size
        if length > cap:
            raise ValueError(f"TQCache holds max_cache_len = {self.max_cache_len} tokens per row ({cap} with whole "
                             f"blocks), got {length}")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[2] > 1:  # prefill or a chunk (eager): the Python length catches up with the tensors
            # (read from the device, a sync, unless nothing was stored since reset(): decode steps
            # replayed as CUDA graphs advance the length without running this code)
            self.seq_len = 0 if self.empty or not self.is_initialized else int(self.cumulative_length)
            self.empty = False
            key, value = super().update(key_states, value_states, *args, **kwargs)
            self.cumulative_length.fill_(self.seq_len)
            return key, value
        self._begin(key_states, value_states)
        self.empty = False
        cap = self.width * self.layout.block_size
        pos = self.seq_lens  # each row's paged position of the new token
        slots = torch.where(pos < cap, self.row_base + pos, -1)
        store(self.pool, key_states[:, :, 0].to(self.store_dtype), value_states[:, :, 0].to(self.store_dtype), slots,
              self.layout, self.device_params)
        self.seq_lens.add_(1)
        self.cumulative_length.add_(1)
        key = key_states.view(key_states.shape)
        setattr(key, _TAG, self)
        return key, value_states

    def drop_padding(self, attention_mask: Optional[torch.Tensor], windowed: bool) -> None:
        """After a prefill's attention: drop each row's leading positions that the mask's last
        query row does not attend (left padding; in a sliding-window layer also the positions
        older than the window, which no later query attends). At the first prefill only; a later
        chunk of a full-attention layer must mask the same prefix. Raises ``NotImplementedError``
        for a mask whose last row is not one contiguous run up to the last position."""
        if attention_mask is None:
            self.dropped = True
            return
        allowed = _allowed(attention_mask)[:, :, -1, : self.seq_len].any(dim=1)  # [b, seq_len]
        starts = prefix_starts(allowed)
        if starts is None:
            raise NotImplementedError("TQCache(max_cache_len=...) needs a mask whose last query row attends one "
                                      "contiguous run of positions up to the last (left padding, a sliding window)")
        if self.dropped:
            if not windowed and not torch.equal(starts, self.starts):
                raise NotImplementedError("TQCache(max_cache_len=...) drops left padding at the first prefill only; "
                                          "a later chunk's mask masks a different prefix")
            return
        self.dropped = True
        if int(starts.max()) >= self.seq_len:
            raise ValueError("attention_mask masks every position of a row (a row of padding only)")
        if int(starts.max()):
            self._drop_prefixes(starts)

    def page_from(self, starts: torch.Tensor, starts_host: Sequence[int]) -> bool:
        """As :meth:`TQCacheLayer.page_from`, at the first prefill only (as :meth:`drop_padding`)."""
        if self.dropped:
            return torch.equal(starts, self.starts)
        self.dropped = True
        if max(starts_host):
            self._drop_prefixes(starts)
        return True

    def _drop_prefixes(self, starts: torch.Tensor) -> None:
        """In place (the addresses stay): row ``b``'s positions ``starts[b] ..`` move to ``0 ..``."""
        cap = self.width * self.layout.block_size
        lengths = self.seq_len - starts
        j = torch.arange(cap, device=self.device)[None, :].expand(self.batch_size, -1)
        base = self.row_base.long()[:, None]
        used = j < lengths[:, None]
        src = (base + (j + starts[:, None]).clamp(max=self.seq_len - 1))[used]
        flat = self.pool.view(self.pool.shape[0] * self.layout.block_size, -1)
        flat[(base + j)[used]] = flat[src]  # (the gather on the right is a copy)
        self.starts.copy_(starts)
        self.seq_lens.copy_(lengths)
        self._set_starts(starts)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self):
        return self.cumulative_length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if getattr(self, "exact", None) is not None:
            self.exact.reset()  # its tensors kept, refilled in place
        if self.is_initialized:
            self.seq_lens.zero_()
            self.starts.zero_()
            self.cumulative_length.zero_()
            self.start_min = self.start_max = 0
        self.seq_len = 0
        self.dropped = False
        self.empty = True
