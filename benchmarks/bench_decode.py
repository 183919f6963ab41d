"""GPU benchmark of paged_decode (every preset) and store, against torch SDPA fp16 and copy_.

One run: correctness gate against the NumPy oracle first (a variant that fails is not timed),
then timings (CUDA events, median of ``triton.testing.do_bench``), a short table printed last,
and everything as JSON under ``--out``.

    python benchmarks/bench_decode.py --out $OUT            # all shapes
    python benchmarks/bench_decode.py --shapes B32x16K --sweep
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tqkern  # noqa: E402
import tqkern_torch as tqt  # noqa: E402
from benchmarks._gpu import require_cuda  # noqa: E402
from benchmarks.shapes import DECODE_PRESETS, DECODE_SHAPES, STORE_SHAPE, decode_shape  # noqa: E402
from tqkern import reference as ref  # noqa: E402
from tqkern.ops.paged_decode.triton import _launch_paged_decode, decode_path  # noqa: E402
from tqkern_torch.attention import paged_decode  # noqa: E402

BLOCK = 16
# (BN, warps, stages, maxnreg)
SWEEP_CONFIGS = ((64, 4, 2, 0), (128, 4, 1, 0), (128, 4, 2, 0), (128, 4, 3, 0), (128, 4, 2, 128), (128, 8, 2, 0),
                 (256, 4, 2, 0), (256, 8, 2, 0))


def bench(fn) -> float:
    """Median microseconds of GPU time: the call is captured in a CUDA graph and replayed
    (``triton.testing.do_bench_cudagraph``), so Python launch overhead, which serving stacks
    also remove with graphs, does not count for any variant, the SDPA baseline included."""
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def make_layout(preset, arrangement, hkv, d):
    fmt = tqkern.KVFormat.preset(preset, d)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=hkv, block_size=BLOCK, arrangement=arrangement)
    return layout, tqt.to_device(tqkern.TQParams.default(fmt, seed=0), "cuda")


def q_rotated(q, layout, params):
    """q in the keys' rotated coordinates, float32 (what the kernels read)."""
    return ((q.float() @ params.rotation) if layout.format.key.rotated else q.float()).contiguous()


def fill_cache(layout, params, num_blocks, g):
    """Random fp16 K/V (N(0,1)) stored into every slot of the cache, in chunks."""
    cache = torch.zeros(layout.cache_shape(num_blocks), dtype=torch.uint8, device="cuda")
    total = num_blocks * BLOCK
    chunk = 1 << 17
    for t0 in range(0, total, chunk):
        n = min(chunk, total - t0)
        k = torch.randn(n, layout.num_kv_heads, layout.head_dim, device="cuda", dtype=torch.float16, generator=g)
        v = torch.randn(n, layout.num_kv_heads, layout.head_dim, device="cuda", dtype=torch.float16, generator=g)
        tqt.store(cache, k, v, torch.arange(t0, t0 + n, device="cuda"), layout, params)
    return cache


def oracle_case(preset, arrangement, hq, hkv, d, g):
    """A small GQA batch for the sweeps' correctness gate: 4 sequences (lengths 1, 77, 600, 1000,
    shuffled blocks), fp16 q, the NumPy oracle's output and the tolerance (4e-3 of 4·max|out|).
    Returns (layout, params, q, cache, block_table, seq_lens, expected, tol)."""
    layout, params = make_layout(preset, arrangement, hkv, d)
    lens = torch.tensor([1, 77, 600, 1000], dtype=torch.int32, device="cuda")
    bt = torch.randperm(4 * 64, device="cuda", generator=g).int().reshape(4, 64)
    cache = fill_cache(layout, params, 4 * 64, g)
    q = torch.randn(4, hq, d, device="cuda", dtype=torch.float16, generator=g)
    exp = ref.paged_decode(q.float().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(), lens.cpu().numpy(),
                           layout, params.params)
    return layout, params, q, cache, bt, lens, exp, 4e-3 * (float(np.abs(exp).max()) * 4 + 1e-6)


def shape_inputs(shape, g, timer=None):
    """For a decode shape: q (fp16), the SDPA fp16 time (µs, by ``timer``: :func:`bench` by
    default) on contiguous K/V of the shape (the baseline, measured now), a shuffled block table
    and full lengths."""
    b, L, hq, hkv, d = shape.batch, shape.seq_len, shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(b, hkv, L, d, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(b, hkv, L, d, device="cuda", dtype=torch.float16, generator=g)
    sdpa = (timer or bench)(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
    del k, v
    bt = torch.randperm(b * L // BLOCK, device="cuda", generator=g).int().reshape(b, L // BLOCK)
    sl = torch.full((b,), L, dtype=torch.int32, device="cuda")
    return q, sdpa, bt, sl


def baseline_runs(names, g, rows):
    """For each decode shape named in ``names`` (:func:`benchmarks.shapes.decode_shape`): ``(shape, q, sdpa_us, block_table, seq_lens)``
    from :func:`shape_inputs`, with the SDPA row appended to ``rows`` and printed."""
    for shape in map(decode_shape, names):
        q, sdpa, bt, sl = shape_inputs(shape, g)
        rows.append(dict(shape=shape.name, variant="sdpa_fp16", us=sdpa))
        print(f"{shape.name} sdpa_fp16 {sdpa:.1f} us", flush=True)
        yield shape, q, sdpa, bt, sl


def preset_caches(shape, presets, g):
    """For each preset in ``presets``: ``(preset, layout, params, cache)``, a full cache of the
    shape (every block written, :func:`fill_cache`); the cache is freed before the next one."""
    arr = dict(DECODE_PRESETS)
    for preset in presets:
        layout, params = make_layout(preset, arr[preset], shape.num_kv_heads, shape.head_dim)
        cache = fill_cache(layout, params, shape.batch * shape.seq_len // BLOCK, g)
        yield preset, layout, params, cache
        del cache
        torch.cuda.empty_cache()


def gate(results, presets):
    """Every preset against the NumPy oracle on a small GQA batch with shuffled blocks."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for preset, arr in DECODE_PRESETS:
        if preset not in presets:
            continue
        for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
            layout, params = make_layout(preset, arr, hkv, d)
            lens = torch.tensor([1, 77, 600, 1000], dtype=torch.int32, device="cuda")
            mb = 64
            nb = 4 * mb
            bt = torch.randperm(nb, device="cuda", generator=g).int().reshape(4, mb)
            cache = fill_cache(layout, params, nb, g)
            q = torch.randn(4, hq, d, device="cuda", dtype=torch.float16, generator=g)
            exp = ref.paged_decode(q.float().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(),
                                   lens.cpu().numpy(), layout, params.params)
            _, v = tqt.decompress_sequences(cache, bt, lens, layout, params, rotate_back=True)
            tol = 4e-3 * float(v.abs().max())
            path = decode_path(layout, hq // hkv, same_codebooks=params.same_codebooks)
            out = paged_decode(q, cache, bt, lens, layout, params)
            err = float(np.abs(out.float().cpu().numpy() - exp).max())
            ok = bool(np.isfinite(err) and err <= tol)
            results["gate"].append(dict(preset=preset, hq=hq, hkv=hkv, d=d, path=path, max_err=err, tol=tol, ok=ok))
            print(f"gate {preset:20s} Hq{hq}/Hkv{hkv}/D{d} [{path}]: max err {err:.2e} (tol {tol:.2e}) "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
    return {r["preset"] for r in results["gate"] if r["ok"]} - {r["preset"] for r in results["gate"] if not r["ok"]}


def run_decode(shape, passed, results, sweep):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, L, hq, hkv, d = shape.batch, shape.seq_len, shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    # SDPA fp16 on contiguous K/V (the baseline), GQA through enable_gqa.
    q, sdpa_us, bt, sl = shape_inputs(shape, g)
    sdpa_bytes = 2 * b * hkv * L * d * 2
    row = dict(shape=shape.name, variant="sdpa_fp16", us=sdpa_us, bytes=sdpa_bytes,
               gbps=sdpa_bytes / sdpa_us / 1e3, ratio=1.0)
    results["decode"].append(row)
    print(f"{shape.name:16s} sdpa_fp16            {sdpa_us:9.1f} us {row['gbps']:8.0f} GB/s", flush=True)
    nb = b * L // BLOCK
    for preset, arr in DECODE_PRESETS:
        if preset not in passed:
            continue
        layout, params = make_layout(preset, arr, hkv, d)
        cache = fill_cache(layout, params, nb, g)
        out = torch.empty_like(q)
        us = bench(lambda: paged_decode(q, cache, bt, sl, layout, params, out=out, check_lengths=False))
        nbytes = b * L * layout.row_bytes
        row = dict(shape=shape.name, variant=preset, us=us, bytes=nbytes, gbps=nbytes / us / 1e3,
                   ratio=sdpa_us / us, slot_bytes=layout.format.slot_bytes)
        results["decode"].append(row)
        print(f"{shape.name:16s} {preset:20s} {us:9.1f} us {row['gbps']:8.0f} GB/s  {row['ratio']:.2f}x SDPA",
              flush=True)
        row["path"] = decode_path(layout, hq // hkv, same_codebooks=params.same_codebooks)
        if preset in ("tq4", "turboquant_4bit_nc") and decode_path(layout, hq // hkv,
                                                                   same_codebooks=params.same_codebooks) == "mma":
            # the session-2 kernel (word path) in the same run, for the comparison
            q_rot = q_rotated(q, layout, params)
            t = bench(lambda: _launch_paged_decode(out, q_rot, cache, bt, sl, layout, params.tables(),
                                                   sm_scale=d**-0.5, interpret=False, path="general",
                                                   same_codebooks=params.same_codebooks))
            row = dict(shape=shape.name, variant=preset + "[word path]", us=t, bytes=nbytes, gbps=nbytes / t / 1e3,
                       ratio=sdpa_us / t, slot_bytes=layout.format.slot_bytes)
            results["decode"].append(row)
            print(f"{shape.name:16s} {row['variant']:20s} {t:9.1f} us {row['gbps']:8.0f} GB/s  {row['ratio']:.2f}x SDPA",
                  flush=True)
        if sweep and preset in ("tq4", "turboquant_4bit_nc") and shape.name == "B32x16K":
            q_rot = q_rotated(q, layout, params)
            configs = [("general", *c) for c in SWEEP_CONFIGS]
            for path, bn, nw, ns, mr in configs:
                try:
                    t = bench(lambda: _launch_paged_decode(out, q_rot, cache, bt, sl, layout,
                                                            params.tables(), sm_scale=d**-0.5,
                                                            interpret=False, block_n=bn, num_warps=nw,
                                                            num_stages=ns, path=path, maxnreg=mr or None,
                                                            same_codebooks=params.same_codebooks))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a data point
                    t = float("nan")
                    print("  sweep fail", bn, nw, ns, type(e).__name__, str(e)[:100])
                results["sweep"].append(dict(shape=shape.name, variant=preset, path=path, block_n=bn,
                                             num_warps=nw, num_stages=ns, maxnreg=mr, us=t))
                print(f"  sweep {preset} {path} BN{bn} W{nw} S{ns} R{mr}: {t:.1f} us", flush=True)
        del cache
        torch.cuda.empty_cache()


EAGER_SHAPES = ("B1x4K", "B32x4K", "B32x16K")


def eager_us(fn, iters: int = 200) -> float:
    """Mean microseconds per call of ``fn`` called from Python without a CUDA graph (as
    transformers' ``generate`` calls attention): host overhead and launches included."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def run_eager(results, names, presets):
    """Eager (no CUDA graph) paged_decode with default arguments against eager SDPA fp16."""
    g = torch.Generator(device="cuda").manual_seed(3)
    for shape in map(decode_shape, names):
        q, sdpa, bt, sl = shape_inputs(shape, g, timer=eager_us)
        results["eager"].append(dict(shape=shape.name, variant="sdpa_fp16", us=sdpa, ratio=1.0))
        print(f"eager {shape.name:10s} sdpa_fp16            {sdpa:8.1f} us", flush=True)
        arr = dict(DECODE_PRESETS)
        for preset in presets:
            layout, params = make_layout(preset, arr[preset], shape.num_kv_heads, shape.head_dim)
            cache = fill_cache(layout, params, shape.batch * shape.seq_len // BLOCK, g)
            us = eager_us(lambda: paged_decode(q, cache, bt, sl, layout, params))
            results["eager"].append(dict(shape=shape.name, variant=preset, us=us, ratio=us / sdpa))
            print(f"eager {shape.name:10s} {preset:20s} {us:8.1f} us = {us / sdpa:.2f}x SDPA's time", flush=True)
            del cache
            torch.cuda.empty_cache()


def run_store(results, sweep):
    n, h, d = STORE_SHAPE["num_tokens"], STORE_SHAPE["num_kv_heads"], STORE_SHAPE["head_dim"]
    g = torch.Generator(device="cuda").manual_seed(2)
    k = torch.randn(n, h, d, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(n, h, d, device="cuda", dtype=torch.float16, generator=g)
    src = torch.cat([k.reshape(-1), v.reshape(-1)])
    dst = torch.empty_like(src)
    copy_us = bench(lambda: dst.copy_(src))
    in_bytes = src.numel() * 2
    copy_gbps = 2 * in_bytes / copy_us / 1e3
    results["store"].append(dict(variant="copy_", us=copy_us, gbps=copy_gbps))
    print(f"store copy_ {copy_us:.1f} us {copy_gbps:.0f} GB/s (read+write)", flush=True)
    slots = torch.randperm(n, device="cuda")
    for preset, arr in DECODE_PRESETS:
        layout, params = make_layout(preset, arr, h, d)
        cache = torch.zeros(layout.cache_shape(n // BLOCK), dtype=torch.uint8, device="cuda")
        us = bench(lambda: tqt.store(cache, k, v, slots, layout, params))
        nbytes = in_bytes + n * layout.row_bytes
        gbps = nbytes / us / 1e3
        results["store"].append(dict(variant=preset, us=us, gbps=gbps, ratio_to_copy=gbps / copy_gbps))
        print(f"store {preset:20s} {us:8.1f} us {gbps:7.0f} GB/s = {gbps / copy_gbps:.0%} of copy_", flush=True)
        if sweep and preset in ("tq4", "turboquant_4bit_nc", "fp16"):
            from tqkern.ops.store.triton import _launch_store

            for bt in (16, 32, 64):
                for nw in (2, 4, 8):
                    t = bench(lambda: _launch_store(cache, k, v, slots, layout, params.tables(), interpret=False,
                                                    block_tokens=bt, num_warps=nw))
                    results["sweep"].append(dict(op="store", variant=preset, block_tokens=bt, num_warps=nw, us=t))
                    print(f"  sweep store {preset} BT{bt} W{nw}: {t:.1f} us", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="*", default=[s.name for s in DECODE_SHAPES])
    ap.add_argument("--presets", nargs="*", default=[p for p, _ in DECODE_PRESETS])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-store", action="store_true")
    ap.add_argument("--eager", nargs="*", default=None, metavar="SHAPE",
                    help=f"also time eager calls (no CUDA graph) at these shapes (default {' '.join(EAGER_SHAPES)})")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    results = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   time=time.strftime("%Y-%m-%d %H:%M:%S"), gate=[], decode=[], sweep=[], store=[],
                   eager=[])
    passed = gate(results, args.presets)
    if not args.no_store:
        run_store(results, args.sweep)
    for shape in DECODE_SHAPES:
        if shape.name in args.shapes:
            run_decode(shape, passed, results, args.sweep)
    if args.eager is not None:
        run_eager(results, args.eager or EAGER_SHAPES, [p for p in ("tq4", "turboquant_4bit_nc") if p in passed])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{results['gpu']}  torch {results['torch']}  triton {results['triton']}")
    print(f"{'shape':16s} {'variant':20s} {'us':>9s} {'GB/s':>7s} {'vs SDPA':>8s}")
    for r in results["decode"]:
        print(f"{r['shape']:16s} {r['variant']:20s} {r['us']:9.1f} {r['gbps']:7.0f} {r['ratio']:7.2f}x")
    for r in results["eager"]:
        print(f"eager {r['shape']:10s} {r['variant']:20s} {r['us']:9.1f} us {r['ratio']:6.2f}x SDPA's time")
    for r in results["store"]:
        extra = f" {r['ratio_to_copy']:.0%} of copy_" if "ratio_to_copy" in r else ""
        print(f"store {r['variant']:20s} {r['us']:8.1f} us {r['gbps']:7.0f} GB/s{extra}")
    return 0 if all(r["ok"] for r in results["gate"]) else 1


if __name__ == "__main__":
    sys.exit(main())
