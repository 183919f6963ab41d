"""Named, model-like shapes shared by the GPU tests and the benchmarks (no torch needed).

Decode: Llama-3-8B-like attention (32 query heads, 8 KV heads, head_dim 128) at four batch ×
context sizes, and a SmolLM2-like one (9 / 3 / 64, GQA 3). Store: the same two head layouts
written by a prefill chunk (one sequence of 4,096 tokens) and by a decode step (one new token in
each of 32 or 256 sequences). Generate: batch × prompt length of an end-to-end ``model.generate``
of a Llama-3-8B-shaped model (:mod:`~tqkern_torch.bench.generate`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["DecodeShape", "StoreShape", "PrefillShape", "GenerateShape", "DECODE_SHAPES", "MODEL_SHAPES",
           "STORE_SHAPES", "PREFILL_SHAPES", "GENERATE_SHAPES", "DECODE_PRESETS", "QUICK_SHAPES", "decode_shape", "store_shape",
           "prefill_shape", "generate_shape", "ShapeHeadsError", "BLOCK_SIZE", "STORE_CACHE_TOKENS"]

BLOCK_SIZE = 16


@dataclass(frozen=True)
class DecodeShape:
    """``batch`` sequences of ``seq_len`` cached tokens, one query each. ``logit_softcap`` and
    ``window_left`` are the model layer's attention options (Gemma-2: a soft-cap of 50, and on its
    local layers a window of 4096 keys, ``window_left = 4095``); ``None``: not used."""

    name: str
    batch: int
    seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    logit_softcap: Optional[float] = None
    window_left: Optional[int] = None

    @property
    def options(self) -> dict:
        """The layer's options as ``paged_decode`` keyword arguments (only those it uses)."""
        opts = {"logit_softcap": self.logit_softcap, "window_left": self.window_left}
        return {k: v for k, v in opts.items() if v is not None}

    @property
    def keys_read(self) -> int:
        """Keys each query attends to: the window's ``window_left + 1`` or the whole context."""
        return self.seq_len if self.window_left is None else min(self.seq_len, self.window_left + 1)


@dataclass(frozen=True)
class StoreShape:
    """``num_seqs`` sequences each writing ``tokens_per_seq`` new tokens (``num_tokens`` in all)."""

    name: str
    num_seqs: int
    tokens_per_seq: int
    num_kv_heads: int
    head_dim: int

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.tokens_per_seq


@dataclass(frozen=True)
class PrefillShape:
    """``num_seqs`` sequences of ``context`` tokens whose last ``q_len`` are the new queries
    (``q_len == context``: a full prefill; fewer: a chunk or speculative tokens on a cached prefix)."""

    name: str
    num_seqs: int
    context: int
    q_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class GenerateShape:
    """``batch`` prompts of ``prompt`` tokens each (no padding)."""

    name: str
    batch: int
    prompt: int


DECODE_SHAPES = (
    DecodeShape("B32x4K", 32, 4096, 32, 8, 128),
    DecodeShape("B32x16K", 32, 16384, 32, 8, 128),
    DecodeShape("B8x64K", 8, 65536, 32, 8, 128),
    DecodeShape("B128x1K", 128, 1024, 32, 8, 128),
    DecodeShape("SmolLM2_B32x4K", 32, 4096, 9, 3, 64),  # head_dim 64, GQA 3
)

# The model-shape table (``tqkern bench decode --shapes models``): one attention layer of a real
# model as one GPU sees it (tensor-parallel slices where a model that size is served that way),
# at a batch and context that model is served at. Together with DECODE_SHAPES it spans head_dim
# 64, 96, 128, 256; KV heads 1-16; GQA 1-16; batch 1-256; contexts 1K-128K; and the attention
# options of Gemma-2 (soft-cap, sliding window) and Mistral (sliding window).
MODEL_SHAPES = DECODE_SHAPES + (
    DecodeShape("Llama3-8B_B1x128K", 1, 131072, 32, 8, 128),  # one long document (Llama 3.1: 128K)
    DecodeShape("Llama3-8B_B256x1K", 256, 1024, 32, 8, 128),  # many short chats
    DecodeShape("Llama3-70B-TP8_B32x16K", 32, 16384, 8, 1, 128),  # 64 / 8 heads per GPU: 1 KV head, GQA 8
    DecodeShape("Llama3-405B-TP8_B16x32K", 16, 32768, 16, 1, 128),  # 128 / 8 per GPU: GQA 16
    DecodeShape("Llama3-70B-TP4_B32x16K", 32, 16384, 16, 2, 128),  # 64 / 4 per GPU: 2 KV heads, GQA 8
    DecodeShape("Qwen2.5-7B_B16x32K", 16, 32768, 28, 4, 128),  # GQA 7
    DecodeShape("Qwen2.5-7B_B1x64K", 1, 65536, 28, 4, 128),  # batch 1, 4 KV heads
    DecodeShape("Llama3-70B-TP8_B1x128K", 1, 131072, 8, 1, 128),  # (S69) batch 1 at one KV head
    # (S62) batch 1 at short contexts: few CTAs, the split count's case (below SDPA fp16 there)
    DecodeShape("Llama3-8B_B1x4K", 1, 4096, 32, 8, 128),  # one short chat
    DecodeShape("Qwen2.5-7B_B1x16K", 1, 16384, 28, 4, 128),
    DecodeShape("Gemma2-9B_B8x8K", 8, 8192, 16, 8, 256),  # head_dim 256, GQA 2
    # Gemma-2's layers as the model runs them: soft-cap 50 everywhere, every other layer a 4096-key window
    DecodeShape("Gemma2-9B-global_B8x8K", 8, 8192, 16, 8, 256, logit_softcap=50.0),
    DecodeShape("Gemma2-9B-local_B8x8K", 8, 8192, 16, 8, 256, logit_softcap=50.0, window_left=4095),
    DecodeShape("Mistral-7B_B32x16K", 32, 16384, 32, 8, 128, window_left=4095),  # v0.1: a 4096-key window
    DecodeShape("Gemma-7B_B4x8K", 4, 8192, 16, 16, 256),  # head_dim 256, multi-head (GQA 1)
    DecodeShape("Phi3-mini-TP2_B16x4K", 16, 4096, 16, 16, 96),  # head_dim 96, multi-head (32 heads / 2)
    DecodeShape("Llama3.2-1B_B64x8K", 64, 8192, 32, 8, 64),  # head_dim 64, GQA 4
    DecodeShape("Qwen2.5-0.5B_B256x2K", 256, 2048, 14, 2, 64),  # head_dim 64, GQA 7, large batch
)

STORE_SHAPES = (
    StoreShape("prefill_1x4096", 1, 4096, 8, 128),
    StoreShape("prefill_1x16384", 1, 16384, 8, 128),  # the shape of docs/performance.md's store table
    StoreShape("decode_B32", 32, 1, 8, 128),
    StoreShape("decode_B256", 256, 1, 8, 128),
    StoreShape("decode_B512", 512, 1, 8, 128),  # issue 23's 512 tokens: a decode step of a large batch
    StoreShape("SmolLM2_prefill_1x4096", 1, 4096, 3, 64),
    StoreShape("SmolLM2_decode_B32", 32, 1, 3, 64),
    StoreShape("Gemma2-9B_prefill_1x16384", 1, 16384, 8, 256),  # head_dim 256 (the column-chunked store)
)

# Issue 21's prefill shapes (Hq32/Hkv8/D128): full prefills, a varlen-sized batch, a chunk on a
# cached prefix, speculative tokens.
PREFILL_SHAPES = (
    PrefillShape("full_1x4K", 1, 4096, 4096, 32, 8, 128),
    PrefillShape("full_1x16K", 1, 16384, 16384, 32, 8, 128),
    PrefillShape("full_8x2K", 8, 2048, 2048, 32, 8, 128),
    PrefillShape("chunk1K_on16K_x8", 8, 16384, 1024, 32, 8, 128),
    PrefillShape("spec4_on16K_x32", 32, 16384, 4, 32, 8, 128),
)

GENERATE_SHAPES = tuple(GenerateShape(f"B{b}x{k}K", b, 1024 * k) for b in (1, 8) for k in (1, 16, 32))

# Tokens of the cache a store benchmark writes into (4,096 blocks of 16): larger than any
# shape's batch, so slots are scattered as in a serving cache.
STORE_CACHE_TOKENS = 65536

# `--quick`: one Llama-like and one SmolLM2-like shape per op.
QUICK_SHAPES = {"decode": ("B32x4K", "SmolLM2_B32x4K"), "store": ("prefill_1x4096", "decode_B32"),
                "decompress": ("prefill_1x4096", "SmolLM2_prefill_1x4096"),
                "prefill": ("full_1x4K", "spec4_on16K_x32"), "generate": ("B1x1K", "B8x16K")}

# (preset, arrangement); "fp16" is tqkern's own uncompressed paged path. Both ops run these.
DECODE_PRESETS = (
    ("tq4", "row"),
    ("turboquant_4bit_nc", "slot"),
    ("turboquant_k8v4", "slot"),
    ("turboquant_k3v4_nc", "slot"),
    ("turboquant_3bit_nc", "slot"),
    ("tqkern_k5v3", "slot"),
    ("k5v4h", "slot"),  # install's default format
    ("fp16", "slot"),
)


class ShapeHeadsError(ValueError):
    """An ad-hoc decode shape whose heads or head_dim cannot be (:func:`decode_shape`): the name
    was meant as a decode shape, so callers that try it against every op report this one."""


def decode_shape(name: str) -> DecodeShape:
    """A named shape of ``MODEL_SHAPES`` (``DECODE_SHAPES`` included), or an ad-hoc one:
    ``B<batch>x<tokens>K`` with the benchmark's Hq 32 / Hkv 8 / D 128 (e.g. ``B33x16K`` for a run
    that fills 132 SMs), or with a model's heads and head_dim as ``B<batch>x<tokens>K_Hq<q>_Hkv<k>_D<d>``
    (e.g. ``B16x32K_Hq32_Hkv2_D128``: Llama-3-405B on 4 GPUs); Hq a multiple of Hkv, D even."""
    for shape in MODEL_SHAPES:
        if shape.name == name:
            return shape
    m = re.fullmatch(r"B(\d+)x(\d+)K(?:_Hq(\d+)_Hkv(\d+)_D(\d+))?", name)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"shape must be one of {[s.name for s in MODEL_SHAPES]} or B<batch>x<tokens>K"
                         f"[_Hq<q>_Hkv<k>_D<d>], got {name!r}")
    hq, hkv, d = (32, 8, 128) if m[3] is None else (int(m[3]), int(m[4]), int(m[5]))
    if hkv < 1 or hq < 1 or hq % hkv or d < 2 or d % 2:
        raise ShapeHeadsError(f"shape {name!r}: Hq must be a positive multiple of Hkv >= 1 and D a positive even "
                              f"head_dim, got Hq {hq}, Hkv {hkv}, D {d}")
    return DecodeShape(name, int(m[1]), 1024 * int(m[2]), hq, hkv, d)


def store_shape(name: str) -> StoreShape:
    """A named shape of ``STORE_SHAPES``."""
    for shape in STORE_SHAPES:
        if shape.name == name:
            return shape
    raise ValueError(f"shape must be one of {[s.name for s in STORE_SHAPES]}, got {name!r}")


def prefill_shape(name: str) -> PrefillShape:
    """A named shape of ``PREFILL_SHAPES``."""
    for shape in PREFILL_SHAPES:
        if shape.name == name:
            return shape
    raise ValueError(f"shape must be one of {[s.name for s in PREFILL_SHAPES]}, got {name!r}")


def generate_shape(name: str) -> GenerateShape:
    """A named shape of ``GENERATE_SHAPES``."""
    for shape in GENERATE_SHAPES:
        if shape.name == name:
            return shape
    raise ValueError(f"shape must be one of {[s.name for s in GENERATE_SHAPES]}, got {name!r}")
