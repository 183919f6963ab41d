"""The key offset μ for the transformers integration (:mod:`tqkern_torch.transformers`).

μ is the mean key a model writes to its cache (after RoPE), per decoder layer and KV head; the
cache stores ``k − μ`` and adds μ back when it reads keys (``TQParams.key_offset``,
``docs/algorithms.md``). This module holds what :func:`~tqkern_torch.transformers.install` needs
to find μ by default:

* :func:`calibrate`: μ from a forward pass over a calibration text or token ids.
* :func:`default_calibration_text`: the text calibrated on when the caller gives none: the
  docstrings of :data:`CALIBRATION_MODULES` (Python standard-library modules), read from the
  running interpreter at run time (Python Software Foundation License; nothing is copied into
  tqkern). It is the calibration text of ``tqkern eval`` (``docs/quality.md`` measures it) and
  disjoint from eval's evaluation text.
* :func:`key_offset_by_default`: which key codecs ``key_offset="auto"`` gives μ (the per-format
  rule, with the measurements it rests on).
* :func:`key_mean_ratio` and :class:`KeyOffsetWarning`: the statistic that says whether μ
  matters for a model, and the warning raised when a compressed format runs without μ on a model
  where it does (:data:`KEY_MEAN_WARN_RATIO`).
* :func:`save_key_offsets` / :func:`load_key_offsets`: calibrate once, serve many times.
"""

from __future__ import annotations

import importlib
import inspect
import os
import warnings
from typing import Optional, Sequence, Union

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from tqkern.layouts import KVFormat
from tqkern.params import TQParams, load_params, save_params

__all__ = ["CALIBRATION_MODULES", "CALIBRATION_TOKENS", "KEY_MEAN_MIN_TOKENS", "KEY_MEAN_WARN_RATIO",
           "KEY_OFFSET_KINDS", "KeyOffsetWarning", "calibrate", "default_calibration_text", "key_mean_ratio",
           "key_mean_ratios", "key_offset_by_default", "load_key_offsets", "resolve_key_offset",
           "save_key_offsets", "stdlib_text", "warn_key_mean"]

CALIBRATION_MODULES = ("string", "textwrap", "shutil", "tempfile", "heapq", "bisect", "csv", "glob")
"""Standard-library modules whose docstrings make the default calibration text."""

CALIBRATION_TOKENS = 2048
"""Tokens of the default calibration text used (its first ones; one sequence)."""

KEY_MEAN_WARN_RATIO = 0.9
"""Threshold of :func:`key_mean_ratio` (max over layers and KV heads) above which a compressed
format installed without μ warns. r = ‖mean k‖ / RMS ‖k‖, so without μ a codec spends its
error on ‖k‖ while only ‖k − μ‖ = √(1 − r²)·RMS‖k‖ varies between tokens: at r = 0.9 the error
relative to that part is 2.3× what it is with μ. Measured (``docs/quality.md``): SmolLM2-135M has
r ≤ 0.85 (median 0.74) over its 90 heads and loses +1–8% perplexity without μ on 4-bit keys (μ
still helps there, so μ is the default for those codecs: :func:`key_offset_by_default`); a tiny
random Qwen2 whose key biases sit in the slowly rotating RoPE pairs has r ≈ 1. The argument holds
for FP8 keys too (their rounding error is relative to each element of k), so FP8 layers that
``key_offset="auto"`` leaves without μ are checked like any other."""

KEY_OFFSET_KINDS = ("lloyd_max", "uniform")
"""Key codec kinds that ``install(key_offset="auto")`` gives μ: :func:`key_offset_by_default`."""

KEY_MEAN_MIN_TOKENS = 32
"""A prefill shorter than this (tokens × batch rows) is not checked for :class:`KeyOffsetWarning`."""


class KeyOffsetWarning(UserWarning):
    """A compressed format runs without the key offset μ on a model whose key means are large
    against its key norms (:func:`key_mean_ratio` above :data:`KEY_MEAN_WARN_RATIO`)."""


def key_offset_by_default(fmt: KVFormat) -> bool:
    """Whether ``install(key_offset="auto")`` gives a layer of format ``fmt`` the key offset μ:
    yes where its key codec's kind is in :data:`KEY_OFFSET_KINDS` (Lloyd-Max, uniform), no for
    FP8 and raw keys. An explicit ``key_offset`` (arrays, ``"prefill"``, ``None``) overrides it.

    The rule and what it rests on (SmolLM2-135M, 24 windows × 256 tokens, ``docs/quality.md``;
    paired: ΔPPL with μ minus without, bootstrapped over the same windows):

    * Lloyd-Max keys (rotated, a norm times a codebook direction; the error scales with ‖k‖):
      μ lowers the mean KL, ``turboquant_4bit_nc`` 0.0683 → 0.0531 (lower in 23 of 24 windows),
      ``tqkern_k5v3`` 0.0428 → 0.0380 (21 of 24), and ΔPPL +5.45% → +4.90% and +3.54% → +2.80%
      (paired differences −0.09 [−0.31, +0.12] and −0.12 [−0.28, +0.05] PPL: not resolved); at 8
      windows every Lloyd-Max preset's mean KL fell with μ.
    * Uniform keys (no preset has them; the error scales with the vector's max − min, which a
      per-dimension offset widens): 4-bit unrotated keys with 4-bit values, 8 windows only: mean
      KL 0.142 → 0.076 and ΔPPL +15.1% → +7.2% with μ (paired −1.41 [−1.94, −1.05] PPL; lower
      NLL in all 8 windows).
    * FP8 keys (``turboquant_k8v4``): μ leaves the mean KL as it was (0.0180 → 0.0178, lower in
      11 of 24 windows) and raises ΔPPL +0.65% → +1.33% (paired +0.11 [+0.02, +0.22] PPL; at 8
      windows: +1.10% → +1.09%, KL 0.0180 → 0.0173): no gain, so off.
    * Raw keys (``fp16``): nothing to gain; with μ the cache stores k − μ rounded to float16
      (mean KL 1e-6 at 8 windows): off.

    One model with moderate key means (r ≤ 0.85, :data:`KEY_MEAN_WARN_RATIO`); where r is larger
    an FP8 layer without μ warns (:class:`KeyOffsetWarning`) and μ can be given explicitly.
    """
    return fmt.key.kind in KEY_OFFSET_KINDS


def stdlib_text(modules: Sequence[str]) -> str:
    """The docstrings (``inspect.getdoc``) of each module and its public classes and functions,
    in a fixed order, separated by blank lines. Empty under ``python -OO`` (no docstrings)."""
    parts = []
    for name in modules:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == name:
                doc = inspect.getdoc(obj)
                if doc:
                    parts.append(f"{attr}: {doc}")
    return "\n\n".join(p for p in parts if p)


def default_calibration_text() -> str:
    """The default calibration text: :func:`stdlib_text` of :data:`CALIBRATION_MODULES`.

    Raises:
        RuntimeError: the interpreter has no docstrings (``python -OO``).
    """
    text = stdlib_text(CALIBRATION_MODULES)
    if len(text) < 1000:
        raise RuntimeError(f"the default calibration text needs the standard library's docstrings, got "
                           f"{len(text)} characters (python -OO?): pass calibration= to install")
    return text


def _batch(model, inputs, attention_mask, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` on the model's device from ids, a list of ids, or strings."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(s, str) for s in inputs):
        if tokenizer is None:
            raise ValueError("tokenizer must be given when inputs are strings")
        enc = tokenizer(list(inputs), return_tensors="pt", padding=True)
        inputs, attention_mask = enc["input_ids"], enc["attention_mask"]
    elif isinstance(inputs, (list, tuple)) and inputs and all(isinstance(t, int) for t in inputs):
        inputs = torch.tensor([list(inputs)], dtype=torch.long)
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2:
        raise ValueError(f"inputs must be input_ids [batch, seq], a list of token ids or a list of strings, "
                         f"got {type(inputs).__name__}")
    if not hasattr(model, "parameters"):
        raise TypeError(f"model must be a transformers model (a torch.nn.Module), got {type(model).__name__}")
    device = next(model.parameters()).device
    if attention_mask is None:
        attention_mask = torch.ones_like(inputs)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != inputs.shape:
        got = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a tensor of the inputs' shape {list(inputs.shape)}, got {got}")
    if not bool((attention_mask != 0).any()):
        raise ValueError("attention_mask must mark at least one token (1 = token), got only padding")
    return inputs.to(device), attention_mask.to(device)


@torch.no_grad()
def _key_moments(model, inputs, attention_mask, tokenizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: the mean key ``[H, D]`` and mean squared key norm ``[H]`` (float64) over every
    non-padded token, from one forward pass."""
    ids, mask = _batch(model, inputs, attention_mask, tokenizer)
    cache = DynamicCache()  # full layers: every token's key is kept, sliding layers included
    model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    w = mask.to(torch.float64)[:, None, :, None]  # [B, 1, S, 1]
    out = []
    for layer in cache.layers:
        keys = layer.keys.to(torch.float64)  # [B, H, S, D]
        mean = (keys * w).sum(dim=(0, 2)) / w.sum()
        sq = (keys.square() * w).sum(dim=(0, 2, 3)) / w.sum()
        out.append((mean, sq))
    return out


def calibrate(model, inputs, *, attention_mask: Optional[torch.Tensor] = None, tokenizer=None) -> list[np.ndarray]:
    """Per-layer key offsets μ: the mean key the model writes to its cache (after RoPE), over
    every non-padded token of the calibration batch, per KV head.

    Args:
        model: the model (any attention implementation; it runs one forward pass).
        inputs: ``input_ids [batch, seq]`` (long), a list of token ids (one sequence), or a string
            or list of strings with ``tokenizer``.
        attention_mask: ``[batch, seq]`` (1 = token, 0 = padding); default all ones.
        tokenizer: turns ``inputs`` strings into a padded batch.

    Returns:
        one float32 ``[num_kv_heads, head_dim]`` array per decoder layer, for
        ``install(key_offset=...)`` (``TQParams.with_key_offset``).
    """
    return [m.to(torch.float32).cpu().numpy() for m, _ in _key_moments(model, inputs, attention_mask, tokenizer)]


def key_mean_ratio(keys: torch.Tensor) -> torch.Tensor:
    """r = ‖mean k‖ / RMS ‖k‖ per KV head of ``keys [batch, num_kv_heads, seq, head_dim]`` (all
    positions count), float64 ``[num_kv_heads]`` in [0, 1].

    ‖mean k‖² is estimated without the bias of a finite sample (E‖k̄‖² = ‖μ‖² + tr Σ / n, with
    tr Σ from the sample variance, clamped at 0), so that a short prefill does not read r ≈ 1 (for
    one token the plain ratio is 1 whatever the model). Tokens are correlated, so a prefill of a
    few tokens still reads noisy values: :class:`~tqkern_torch.transformers.TQCache` checks only
    prefills of at least ``KEY_MEAN_MIN_TOKENS`` tokens."""
    k = keys.to(torch.float64).transpose(0, 1).reshape(keys.shape[1], -1, keys.shape[-1])  # [H, n, D]
    n = k.shape[1]
    mean = k.mean(dim=1)
    ms = k.square().sum(dim=-1).mean(dim=1)  # [H]
    m2 = mean.square().sum(dim=-1)
    if n > 1:
        m2 = (m2 - (ms - m2) / (n - 1)).clamp(min=0)  # tr Σ ≈ n/(n−1)·(ms − ‖k̄‖²), divided by n
    return (m2 / ms.clamp(min=1e-300)).sqrt()


def warn_key_mean(params: TQParams, key_states: torch.Tensor, layer_idx: int) -> bool:
    """Raise a :class:`KeyOffsetWarning` (and return True) if ``params`` quantize keys without μ
    and ``key_states [batch, num_kv_heads, tokens, head_dim]`` (at least
    :data:`KEY_MEAN_MIN_TOKENS` tokens × rows) have :func:`key_mean_ratio` above
    :data:`KEY_MEAN_WARN_RATIO` for some head."""
    if (params.key_offset is not None or params.format.key.kind == "raw"
            or key_states.shape[0] * key_states.shape[2] < KEY_MEAN_MIN_TOKENS):
        return False
    r = float(key_mean_ratio(key_states).max())
    if r <= KEY_MEAN_WARN_RATIO:
        return False
    fix = ("key_offset='auto' leaves these keys without mu (key_offset_by_default): install with "
           "key_offset='prefill' or calibrated arrays (calibrate)" if not key_offset_by_default(params.format)
           else "install with the default key_offset='auto' (and a tokenizer) or key_offset='prefill'")
    warnings.warn(f"layer {layer_idx} stores keys in {params.format.key.kind} without a key offset mu, but its "
                  f"keys' mean is large against their norms (||mean k|| / RMS ||k|| = {r:.2f} > "
                  f"{KEY_MEAN_WARN_RATIO}): quality suffers; {fix}", KeyOffsetWarning, stacklevel=4)
    return True


def save_key_offsets(path: Union[str, os.PathLike], params: Sequence[TQParams]) -> None:
    """Write per-layer parameters (μ included) to ``path``: :func:`tqkern.params.save_params`.
    ``TQInstall.save(path)`` calls this with what :func:`install` attached."""
    save_params(path, params)


def load_key_offsets(path: Union[str, os.PathLike]) -> list[Optional[np.ndarray]]:
    """The per-layer μ of a file written by :func:`save_key_offsets` (or ``TQInstall.save``), for
    ``install(model, fmt, key_offset=load_key_offsets(path))``: ``None`` for a layer saved
    without μ (e.g. an FP8 or fp16 layer under ``key_offset="auto"``), which then gets none."""
    return [None if p.key_offset is None else np.asarray(p.key_offset, dtype=np.float32) for p in load_params(path)]


def resolve_key_offset(model, key_offset, calibration, tokenizer,
                       formats: Sequence[KVFormat]) -> tuple[Optional[list], tuple[str, ...]]:
    """What :func:`~tqkern_torch.transformers.install` makes of its ``key_offset``,
    ``calibration`` and ``tokenizer`` arguments for layers of ``formats`` (one per layer):
    ``(per-layer μ or None, per-layer source)``.

    A source is ``"given"`` (an array passed in), ``"none"`` (``key_offset=None``, or a ``None``
    entry of the arrays), ``"calibration"`` (the caller's text or ids), ``"default text"``,
    ``"prefill"`` (estimated by each TQCache from its first prefill), or, with ``"auto"``, ``"off
    (<kind> keys)"`` for a layer whose key codec gets no μ by default (:func:`key_offset_by_default`)
    and ``"off (soft-capping)"`` for every layer of a model that soft-caps its attention logits
    (Gemma-2's ``attn_logit_softcapping``): the paged kernels attend the stored ``k − μ`` and
    drop ``q·μ``, which softmax ignores but the cap does not (the cap of ``q·(k − μ)`` is not that of
    ``q·k``), so μ there would be exact only on the dense path.
    ``"auto"`` runs no calibration pass where no layer gets μ."""
    auto = isinstance(key_offset, str) and key_offset == "auto"
    if calibration is not None and not auto:
        raise ValueError(f"calibration must be None unless key_offset is 'auto', got key_offset="
                         f"{key_offset if isinstance(key_offset, str) or key_offset is None else 'arrays'!r}")
    n = len(formats)
    if key_offset is None:
        return None, ("none",) * n
    if not isinstance(key_offset, str):
        if not isinstance(key_offset, (list, tuple, np.ndarray)):
            raise ValueError(f"key_offset must be 'auto', 'prefill', None or one [num_kv_heads, head_dim] array "
                             f"per layer, got {type(key_offset).__name__}")
        offsets = list(key_offset)
        return offsets, tuple("none" if m is None else "given" for m in offsets)
    if key_offset == "prefill":
        return None, ("prefill",) * n
    if not auto:
        raise ValueError(f"key_offset must be 'auto', 'prefill', None or one [num_kv_heads, head_dim] array "
                         f"per layer, got {key_offset!r}")
    capped = soft_capped(model)
    wanted = [key_offset_by_default(f) and not capped for f in formats]
    off = ["off (soft-capping)" if capped else f"off ({f.key.kind} keys)" for f in formats]
    mu, source = None, "prefill"
    if any(wanted) and calibration is not None:
        mu, source = calibrate(model, calibration, tokenizer=tokenizer), "calibration"
    elif any(wanted):
        tokenizer = tokenizer if tokenizer is not None else _local_tokenizer(model)
        if tokenizer is not None:
            ids = tokenizer(default_calibration_text(), add_special_tokens=False)["input_ids"][:CALIBRATION_TOKENS]
            mu, source = calibrate(model, torch.tensor([ids], dtype=torch.long)), "default text"
    sources = tuple(source if w else o for w, o in zip(wanted, off))
    return (None if mu is None else [m if w else None for m, w in zip(mu, wanted)]), sources


def soft_capped(model_or_config) -> bool:
    """Whether the model soft-caps its attention logits (a set ``attn_logit_softcapping``)."""
    config = getattr(model_or_config, "config", model_or_config)
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(config, "attn_logit_softcapping", None) is not None


def _local_tokenizer(model):
    """The tokenizer saved beside the model's weights (``model.name_or_path``, local files only),
    or None: a transformers model does not carry its tokenizer."""
    name = getattr(model, "name_or_path", "") or ""
    if not name:
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError, ImportError):
        return None


def key_mean_ratios(model, inputs, *, attention_mask: Optional[torch.Tensor] = None, tokenizer=None) -> np.ndarray:
    """``[num_layers, num_kv_heads]`` float64: ‖mean k‖ / RMS ‖k‖ per layer and KV head over the
    non-padded tokens of ``inputs`` (as :func:`calibrate` takes them; the plain ratio, for texts
    long enough that a sample mean's own spread does not matter)."""
    moments = _key_moments(model, inputs, attention_mask, tokenizer)
    return np.stack([(m.square().sum(dim=-1) / sq).sqrt().cpu().numpy() for m, sq in moments])
