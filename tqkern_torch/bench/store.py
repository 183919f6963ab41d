"""The store benchmark (GPU): ``store`` of every preset against a plain torch fp16 paged-cache write.

Correctness first: each preset stores 64 random tokens (Hkv8/D128 and Hkv3/D64, :data:`GATE_HEADS`,
and each timed shape's own heads and head_dim: :func:`tqkern_torch.bench.runner.run`) and the written
slots must equal the NumPy oracle's bytes, except bytes the oracle marks uncertain (a code within
rounding of a decision point); a preset that fails is not timed (at a shape's own case: not at that
shape).

Then, per shape (:data:`~tqkern_torch.bench.shapes.STORE_SHAPES`), into a cache of
:data:`~tqkern_torch.bench.shapes.STORE_CACHE_TOKENS` tokens: a prefill chunk writes whole
blocks (each sequence's blocks drawn at random), a decode step one token per sequence at a
random block and offset. The baseline writes the same fp16 K/V at the same slots into fp16 key
and value caches ``[num_blocks · block_size, num_kv_heads, head_dim]`` with ``index_copy_`` (what
a paged fp16 cache does per layer); beside it ``copy_`` of the same K and V into contiguous
buffers (the bandwidth issue 23's goal is stated against). Every preset stores fp16 K/V and, as
``bf16:<preset>``, the same values in bfloat16; a preset with Lloyd-Max keys also stores the fp16
K/V with a key offset μ, as ``mu:<preset>`` (what ``install``'s calibrated path writes: the key
side's norms take float64 there). All by CUDA-graph replay. ``bytes``: K and V read
plus the bytes written (for the baseline and ``copy_``, the same 16-bit bytes again).
"""

from __future__ import annotations

import numpy as np
import torch

import tqkern_torch as tqt
from tqkern import KVFormat, LloydMax, TQParams
from tqkern import reference as ref
from tqkern_torch.bench.decode import make_layout
from tqkern_torch.bench.report import record
from tqkern_torch.bench.shapes import BLOCK_SIZE, STORE_CACHE_TOKENS, StoreShape
from tqkern_torch.bench.timing import graph_us

__all__ = ["BASELINE", "COPY", "MU", "has_mu_variant", "mu_params", "slot_mapping", "stored_sample", "shape_inputs",
           "gate", "run_shape"]

BASELINE = "fp16_index_copy"
COPY = "copy_"
MU = "mu:"


def has_mu_variant(preset: str, head_dim: int) -> bool:
    """Whether ``preset`` is also timed with a key offset: its keys are Lloyd-Max codes."""
    return isinstance(KVFormat.preset(preset, head_dim).key, LloydMax)


def mu_params(layout, device):
    """Device params of ``layout``'s format (seed 0) with a fixed key offset μ ~ N(0, 0.5²)
    ``[Hkv, D]`` (NumPy seed 5)."""
    fmt = layout.format
    mu = np.random.default_rng(5).normal(0.0, 0.5, (layout.num_kv_heads, fmt.head_dim))
    return tqt.to_device(TQParams.default(fmt, seed=0, key_offset=mu), device)


def slot_mapping(shape: StoreShape, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    """int64 ``[shape.num_tokens]`` distinct slots of a ``num_blocks`` cache, sequence by sequence.

    Each sequence gets its own random blocks; a sequence of several tokens fills them from
    offset 0 (a prefill chunk), a one-token sequence writes at a random offset (a decode step).

    Raises:
        ValueError: the shape needs more blocks than ``num_blocks``.
    """
    per_seq = -(-shape.tokens_per_seq // BLOCK_SIZE)
    if shape.num_seqs * per_seq > num_blocks:
        raise ValueError(f"num_blocks must be >= {shape.num_seqs * per_seq} for {shape.name}, got {num_blocks}")
    dev = g.device
    blocks = torch.randperm(num_blocks, device=dev, generator=g)[: shape.num_seqs * per_seq].view(shape.num_seqs,
                                                                                                  per_seq)
    if shape.tokens_per_seq == 1:
        offsets = torch.randint(0, BLOCK_SIZE, (shape.num_seqs, 1), device=dev, generator=g)
        return (blocks * BLOCK_SIZE + offsets).reshape(-1).long()
    pos = torch.arange(shape.tokens_per_seq, device=dev)
    return (blocks[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1).long()


def stored_sample(layout, params, g: torch.Generator, n: int = 64, num_blocks: int = 16):
    """``(k, v, slots, cache)``: ``n`` random fp16 tokens stored at shuffled slots of a
    ``num_blocks`` cache on ``g``'s device (the gates' sample)."""
    dev = g.device
    h, d = layout.num_kv_heads, layout.head_dim
    k = torch.randn(n, h, d, device=dev, dtype=torch.float16, generator=g)
    v = torch.randn(n, h, d, device=dev, dtype=torch.float16, generator=g)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=dev, generator=g)[:n]
    cache = torch.zeros(layout.cache_shape(num_blocks), dtype=torch.uint8, device=dev)
    tqt.store(cache, k, v, slots, layout, params)
    return k, v, slots, cache


GATE_HEADS = ((8, 128), (3, 64))  # (Hkv, D) of the gate's fixed cases; the first also with a key offset


def gate(presets, *, device: str = "cuda", heads=GATE_HEADS) -> list[dict]:
    """Every preset's written slots against the oracle's bytes (uncertain bytes excepted), for
    64 tokens at each ``(Hkv, D)`` of ``heads``, and with a key offset (:func:`mu_params`) at the
    first where the preset has a ``mu:`` variant."""
    g = torch.Generator(device=device).manual_seed(4)
    out = []
    for preset in presets:
        cases = [(hkv, d, False) for hkv, d in heads]
        if has_mu_variant(preset, heads[0][1]):
            cases.append((heads[0][0], heads[0][1], True))
        for hkv, d, with_mu in cases:
            layout, params = make_layout(preset, hkv, d, device)
            if with_mu:
                params = mu_params(layout, device)
            k, v, slots, cache = stored_sample(layout, params, g)
            got = ref.gather_slots(cache.cpu().numpy(), layout, slots.cpu().numpy())
            exp, unsure = ref.compress(k.cpu().numpy(), v.cpu().numpy(), params.params, return_uncertain=True)
            bad = int(((got != exp) & ~unsure).sum())
            out.append(dict(op="store", preset=preset, case=f"Hkv{hkv}/D{d}" + " mu" * with_mu, bad_bytes=bad,
                            uncertain_bytes=int(unsure.sum()), ok=bad == 0))
    return out


def shape_inputs(shape: StoreShape, cache_tokens: int, device: str):
    """``(generator, k, v, slots)`` of a timed shape: random fp16 K/V ``[num_tokens, Hkv, D]`` and
    their slots (:func:`slot_mapping`) in a ``cache_tokens`` cache; the generator, seeded 2, goes on."""
    g = torch.Generator(device=device).manual_seed(2)
    n, h, d = shape.num_tokens, shape.num_kv_heads, shape.head_dim
    k = torch.randn(n, h, d, device=device, dtype=torch.float16, generator=g)
    v = torch.randn(n, h, d, device=device, dtype=torch.float16, generator=g)
    return g, k, v, slot_mapping(shape, cache_tokens // BLOCK_SIZE, g)


def run_shape(shape: StoreShape, presets, step, *, rep_ms: int = 100, device: str = "cuda", timer=None,
              cache_tokens: int = STORE_CACHE_TOKENS) -> list[dict]:
    """Records of the fp16 ``index_copy_`` baseline, ``copy_``, and every preset's ``store`` of
    fp16 and of bf16 (``bf16:<preset>``) K/V at ``shape``, and of fp16 K/V with a key offset
    (``mu:<preset>``, :func:`has_mu_variant`); ``step(label)`` is called after each timed variant.
    ``timer(fn) -> µs`` defaults to CUDA-graph replay for ``rep_ms``."""
    timer = timer or (lambda fn: graph_us(fn, rep_ms))
    g, k, v, slots = shape_inputs(shape, cache_tokens, device)
    n, h, d = shape.num_tokens, shape.num_kv_heads, shape.head_dim
    num_blocks = cache_tokens // BLOCK_SIZE
    kv_bytes = 2 * n * h * d * 2  # K and V, fp16

    k_cache = torch.zeros(num_blocks * BLOCK_SIZE, h, d, device=device, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)

    def fp16_write():
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    base_us = timer(fp16_write)
    k_cache = v_cache = None
    rows = [record("store", shape.name, BASELINE, BASELINE, base_us, base_us, nbytes=2 * kv_bytes)]
    step(f"store {shape.name} {BASELINE}")
    k_copy, v_copy = torch.empty_like(k), torch.empty_like(v)

    def copy():
        k_copy.copy_(k)
        v_copy.copy_(v)

    rows.append(record("store", shape.name, COPY, BASELINE, timer(copy), base_us, nbytes=2 * kv_bytes))
    step(f"store {shape.name} {COPY}")
    k_copy = v_copy = None
    inputs = {"": (k, v), "bf16:": (k.to(torch.bfloat16), v.to(torch.bfloat16))}
    for preset in presets:
        layout, params = make_layout(preset, h, d, device)
        cache = torch.zeros(layout.cache_shape(num_blocks), dtype=torch.uint8, device=device)
        runs = [(prefix, key, value, params) for prefix, (key, value) in inputs.items()]
        if has_mu_variant(preset, d):
            runs.append((MU, k, v, mu_params(layout, device)))
        for prefix, key, value, p in runs:
            us = timer(lambda: tqt.store(cache, key, value, slots, layout, p))
            rows.append(record("store", shape.name, prefix + preset, BASELINE, us, base_us,
                               nbytes=kv_bytes + n * layout.row_bytes))
            step(f"store {shape.name} {prefix}{preset}")
        cache = None
        torch.cuda.empty_cache()
    return rows
