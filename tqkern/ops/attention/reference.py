"""Dense softmax attention: the NumPy oracle and normative spec of ``attention``.

``attention(q, k, v, *, scale=None, causal=False, mask=None)`` with

    q     [Tq, Hq, D]   any NumPy float dtype (float16/32/64), converted exactly to float64
    k, v  [Tk, Hkv, D]  the same
    out   [Tq, Hq, D]   float64

Grouped-query attention: ``Hq % Hkv == 0``; with ``group = Hq // Hkv`` query head h reads KV
head ``g(h) = h // group`` (consecutive query heads share a KV head, as in vLLM and HF).

Maths, for every query head h and query row i, all in float64:

    s_ij  = scale · Σ_d q[i, h, d] · k[j, g(h), d]  +  mask[h, i, j]
    s_ij  = −inf                     where causal and j > Tk − Tq + i
    m_i   = max_j s_ij
    p_ij  = exp(s_ij − m_i)          (the stable softmax: the largest term is exp(0) = 1)
    out[i, h] = (Σ_j p_ij · v[j, g(h)]) / (Σ_j p_ij)

- ``scale`` defaults to ``1/√D``; a given scale must be a finite real number.
- ``causal`` is aligned to the bottom-right corner: query row i sits at position
  ``Tk − Tq + i`` of the key sequence and sees keys ``0 .. Tk − Tq + i``. With ``Tq == Tk`` this
  is the usual lower triangle; with ``Tq < Tk`` the queries are the *last* Tq tokens of a
  sequence whose first ``Tk − Tq`` tokens are a cached prefix (chunked prefill, decode).
- ``mask`` is an additive float array broadcastable to ``[Hq, Tq, Tk]``; ``−inf`` masks a key
  out; NaN and ``+inf`` are rejected.
- A row in which every key is masked (``Tk == 0``; every mask entry −inf; with ``causal`` and
  ``Tq > Tk`` the first ``Tq − Tk`` rows) has no softmax: its output is **zeros**, never NaN.
  Kernels must write the same zeros.
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

import numpy as np
from einops import repeat

__all__ = ["attention", "softmax_attend", "causal_visible", "resolve_scale"]


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


def softmax_attend(scores: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Softmax over keys, then P·V: the last two lines of the module's maths.

    Args:
        scores: float64 ``[Hq, Tq, Tk]``, masked entries already ``−inf``.
        v: float64 ``[Tk, Hkv, D]`` with ``Hq % Hkv == 0``.

    Returns:
        float64 ``[Tq, Hq, D]``; rows with every score ``−inf`` are zeros.
    """
    hq, tq, tk = scores.shape
    hkv, d = v.shape[1], v.shape[2]
    m = np.max(scores, axis=-1, keepdims=True) if tk else np.full((hq, tq, 1), -np.inf)
    live = m != -np.inf  # [Hq, Tq, 1]: the row has a visible key (NaN rows stay live: NaN out)
    with np.errstate(invalid="ignore"):
        p = np.exp(scores - np.where(live, m, 0.0))  # masked entries: exp(−inf) = 0
    denom = np.sum(p, axis=-1, keepdims=True)
    # GQA: query head h = kv·group + g reads KV head kv = h // group. A contiguous copy, as
    # np.repeat made (einops returns a strided view when group == 1), so the matmul is given
    # the same operands and its float64 sums stay bit-identical.
    vg = np.ascontiguousarray(repeat(v, "tk hkv d -> (hkv g) tk d", g=hq // hkv))  # [Hq, Tk, D]
    with np.errstate(invalid="ignore"):
        num = p @ vg  # [Hq, Tq, D]
        out = np.divide(num, denom, out=np.zeros_like(num), where=live)
    return out.transpose(1, 0, 2)


def attention(q, k, v, *, scale=None, causal: bool = False, mask=None) -> np.ndarray:
    """Dense attention ``softmax(scale·q·kᵀ + mask)·v`` with GQA (module docstring has the maths).

    Args:
        q: float ``[Tq, Hq, D]``.
        k: float ``[Tk, Hkv, D]``.
        v: float ``[Tk, Hkv, D]``.
        scale: score multiplier, default ``1/√D``.
        causal: mask keys after each query's position, bottom-right aligned.
        mask: additive float array broadcastable to ``[Hq, Tq, Tk]`` (−inf allowed) or ``None``.

    Returns:
        float64 ``[Tq, Hq, D]``.
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
    # GQA, group = Hq // Hkv: query head h = kv·group + g reads KV head kv (copy: see softmax_attend).
    kg = np.ascontiguousarray(repeat(k, "tk hkv d -> (hkv g) tk d", g=hq // hkv))  # [Hq, Tk, D]
    with np.errstate(invalid="ignore"):  # (inf · 0 in a non-finite query row: NaN, as specified)
        scores = sc * (q.transpose(1, 0, 2) @ kg.transpose(0, 2, 1))  # [Hq, Tq, Tk]
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
    return softmax_attend(scores, v)
