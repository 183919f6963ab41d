"""The decode benchmark (GPU): ``paged_decode`` of every preset against torch SDPA fp16.

Correctness first: every preset is compared once with the NumPy oracle on a small GQA batch
(lengths 1, 77, 600, 1000, shuffled blocks; Hq32/Hkv8/D128, Hq9/Hkv3/D64 and, through the runner,
each timed shape's own head geometry); a preset that fails is not timed (at a shape's own
geometry: not timed at that shape). Then, per shape: SDPA fp16 on contiguous K/V (the baseline, timed in the same
run), and the public ``paged_decode`` on a full cache with a shuffled block table, both by
CUDA-graph replay. ``bytes`` counts what each reads: K and V in fp16 for SDPA, the cache rows of
every token for a preset.

A shape with attention options (:attr:`DecodeShape.options`: Gemma-2's soft-cap, a sliding
window) times ``paged_decode`` with them and is gated with them (a window of at most
:data:`GATE_WINDOW` keys, so the gate's lengths cross it). SDPA has no soft-cap: its baseline stays
SDPA fp16 without one. A window's baseline is SDPA fp16 over the window's keys only, what a
windowed fp16 kernel (or a cache that keeps only the window) reads; ``bytes`` of both count the
window's keys.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.ops.paged_decode.triton import decode_path
from tqkern_torch.attention import paged_decode, plan_decode
from tqkern_torch.bench.report import record
from tqkern_torch.bench.shapes import BLOCK_SIZE, DECODE_PRESETS, DecodeShape
from tqkern_torch.bench.timing import eager_us, graph_us

__all__ = ["BASELINE", "EAGER_SHAPES", "GATE_WINDOW", "make_layout", "fill_cache", "gate_head", "case_name", "gate",
           "run_shape", "run_eager"]

BASELINE = "sdpa_fp16"
EAGER_SHAPES = ("B1x4K", "B32x4K", "B32x16K")
_ARRANGEMENT = dict(DECODE_PRESETS)


def make_layout(preset: str, num_kv_heads: int, head_dim: int, device: str = "cuda"):
    """``(layout, device params)`` of a benchmark preset (its arrangement from ``DECODE_PRESETS``) or
    a ``kXvYh`` format (:meth:`tqkern.KVFormat.preset`; the slot arrangement)."""
    fmt = tqkern.KVFormat.preset(preset, head_dim)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=num_kv_heads, block_size=BLOCK_SIZE,
                                arrangement=_ARRANGEMENT.get(preset, "slot"))
    return layout, tqt.to_device(tqkern.TQParams.default(fmt, seed=0), device)


def fill_cache(layout, params, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    """A cache of ``num_blocks`` with random fp16 K/V (N(0, 1)) stored into every slot, in chunks,
    on ``g``'s device."""
    dev = g.device
    cache = torch.zeros(layout.cache_shape(num_blocks), dtype=torch.uint8, device=dev)
    total = num_blocks * BLOCK_SIZE
    chunk = 1 << 17
    for t0 in range(0, total, chunk):
        n = min(chunk, total - t0)
        k = torch.randn(n, layout.num_kv_heads, layout.head_dim, device=dev, dtype=torch.float16, generator=g)
        v = torch.randn(n, layout.num_kv_heads, layout.head_dim, device=dev, dtype=torch.float16, generator=g)
        tqt.store(cache, k, v, torch.arange(t0, t0 + n, device=dev), layout, params)
    return cache


GATE_LENGTHS = (1, 77, 600, 1000)
GATE_HEADS = ((32, 8, 128), (9, 3, 64))  # (Hq, Hkv, D)
GATE_WINDOW = 255  # the gate's longest window: shorter than most of GATE_LENGTHS


def gate_head(shape: DecodeShape) -> tuple:
    """The gate's case of ``shape``: ``(Hq, Hkv, D)``, and with attention options
    ``(Hq, Hkv, D, logit_softcap, window_left)``, the window at most :data:`GATE_WINDOW`."""
    head = (shape.num_q_heads, shape.num_kv_heads, shape.head_dim)
    if not shape.options:
        return head
    w = None if shape.window_left is None else min(shape.window_left, GATE_WINDOW)
    return head + (shape.logit_softcap, w)


def case_name(head: tuple) -> str:
    """A gate case's name: ``Hq32/Hkv8/D128``, with ``cap50`` / ``win255`` for options."""
    hq, hkv, d, cap, win = (*head, None, None)[:5]
    return f"Hq{hq}/Hkv{hkv}/D{d}" + (f" cap{cap:g}" if cap is not None else "") + \
        (f" win{win}" if win is not None else "")


def gate(presets, *, device: str = "cuda", lengths=GATE_LENGTHS, heads=GATE_HEADS) -> list[dict]:
    """Every preset against the NumPy oracle; one gate entry per (preset, head case): ``heads``
    holds ``(Hq, Hkv, D)`` or, with attention options, ``(Hq, Hkv, D, logit_softcap, window_left)``
    (:func:`gate_head`).

    Tolerance: 4e-3 of the largest decompressed value (fp16 q and output, float32 softmax).
    """
    g = torch.Generator(device=device).manual_seed(1)
    out = []
    mb = -(-max(lengths) // BLOCK_SIZE)
    for preset in presets:
        for head in heads:
            hq, hkv, d, cap, win = (*head, None, None)[:5]
            opts = {k: v for k, v in (("logit_softcap", cap), ("window_left", win)) if v is not None}
            layout, params = make_layout(preset, hkv, d, device)
            lens = torch.tensor(lengths, dtype=torch.int32, device=device)
            bt = torch.randperm(len(lengths) * mb, device=device, generator=g).int().reshape(len(lengths), mb)
            cache = fill_cache(layout, params, len(lengths) * mb, g)
            q = torch.randn(len(lengths), hq, d, device=device, dtype=torch.float16, generator=g)
            exp = ref.paged_decode(q.float().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(),
                                   lens.cpu().numpy(), layout, params.params, **opts)
            _, v = tqt.decompress_sequences(cache, bt, lens, layout, params, rotate_back=True)
            tol = 4e-3 * float(v.abs().max())
            got = paged_decode(q, cache, bt, lens, layout, params, **opts)
            err = float(np.abs(got.float().cpu().numpy() - exp).max())
            out.append(dict(op="decode", preset=preset, case=case_name(head),
                            path=decode_path(layout, hq // hkv, same_codebooks=params.same_codebooks),
                            max_err=err, tol=tol, ok=bool(np.isfinite(err) and err <= tol)))
    return out


def _inputs(shape: DecodeShape, g: torch.Generator, timer):
    """q (fp16), the SDPA fp16 time (µs, by ``timer``) on contiguous K/V of the keys the shape's
    query attends to (:attr:`DecodeShape.keys_read`), a shuffled block table and full lengths, on
    ``g``'s device."""
    b, L, hq, hkv, d = shape.batch, shape.seq_len, shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    dev = g.device
    q = torch.randn(b, hq, d, device=dev, dtype=torch.float16, generator=g)
    k = torch.randn(b, hkv, shape.keys_read, d, device=dev, dtype=torch.float16, generator=g)
    v = torch.randn(b, hkv, shape.keys_read, d, device=dev, dtype=torch.float16, generator=g)
    sdpa = timer(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
    k = v = None  # freed before the caches are filled
    bt = torch.randperm(b * L // BLOCK_SIZE, device=dev, generator=g).int().reshape(b, L // BLOCK_SIZE)
    sl = torch.full((b,), L, dtype=torch.int32, device=dev)
    return q, sdpa, bt, sl


def run_shape(shape: DecodeShape, presets, step, *, rep_ms: int = 100, device: str = "cuda",
              timer=None) -> list[dict]:
    """Records of the SDPA baseline and every preset at ``shape``; ``step(label)`` is called after
    each timed variant. ``timer(fn) -> µs`` defaults to CUDA-graph replay for ``rep_ms``."""
    timer = timer or (lambda fn: graph_us(fn, rep_ms))
    g = torch.Generator(device=device).manual_seed(0)
    b, L, hkv, d = shape.batch, shape.seq_len, shape.num_kv_heads, shape.head_dim
    q, sdpa_us, bt, sl = _inputs(shape, g, timer)
    n = shape.keys_read
    rows = [record("decode", shape.name, BASELINE, BASELINE, sdpa_us, sdpa_us, nbytes=2 * b * hkv * n * d * 2)]
    step(f"decode {shape.name} {BASELINE}")
    for preset in presets:
        layout, params = make_layout(preset, hkv, d, device)
        cache = fill_cache(layout, params, b * L // BLOCK_SIZE, g)
        out = torch.empty_like(q)
        us = timer(lambda: paged_decode(q, cache, bt, sl, layout, params, out=out, check_lengths=False,
                                        **shape.options))
        plan = plan_decode(q, cache, bt, layout, params, **shape.options).summary()
        rows.append(record("decode", shape.name, preset, BASELINE, us, sdpa_us, nbytes=b * n * layout.row_bytes,
                           plan=plan))
        step(f"decode {shape.name} {preset}")
        cache = None
        torch.cuda.empty_cache()
    return rows


def run_eager(shape: DecodeShape, presets, step, *, timer=None) -> list[dict]:
    """Eager (no CUDA graph) ``paged_decode`` with default arguments against eager SDPA fp16
    (``timer(fn) -> µs``, default :func:`~tqkern_torch.bench.timing.eager_us`)."""
    timer = timer or eager_us
    g = torch.Generator(device="cuda").manual_seed(3)
    q, sdpa_us, bt, sl = _inputs(shape, g, timer)
    rows = [record("decode", shape.name, BASELINE, BASELINE, sdpa_us, sdpa_us, mode="eager")]
    step(f"eager {shape.name} {BASELINE}")
    for preset in presets:
        layout, params = make_layout(preset, shape.num_kv_heads, shape.head_dim)
        cache = fill_cache(layout, params, shape.batch * shape.seq_len // BLOCK_SIZE, g)
        us = timer(lambda: paged_decode(q, cache, bt, sl, layout, params, **shape.options))
        rows.append(record("decode", shape.name, preset, BASELINE, us, sdpa_us, mode="eager"))
        step(f"eager {shape.name} {preset}")
        cache = None
        torch.cuda.empty_cache()
    return rows
