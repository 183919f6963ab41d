"""Whole slots: the NumPy oracle of ``compress``.

``compress(key, value, params)`` turns ``key, value [N, H, D]`` (any float dtype; H KV heads)
into slots ``[N, H, slot_bytes]`` uint8 of ``params.format``:

    k' = key − μ[h]                        (μ = params.key_offset, float32 values, or 0)
    k', value: a vector (one token, one head) holding a NaN or ±inf becomes the zero vector
    key fields   = quantize(k', format.key)     (see tqkern.ops.quantize.reference)
    value fields = quantize(value, format.value)
    slot = [key fields | value fields | zero padding], fields in ``format.slot_fields()`` order,
           codes packed with ``format.bit_order`` (tqkern.ops.pack.reference), floats
           little-endian in their field dtype.

Both K and V use the one rotation ``params.rotation``. With ``return_uncertain=True`` the oracle
also returns a bool mask of the same shape as the slots marking the bytes a conforming kernel
may produce differently (bytes holding a code or stored float that lies within
:data:`~tqkern.ops.quantize.reference.EPS` of a decision point); every other byte must match.

Non-finite and out-of-range inputs (``docs/layout.md``): a key or value vector with a NaN or
±inf element is stored as the zero vector (every field as for ``x = 0``), so that one bad token
cannot turn every later attention output of its sequence into NaN; a stored float beyond its
dtype's range saturates (:mod:`tqkern.numerics`). With ``return_flags=True`` the oracle also
returns the :class:`~tqkern.errors.ErrorFlag` bits a kernel sets for the same input:
``NONFINITE_INPUT`` and ``SATURATED``.
"""

from __future__ import annotations

import numpy as np

from tqkern.errors import ErrorFlag
from tqkern.layouts import KVFormat
from tqkern.numerics import encode_float
from tqkern.ops.pack.reference import pack
from tqkern.ops.quantize.reference import Quantized, quantize
from tqkern.params import TQParams

__all__ = ["compress", "codec_inputs"]


def _check_kv(key: np.ndarray, value: np.ndarray, fmt: KVFormat, params: TQParams) -> None:
    d = fmt.head_dim
    for name, t in (("key", key), ("value", value)):
        if t.ndim != 3 or t.shape[-1] != d:
            raise ValueError(f"{name} must have shape [num_tokens, num_kv_heads, {d}], got {t.shape}")
    if key.shape != value.shape:
        raise ValueError(f"value must have the shape of key {key.shape}, got {value.shape}")
    if params.key_offset is not None and params.key_offset.shape[0] != key.shape[1]:
        raise ValueError(f"params.key_offset must have {key.shape[1]} rows (num_kv_heads), "
                         f"got {params.key_offset.shape[0]}")


def finite_vectors(x: np.ndarray) -> np.ndarray:
    """bool ``[...]``: the vectors ``x [..., D]`` whose every element is finite."""
    return np.all(np.isfinite(x), axis=-1)


def codec_inputs(key, value, params: TQParams) -> tuple[np.ndarray, np.ndarray]:
    """The float64 vectors the key and value codecs see: ``(key − μ, value)``, a vector with a
    non-finite element replaced by zeros."""
    k = np.asarray(key, dtype=np.float64)
    if params.key_offset is not None:
        k = k - params.key_offset.astype(np.float64)[None]
    v = np.asarray(value, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return tuple(np.where(finite_vectors(x)[..., None], x, 0.0) for x in (k, v))


def _side_bytes(q: Quantized, fields, bits: int, bit_order: str) -> tuple[list, list]:
    chunks, unsure = [], []
    for f in fields:
        if f.dtype == "codes":
            chunks.append(pack(q.codes, bits, bit_order))
            # A byte is uncertain if any code with a bit in it is uncertain.
            n = q.codes.shape[-1]
            idx = np.arange(n)
            if bit_order == "nibble_high_even":
                first = last = idx // 2
            else:
                first, last = idx * bits // 8, (idx * bits + bits - 1) // 8
            m = np.zeros((*q.codes.shape[:-1], f.nbytes), bool)
            for j in range(n):
                for b in {int(first[j]), int(last[j])}:
                    m[..., b] |= q.uncertain_codes[..., j]
            unsure.append(m)
        elif f.name == "data":
            chunks.append(encode_float(q.data, f.dtype).reshape(*q.data.shape[:-1], f.nbytes))
            reps = f.nbytes // q.data.shape[-1]
            unsure.append(np.repeat(q.uncertain_codes, reps, axis=-1))
        else:
            chunks.append(encode_float(q.params[f.name], f.dtype))
            unsure.append(np.repeat(q.uncertain_params[f.name][..., None], f.nbytes, axis=-1))
    return chunks, unsure


def compress(key, value, params: TQParams, *, return_uncertain: bool = False, return_flags: bool = False):
    """Compress ``key, value [N, H, D]`` into slots ``[N, H, slot_bytes]`` uint8.

    Returns:
        ``slots``, followed, as a tuple, by ``uncertain`` (bool ``[N, H, slot_bytes]``) with
        ``return_uncertain`` and by the :class:`~tqkern.errors.ErrorFlag` bits with
        ``return_flags``.
    """
    if not isinstance(params, TQParams):
        raise TypeError(f"params must be a TQParams, got {type(params).__name__}")
    fmt = params.format
    key, value = np.asarray(key), np.asarray(value)
    _check_kv(key, value, fmt, params)
    k, v = codec_inputs(key, value, params)
    flags = ErrorFlag(0)
    with np.errstate(invalid="ignore"):
        if not (np.all(np.isfinite(key)) and np.all(np.isfinite(value))):
            flags |= ErrorFlag.NONFINITE_INPUT
    chunks, unsure = [], []
    for side, x, cb in (("key", k, params.key_codebook), ("value", v, params.value_codebook)):
        codec = getattr(fmt, side)
        q = quantize(x, codec, rotation=params.rotation, codebook=cb)
        if np.any(q.saturated):
            flags |= ErrorFlag.SATURATED
        c, u = _side_bytes(q, codec.fields(fmt.head_dim), codec.bits, fmt.bit_order)
        chunks += c
        unsure += u
    n, h = key.shape[:2]
    chunks.append(np.zeros((n, h, fmt.pad_bytes), np.uint8))
    unsure.append(np.zeros((n, h, fmt.pad_bytes), bool))
    slots = np.concatenate(chunks, axis=-1)
    assert slots.shape[-1] == fmt.slot_bytes
    extra = ((np.concatenate(unsure, axis=-1),) if return_uncertain else ()) + ((flags,) if return_flags else ())
    return (slots, *extra) if extra else slots
