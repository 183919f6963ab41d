"""Hugging Face ``transformers`` integration (``transformers>=5.17,<6``): a compressed KV cache
for ``model.generate``.

Usage::

    import tqkern_torch.transformers as tqt

    # μ (per-layer key offsets) calibrated on tqkern's default text with the model's tokenizer
    tqt.install(model, "tqkern_k5v3", tokenizer=tok, formats={0: "fp16", -1: "fp16"})
    out = model.generate(ids, past_key_values=tqt.TQCache(model), max_new_tokens=32)
    tqt.uninstall(model)                                  # the previous attention, exactly

Pieces:

* :class:`TQCache`, a ``transformers.Cache`` with one :class:`TQCacheLayer` per decoder layer.
  A layer keeps its keys and values compressed in a paged cache of its own
  :class:`~tqkern.PagedLayout` (one paged sequence per batch row, growing by blocks) and writes
  through :func:`tqkern_torch.store`. transformers 5.17 has no registry through which
  ``generate`` would build a custom cache class (``cache_implementation`` only names built-in
  caches), so the cache is passed as ``past_key_values``.
* :func:`attention_forward`, registered as ``AttentionInterface["tqkern"]`` (with
  ``sdpa_mask`` as ``AttentionMaskInterface["tqkern"]``). Prefill (more than one new token):
  the whole sequence is read back with :func:`tqkern_torch.decompress_sequences`
  (``rotate_back=True``) and attended with torch SDPA and the model's mask; no prefill kernel
  over the compressed cache exists yet. Decode (one new token): :func:`tqkern_torch.paged_decode`
  when there is no logit soft-capping, no ``sliding_window`` argument, and the model's mask is
  ``None`` (with ``sdpa_mask``: no padding, no active window) or masks exactly a prefix of each
  row (left padding); otherwise the decompress + dense path with the mask (``paged_decode`` has
  no mask and no window). ``paged_decode`` has no per-row start either: at the first padded
  decode step the cache re-pages each row from its first real token (an exact byte copy, once
  per layer), so the padded positions, stored at prefill and masked there, are then gone.
* :func:`install` / :func:`uninstall` and :func:`calibrate` (μ: the mean key after RoPE, i.e. what
  the cache stores, per layer and KV head; ``TQParams.key_offset``; :mod:`tqkern_torch.calibration`).
  By default a layer gets μ where its key codec gains from it (Lloyd-Max and uniform keys, not
  FP8 or raw: :func:`~tqkern_torch.calibration.key_offset_by_default`).

Attention through the stored cache sees the *reconstructed* keys and values everywhere (the
current chunk included), so prefill and decode attend the same K/V. K/V are stored from float16
(bfloat16 for a bfloat16 model): a float32 model's K/V are rounded to float16 first. With a
cache other than :class:`TQCache` (e.g. transformers' default ``DynamicCache``) the ``"tqkern"``
attention is plain dense attention over the uncompressed K/V. Not supported yet: beam search
(``reorder_cache``), cache cropping (assisted decoding), ``torch.compile``, and linear-attention
layer types.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import numpy as np
import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import sdpa_mask

from tqkern.layouts import KVFormat, PagedLayout
from tqkern.params import TQParams
from tqkern_torch._params import to_device
from tqkern_torch.attention import paged_decode
from tqkern_torch.calibration import (KeyOffsetWarning, calibrate, load_key_offsets, resolve_key_offset,
                                      save_key_offsets, warn_key_mean)
from tqkern_torch.ops import allocate_cache, decompress_sequences, store

__all__ = ["ATTN_IMPLEMENTATION", "KeyOffsetWarning", "TQCache", "TQCacheLayer", "TQInstall", "attention_forward",
           "calibrate", "install", "layer_params", "load_key_offsets", "uninstall"]

ATTN_IMPLEMENTATION = "tqkern"
_ATTR = "_tqkern_install"  # where install() keeps its TQInstall on the model
_TAG = "_tqkern_layer"  # decode steps: the attribute on the returned key naming its cache layer
FormatSpec = Union[str, KVFormat]


def _text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config(decoder=True)


def _geometry(config) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a decoder config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, head_dim


def _resolve_format(spec: FormatSpec, head_dim: int, name: str) -> KVFormat:
    if isinstance(spec, KVFormat):
        if spec.head_dim != head_dim:
            raise ValueError(f"{name}.head_dim must be the model's head_dim = {head_dim}, got {spec.head_dim}")
        return spec
    if isinstance(spec, str):
        return KVFormat.preset(spec, head_dim)
    raise TypeError(f"{name} must be a preset name or a KVFormat, got {type(spec).__name__}")


@dataclass(frozen=True)
class TQInstall:
    """What :func:`install` attached to a model: per-layer parameters and the attention
    implementation to restore.

    Attributes:
        params: one :class:`~tqkern.TQParams` per decoder layer (its format and key offset).
        block_size: tokens per cache block.
        previous: ``config._attn_implementation`` before :func:`install`.
        key_offset_sources: per layer, where its μ came from: ``"calibration"``, ``"default
            text"``, ``"given"``, ``"prefill"`` (each :class:`TQCache` estimates it from its first
            prefill; ``params`` then hold none), ``"none"`` (the caller asked for none), or
            ``"off (fp8 keys)"`` / ``"off (raw keys)"`` (``key_offset="auto"`` gives this key codec
            no μ: :func:`~tqkern_torch.calibration.key_offset_by_default`).
    """

    params: tuple[TQParams, ...]
    block_size: int
    previous: Optional[str]
    key_offset_sources: tuple[str, ...] = ()

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write :attr:`params` (formats, rotations, codebooks, μ) to ``path``; reinstall with
        ``install(model, fmt, key_offset=load_key_offsets(path))`` or read them back with
        :func:`tqkern.params.load_params`."""
        save_key_offsets(path, self.params)


def layer_params(model_or_config, format: FormatSpec = "tqkern_k5v3", *, key_offset=None,
                 formats: Optional[Mapping[int, FormatSpec]] = None) -> tuple[TQParams, ...]:
    """One :class:`~tqkern.TQParams` per decoder layer: ``formats[i]`` (negative indices count
    from the last layer) or ``format``, with ``TQParams.default`` and ``key_offset[i]`` (a
    ``[num_kv_heads, head_dim]`` array per layer, e.g. from :func:`calibrate`, or ``None`` for a
    layer without μ) when given."""
    num_layers, kv_heads, head_dim = _geometry(_text_config(model_or_config))
    per_layer: dict[int, FormatSpec] = {}
    for idx, spec in (formats or {}).items():
        if isinstance(idx, bool) or not isinstance(idx, int) or not -num_layers <= idx < num_layers:
            raise ValueError(f"formats keys must be layer indices in [{-num_layers}, {num_layers}), got {idx!r}")
        per_layer[idx % num_layers] = spec
    if key_offset is not None and len(key_offset) != num_layers:
        raise ValueError(f"key_offset must hold one [num_kv_heads, head_dim] array per layer ({num_layers}), "
                         f"got {len(key_offset)}")
    out = []
    for i in range(num_layers):
        fmt = _resolve_format(per_layer.get(i, format), head_dim, f"formats[{i}]" if i in per_layer else "format")
        mu = None
        if key_offset is not None and key_offset[i] is not None:
            mu = np.asarray(key_offset[i], dtype=np.float64)
            if mu.shape != (kv_heads, head_dim):
                raise ValueError(f"key_offset[{i}] must have shape ({kv_heads}, {head_dim}), got {mu.shape}")
        out.append(TQParams.default(fmt, key_offset=mu))
    return tuple(out)


class TQCacheLayer(CacheLayerMixin):
    """One decoder layer's K/V, compressed in a paged cache of ``params.format``.

    Row ``b`` of the batch is paged sequence ``b``. transformers pads batches on the left, so all
    rows have the same logical length ``seq_len``; padded positions are stored like any token.
    At the first decode step whose mask masks exactly a prefix of each row (left padding, see
    :meth:`paged_rows`), every row is re-paged from its first real token by copying slot bytes
    (exact, once): row ``b`` then holds logical positions ``starts[b] ..`` as paged positions
    ``0 ..``, and ``paged_decode`` serves the padded batch. Physical blocks are handed out in
    order and the pool grows by doubling. ``update`` stores the new tokens and returns

    * more than one new token (prefill, chunked prefill): the whole decompressed sequence
      ``[batch, num_kv_heads, seq_len, head_dim]`` in the model's dtype (μ added back);
    * one new token (decode): that token's own key and value, the key tagged with this layer,
      for :func:`attention_forward` to attend the cache (``paged_decode``, or the dense path).
    """

    is_compileable = False
    is_sliding = False  # every token is kept; a sliding window is applied by the mask
    is_croppable = False

    def __init__(self, params: TQParams, num_kv_heads: int, block_size: int = 16, *,
                 estimate_key_offset: bool = False):
        super().__init__()
        self.params = params
        self.estimate_key_offset = estimate_key_offset and params.key_offset is None
        self.layout = PagedLayout(format=params.format, num_kv_heads=num_kv_heads, block_size=block_size)
        self.seq_len = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float16
        self.batch_size = key_states.shape[0]
        if self.estimate_key_offset:  # μ = mean key of the first prefill (every row and position), fixed
            mu = key_states.to(torch.float32).mean(dim=(0, 2))  # [H, D]
            self.params = self.params.with_key_offset(mu.cpu().numpy())
        self.device_params = to_device(self.params, self.device)
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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store ``key_states, value_states [batch, num_kv_heads, new_tokens, head_dim]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, t, d = key_states.shape
        if b != self.batch_size:
            raise ValueError(f"key_states.shape[0] must be the cache's batch size {self.batch_size}, got {b}")
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
            self.seq_lens = (self.seq_len - self.starts).to(torch.int32)
        else:  # every row holds seq_len paged positions
            self.seq_lens.fill_(self.seq_len)
        if t > 1:
            return self.dense()
        key, value = key_states.view(key_states.shape), value_states.view(value_states.shape)
        setattr(key, _TAG, self)
        return key, value

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
        self.start_min, self.start_max = int(starts.min()), int(starts.max())

    def paged_rows(self, attention_mask: torch.Tensor) -> bool:
        """Whether a decode step's 4D ``attention_mask`` masks exactly each row's dropped (or
        droppable) prefix, so that ``paged_decode`` over the re-paged rows is exact. Re-pages at
        the first such mask with any padding. Raises if the mask attends a dropped position."""
        allowed = _allowed(attention_mask)[..., : self.seq_len].any(dim=(1, 2))  # [b, seq_len]
        positions = torch.arange(self.seq_len, device=self.device)[None, :]
        if self.start_max and bool((allowed & (positions < self.starts[:, None])).any()):
            raise RuntimeError("attention_mask attends positions that TQCache dropped as left padding")
        if attention_mask.shape[1] != 1 or attention_mask.shape[2] != 1:
            return False
        starts = (~allowed).long().cumprod(dim=1).sum(dim=1)  # leading masked positions per row
        if not torch.equal(allowed, positions >= starts[:, None]) or int(starts.max()) >= self.seq_len:
            return False  # not a pure prefix (e.g. a sliding window inside a row), or a row all masked
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
    docstring). ``TQCache(model)`` uses what :func:`install` attached to ``model``; pass
    ``params=`` (one :class:`~tqkern.TQParams` per layer, e.g. from :func:`layer_params`) to build
    one without installing, and ``block_size`` and ``estimate_key_offset`` then.

    With ``estimate_key_offset`` (``install(key_offset="prefill")``, or, for the layers it gives μ,
    ``"auto"`` without a tokenizer) each layer without μ takes μ = the mean key of its first
    update (every row and position of the first prefill, padding included), fixed for the
    cache's life. Each layer
    that quantizes keys without μ is checked at its first update, if that holds at least
    ``KEY_MEAN_MIN_TOKENS`` tokens (rows × positions): if :func:`~tqkern_torch.calibration.key_mean_ratio` exceeds
    ``KEY_MEAN_WARN_RATIO`` for a head, a :class:`KeyOffsetWarning` is raised (once per cache)."""

    def __init__(self, model_or_config, *, params: Optional[Sequence[TQParams]] = None,
                 block_size: Optional[int] = None, estimate_key_offset: bool = False):
        installed = getattr(model_or_config, _ATTR, None)
        if params is None:
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
        layers = [TQCacheLayer(p, kv_heads, block_size or 16, estimate_key_offset=e) for p, e in zip(params, estimate)]
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


def _dense_attention(query, key, value, mask, scaling: float, softcap: Optional[float]) -> torch.Tensor:
    """Attention of ``query [B, Hq, Tq, D]`` over ``key, value [B, Hkv, Tk, D]`` (GQA by repeat);
    ``mask`` boolean (True = attend) or additive, ``[B, 1|Hq, Tq, ≥Tk]``, or ``None`` (causal,
    aligned to the last key). Returns ``[B, Tq, Hq, D]``."""
    hq, tq, tk = query.shape[1], query.shape[2], key.shape[2]
    rep = hq // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    if mask is None:
        mask = torch.ones((tq, tk), dtype=torch.bool, device=query.device).tril(diagonal=tk - tq)
    else:
        mask = mask[..., :tk]
    if softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    else:
        s = (query.float() @ key.float().transpose(-1, -2)) * scaling
        s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
        out = (torch.softmax(s, dim=-1) @ value.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous()


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """A boolean (True = attend) view of a boolean or additive mask."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      softcap: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The ``"tqkern"`` attention implementation (transformers' ``AttentionInterface`` signature).

    ``query [B, Hq, Tq, D]``; ``key, value`` as :meth:`TQCacheLayer.update` returned them (or
    plain ``[B, Hkv, Tk, D]`` K/V from another cache). Returns ``([B, Tq, Hq, D], None)``.
    Decode over a :class:`TQCache` runs ``paged_decode`` when there is no soft-capping and no
    ``sliding_window`` argument and the mask is ``None`` or left padding only
    (:meth:`TQCacheLayer.paged_rows`), else the dense path over the decompressed cache with the
    mask (which carries any window). Inference only (``dropout`` must be 0)."""
    if dropout:
        raise NotImplementedError("tqkern attention is inference-only: dropout must be 0")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    layer = getattr(key, _TAG, None)
    if layer is not None:
        if attention_mask is None and layer.start_max:
            raise RuntimeError("attention_mask is None but TQCache dropped left padding: pass the padded mask")
        windowed = kwargs.get("sliding_window") is not None
        if softcap is None and (attention_mask is None or (not windowed and layer.paged_rows(attention_mask))):
            b, hq, _, d = query.shape
            q = query[:, :, 0, :].to(layer.store_dtype).contiguous()
            out = paged_decode(q, layer.pool, layer.block_table, layer.seq_lens, layer.layout,
                               layer.device_params, scale=scale)
            return out.to(query.dtype).reshape(b, 1, hq, d), None
        key, value = layer.dense()
    return _dense_attention(query, key, value, attention_mask, scale, softcap), None


def _register() -> None:
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    transformers.AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def install(model, format: FormatSpec = "tqkern_k5v3", *, key_offset="auto", calibration=None, tokenizer=None,
            formats: Optional[Mapping[int, FormatSpec]] = None, block_size: int = 16) -> TQInstall:
    """Switch ``model`` to the ``"tqkern"`` attention (``model.set_attn_implementation``) and attach
    the per-layer cache parameters that :class:`TQCache` reads, the key offset μ included.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention follows ``AttentionInterface``.
        format: preset name (``KVFormat.preset``) or :class:`~tqkern.KVFormat` for every layer.
        key_offset: the per-layer key offset μ (``docs/quality.md`` measures what it is worth):

            * ``"auto"`` (default): per layer, by its key codec
              (:func:`~tqkern_torch.calibration.key_offset_by_default`): Lloyd-Max and uniform
              keys get μ (on SmolLM2-135M it lowered the mean KL of every such preset, e.g.
              ``tqkern_k5v3`` ΔPPL +3.54% → +2.80%); FP8 keys get none (``turboquant_k8v4``:
              +0.65% → +1.33% with μ, mean KL unchanged) and raw keys none (nothing to gain).
              μ is calibrated (:func:`calibrate`) on ``calibration`` if given, else on the first
              2,048 tokens of tqkern's default calibration text
              (:func:`tqkern_torch.calibration.default_calibration_text`) with ``tokenizer`` or
              the tokenizer saved beside the model's weights (``model.name_or_path``, local files
              only). With neither, each :class:`TQCache` estimates μ from its first prefill
              (as ``"prefill"``): no tokenizer needed, no warning. No calibration pass runs
              where no layer gets μ.
            * ``"prefill"``: μ = the mean key of each cache's first prefill, per layer and head,
              for every layer (whatever its codec).
            * ``None``: no μ; keys are stored as they are.
            * one ``[num_kv_heads, head_dim]`` array (or ``None``) per layer: used as given
              (e.g. :func:`calibrate`, :func:`load_key_offsets`).

            A layer that quantizes its keys (any codec but raw) without μ warns
            (:class:`KeyOffsetWarning`) at the first prefill of a model whose key means are large
            against its key norms; under ``"auto"`` that can only be an FP8 layer.
        calibration: with ``key_offset="auto"``: ``input_ids [batch, seq]``, a list of token ids,
            or a string / list of strings (then ``tokenizer`` is required). It supplies the text
            only: which layers get μ is still decided by their key codec.
        tokenizer: turns ``calibration`` strings, or the default text, into token ids.
        formats: per-layer overrides, e.g. ``{0: "fp16", -1: "fp16"}`` (boundary layers).
        block_size: tokens per cache block (a power of two).

    Returns the :class:`TQInstall` (``.key_offset_sources`` says per layer where μ came from,
    ``.save(path)`` keeps it); generate with ``past_key_values=TQCache(model)``. Installing again replaces the
    parameters and keeps the implementation to restore.

    Raises:
        ValueError: ``key_offset`` is an unknown string or arrays of the wrong shape or count;
            ``calibration`` is given with a ``key_offset`` other than ``"auto"``; strings without
            a tokenizer.
    """
    _register()
    plain = layer_params(model, format, formats=formats)  # validates the formats before any calibration pass
    offsets, sources = resolve_key_offset(model, key_offset, calibration, tokenizer, [p.format for p in plain])
    params = layer_params(model, format, key_offset=offsets, formats=formats)
    PagedLayout(format=params[0].format, num_kv_heads=1, block_size=block_size)  # validates block_size
    previous = getattr(model, _ATTR).previous if hasattr(model, _ATTR) else model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    spec = TQInstall(params=params, block_size=block_size, previous=previous, key_offset_sources=sources)
    setattr(model, _ATTR, spec)
    return spec


def uninstall(model) -> None:
    """Restore the attention implementation ``model`` had before :func:`install` and drop the
    attached parameters."""
    spec = getattr(model, _ATTR, None)
    if spec is None:
        raise ValueError("model has no tqkern install to undo")
    model.set_attn_implementation(spec.previous)
    delattr(model, _ATTR)
