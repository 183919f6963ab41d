"""Packing integer codes into bytes: the NumPy oracle.

Two bit orders (``KVFormat.bit_order``):

- ``"lsb"``: the n codes of b bits form one little-endian bitstream. Code j occupies stream bits
  [j·b, j·b + b), its least significant bit first; stream bit i is bit (i mod 8) of byte
  ⌊i/8⌋ (bit 0 = least significant). This is ``numpy.packbits(bitorder="little")`` of each
  code's bits written LSB first. The stream has ⌈n·b/8⌉ bytes; the unused high bits of the last
  byte are zero. For b = 4 the even index is the low nibble; for b = 8 a code is its byte.
- ``"nibble_high_even"``: b = 4 only, n even; byte j holds code 2j in its high nibble and code
  2j + 1 in its low nibble (turboquant-vllm).

Shapes: codes ``[..., n]`` uint8 (each < 2**b) ↔ packed ``[..., packed_bytes(n, b)]`` uint8.
Integers only: there are no non-finite values here (a code ≥ 2**b is a ``ValueError``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["pack", "unpack", "packed_bytes"]


def packed_bytes(n: int, bits: int) -> int:
    """⌈n·bits/8⌉."""
    return (n * bits + 7) // 8


def _check(bits: int, bit_order: str) -> None:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in [1, 8], got {bits!r}")
    if bit_order not in ("lsb", "nibble_high_even"):
        raise ValueError(f"bit_order must be one of ('lsb', 'nibble_high_even'), got {bit_order!r}")
    if bit_order == "nibble_high_even" and bits != 4:
        raise ValueError(f"bits must be 4 with bit_order='nibble_high_even', got {bits}")


def pack(codes: np.ndarray, bits: int, bit_order: str = "lsb") -> np.ndarray:
    """Pack ``codes [..., n]`` (uint8, each < 2**bits) into ``[..., ⌈n·bits/8⌉]`` uint8."""
    _check(bits, bit_order)
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.size and int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes must be < 2**bits = {1 << bits}, got max {int(codes.max())}")
    n = codes.shape[-1]
    if bit_order == "nibble_high_even":
        if n % 2:
            raise ValueError(f"codes.shape[-1] must be even for bit_order='nibble_high_even', got {n}")
        return ((codes[..., 0::2] << 4) | codes[..., 1::2]).astype(np.uint8)
    # [..., n, bits] bits of each code, LSB first, then one little-endian bitstream.
    bitplanes = (codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    stream = bitplanes.reshape(*codes.shape[:-1], n * bits)
    return np.packbits(stream, axis=-1, bitorder="little")


def unpack(packed: np.ndarray, bits: int, n: int, bit_order: str = "lsb") -> np.ndarray:
    """Inverse of :func:`pack`: ``packed [..., ⌈n·bits/8⌉]`` uint8 → ``codes [..., n]`` uint8."""
    _check(bits, bit_order)
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_bytes(n, bits):
        raise ValueError(f"packed.shape[-1] must be {packed_bytes(n, bits)} for n={n}, bits={bits}, "
                         f"got {packed.shape[-1]}")
    if bit_order == "nibble_high_even":
        out = np.empty((*packed.shape[:-1], n), np.uint8)
        out[..., 0::2] = packed >> 4
        out[..., 1::2] = packed & 15
        return out
    stream = np.unpackbits(packed, axis=-1, bitorder="little")[..., : n * bits]
    bitplanes = stream.reshape(*packed.shape[:-1], n, bits).astype(np.uint8)
    return (bitplanes << np.arange(bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8)
