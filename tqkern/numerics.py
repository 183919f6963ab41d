"""Exact float encodings used by the formats, in NumPy (no torch, no ml_dtypes).

All functions take float64 values and return either the rounded float64 values (exactly
representable in the target type) or their little-endian bytes.

Every encoding *saturates*: a finite value beyond the type's largest finite value ``MAX`` is
stored as ±MAX (a stored norm or scale must never be inf), and ``store`` reports it
(:class:`tqkern.errors.ErrorFlag` ``SATURATED``; see :func:`exceeds`). NaN stays NaN.

- float16: IEEE binary16, round to nearest, ties to even; MAX = 65504.
- bfloat16: the value rounded first to float32 (exact for fp16/bf16/fp32 inputs), then to the
  top 16 bits with round to nearest, ties to even; MAX = (2 − 2^-7)·2^127.
- float32: IEEE binary32, round to nearest even (``numpy.float32``); MAX = (2 − 2^-23)·2^127.
- float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7F/0xFF NaN;
  max ±448; subnormals 2^-9·m. Round to nearest, ties to even, saturating to ±448 (Hopper's
  ``cvt.rn.satfinite``); NaN → 0x7F (sign kept).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "FP16_MAX",
    "FP8_MAX",
    "FLOAT_MAX",
    "exceeds",
    "round_float",
    "encode_float",
    "decode_float",
    "fp8_e4m3fn_encode",
    "fp8_e4m3fn_decode",
    "ties_within",
]

FP16_MAX = 65504.0
FP8_MAX = 448.0
FP32_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float(np.float32(2.0**127 * (2 - 2.0**-7)))
FLOAT_MAX = {"float16": FP16_MAX, "bfloat16": BF16_MAX, "float32": FP32_MAX, "float8_e4m3fn": FP8_MAX}
"""The largest finite value of each stored float type."""
_NBYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}


def fp8_e4m3fn_encode(x: np.ndarray) -> np.ndarray:
    """float64 → uint8 E4M3FN codes (see module docstring)."""
    x = np.asarray(x, dtype=np.float64)
    sign = np.signbit(x).astype(np.uint8) << 7
    a = np.minimum(np.abs(np.nan_to_num(x, nan=0.0)), FP8_MAX)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0))).astype(np.int64)
    sub = a < 2.0**-6
    # Subnormal (and zero): the code is the integer multiple of 2^-9, 8 rolling into 2^-6.
    q_sub = np.rint(a * 2.0**9).astype(np.int64)
    e = np.maximum(e, -6)
    m = np.rint((a / np.exp2(e.astype(np.float64)) - 1.0) * 8.0).astype(np.int64)
    carry = m == 8
    e = np.where(carry, e + 1, e)
    m = np.where(carry, 0, m)
    q_norm = ((e + 7) << 3) | m
    code = np.where(sub, q_sub, q_norm).astype(np.uint8) | sign
    return np.where(np.isnan(x), np.uint8(0x7F) | sign, code).astype(np.uint8)


def fp8_e4m3fn_decode(code: np.ndarray) -> np.ndarray:
    """uint8 E4M3FN codes → float64."""
    c = np.asarray(code, dtype=np.uint8).astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 15
    m = c & 7
    val = np.where(e == 0, m * 2.0**-9, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    val = np.where((c & 0x7F) == 0x7F, np.nan, val)
    return np.copysign(val, sign)


def exceeds(x: np.ndarray, dtype: str) -> np.ndarray:
    """True where finite ``x`` lies beyond ±MAX of ``dtype`` (encoding it saturates)."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    return np.isfinite(a) & (a > FLOAT_MAX[dtype])


def _f32(x: np.ndarray) -> np.ndarray:
    """float64 → float32, saturating at ±FP32_MAX (NaN stays NaN)."""
    return np.clip(np.asarray(x, dtype=np.float64), -FP32_MAX, FP32_MAX).astype(np.float32)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    x = np.clip(np.asarray(x, dtype=np.float64), -BF16_MAX, BF16_MAX)
    u = _f32(x).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(x, dtype=np.float64))
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def round_float(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values to ``dtype`` and return them as float64 (exactly representable)."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float16":
        return np.clip(x, -FP16_MAX, FP16_MAX).astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return (_bf16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype == "float32":
        return _f32(x).astype(np.float64)
    if dtype == "float8_e4m3fn":
        return fp8_e4m3fn_decode(fp8_e4m3fn_encode(x))
    if dtype == "float64":
        return x
    raise ValueError(f"dtype must be one of {sorted(_NBYTES)}, got {dtype!r}")


def encode_float(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 ``x [...]`` to ``dtype`` and return its little-endian bytes ``[..., nbytes]``."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float16":
        raw = np.clip(x, -FP16_MAX, FP16_MAX).astype("<f2")
    elif dtype == "bfloat16":
        raw = _bf16_bits(x).astype("<u2")
    elif dtype == "float32":
        raw = _f32(x).astype("<f4")
    elif dtype == "float8_e4m3fn":
        return fp8_e4m3fn_encode(x)[..., None]
    else:
        raise ValueError(f"dtype must be one of {sorted(_NBYTES)}, got {dtype!r}")
    raw = np.ascontiguousarray(raw)
    return raw.view(np.uint8).reshape(*x.shape, _NBYTES[dtype])


def decode_float(b: np.ndarray, dtype: str) -> np.ndarray:
    """Little-endian bytes ``[..., nbytes]`` (uint8) → float64 ``[...]``."""
    b = np.ascontiguousarray(np.asarray(b, dtype=np.uint8))
    if dtype == "float8_e4m3fn":
        return fp8_e4m3fn_decode(b[..., 0])
    if b.shape[-1] != _NBYTES.get(dtype, -1):
        raise ValueError(f"last axis must be {_NBYTES.get(dtype)} bytes for {dtype}, got {b.shape[-1]}")
    if dtype == "float16":
        return b.view("<f2")[..., 0].astype(np.float64)
    if dtype == "bfloat16":
        return (b.view("<u2")[..., 0].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype == "float32":
        return b.view("<f4")[..., 0].astype(np.float64)
    raise ValueError(f"dtype must be one of {sorted(_NBYTES)}, got {dtype!r}")


def ties_within(x: np.ndarray, dtype: str, rel_eps: float) -> np.ndarray:
    """True where rounding ``x`` to ``dtype`` could change if ``x`` moved by ``rel_eps·|x|``:
    the value lies that close to a rounding decision point."""
    x = np.asarray(x, dtype=np.float64)
    lo = round_float(x * (1.0 - rel_eps), dtype)
    hi = round_float(x * (1.0 + rel_eps), dtype)
    return lo != hi
