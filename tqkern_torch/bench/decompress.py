"""The decompress benchmark (GPU): ``decompress`` of every preset against ``copy_`` of the float32
K/V it produces (issue 23's measure for the read path).

Correctness first: each preset stores 64 random tokens (Hkv8/D128 and Hkv3/D64) and
``decompress`` of their slots, in the codec's space and rotated back, must equal the NumPy
oracle's float64 values to the property tests' bounds (8 float32 ulps of the vector's largest
entry; rotated back, ``4·√D·2^-24·‖x‖``); a preset that fails is not timed.

Then, per shape (:data:`~tqkern_torch.bench.shapes.STORE_SHAPES`: the slots a store of that shape
writes into a cache of :data:`~tqkern_torch.bench.shapes.STORE_CACHE_TOKENS` tokens), the slots
read back: ``<preset>`` in the codec's space, ``rot:<preset>`` rotated back (presets with a
rotated side). The baseline is ``copy_`` of float32 K and V of the same shape into contiguous
buffers. ``bytes``: the slot bytes read plus the float32 K/V written (``copy_``: float32 K/V
read and written). All by CUDA-graph replay.
"""

from __future__ import annotations

import numpy as np
import torch

import tqkern_torch as tqt
from tqkern import KVFormat
from tqkern import reference as ref
from tqkern_torch.bench.decode import make_layout
from tqkern_torch.bench.report import record
from tqkern_torch.bench.shapes import BLOCK_SIZE, STORE_CACHE_TOKENS, StoreShape
from tqkern_torch.bench.store import GATE_HEADS, shape_inputs, stored_sample
from tqkern_torch.bench.timing import graph_us

__all__ = ["BASELINE", "ROT", "has_rotated_side", "gate", "run_shape"]

BASELINE = "copy_"
ROT = "rot:"


def has_rotated_side(preset: str, head_dim: int) -> bool:
    """Whether ``preset`` is also timed rotated back: one of its sides is rotated."""
    fmt = KVFormat.preset(preset, head_dim)
    return fmt.key.rotated or fmt.value.rotated


def _error_ok(got: np.ndarray, exp: np.ndarray, rotate_back: bool, d: int) -> tuple[float, bool]:
    err = np.abs(got - exp)
    if rotate_back:
        tol = 4 * np.sqrt(d) * 2.0**-24 * np.linalg.norm(exp, axis=-1, keepdims=True)
    else:
        tol = 8 * 2.0**-24 * np.max(np.abs(exp), axis=-1, keepdims=True)
    return float(err.max()), bool(np.all(err <= tol))


def gate(presets, *, device: str = "cuda", heads=GATE_HEADS) -> list[dict]:
    """Every preset's ``decompress`` (both ways) of 64 stored tokens against the oracle, at each
    ``(Hkv, D)`` of ``heads``."""
    g = torch.Generator(device=device).manual_seed(6)
    out = []
    for preset in presets:
        for hkv, d in heads:
            layout, params = make_layout(preset, hkv, d, device)
            _, _, slots, cache = stored_sample(layout, params, g)
            rows = ref.gather_slots(cache.cpu().numpy(), layout, slots.cpu().numpy())
            for rotate_back in (False, True):
                got = tqt.decompress(cache, slots, layout, params, rotate_back=rotate_back)
                exp = ref.decompress(rows, params.params, rotate_back=rotate_back)
                checks = [_error_ok(x.cpu().numpy().astype(np.float64), e, rotate_back, d) for x, e in zip(got, exp)]
                out.append(dict(op="decompress", preset=preset, case=f"Hkv{hkv}/D{d}" + " rotate_back" * rotate_back,
                                max_err=max(c[0] for c in checks), ok=all(c[1] for c in checks)))
    return out


def run_shape(shape: StoreShape, presets, step, *, rep_ms: int = 100, device: str = "cuda", timer=None,
              cache_tokens: int = STORE_CACHE_TOKENS) -> list[dict]:
    """Records of ``copy_`` (the baseline) and every preset's ``decompress`` of the slots a store of
    ``shape`` wrote, in its codec's space and (``rot:<preset>``) rotated back; ``step(label)`` after
    each timed variant. ``timer(fn) -> µs`` defaults to CUDA-graph replay for ``rep_ms``."""
    timer = timer or (lambda fn: graph_us(fn, rep_ms))
    g, k, v, slots = shape_inputs(shape, cache_tokens, device)
    n, h, d = shape.num_tokens, shape.num_kv_heads, shape.head_dim
    num_blocks = cache_tokens // BLOCK_SIZE
    out_bytes = 2 * n * h * d * 4  # float32 K and V
    src = (torch.randn(n, h, d, device=device, generator=g), torch.randn(n, h, d, device=device, generator=g))
    dst = (torch.empty_like(src[0]), torch.empty_like(src[1]))

    def copy():
        dst[0].copy_(src[0])
        dst[1].copy_(src[1])

    base_us = timer(copy)
    rows = [record("decompress", shape.name, BASELINE, BASELINE, base_us, base_us, nbytes=2 * out_bytes)]
    step(f"decompress {shape.name} {BASELINE}")
    src = dst = None
    for preset in presets:
        layout, params = make_layout(preset, h, d, device)
        cache = torch.zeros(layout.cache_shape(num_blocks), dtype=torch.uint8, device=device)
        tqt.store(cache, k, v, slots, layout, params)
        nbytes = n * layout.row_bytes + out_bytes
        for prefix, rotate_back in (("", False), (ROT, True)):
            if rotate_back and not has_rotated_side(preset, d):
                continue
            us = timer(lambda: tqt.decompress(cache, slots, layout, params, rotate_back=rotate_back))
            rows.append(record("decompress", shape.name, prefix + preset, BASELINE, us, base_us, nbytes=nbytes))
            step(f"decompress {shape.name} {prefix}{preset}")
        cache = None
        torch.cuda.empty_cache()
    return rows
