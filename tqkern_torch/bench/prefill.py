"""The prefill benchmark (GPU): ``prefill`` of every preset against torch SDPA fp16 with the same
bottom-right causal mask on contiguous uncompressed K/V, and against what a user can do without a
prefill kernel (``decompress_sequences`` of the whole context, then SDPA).

Correctness first: each preset's ``prefill`` on two small mixed batches over contexts of 40, 60
and 20 tokens (shuffled blocks), query lengths 1, 5 and 20 (the prefill kernel) and 1, 5 and 3
(the short-row path), against the NumPy oracle, to 4e-3 of 4·max|out| (the decode gate's bound);
a preset that fails is not timed.

Then, per shape (:data:`~tqkern_torch.bench.shapes.PREFILL_SHAPES`): ``num_seqs`` sequences, each
with ``context`` tokens of which the last ``q_len`` are the new ones (all already in the cache, as
``prefill`` expects). ``flops`` (reported as ``tflops``): ``4·D·Hq`` per visible (query, key) pair,
the causal count; every variant of a shape is credited the same FLOPs, so its TFLOP/s ratio is its
speed-up. ``prefill`` gets ``max_query_len = q_len`` and the host lengths (as a serving stack
passes them) and returns its own output, as SDPA does: shapes of at most
:data:`~tqkern_torch.short_rows.SHORT_QUERY_MAX` new tokens take the short-row path, longer ones
the tiled path; ``out:<first preset>`` times the same call writing into a given ``out`` (a
serving stack's output buffer: a one-piece tiled call then copies the dense kernel's output
into it), ``fused:<first preset>`` the fused prefill kernel (no host lengths), ``cap:<preset>``
(shapes longer than the short-row limit) ``prefill`` with a logit soft-cap of 50 (Gemma-2's; SDPA
has no cap: its baseline stays SDPA fp16 without one). Short
shapes also time ``sdpa_fp16_1token``: SDPA fp16 of one new token per sequence over the same
context (what the issue's speculative goal is measured against). All by CUDA-graph replay.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern_torch.bench.decode import make_layout
from tqkern_torch.bench.report import record
from tqkern_torch.bench.shapes import PrefillShape
from tqkern_torch.bench.timing import graph_us
from tqkern_torch.short_rows import SHORT_QUERY_MAX

__all__ = ["BASELINE", "DECOMPRESS_SDPA", "SDPA_1TOKEN", "batch", "causal_flops", "gate", "run_shape"]

BASELINE = "sdpa_fp16"
DECOMPRESS_SDPA = "decompress_sdpa"
INT8 = "int8"  # variant ``int8:<preset>``: ``int8_prefill`` of that preset
FUSED = "fused"  # variant ``fused:<preset>``: the fused prefill kernel (no host lengths given)
OUT = "out"  # variant ``out:<preset>``: prefill writing into a given ``out``
SDPA_1TOKEN = "sdpa_fp16_1token"  # SDPA fp16 of one new token per sequence (short shapes)
CAP = "cap"  # variant ``cap:<preset>``: prefill with logit_softcap=SOFTCAP (long shapes; SDPA has no cap)
SOFTCAP = 50.0  # Gemma-2's attention soft-cap


def causal_flops(shape: PrefillShape) -> int:
    """``4·D·Hq`` per visible pair: query ``i`` (position ``context − q_len + i``) sees
    ``context − q_len + i + 1`` keys (Q·Kᵀ and P·V, two FLOPs per multiply-add)."""
    prefix = shape.context - shape.q_len
    pairs = shape.q_len * prefix + shape.q_len * (shape.q_len + 1) // 2
    return 4 * shape.head_dim * shape.num_q_heads * shape.num_seqs * pairs


def batch(layout, params, lens, q_lens, hq, g, device):
    """A filled paged cache (shuffled blocks) and the prefill arguments for sequences of ``lens``
    tokens whose last ``q_lens`` are the queries."""
    bs = layout.block_size
    per = max(-(-n // bs) for n in lens)
    num_blocks = len(lens) * per
    bt = torch.randperm(num_blocks, device=device, generator=g).int().view(len(lens), per)
    cache = torch.zeros(layout.cache_shape(num_blocks), dtype=torch.uint8, device=device)
    h, d = layout.num_kv_heads, layout.head_dim
    for i, n in enumerate(lens):
        pos = torch.arange(n, device=device)
        slots = (bt[i].long()[pos // bs] * bs + pos % bs)
        k = torch.randn(n, h, d, device=device, dtype=torch.float16, generator=g)
        v = torch.randn(n, h, d, device=device, dtype=torch.float16, generator=g)
        tqt.store(cache, k, v, slots, layout, params)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=device)
    q = torch.randn(int(sum(q_lens)), hq, d, device=device, dtype=torch.float16, generator=g)
    return cache, bt, sl, qsl, q


def gate(presets, *, device: str = "cuda", heads=((2, 64),), hq_per_kv: int = 2) -> list[dict]:
    """Every preset's ``prefill`` against the oracle on a mixed batch, at each ``(Hkv, D)``."""
    g = torch.Generator(device=device).manual_seed(5)
    out = []
    for preset in presets:
        for hkv, d in heads:
            layout, params = make_layout(preset, hkv, d, device)
            for q_lens, path in (([1, 5, 20], ""), ([1, 5, 3], " short rows")):
                cache, bt, sl, qsl, q = batch(layout, params, [40, 60, 20], q_lens, hkv * hq_per_kv, g, device)
                got = tqt.prefill(q, cache, bt, sl, qsl, layout, params).float().cpu().numpy()
                exp = ref.prefill(q.float().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(), sl.cpu().numpy(),
                                  qsl.cpu().numpy(), layout, params.params)
                err = float(np.abs(got - exp).max())
                tol = 4e-3 * (float(np.abs(exp).max()) * 4 + 1e-6)
                out.append(dict(op="prefill", preset=preset, case=f"Hkv{hkv}/D{d}{path}", max_err=err, tol=tol,
                                ok=err <= tol))
    return out


def run_shape(shape: PrefillShape, presets, step, *, rep_ms: int = 100, device: str = "cuda", timer=None,
              decompress_baseline: bool = True) -> list[dict]:
    """Records of SDPA fp16 (the baseline), every preset's ``prefill`` and ``int8_prefill``
    (``int8:<preset>``) and, with ``decompress_baseline``, decompress-then-SDPA of the first
    preset, at ``shape``;
    ``step(label)`` after each timed variant. ``timer(fn) -> µs`` defaults to CUDA-graph replay."""
    timer = timer or (lambda fn: graph_us(fn, rep_ms))
    g = torch.Generator(device=device).manual_seed(3)
    b, hq, hkv, d, n, lq = (shape.num_seqs, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.context,
                            shape.q_len)
    flops = causal_flops(shape)
    k = torch.randn(b, hkv, n, d, device=device, dtype=torch.float16, generator=g)
    v = torch.randn_like(k)
    q4 = torch.randn(b, hq, lq, d, device=device, dtype=torch.float16, generator=g)
    # bottom-right causal: query i at position n − lq + i sees keys 0 .. n − lq + i
    mask = torch.arange(n, device=device)[None, :] <= (n - lq + torch.arange(lq, device=device))[:, None]

    def sdpa():
        if lq == n:
            return F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=hq != hkv)
        return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=hq != hkv)

    base_us = timer(sdpa)
    rows = [record("prefill", shape.name, BASELINE, BASELINE, base_us, base_us, flops=flops)]
    step(f"prefill {shape.name} {BASELINE}")
    if lq <= SHORT_QUERY_MAX:
        q1 = q4[:, :, -1:].contiguous()
        us = timer(lambda: F.scaled_dot_product_attention(q1, k, v, enable_gqa=hq != hkv))
        rows.append(record("prefill", shape.name, SDPA_1TOKEN, BASELINE, us, base_us))
        step(f"prefill {shape.name} {SDPA_1TOKEN}")
    k = v = None
    q = q4.transpose(1, 2).reshape(b * lq, hq, d).contiguous()
    for i, preset in enumerate(presets):
        layout, params = make_layout(preset, hkv, d, device)
        cache, bt, sl, qsl, _ = batch(layout, params, [n] * b, [lq] * b, hq, g, device)
        out = torch.empty_like(q)
        host = dict(query_start_loc_cpu=qsl.cpu(), seq_lens_cpu=sl.cpu())
        us = timer(lambda: tqt.prefill(q, cache, bt, sl, qsl, layout, params, max_query_len=lq, **host))
        rows.append(record("prefill", shape.name, preset, BASELINE, us, base_us, flops=flops))
        step(f"prefill {shape.name} {preset}")
        if i == 0:
            us = timer(lambda: tqt.prefill(q, cache, bt, sl, qsl, layout, params, out=out, max_query_len=lq, **host))
            rows.append(record("prefill", shape.name, f"{OUT}:{preset}", BASELINE, us, base_us, flops=flops))
            step(f"prefill {shape.name} {OUT}:{preset}")
        if i == 0 and lq > SHORT_QUERY_MAX:  # the fused kernel: no host lengths under capture
            us = timer(lambda: tqt.prefill(q, cache, bt, sl, qsl, layout, params, out=out, max_query_len=lq))
            rows.append(record("prefill", shape.name, f"{FUSED}:{preset}", BASELINE, us, base_us, flops=flops))
            step(f"prefill {shape.name} {FUSED}:{preset}")
        if lq > SHORT_QUERY_MAX:  # soft-capped (Gemma-2): the tiled path's Triton kernel (cuDNN has no cap)
            us = timer(lambda: tqt.prefill(q, cache, bt, sl, qsl, layout, params, logit_softcap=SOFTCAP,
                                           max_query_len=lq, **host))
            rows.append(record("prefill", shape.name, f"{CAP}:{preset}", BASELINE, us, base_us, flops=flops))
            step(f"prefill {shape.name} {CAP}:{preset}")
        us = timer(lambda: tqt.int8_prefill(q, cache, bt, sl, qsl, layout, params, max_query_len=lq, **host))
        rows.append(record("prefill", shape.name, f"{INT8}:{preset}", BASELINE, us, base_us, flops=flops))
        step(f"prefill {shape.name} {INT8}:{preset}")
        if decompress_baseline and i == 0:
            def decompress_sdpa():
                kk, vv = tqt.decompress_sequences(cache, bt, sl, layout, params, rotate_back=True)
                kk, vv = kk[:, :n].transpose(1, 2).half(), vv[:, :n].transpose(1, 2).half()
                return F.scaled_dot_product_attention(q4, kk, vv, attn_mask=mask, enable_gqa=hq != hkv)
            us = timer(decompress_sdpa)
            rows.append(record("prefill", shape.name, f"{DECOMPRESS_SDPA}:{preset}", BASELINE, us, base_us,
                               flops=flops))
            step(f"prefill {shape.name} {DECOMPRESS_SDPA}")
        cache = None
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


