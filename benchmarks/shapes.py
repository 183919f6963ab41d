"""Named, model-like shapes shared by the GPU tests and the benchmarks."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DecodeShape", "DECODE_SHAPES", "DECODE_PRESETS", "STORE_SHAPE", "decode_shape"]


@dataclass(frozen=True)
class DecodeShape:
    name: str
    batch: int
    seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


DECODE_SHAPES = (
    DecodeShape("B32x4K", 32, 4096, 32, 8, 128),
    DecodeShape("B32x16K", 32, 16384, 32, 8, 128),
    DecodeShape("B8x64K", 8, 65536, 32, 8, 128),
    DecodeShape("B128x1K", 128, 1024, 32, 8, 128),
    DecodeShape("SmolLM2_B32x4K", 32, 4096, 9, 3, 64),  # head_dim 64, GQA 3
)

# (preset, arrangement); "fp16" is tqkern's own uncompressed paged path.
DECODE_PRESETS = (
    ("tq4", "row"),
    ("turboquant_4bit_nc", "slot"),
    ("turboquant_k8v4", "slot"),
    ("turboquant_k3v4_nc", "slot"),
    ("turboquant_3bit_nc", "slot"),
    ("tqkern_k5v3", "slot"),
    ("fp16", "slot"),
)



def decode_shape(name: str) -> DecodeShape:
    """A named shape of ``DECODE_SHAPES``, or an ad-hoc ``B<batch>x<tokens>K`` one with the
    benchmark's Hq 32 / Hkv 8 / D 128 (e.g. ``B33x16K`` for a sweep that fills 132 SMs)."""
    for shape in DECODE_SHAPES:
        if shape.name == name:
            return shape
    m = re.fullmatch(r"B(\d+)x(\d+)K", name)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"shape must be one of {[s.name for s in DECODE_SHAPES]} or B<batch>x<tokens>K, got {name!r}")
    return DecodeShape(name, int(m[1]), 1024 * int(m[2]), 32, 8, 128)


STORE_SHAPE = dict(num_tokens=16384, num_kv_heads=8, head_dim=128)
