"""Hugging Face ``transformers`` integration (``transformers>=5.17,<6``): a compressed KV cache
for ``model.generate``.

Usage::

    import tqkern_torch.transformers as tqt

    # μ (per-layer key offsets) calibrated on tqkern's default text with the model's tokenizer
    tqt.install(model, tokenizer=tok, formats={0: "fp16", -1: "fp16"})  # DEFAULT_FORMAT elsewhere
    out = model.generate(ids, past_key_values=tqt.TQCache(model), max_new_tokens=32)
    tqt.uninstall(model)                                  # the previous attention, exactly

Pieces:

* :class:`TQCache`, a ``transformers.Cache`` with one :class:`TQCacheLayer` per decoder layer.
  A layer keeps its keys and values compressed in a paged cache of its own
  :class:`~tqkern.PagedLayout` (one paged sequence per batch row, growing by blocks) and writes
  through :func:`tqkern_torch.store`. transformers 5.17 has no registry through which
  ``generate`` would build a custom cache class (``cache_implementation`` only names built-in
  caches), so the cache is passed as ``past_key_values``.
* :func:`attention_forward`, registered as ``AttentionInterface["tqkern"]``, with
  :func:`~tqkern_torch.hf_prefill.causal_mask` as ``AttentionMaskInterface["tqkern"]``: for a
  prefill under a plain or sliding-window causal mask it builds no dense mask, only a
  :class:`~tqkern_torch.hf_prefill.CausalMask` (padding and offsets). Prefill (more than one new
  token): on CUDA (``TQCache(prefill="auto")``) :func:`tqkern_torch.prefill` over the compressed
  cache when the mask is causal with left padding only (rows re-paged from their first real token
  first, an exact byte copy); otherwise (CPU, soft-capping with μ, other masks) the whole
  sequence is read back with :func:`tqkern_torch.decompress_sequences` (``rotate_back=True``) and
  attended with torch SDPA and the dense mask. Decode (one new token):
  :func:`tqkern_torch.paged_decode`, with the layer's ``sliding_window`` (``window_left``) and
  logit soft-cap, when the model's mask is ``None`` or masks exactly a prefix of each row (left
  padding, and a sliding window's keys before it); otherwise (soft-capping with μ, a window with
  an exact prefix, other masks) the decompress + dense path with the mask (``paged_decode`` has
  no mask). ``paged_decode`` has no per-row start either: at
  the first padded decode step (or the prefill, on the kernel path) the cache re-pages each row
  from its first real token (an exact byte copy, once per layer), so the padded positions are
  then gone.
* :func:`install` / :func:`uninstall` and :func:`calibrate` (μ: the mean key after RoPE, i.e. what
  the cache stores, per layer and KV head; ``TQParams.key_offset``; :mod:`tqkern_torch.calibration`).
  By default a layer gets μ where its key codec gains from it (Lloyd-Max and uniform keys, not
  FP8 or raw: :func:`~tqkern_torch.calibration.key_offset_by_default`).

Attention through the stored cache sees the *reconstructed* keys and values everywhere (the
current chunk included), so prefill and decode attend the same K/V. K/V are stored from float16
(bfloat16 for a bfloat16 model): a float32 model's K/V are rounded to float16 first. With a
cache other than :class:`TQCache` (e.g. transformers' default ``DynamicCache``) the ``"tqkern"``
attention is plain dense attention over the uncompressed K/V.

``TQCache(model, max_cache_len=N)`` is the compileable variant (:class:`TQStaticCacheLayer`):
fixed capacity, static tensor addresses, decode steps that change no Python state, left padding
dropped at the prefill, every decode step through ``paged_decode`` (sliding windows as
``window_left``, soft-capping as ``logit_softcap``; with ``exact_prefix`` corrected through the
log-sum-exp from tensors made at the first prefill). ``generate`` then compiles the decode step
(``torch.compile``, by default ``mode="reduce-overhead"``: CUDA graphs on a GPU). Not supported
yet: beam search (``reorder_cache``), cache cropping (assisted decoding), linear-attention layer
types.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import numpy as np
import torch
import transformers

from tqkern.layouts import KVFormat, PagedLayout
from tqkern.params import TQParams
from tqkern_torch.attention import paged_decode
from tqkern_torch.calibration import (KeyOffsetWarning, calibrate, load_key_offsets, resolve_key_offset,
                                      save_key_offsets)
from tqkern_torch.hf_prefill import CausalMask, causal_mask, prefill_attention
from tqkern_torch.kv_cache import (_ATTR, _TAG, ATTN_IMPLEMENTATION, _allowed, TQCache, TQCacheLayer, _geometry,
                                   _text_config, prefix_starts)
from tqkern_torch.static_cache import TQStaticCacheLayer

__all__ = ["ATTN_IMPLEMENTATION", "DEFAULT_FORMAT", "KeyOffsetWarning", "TQCache", "TQCacheLayer", "TQInstall",
           "TQStaticCacheLayer", "attention_forward", "calibrate", "install", "layer_params", "load_key_offsets",
           "uninstall"]

FormatSpec = Union[str, KVFormat]

#: The format :func:`install` and :func:`layer_params` use when given none: 5-bit keys, 4-bit
#: values (Lloyd-Max codes, float16 norms; 76 bytes per token and KV head at head_dim 64, 148 at
#: 128). Measured with ``tqkern eval`` on SmolLM2-135M with μ (``docs/quality.md``): ΔPPL +0.83%
#: and +1.10% on the two halves of the text (windows 0–23, 24–47), where ``tqkern_k5v3`` (72 / 136
#: bytes, the default until session 29) read +3.02% and +4.00%: above issue 24's +3% line.
DEFAULT_FORMAT = "k5v4h"


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
            no μ: :func:`~tqkern_torch.calibration.key_offset_by_default`), ``"off (soft-capping)"``
            (``"auto"`` on a model that soft-caps its logits).
        device_copies: ``(params, device) → DeviceParams``, filled by the model's caches at their
            first update: every :class:`TQCache` of this install reads one device copy of each
            layer's tables (made once, kept as long as the install).
    """

    params: tuple[TQParams, ...]
    block_size: int
    previous: Optional[str]
    key_offset_sources: tuple[str, ...] = ()
    device_copies: dict = field(default_factory=dict, repr=False, compare=False)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write :attr:`params` (formats, rotations, codebooks, μ) to ``path``; reinstall with
        ``install(model, fmt, key_offset=load_key_offsets(path))`` or read them back with
        :func:`tqkern.params.load_params`."""
        save_key_offsets(path, self.params)


def layer_params(model_or_config, format: FormatSpec = DEFAULT_FORMAT, *, key_offset=None,
                 formats: Optional[Mapping[int, FormatSpec]] = None) -> tuple[TQParams, ...]:
    """One :class:`~tqkern.TQParams` per decoder layer: ``formats[i]`` (negative indices count
    from the last layer) or ``format``, with ``TQParams.default`` and ``key_offset[i]`` (a
    ``[num_kv_heads, head_dim]`` array per layer, e.g. from :func:`calibrate`, or ``None`` for a
    layer without μ) when given."""
    num_layers, kv_heads, head_dim = _geometry(_text_config(model_or_config))
    per_layer: dict[int, FormatSpec] = {}
    if formats is not None and not isinstance(formats, Mapping):
        raise TypeError(f"formats must be a mapping of layer index to format, got {type(formats).__name__}")
    for idx, spec in (formats or {}).items():
        if isinstance(idx, bool) or not isinstance(idx, int) or not -num_layers <= idx < num_layers:
            raise ValueError(f"formats keys must be layer indices in [{-num_layers}, {num_layers}), got {idx!r}")
        per_layer[idx % num_layers] = spec
    if key_offset is not None and (not isinstance(key_offset, (list, tuple, np.ndarray)) or len(key_offset) != num_layers):
        got = len(key_offset) if isinstance(key_offset, (list, tuple, np.ndarray)) else type(key_offset).__name__
        raise ValueError(f"key_offset must hold one [num_kv_heads, head_dim] array per layer ({num_layers}), "
                         f"got {got}")
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


def _first_chunk_padding(mask, length: int) -> Optional[torch.Tensor]:
    """Each row's left padding among the first ``length`` positions under ``mask`` (a
    :class:`CausalMask` without building it, a 4D mask, or None: no padding)."""
    if mask is None:
        return None
    if isinstance(mask, CausalMask):
        padding = mask.left_padding(length)
        starts = None if padding is None else padding[0]
    else:
        starts = prefix_starts(_allowed(mask)[..., :length].any(dim=(1, 2)))
    if starts is None:
        raise ValueError("TQCache(exact_prefix=...) needs the first chunk's mask to pad rows on the left only")
    return starts


def _static_decode(layer: TQStaticCacheLayer, query, key, value, scale: float, window: Optional[int],
                   softcap: Optional[float]) -> torch.Tensor:
    """A :class:`TQStaticCacheLayer`'s decode step (tensor work only: torch.compile, CUDA graphs):
    ``paged_decode`` with the window and soft-cap, the exact prefix's correction after it."""
    b, hq, _, d = query.shape
    exact = layer.exact
    if exact is not None and exact.k is None:  # a one-token first chunk (eager): nothing to drop, keep it
        exact.capture(key, value, None, layer.store_dtype)
        layer.dropped = True
        exact.freeze(layer)
    q = query[:, :, 0, :].to(layer.store_dtype).contiguous()
    window_left = None if window is None else window - 1
    out = paged_decode(q, layer.pool, layer.block_table, layer.seq_lens, layer.layout, layer.device_params,
                       scale=scale, window_left=window_left, logit_softcap=softcap, return_lse=exact is not None)
    if exact is not None:  # the query at paged position seq_lens − 1, after every prefix token
        q_pos = None if window_left is None else (layer.seq_lens - 1).long()[:, None]
        out = exact.correct(layer, q[:, :, None], out[0][:, None], out[1][:, None], scale, q_pos,
                            window_left=window_left, logit_softcap=softcap)[:, 0]
    return out.to(query.dtype).reshape(b, 1, hq, d)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling: Optional[float] = None,
                      softcap: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The ``"tqkern"`` attention implementation (transformers' ``AttentionInterface`` signature).

    ``query [B, Hq, Tq, D]``; ``key, value`` as :meth:`TQCacheLayer.update` returned them (or
    plain ``[B, Hkv, Tk, D]`` K/V from another cache); ``attention_mask`` a 4D mask, ``None`` or
    a :class:`~tqkern_torch.hf_prefill.CausalMask` (from the ``"tqkern"`` mask entry). Returns
    ``([B, Tq, Hq, D], None)``. Over a :class:`TQCache`: a prefill runs ``prefill``
    (:func:`~tqkern_torch.hf_prefill.prefill_attention`) where the layer's
    :meth:`~TQCacheLayer.prefill_kernels` allow it and the mask is causal with left padding only;
    a decode step runs ``paged_decode`` (with the layer's ``sliding_window`` and soft-cap) when
    the mask is ``None`` or left padding plus that window (:meth:`TQCacheLayer.paged_rows`), unless
    the layer soft-caps with a key offset μ or has both a window and an exact prefix; everything
    else the dense path over the decompressed cache with the mask (which carries any window).
    Inference only (``dropout`` must be 0)."""
    if dropout:
        raise NotImplementedError("tqkern attention is inference-only: dropout must be 0")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    layer = getattr(key, _TAG, None)
    window = kwargs.get("sliding_window")
    b, hq, tq, d = query.shape
    if isinstance(layer, TQStaticCacheLayer) and tq == 1:  # a compileable decode step: the paged kernel, no mask
        return _static_decode(layer, query, key, value, scale, window, softcap), None
    if layer is not None and layer.exact is not None and layer.exact.k is None:  # the first chunk: keep N tokens
        layer.exact.capture(key, value, _first_chunk_padding(attention_mask, layer.seq_len), layer.store_dtype)
    if layer is not None and tq > 1:  # a prefill or a chunk
        out = None
        if isinstance(attention_mask, CausalMask) and layer.prefill_kernels():
            out = prefill_attention(layer, query, attention_mask, scale, softcap)
        if out is None:
            mask = attention_mask.dense() if isinstance(attention_mask, CausalMask) else attention_mask
            k, v = layer.dense()
            if layer.exact is not None:
                k, v = layer.exact.patch(k, v)
            out = _dense_attention(query, k, v, mask, scale, softcap)
            if isinstance(layer, TQStaticCacheLayer):  # decode steps read no mask: drop the left padding now
                layer.drop_padding(mask, window is not None)
        if isinstance(layer, TQStaticCacheLayer) and layer.exact is not None and layer.exact.k_pos is None:
            layer.exact.freeze(layer)  # the rows re-paged: what the compiled decode steps read, made now
        return out, None
    if isinstance(attention_mask, CausalMask):
        attention_mask = attention_mask.dense()
    if layer is not None:
        if attention_mask is None and layer.start_max:
            raise RuntimeError("attention_mask is None but TQCache dropped left padding: pass the padded mask")
        exact = layer.exact
        if (softcap is None or layer.mu is None) and (exact is None or window is None) and (
                attention_mask is None or layer.paged_rows(attention_mask, window)):
            q = query[:, :, 0, :].to(layer.store_dtype).contiguous()
            out = paged_decode(q, layer.pool, layer.block_table, layer.seq_lens, layer.layout,
                               layer.device_params, scale=scale, window_left=None if window is None else window - 1,
                               logit_softcap=softcap, return_lse=exact is not None)
            if exact is not None:
                out = exact.correct(layer, q[:, :, None], out[0][:, None], out[1][:, None], scale,
                                    logit_softcap=softcap)[:, 0]
            return out.to(query.dtype).reshape(b, 1, hq, d), None
        key, value = layer.dense()
        if exact is not None:
            key, value = exact.patch(key, value)
    return _dense_attention(query, key, value, attention_mask, scale, softcap), None


def _register() -> None:
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    transformers.AttentionMaskInterface.register(ATTN_IMPLEMENTATION, causal_mask)


def install(model, format: FormatSpec = DEFAULT_FORMAT, *, key_offset="auto", calibration=None, tokenizer=None,
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
              where no layer gets μ. A model that soft-caps its attention logits (Gemma-2) gets
              no μ (``"off (soft-capping)"``): its kernels would cap ``q·(k − μ)``.
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
