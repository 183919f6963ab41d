"""The compressed KV cache of the transformers integration: :class:`TQCache`, a
``transformers.Cache`` with one :class:`TQCacheLayer` per decoder layer, or with
``max_cache_len`` one :class:`~tqkern_torch.static_cache.TQStaticCacheLayer` (how it pages,
stores and reads back a batch: :mod:`tqkern_torch.transformers`, whose
:func:`~tqkern_torch.transformers.install` attaches the per-layer parameters it reads)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tqkern.layouts import PagedLayout
from tqkern.params import TQParams
from tqkern_torch._params import to_device
from tqkern_torch._validate import check_flag
from tqkern_torch.calibration import soft_capped, warn_key_mean
from tqkern_torch.exact_prefix import ExactPrefix
from tqkern_torch.ops import allocate_cache, decompress_sequences, store

__all__ = ["ATTN_IMPLEMENTATION", "TQCache", "TQCacheLayer"]

PREFILL_MODES = ("auto", "kernel", "dense")  # TQCache(prefill=): kernels on CUDA, always, never
ATTN_IMPLEMENTATION = "tqkern"
_ATTR = "_tqkern_install"  # where install() keeps its TQInstall on the model
_TAG = "_tqkern_layer"  # decode steps: the attribute on the returned key naming its cache layer


def _text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "get_text_config"):
        raise TypeError(f"model must be a transformers model or its config, got {type(model_or_config).__name__}")
    return config.get_text_config(decoder=True)


def _geometry(config) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a decoder config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, head_dim


def prefix_starts(allowed: torch.Tensor) -> Optional[torch.Tensor]:
    """For boolean ``allowed [b, n]``: per row the number of leading False entries (int64 ``[b]``)
    when every entry after them is True (a masked prefix, e.g. left padding), else None."""
    starts = (~allowed).long().cumprod(dim=1).sum(dim=1)
    positions = torch.arange(allowed.shape[1], device=allowed.device)[None, :]
    return starts if torch.equal(allowed, positions >= starts[:, None]) else None


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """A boolean (True = attend) view of a boolean or additive mask."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def _shared_copy(store: Optional[dict], params: TQParams, device: torch.device):
    """``params``' device copy from ``store`` (an install's :attr:`TQInstall.device_copies`, kept as
    long as the install), made there once; without a store (``TQCache(params=...)``) a new one."""
    if store is None:
        return to_device(params, device)
    if (params, device) not in store:
        store[params, device] = to_device(params, device)
    return store[params, device]


class TQCacheLayer(CacheLayerMixin):
    """One decoder layer's K/V, compressed in a paged cache of ``params.format``.

    Row ``b`` of the batch is paged sequence ``b``. transformers pads batches on the left, so all
    rows have the same logical length ``seq_len``; padded positions are stored like any token.
    At the first decode step whose mask masks exactly a prefix of each row (left padding, see
    :meth:`paged_rows`), every row is re-paged from its first real token by copying slot bytes
    (exact, once): row ``b`` then holds logical positions ``starts[b] ..`` as paged positions
    ``0 ..``, and ``paged_decode`` serves the padded batch. Physical blocks are handed out in
    order and the pool grows by doubling. ``update`` stores the new tokens and returns them, the
    key tagged with this layer, for :func:`~tqkern_torch.transformers.attention_forward` to attend
    the cache: ``paged_decode`` for one new token; for more (a prefill or a chunk) ``prefill``
    where :meth:`prefill_kernels` says so (``prefill="auto"``: on CUDA; ``"kernel"``: always, on
    CPU through the interpreter or the oracles; ``"dense"``: never) and the mask is causal with
    left padding only (:mod:`tqkern_torch.hf_prefill`: the padding is then dropped before the
    attention); otherwise the dense path over :meth:`dense`.
    """

    is_compileable = False
    is_sliding = False  # every token is kept; a sliding window is applied by the mask
    is_croppable = False

    def __init__(self, params: TQParams, num_kv_heads: int, block_size: int = 16, *,
                 estimate_key_offset: bool = False, prefill: str = "auto", exact_prefix: int = 0):
        super().__init__()
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        self.exact = ExactPrefix(exact_prefix) if exact_prefix else None
        self.params = params
        self.prefill = prefill
        self.estimate_key_offset = check_flag(estimate_key_offset, "estimate_key_offset") and params.key_offset is None
        self.layout = PagedLayout(format=params.format, num_kv_heads=num_kv_heads, block_size=block_size)
        self.seq_len = 0
        self.shared: Optional[dict] = None  # an install's device copies (TQInstall.device_copies; TQCache sets it)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float16
        self.batch_size = key_states.shape[0]
        if self.estimate_key_offset:  # μ = mean key of the first prefill (every row and position), fixed
            mu = key_states.to(torch.float32).mean(dim=(0, 2))  # [H, D]
            self.params = self.params.with_key_offset(mu.cpu().numpy())
            self.device_params = to_device(self.params, self.device)  # (this cache's own params)
        else:  # one device copy of these params for every cache (each layer used to copy per cache)
            self.device_params = _shared_copy(self.shared, self.params, self.device)
        mu = self.device_params.key_offset
        self.mu = None if mu is None else mu[None, :, None, :]  # [1, H, 1, D]
        self.pool = allocate_cache(self.layout, 0, self.device)
        self.blocks_used = 0
        self.block_table = torch.zeros((self.batch_size, 0), dtype=torch.int32, device=self.device)
        self.seq_lens = torch.zeros(self.batch_size, dtype=torch.int32, device=self.device)
        self.starts = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        self.start_min = self.start_max = 0  # host copies of starts.min(), starts.max()
        self.is_initialized = True

    def _reserve(self, length: int) -> None:
        """Make every row's block table cover ``length`` paged positions."""
        bs, rows = self.layout.block_size, self.batch_size
        have = self.block_table.shape[1]
        need = -(-length // bs)
        if need <= have:
            return
        extra = rows * (need - have)
        if self.blocks_used + extra > self.pool.shape[0]:
            grown = allocate_cache(self.layout, max(2 * self.pool.shape[0], self.blocks_used + extra), self.device)
            grown[: self.pool.shape[0]] = self.pool
            self.pool = grown
        new = torch.arange(self.blocks_used, self.blocks_used + extra, dtype=torch.int32, device=self.device)
        self.block_table = torch.cat([self.block_table, new.reshape(rows, need - have)], dim=1).contiguous()
        self.blocks_used += extra

    def _begin(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[int, int, int, int]:
        """Initialise at the first update and check the batch; ``key_states.shape``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, t, d = key_states.shape
        if b != self.batch_size:
            raise ValueError(f"key_states.shape[0] must be the cache's batch size {self.batch_size}, got {b}")
        return b, h, t, d

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store ``key_states, value_states [batch, num_kv_heads, new_tokens, head_dim]``."""
        b, h, t, d = self._begin(key_states, value_states)
        start = self.seq_len
        self._reserve(start + t - self.start_min)
        bs = self.layout.block_size
        if t == 1 and not self.start_max:  # a decode step, every row at paged position `start`: few launches
            slots = torch.add(start % bs, self.block_table[:, start // bs], alpha=bs)  # [b] int32
            k = key_states[:, :, 0].to(self.store_dtype)  # [b, h, d] views (last dimension contiguous)
            v = value_states[:, :, 0].to(self.store_dtype)
        else:
            pos = torch.arange(start, start + t, device=self.device)[None, :] - self.starts[:, None]  # [b, t] paged
            slots = (self.block_table.gather(1, pos // bs).long() * bs + pos % bs).reshape(-1)  # [b·t], row-major
            k = key_states.transpose(1, 2).reshape(b * t, h, d).to(self.store_dtype).contiguous()
            v = value_states.transpose(1, 2).reshape(b * t, h, d).to(self.store_dtype).contiguous()
        store(self.pool, k, v, slots, self.layout, self.device_params)
        self.seq_len = start + t
        if self.start_max:
            self.seq_lens.copy_(self.seq_len - self.starts)
        else:  # every row holds seq_len paged positions
            self.seq_lens.fill_(self.seq_len)
        key, value = key_states.view(key_states.shape), value_states.view(value_states.shape)
        setattr(key, _TAG, self)
        return key, value

    def prefill_kernels(self) -> bool:
        """Whether a prefill attends through :func:`tqkern_torch.prefill` (``TQCache(prefill=)``)."""
        return self.device.type == "cuda" if self.prefill == "auto" else self.prefill == "kernel"

    def page_from(self, starts: torch.Tensor, starts_host: Sequence[int]) -> bool:
        """Make row ``b`` page from logical position ``starts[b]`` (its left padding dropped, an
        exact byte copy, once; ``starts_host`` the same as host ints); False when the rows were
        re-paged from other positions already."""
        if self.start_max:
            return torch.equal(starts, self.starts)
        if max(starts_host):
            self._drop_prefixes(starts)
        return True

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole stored sequence ``[batch, num_kv_heads, seq_len, head_dim]`` in the model's
        dtype: decompressed and rotated back, with μ added back to the keys."""
        k, v = decompress_sequences(self.pool, self.block_table, self.seq_lens, self.layout, self.device_params,
                                    rotate_back=True)  # [b, paged positions, h, d]
        keep = None
        if self.start_max:  # logical position p of row b is paged p − starts[b]; dropped ones are zeros
            p = torch.arange(self.seq_len, device=self.device)[None, :] - self.starts[:, None]  # [b, seq_len]
            idx = p.clamp(min=0)[:, :, None, None].expand(-1, -1, *k.shape[2:])
            keep = (p >= 0)[:, None, :, None]  # [b, 1, seq_len, 1]
            k, v = k.gather(1, idx), v.gather(1, idx)
        k = k[:, : self.seq_len].transpose(1, 2)
        v = v[:, : self.seq_len].transpose(1, 2)
        if self.mu is not None:
            k = k + self.mu
        if keep is not None:  # after μ: a dropped position reads zeros with or without μ
            k, v = k * keep, v * keep
        return k.to(self.dtype), v.to(self.dtype)

    def _drop_prefixes(self, starts: torch.Tensor) -> None:
        """Re-page row ``b`` from logical position ``starts[b]`` on (slot bytes copied, exact);
        the positions before it are dropped. Only from the un-dropped state."""
        bs, rows = self.layout.block_size, self.batch_size
        lengths = self.seq_len - starts  # [b]
        width = -(-int(lengths.max()) // bs)
        pool = allocate_cache(self.layout, rows * width, self.device)
        table = torch.arange(rows * width, dtype=torch.int32, device=self.device).reshape(rows, width)
        j = torch.arange(width * bs, device=self.device)[None, :].expand(rows, -1)  # new paged positions
        p = (j + starts[:, None]).clamp(max=self.seq_len - 1)  # logical = old paged positions
        src = self.block_table.gather(1, p // bs).long() * bs + p % bs
        dst = table.gather(1, j // bs).long() * bs + j % bs
        used = j < lengths[:, None]
        pool.view(rows * width * bs, -1)[dst[used]] = self.pool.view(self.pool.shape[0] * bs, -1)[src[used]]
        self.pool, self.block_table, self.blocks_used = pool, table, rows * width
        self.starts, self.seq_lens = starts.clone(), lengths.to(torch.int32)
        self._set_starts(starts)

    def _set_starts(self, starts: torch.Tensor) -> None:
        self.start_min, self.start_max = int(starts.min()), int(starts.max())

    def paged_rows(self, attention_mask: torch.Tensor, window: Optional[int] = None) -> bool:
        """Whether a decode step's 4D ``attention_mask`` masks exactly each row's dropped (or
        droppable) prefix, so that ``paged_decode`` over the re-paged rows is exact. Re-pages at
        the first such mask with any padding. Raises if the mask attends a dropped position.

        ``window``: a sliding-window layer's window in keys (transformers' ``sliding_window``; the
        query at position ``seq_len − 1`` sees positions ``≥ seq_len − window``). The mask must
        then also mask every key before the window, which ``paged_decode(window_left=window − 1)``
        masks itself; left padding shows only where it reaches into the window, and only such rows
        are re-paged (padding wholly before the window stays, masked by the window from then on:
        re-paging keeps each key's distance to the query)."""
        allowed = _allowed(attention_mask)[..., : self.seq_len].any(dim=(1, 2))  # [b, seq_len]
        positions = torch.arange(self.seq_len, device=self.device)[None, :]
        if self.start_max and bool((allowed & (positions < self.starts[:, None])).any()):
            raise RuntimeError("attention_mask attends positions that TQCache dropped as left padding")
        if attention_mask.shape[1] != 1 or attention_mask.shape[2] != 1:
            return False
        starts = prefix_starts(allowed)  # leading masked positions per row
        if starts is None or int(starts.max()) >= self.seq_len:
            return False  # not a pure prefix (e.g. a sliding window inside a row), or a row all masked
        if window is not None:
            first = self.seq_len - window  # the window's first position (negative: before the row)
            if int(starts.min()) < first:
                return False  # attends keys before the window: not this window's mask
            if self.start_max:
                return torch.equal(starts, self.starts.clamp(min=first))
            starts = torch.where(starts > first, starts, 0)  # padding known only inside the window
        if not self.start_max and int(starts.max()):
            self._drop_prefixes(starts)
        return torch.equal(starts, self.starts)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if getattr(self, "exact", None) is not None:
            self.exact.reset()
        if self.is_initialized:
            self.blocks_used = 0
            self.block_table = self.block_table[:, :0].contiguous()
            self.seq_lens.zero_()
            self.starts.zero_()
            self.start_min = self.start_max = 0
        self.seq_len = 0

    def offload(self):
        raise NotImplementedError("TQCache does not offload; supported: one device per cache")

    def prefetch(self):
        raise NotImplementedError("TQCache does not offload; supported: one device per cache")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("TQCache does not support beam search yet (reorder_cache); use greedy or sampling")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("TQCache cannot crop yet (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("TQCache cannot repeat batch rows yet (beam search, num_return_sequences > 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("TQCache cannot select batch rows yet")


class TQCache(Cache):
    """A ``transformers.Cache`` keeping every decoder layer's K/V compressed (see the module
    docstring of :mod:`tqkern_torch.transformers`). ``TQCache(model)`` uses what
    :func:`~tqkern_torch.transformers.install` attached to ``model``; pass ``params=`` (one
    :class:`~tqkern.TQParams` per layer, e.g. from :func:`~tqkern_torch.transformers.layer_params`)
    to build one without installing, and ``block_size`` and ``estimate_key_offset`` then.

    With ``estimate_key_offset`` (``install(key_offset="prefill")``, or, for the layers it gives μ,
    ``"auto"`` without a tokenizer) each layer without μ takes μ = the mean key of its first
    update (every row and position of the first prefill, padding included), fixed for the
    cache's life. Each layer
    that quantizes keys without μ is checked at its first update, if that holds at least
    ``KEY_MEAN_MIN_TOKENS`` tokens (rows × positions): if :func:`~tqkern_torch.calibration.key_mean_ratio` exceeds
    ``KEY_MEAN_WARN_RATIO`` for a head, a :class:`KeyOffsetWarning` is raised (once per cache).

    With ``max_cache_len`` every layer is a :class:`TQStaticCacheLayer`: fixed capacity (tokens
    per batch row, the prompt included), compileable, so that ``generate`` compiles the decode
    step and replays it as a CUDA graph (on CUDA; see that class). Without it the layers grow.
    ``prefill`` (``"auto"``, ``"kernel"`` or ``"dense"``) picks how prefills attend
    (:class:`TQCacheLayer`). ``exact_prefix=N`` keeps each row's first ``N`` real tokens exact
    beside the compressed cache (:class:`~tqkern_torch.exact_prefix.ExactPrefix`: attention sinks;
    ``N · 4 · head_dim`` bytes per KV head and row, float16 or bfloat16): the dense path attends
    them in place of their reconstruction, the outputs of ``paged_decode`` and ``prefill`` are
    corrected through their log-sum-exp (:func:`~tqkern_torch.exact_prefix.replace_prefix`; a
    prefill under soft-capping or a sliding window takes the dense path), and the first chunk
    must hold ``N`` real tokens per row. With ``max_cache_len`` too: each compiled decode step
    corrects ``paged_decode`` (window and soft-cap included) from tensors computed once at the end
    of the first prefill."""

    def __init__(self, model_or_config, *, params: Optional[Sequence[TQParams]] = None,
                 block_size: Optional[int] = None, estimate_key_offset: bool = False,
                 max_cache_len: Optional[int] = None, prefill: str = "auto", exact_prefix: int = 0):
        installed = getattr(model_or_config, _ATTR, None)
        check_flag(estimate_key_offset, "estimate_key_offset")
        if block_size is not None:
            if params is None:
                raise ValueError("block_size is install()'s unless params= is given, got block_size "
                                 f"{block_size!r} without params")
            if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
                raise ValueError(f"block_size must be None or a positive int, got {block_size!r}")
        from_install = params is None
        if from_install:
            if installed is None:
                raise ValueError("model must have tqkern installed (tqkern_torch.transformers.install), "
                                 "or pass params=")
            params, block_size = installed.params, installed.block_size
            estimate = [source == "prefill" for source in installed.key_offset_sources]
        else:
            estimate = [estimate_key_offset] * len(params)
        config = _text_config(model_or_config)
        num_layers, kv_heads, head_dim = _geometry(config)
        if len(params) != num_layers:
            raise ValueError(f"params must hold one TQParams per layer ({num_layers}), got {len(params)}")
        for i, p in enumerate(params):
            if not isinstance(p, TQParams) or p.format.head_dim != head_dim:
                raise ValueError(f"params[{i}] must be a TQParams of head_dim {head_dim}, got {p!r}")
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if not kinds <= {"full_attention", "sliding_attention"}:
            raise NotImplementedError(f"TQCache supports full and sliding attention layers, got {sorted(kinds)}")
        if max_cache_len is not None and soft_capped(config):
            with_mu = [i for i, (p, e) in enumerate(zip(params, estimate)) if p.key_offset is not None or e]
            if with_mu:
                raise ValueError(f"TQCache(max_cache_len=...) of a model with soft-capped attention logits needs "
                                 f"layers without a key offset (its decode kernel would cap q·(k − μ), not q·k), "
                                 f"got μ on layers {with_mu}: install with key_offset=None or 'auto', or use "
                                 f"TQCache without max_cache_len (its soft-capped steps attend the dense K/V)")
        if not isinstance(exact_prefix, int) or isinstance(exact_prefix, bool) or exact_prefix < 0:
            raise ValueError(f"exact_prefix must be an int >= 0, got {exact_prefix!r}")
        if max_cache_len is None:
            layers = [TQCacheLayer(p, kv_heads, block_size or 16, estimate_key_offset=e, prefill=prefill,
                                   exact_prefix=exact_prefix) for p, e in zip(params, estimate)]
        else:
            from tqkern_torch.static_cache import TQStaticCacheLayer  # (a subclass of TQCacheLayer, above)

            layers = [TQStaticCacheLayer(p, kv_heads, max_cache_len, block_size or 16, estimate_key_offset=e,
                                         prefill=prefill, exact_prefix=exact_prefix) for p, e in zip(params, estimate)]
        if from_install:  # the install's device copies of its params, shared by its caches
            for layer in layers:
                layer.shared = installed.device_copies
        super().__init__(layers=layers)
        self._config = config
        self._warned = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # A decode step returns only the new token's K/V (the "tqkern" attention reads the cache):
        # any other attention would silently attend that token alone.
        if self._config._attn_implementation != ATTN_IMPLEMENTATION:
            raise RuntimeError(f"TQCache needs the model's attention implementation to be "
                               f"{ATTN_IMPLEMENTATION!r} (tqkern_torch.transformers.install), "
                               f"got {self._config._attn_implementation!r}")
        layer = self.layers[layer_idx]
        if not self._warned and not layer.is_initialized and not layer.estimate_key_offset:
            self._warned = warn_key_mean(layer.params, key_states, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
