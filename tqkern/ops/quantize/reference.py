"""Per-vector quantization for every codec: the NumPy oracle and normative spec.

Inputs are vectors ``x [..., D]`` given as any float dtype and converted exactly to float64;
all arithmetic below is exact real arithmetic carried out in float64, and every rounding to a
stored type happens once, at the end, as stated. Where a kernel computes a quantity in lower
precision (the rotation), the oracle also reports which outputs sit within ``EPS`` of a decision
point (see :class:`Quantized`); only those may differ between a kernel and this oracle.

``LloydMax(bits, norm_dtype, norm_correction)`` with codebook c (ascending, boundaries β) and
rotation Π:
    n = ‖x‖₂; u = x / n (u = 0 when n = 0); y = u @ Π
    idx_j = #{i : β_i ≤ y_j}                      (a tie goes to the upper bucket)
    norm field = n                                 norm_correction "none" / "decode"
               = n / ‖c[idx]‖₂                     norm_correction "stored" (n if ‖c[idx]‖ = 0)
    rounded to norm_dtype (float16 saturating at 65504; float32 nearest-even).
    dequantize (rotated space): ŷ = f·c[idx]  with f the stored field, except "decode":
    ŷ = f·c[idx]/‖c[idx]‖₂. In original space: ŷ @ Πᵀ.
``Uniform(bits, param_dtype, rotated)``, on y = x (or x @ Π when rotated):
    lo = min_j y_j, hi = max_j y_j, scale = max((hi − lo)/(2^b − 1), 1e-8)
    q_j = clamp(⌊(y_j − lo)/scale + 1/2⌋, 0, 2^b − 1)   in exact arithmetic, a half rounding up:
          ⌊(y_j − lo)·(2^b − 1)/(hi − lo) + 1/2⌋ decided by exact float64 comparisons (see
          ``_uniform_codes``). vLLM evaluates it in float32 and can differ where the quotient
          lies within float32 rounding of a half.
    stored: scale and zero = lo, each rounded to param_dtype. The codes use the *unrounded*
    scale and lo (vLLM's order). dequantize: q·scale' + zero' with the rounded values.
``FP8(rotated)``: y = x (or x @ Π); stored E4M3FN(y) (nearest-even, saturating at ±448).
``Raw(dtype)``: stored round(x, dtype) (see :mod:`tqkern.numerics`).

Out-of-range and non-finite values: every stored float saturates at its dtype's largest finite
value (:mod:`tqkern.numerics`), and :attr:`Quantized.saturated` marks the vectors where that
happened (a stored norm, scale or zero, or any FP8/Raw element, beyond ±MAX before rounding).
This function takes finite inputs; ``compress`` replaces a non-finite vector by the zero vector
before it gets here (``docs/layout.md``, "Non-finite and out-of-range values").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tqkern.codebooks import Codebook
from tqkern.layouts import FP8, Codec, LloydMax, Raw, Uniform
from tqkern.numerics import exceeds, fp8_e4m3fn_decode, fp8_e4m3fn_encode, round_float, ties_within

__all__ = ["Quantized", "quantize", "dequantize", "EPS", "SCALE_FLOOR"]

EPS = 2.0**-16
"""Uncertainty window: a code or stored value computed from the rotated vector is *uncertain*
when moving that vector's entries by ``EPS`` (relative to ‖x‖) could change it. Kernels rotate in
float32, whose error is far below this (~1e-6 at D = 256)."""

SCALE_FLOOR = 1e-8


@dataclass
class Quantized:
    """The result of :func:`quantize` for vectors ``[..., D]``.

    Attributes:
        codes: uint8 ``[..., D]`` integer codes (LloydMax, Uniform), else ``None``.
        data: float64 ``[..., D]`` stored element values (FP8, Raw), else ``None``.
        params: stored per-vector floats (``"norm"``, or ``"scale"`` and ``"zero"``), float64
            ``[...]``, already rounded to their storage dtype.
        uncertain_codes: bool ``[..., D]``: this code (or element) may differ in a kernel.
        uncertain_params: name → bool ``[...]``: this stored float may differ in a kernel.
        saturated: bool ``[...]``: some stored float of this vector was saturated.
    """

    codes: np.ndarray | None
    data: np.ndarray | None
    params: dict[str, np.ndarray] = field(default_factory=dict)
    uncertain_codes: np.ndarray | None = None
    uncertain_params: dict[str, np.ndarray] = field(default_factory=dict)
    saturated: np.ndarray | None = None


def _codebook_for(codec: LloydMax, codebook: Codebook | None) -> Codebook:
    if not isinstance(codebook, Codebook):
        raise TypeError(f"codebook must be a Codebook for a LloydMax codec, got {type(codebook).__name__}")
    if codebook.bits != codec.bits:
        raise ValueError(f"codebook.bits must be {codec.bits}, got {codebook.bits}")
    return codebook


def _rotation_for(codec: Codec, rotation, d: int) -> np.ndarray | None:
    if not codec.rotated:
        return None
    if rotation is None:
        raise ValueError(f"rotation must be a [{d}, {d}] matrix for a rotated {codec.kind} codec, got None")
    r = np.asarray(rotation, dtype=np.float64)
    if r.shape != (d, d):
        raise ValueError(f"rotation must have shape ({d}, {d}), got {r.shape}")
    return r


def _uniform_codes(y: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits: int) -> np.ndarray:
    """⌊t + 1/2⌋ for t = (y − lo)·(2^b − 1)/(hi − lo), or t = (y − lo)/1e-8 when the scale is
    floored, decided exactly: an estimate moved by the exact float64 comparisons
    ``(q − 1/2)·den ≤ num < (q + 1/2)·den`` (the products are exact for fp16/bf16 inputs), so an
    exact half rounds up."""
    levels = (1 << bits) - 1
    span = (hi - lo)[..., None]
    floored = span / levels < SCALE_FLOOR
    d = y - lo[..., None]
    num = np.where(floored, d, d * levels)
    den = np.where(floored, SCALE_FLOOR, span)
    q = np.floor(num / den + 0.5)
    q = q - ((q - 0.5) * den > num) + ((q + 0.5) * den <= num)
    return np.clip(q, 0, levels).astype(np.uint8)


def quantize(x: np.ndarray, codec: Codec, *, rotation=None, codebook: Codebook | None = None) -> Quantized:
    """Quantize vectors ``x [..., D]`` with ``codec`` (module docstring has the maths).

    Args:
        x: float ``[..., D]``.
        codec: a ``LloydMax``, ``Uniform``, ``FP8`` or ``Raw`` codec.
        rotation: float64 ``[D, D]`` Π, required when ``codec.rotated``.
        codebook: the Lloyd-Max codebook, required for ``LloydMax``.
    """
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    rot = _rotation_for(codec, rotation, d)
    if isinstance(codec, LloydMax):
        cb = _codebook_for(codec, codebook)
        n = np.sqrt(np.sum(x * x, axis=-1))
        u = np.divide(x, n[..., None], out=np.zeros_like(x), where=n[..., None] > 0)
        y = u @ rot
        codes = cb.index(y)
        # A zero vector gives y = 0 exactly in any arithmetic: its codes are certain.
        unsure = (cb.index(y - EPS) != cb.index(y + EPS)) & (n[..., None] > 0)
        cnorm = np.sqrt(np.sum(cb.centroids[codes] ** 2, axis=-1))
        if codec.norm_correction == "stored":
            raw = n / np.where(cnorm > 0, cnorm, 1.0)
            unsure_p = np.any(unsure, axis=-1)
        else:
            raw = n
            unsure_p = np.zeros(n.shape, bool)
        return Quantized(codes=codes, data=None, params={"norm": round_float(raw, codec.norm_dtype)},
                         uncertain_codes=unsure, uncertain_params={"norm": unsure_p},
                         saturated=exceeds(raw, codec.norm_dtype))
    if isinstance(codec, Uniform):
        y = x if rot is None else x @ rot
        lo, hi = y.min(axis=-1), y.max(axis=-1)
        scale = np.maximum((hi - lo) / ((1 << codec.bits) - 1), SCALE_FLOOR)
        codes = _uniform_codes(y, lo, hi, codec.bits)
        params = {"scale": round_float(scale, codec.param_dtype), "zero": round_float(lo, codec.param_dtype)}
        if rot is None:
            unsure = np.zeros(y.shape, bool)
            unsure_p = {k: np.zeros(lo.shape, bool) for k in params}
        else:
            # Perturb the whole rotated vector: its min, max, scale and every code may move.
            e = EPS * np.sqrt(np.sum(x * x, axis=-1))
            unsure = np.zeros(y.shape, bool)
            for s in (-1.0, 1.0):
                lo2, hi2 = lo + s * e, hi - s * e
                for t in (-1.0, 1.0):
                    unsure |= _uniform_codes(y + t * e[..., None], lo2, hi2, codec.bits) != codes
            rel = EPS * 8
            unsure_p = {"scale": ties_within(scale, codec.param_dtype, rel),
                        "zero": ties_within(lo, codec.param_dtype, rel) | (np.abs(lo) < e)}
        sat = exceeds(scale, codec.param_dtype) | exceeds(lo, codec.param_dtype)
        return Quantized(codes=codes, data=None, params=params, uncertain_codes=unsure,
                         uncertain_params=unsure_p, saturated=sat)
    if isinstance(codec, FP8):
        y = x if rot is None else x @ rot
        data = fp8_e4m3fn_decode(fp8_e4m3fn_encode(y))
        if rot is None:
            unsure = np.zeros(y.shape, bool)
        else:
            e = EPS * np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
            unsure = fp8_e4m3fn_encode(y - e) != fp8_e4m3fn_encode(y + e)
        return Quantized(codes=None, data=data, uncertain_codes=unsure,
                         saturated=np.any(exceeds(y, "float8_e4m3fn"), axis=-1))
    if isinstance(codec, Raw):
        return Quantized(codes=None, data=round_float(x, codec.dtype), uncertain_codes=np.zeros(x.shape, bool),
                         saturated=np.any(exceeds(x, codec.dtype), axis=-1))
    raise TypeError(f"codec must be LloydMax, Uniform, FP8 or Raw, got {type(codec).__name__}")


def dequantize(q: Quantized, codec: Codec, *, rotation=None, codebook: Codebook | None = None,
               rotate_back: bool = False) -> np.ndarray:
    """Reconstruct float64 ``[..., D]`` from :func:`quantize`'s result (or from decoded slots).

    The result is in the codec's own space (rotated for a rotated codec) unless ``rotate_back``,
    which applies Πᵀ to rotated codecs (unrotated codecs are returned as they are)."""
    if isinstance(codec, LloydMax):
        cb = _codebook_for(codec, codebook)
        c = cb.centroids[q.codes]
        f = q.params["norm"][..., None]
        if codec.norm_correction == "decode":
            cn = np.sqrt(np.sum(c * c, axis=-1, keepdims=True))
            y = f * np.divide(c, cn, out=np.zeros_like(c), where=cn > 0)
        else:
            y = f * c
    elif isinstance(codec, Uniform):
        y = q.codes * q.params["scale"][..., None] + q.params["zero"][..., None]
    elif isinstance(codec, (FP8, Raw)):
        y = np.asarray(q.data, dtype=np.float64)
    else:
        raise TypeError(f"codec must be LloydMax, Uniform, FP8 or Raw, got {type(codec).__name__}")
    if rotate_back and codec.rotated:
        y = y @ _rotation_for(codec, rotation, y.shape[-1]).T
    return y
