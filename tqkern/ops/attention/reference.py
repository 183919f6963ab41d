"""Dense softmax attention: the NumPy oracle and normative spec of ``attention``.

``attention(q, k, v, *, scale=None, causal=False, mask=None, window_left=None,
logit_softcap=None, sinks=None, return_lse=False)`` with

    q     [Tq, Hq, D]   any NumPy float dtype (float16/32/64), converted exactly to float64
    k, v  [Tk, Hkv, D]  the same
    sinks [Hq]          float, optional
    out   [Tq, Hq, D]   float64;   lse [Tq, Hq] float64 with ``return_lse``

Grouped-query attention: ``Hq % Hkv == 0``; with ``group = Hq // Hkv`` query head h reads KV
head ``g(h) = h // group`` (consecutive query heads share a KV head, as in vLLM and HF).

Maths, for every query head h and query row i, all in float64:

    a_ij  = scale · Σ_d q[i, h, d] · k[j, g(h), d]
    a_ij  = c · tanh(a_ij / c)       with ``logit_softcap = c`` (Gemma-2; applied before the mask)
    s_ij  = a_ij + mask[h, i, j]
    s_ij  = −inf                     where causal and j > P_i,  or  j < P_i − window_left
    m_i   = max(max_j s_ij, σ_h)     (σ_h = sinks[h]; −inf without sinks)
    p_ij  = exp(s_ij − m_i)          (the stable softmax: the largest term is exp(0) = 1)
    Z_i   = Σ_j p_ij + exp(σ_h − m_i)
    out[i, h] = (Σ_j p_ij · v[j, g(h)]) / Z_i
    lse[i, h] = m_i + log Z_i        (natural log of Σ_j exp(s_ij) + exp(σ_h))

with ``P_i = Tk − Tq + i`` the position of query row i in the key sequence.

- ``scale`` defaults to ``1/√D``; a given scale must be a finite real number.
- ``causal`` is aligned to the bottom-right corner: query row i sits at position
  ``Tk − Tq + i`` of the key sequence and sees keys ``0 .. Tk − Tq + i``. With ``Tq == Tk`` this
  is the usual lower triangle; with ``Tq < Tk`` the queries are the *last* Tq tokens of a
  sequence whose first ``Tk − Tq`` tokens are a cached prefix (chunked prefill, decode).
- ``mask`` is an additive float array broadcastable to ``[Hq, Tq, Tk]``; ``−inf`` masks a key
  out; NaN and ``+inf`` are rejected.
- ``window_left = W`` (an int ≥ 0, sliding-window layers): query row i sees only keys
  ``P_i − W .. P_i`` on its left (W + 1 positions with its own); independent of ``causal``,
  which masks the right side.
- ``sinks`` (GPT-OSS attention sinks): one finite logit per query head that joins every row's
  softmax denominator and attends to nothing (a key of score σ_h and value 0).
- ``lse`` is the log of the row's whole normaliser, sink included, so that
  ``out = Σ_j exp(s_ij − lse) v_j``: two partial results over disjoint key sets merge exactly as
  ``L = logaddexp(lse_1, lse_2)``, ``out = exp(lse_1 − L)·out_1 + exp(lse_2 − L)·out_2`` (give
  the sinks to one of them only).
- A row in which every key is masked (``Tk == 0``; every mask entry −inf; with ``causal`` and
  ``Tq > Tk`` the first ``Tq − Tk`` rows) has no softmax: its output is **zeros**, never NaN, and
  its ``lse`` is ``−inf`` (``σ_h`` with sinks, which leave such a row's output zero too). Kernels
  must write the same.
- Non-finite inputs are not rejected and propagate: a NaN or ±inf in q makes the rows of
  that query head NaN (even where every key is masked); in k or v, every row that sees that
  token (an ±inf score that is the row's maximum gives inf − inf = NaN). The compressed paths
  never see a non-finite key or value: ``store`` writes such vectors as zeros
  (``docs/layout.md``, "Non-finite and out-of-range values").

Bad arguments raise ``TypeError`` (not a float array, scale not a real number) or ``ValueError``
(shapes, head counts, mask values) naming the argument, the expected and the actual value.

:func:`softmax_attend` (the softmax and P·V step on precomputed scores) and
:func:`causal_visible` are the shared building blocks of the paged oracles.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np
from einops import repeat

__all__ = ["attention", "softmax_attend", "causal_visible", "window_visible", "softcap", "check_options",
           "Options", "resolve_scale"]


def _float_array(name: str, x) -> np.ndarray:
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name} must be a float array (float16/float32/float64), got {a.dtype}")
    return a.astype(np.float64)


def resolve_scale(scale, head_dim: int) -> float:
    """``scale`` as a float, or ``1/√head_dim`` when it is ``None``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return float(scale)


def causal_visible(tq: int, tk: int) -> np.ndarray:
    """bool ``[tq, tk]``: True where query row i may see key j, i.e. ``j ≤ tk − tq + i``."""
    return np.arange(tk)[None, :] <= (tk - tq + np.arange(tq))[:, None]


def softmax_attend(scores: np.ndarray, v: np.ndarray, *, sinks: np.ndarray | None = None,
                   return_lse: bool = False):
    """Softmax over keys (with the sinks in the denominator), then P·V: the module's last lines.

    Args:
        scores: float64 ``[Hq, Tq, Tk]``, masked entries already ``−inf``.
        v: float64 ``[Tk, Hkv, D]`` with ``Hq % Hkv == 0``.
        sinks: float64 ``[Hq]`` or ``None``.
        return_lse: also return the natural-log normaliser ``[Tq, Hq]``.

    Returns:
        float64 ``[Tq, Hq, D]`` (rows with every score ``−inf`` are zeros), and ``lse`` with
        ``return_lse``.
    """
    hq, tq, tk = scores.shape
    hkv = v.shape[1]
    m = np.max(scores, axis=-1, keepdims=True) if tk else np.full((hq, tq, 1), -np.inf)
    sink = None if sinks is None else np.asarray(sinks, np.float64)[:, None, None]  # [Hq, 1, 1]
    if sink is not None:
        m = np.maximum(m, sink)  # (NaN rows stay NaN: np.maximum propagates it)
    live = m != -np.inf  # [Hq, Tq, 1]: the row has a visible key or a sink (NaN rows stay live: NaN out)
    with np.errstate(invalid="ignore"):
        p = np.exp(scores - np.where(live, m, 0.0))  # masked entries: exp(−inf) = 0
    denom = np.sum(p, axis=-1, keepdims=True)
    if sink is not None:
        with np.errstate(invalid="ignore"):
            denom = denom + np.exp(sink - np.where(live, m, 0.0))
    # GQA: query head h = kv·group + g reads KV head kv = h // group. A contiguous copy, as
    # np.repeat made (einops returns a strided view when group == 1), so the matmul is given
    # the same operands and its float64 sums stay bit-identical.
    vg = np.ascontiguousarray(repeat(v, "tk hkv d -> (hkv g) tk d", g=hq // hkv))  # [Hq, Tk, D]
    with np.errstate(invalid="ignore"):
        num = p @ vg  # [Hq, Tq, D]
        out = np.divide(num, denom, out=np.zeros_like(num), where=live).transpose(1, 0, 2)
    if not return_lse:
        return out
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(live, m + np.log(denom), -np.inf)[..., 0].T  # [Tq, Hq]
    return out, lse


def attention(q, k, v, *, scale=None, causal: bool = False, mask=None, window_left=None, logit_softcap=None,
              sinks=None, return_lse: bool = False):
    """Dense attention ``softmax(scale·q·kᵀ + mask)·v`` with GQA (module docstring has the maths).

    Args:
        q: float ``[Tq, Hq, D]``.
        k: float ``[Tk, Hkv, D]``.
        v: float ``[Tk, Hkv, D]``.
        scale: score multiplier, default ``1/√D``.
        causal: mask keys after each query's position, bottom-right aligned.
        mask: additive float array broadcastable to ``[Hq, Tq, Tk]`` (−inf allowed) or ``None``.
        window_left: keys more than this many positions left of the query are masked, or ``None``.
        logit_softcap: ``c > 0`` caps the scaled logits as ``c·tanh(a/c)``, or ``None``.
        sinks: float ``[Hq]`` per-head sink logits, or ``None``.
        return_lse: also return ``lse`` float64 ``[Tq, Hq]``.

    Returns:
        float64 ``[Tq, Hq, D]``, or ``(out, lse)`` with ``return_lse``.
    """
    q, k, v = _float_array("q", q), _float_array("k", k), _float_array("v", v)
    if q.ndim != 3:
        raise ValueError(f"q must have shape [Tq, Hq, D], got {q.shape}")
    tq, hq, d = q.shape
    for name, t in (("k", k), ("v", v)):
        if t.ndim != 3 or t.shape[-1] != d:
            raise ValueError(f"{name} must have shape [Tk, Hkv, {d}], got {t.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {k.shape}, got {v.shape}")
    tk, hkv = k.shape[:2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q.shape[1] (Hq) must be a multiple of k.shape[1] (Hkv) = {hkv}, got {hq}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    sc = resolve_scale(scale, d)
    opts = check_options(window_left, logit_softcap, sinks, hq)
    # GQA, group = Hq // Hkv: query head h = kv·group + g reads KV head kv (copy: see softmax_attend).
    kg = np.ascontiguousarray(repeat(k, "tk hkv d -> (hkv g) tk d", g=hq // hkv))  # [Hq, Tk, D]
    with np.errstate(invalid="ignore"):  # (inf · 0 in a non-finite query row: NaN, as specified)
        scores = sc * (q.transpose(1, 0, 2) @ kg.transpose(0, 2, 1))  # [Hq, Tq, Tk]
    scores = softcap(scores, opts.logit_softcap)
    if mask is not None:
        mk = _float_array("mask", mask)
        try:
            shape = np.broadcast_shapes(mk.shape, (hq, tq, tk))
        except ValueError:
            shape = None
        if shape != (hq, tq, tk):
            raise ValueError(f"mask must be broadcastable to [Hq, Tq, Tk] = {(hq, tq, tk)}, got {mk.shape}")
        if np.any(np.isnan(mk)) or np.any(mk == np.inf):
            raise ValueError("mask must hold finite values or -inf, got NaN or +inf")
        scores = scores + mk
    if causal:
        scores = np.where(causal_visible(tq, tk)[None], scores, -np.inf)
    if opts.window_left is not None:
        scores = np.where(window_visible(tq, tk, opts.window_left)[None], scores, -np.inf)
    return softmax_attend(scores, v, sinks=opts.sinks, return_lse=return_lse)


class Options(NamedTuple):
    """The validated attention options shared by the dense and paged oracles."""

    window_left: int | None
    logit_softcap: float | None
    sinks: np.ndarray | None


def check_options(window_left, logit_softcap, sinks, num_q_heads: int) -> Options:
    """Validate ``window_left`` (int ≥ 0 or None), ``logit_softcap`` (finite real > 0 or None) and
    ``sinks`` (finite float ``[num_q_heads]`` or None), each error naming the argument."""
    if window_left is not None and (isinstance(window_left, bool) or not isinstance(window_left, numbers.Integral)
                                    or window_left < 0):
        raise ValueError(f"window_left must be None or an int >= 0, got {window_left!r}")
    if logit_softcap is not None:
        if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, numbers.Real):
            raise TypeError(f"logit_softcap must be a real number or None, got {type(logit_softcap).__name__}")
        if not (math.isfinite(float(logit_softcap)) and logit_softcap > 0):
            raise ValueError(f"logit_softcap must be finite and > 0, got {logit_softcap!r}")
        logit_softcap = float(logit_softcap)
    if sinks is not None:
        sinks = _float_array("sinks", sinks)
        if sinks.shape != (num_q_heads,):
            raise ValueError(f"sinks must have shape [{num_q_heads}] (num_q_heads), got {list(sinks.shape)}")
        if not np.all(np.isfinite(sinks)):
            raise ValueError("sinks must be finite")
    return Options(None if window_left is None else int(window_left), logit_softcap, sinks)


def softcap(scores: np.ndarray, c: float | None) -> np.ndarray:
    """``c·tanh(scores / c)`` (−inf stays −inf), or the scores unchanged when ``c`` is None."""
    return scores if c is None else c * np.tanh(scores / c)


def window_visible(tq: int, tk: int, window_left: int) -> np.ndarray:
    """bool ``[tq, tk]``: True where key j is at most ``window_left`` positions left of query row
    i's position ``tk − tq + i`` (keys to its right are left to ``causal``)."""
    return np.arange(tk)[None, :] >= (tk - tq + np.arange(tq))[:, None] - window_left
