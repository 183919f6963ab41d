"""Named, model-like shapes shared by the GPU tests and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DecodeShape", "DECODE_SHAPES", "DECODE_PRESETS", "STORE_SHAPE"]


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

STORE_SHAPE = dict(num_tokens=16384, num_kv_heads=8, head_dim=128)
