"""A/B the public ``paged_decode`` under launch variants, against SDPA fp16 in the same run.

Variants change how the public path launches (the merge kernel), never what it computes: each variant's output is first compared with
the plain variant's on the benchmark inputs (bit-exact where the arithmetic is the same, else
within 1e-5 of the output's scale); a variant that differs is reported and not timed. Timing is
CUDA-graph replay (``bench_decode.bench``).

    python benchmarks/ab_public.py --out $OUT [--shapes B32x16K B8x64K] [--presets tq4 turboquant_4bit_nc]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._gpu import require_cuda  # noqa: E402
from benchmarks.bench_decode import baseline_runs, bench, preset_caches  # noqa: E402
from tqkern.ops.paged_decode import triton as pdt  # noqa: E402
from tqkern_torch.attention import paged_decode  # noqa: E402


@contextlib.contextmanager
def variant(merge: str | None = None):
    """The merge kernel (``impl`` of ``_launch_merge``; None: the launcher's default). (Register
    caps of the warp-MMA kernel: ``sweep_mma.py --maxnreg``.)"""
    old_merge = pdt._launch_merge
    if merge is not None:
        pdt._launch_merge = lambda *a, **k: old_merge(*a, **{**k, "impl": merge})
    try:
        yield
    finally:
        pdt._launch_merge = old_merge


# Session 5 run 1 also had programmatic dependent launch and a two-launch merge here (both
# slower, removed: docs/performance.md §19, the code is in commit d537786).
VARIANTS = {
    "default": dict(),
    "merge-rows": dict(merge="rows"),
    "merge-heads": dict(merge="heads"),
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="*", default=["B32x16K", "B8x64K", "B32x4K", "B128x1K", "SmolLM2_B32x4K"])
    ap.add_argument("--presets", nargs="*", default=["tq4", "turboquant_4bit_nc"])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = ap.parse_args(argv)
    require_cuda(__file__)
    res = dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__,
               time=time.strftime("%F %T"), rows=[], checks=[])
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape, q, sdpa, bt, sl in baseline_runs(args.shapes, g, res["rows"]):
        for preset, layout, params, cache in preset_caches(shape, args.presets, g):
            out = torch.empty_like(q)
            ref_out = None
            for name in args.variants:
                spec = VARIANTS[name]
                with variant(**spec):
                    got = paged_decode(q, cache, bt, sl, layout, params, check_lengths=False)
                    torch.cuda.synchronize()
                    if ref_out is None:
                        ref_out = got
                    exact = not spec
                    err = float((got.float() - ref_out.float()).abs().max())
                    scale = float(ref_out.float().abs().max())
                    ok = bool(torch.isfinite(got).all()) and (err == 0.0 if exact else err <= 1e-5 * scale + 1e-3)
                    res["checks"].append(dict(shape=shape.name, preset=preset, variant=name, err=err, exact=exact,
                                              ok=ok))
                    if not ok:
                        print(f"{shape.name} {preset} {name}: output differs from {args.variants[0]} "
                              f"(max err {err:.3e}); not timed", flush=True)
                        continue
                    us = bench(lambda: paged_decode(q, cache, bt, sl, layout, params, out=out, check_lengths=False))
                res["rows"].append(dict(shape=shape.name, variant=preset, launch=name, us=us, ratio=sdpa / us,
                                        err=err))
                print(f"{shape.name} {preset:20s} {name:10s} {us:8.1f} us {sdpa / us:.2f}x SDPA (err {err:.1e})",
                      flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab_public.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{res['gpu']} torch {res['torch']} triton {res['triton']}")
    for r in res["rows"]:
        if r["variant"] == "sdpa_fp16":
            print(f"{r['shape']:16s} sdpa_fp16 {r['us']:8.1f} us")
        else:
            print(f"{r['shape']:16s} {r['variant']:20s} {r['launch']:10s} {r['us']:8.1f} us {r['ratio']:.2f}x")
    return 0 if all(c["ok"] for c in res["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
