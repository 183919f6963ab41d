"""Sweep the warp-MMA decode kernel's launch options on the GPU, against SDPA fp16 in the same run.

Every configuration is first checked against the NumPy oracle on a small batch (a config that
fails is reported and not timed), then timed with CUDA-graph replay at the named shapes.

    python benchmarks/sweep_mma.py --out $OUT [--shapes B32x16K B8x64K] [--presets tq4 turboquant_4bit_nc]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import NamedTuple

import numpy as np
import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._gpu import require_cuda  # noqa: E402
from benchmarks.bench_decode import baseline_runs, bench, oracle_case, preset_caches, q_rotated  # noqa: E402
from benchmarks.shapes import DECODE_PRESETS  # noqa: E402
from tqkern.ops.paged_decode.merge import _launch_merge  # noqa: E402
from tqkern.ops.paged_decode.mma_launch import _launch_paged_decode_mma, resident_warps  # noqa: E402
from tqkern.ops.paged_decode.mma_plans import coop_plan, mma_plan, num_splits_mma, per_warp_plan  # noqa: E402
from tqkern.ops.paged_decode.rotate import rotate_q  # noqa: E402
from tqkern.ops.paged_decode.triton import _workspace  # noqa: E402


def plan_for(layout, g, sub=0, coop=0, t256=-1, late_v=-1):
    """The launcher's plan, with ``sub`` 16-token steps per softmax update (0: the plan's) and
    CTA-cooperative stages (``coop``: their number,
    -1 the plan's own choice, 0 none); ``t256 = 0`` keeps the 32 KB pair table where the plan
    would take the PRMT-addressed one (-1: the plan's choice); ``late_v`` 0 / 1 reads the values
    with the keys / after the softmax update under the stages (-1: the plan's choice)."""
    plan = mma_plan(layout, g)
    if plan is None:
        return None
    plan = per_warp_plan(plan) if coop >= 0 else plan
    if sub:
        plan = dict(plan, SUB=sub)
    if coop > 0:
        plan = coop_plan(plan, layout, coop)
    if plan is not None and t256 == 0:
        plan = {k: v for k, v in plan.items() if k not in ("LUT_AT", "NLOW")}
    if plan is not None and late_v >= 0 and plan.get("COOP"):
        plan = dict(plan, LATE_V=late_v)
    return plan


def resident_for(q, cache, bt, sl, layout, params, plan, *, warps=4, prefetch=None, hint=1, maxnreg=None):
    """Warps of ``plan``'s compiled kernel the GPU holds at once (what the launcher's split count
    is made from)."""
    g = q.shape[1] // layout.num_kv_heads
    return resident_warps(q_rotated(q, layout, params), cache, bt, sl, layout, plan, params.key_centroids_f32,
                          group=g, warps=warps, prefetch=prefetch, hint=hint, maxnreg=maxnreg,
                          value_centroids_f32=params.value_centroids_f32)


def launch(q, cache, bt, sl, layout, params, out, *, prefetch, hint, warps, num_splits, parts="all", maxnreg=None,
           sub=0, coop=-1, t256=-1, late_v=-1):
    s, hq, d = q.shape
    g = hq // layout.num_kv_heads
    q_rot = q_rotated(q, layout, params)
    acc, ml = _workspace(None, s, hq, num_splits, max(16, triton.next_power_of_2(d)), q.device)
    plan = plan_for(layout, g, sub, coop, t256, late_v)
    if plan is None:
        raise ValueError("this plan does not apply")

    def run():
        if parts in ("all", "rotate"):  # what the public API does before the kernel
            rotate_q(q, params.rotation, True, False)
        if parts in ("all", "kernel"):
            _launch_paged_decode_mma(q_rot, cache, bt, sl, layout, plan, params.key_centroids_f32, acc, ml, group=g,
                                     num_splits=num_splits, sm_scale=d**-0.5, warps=warps, prefetch=prefetch or None,
                                     hint=hint, maxnreg=maxnreg, value_centroids_f32=params.value_centroids_f32)
        if parts in ("all", "merge"):
            _launch_merge(acc, ml, params.rotation, out, layout, g, num_splits, False)
    return run


class Config(NamedTuple):
    """One launch variant of the sweep (the command line's options, one value each)."""
    prefetch: int
    hint: int
    warps: int
    splits: int
    maxnreg: int
    sub: int
    coop: int
    table256: int
    late_v: int

    @property
    def tag(self) -> str:
        return (f"pf{self.prefetch} hint{self.hint} w{self.warps} r{self.maxnreg} u{self.sub} "
                f"c{self.coop} t{self.table256} v{self.late_v}")

    def kwargs(self) -> dict:
        """The keyword arguments of :func:`launch` (the split count apart)."""
        return dict(prefetch=self.prefetch, hint=self.hint, warps=self.warps,
                    maxnreg=None if self.maxnreg < 0 else self.maxnreg, sub=self.sub,
                    coop=self.coop, t256=self.table256, late_v=self.late_v)


# (kind, rows, chunks, splits unrolled per loop iteration)
MERGES = (("heads", 16, None, 8), ("rows", 16, 1, 8), ("rows", 16, 2, 8), ("rows", 16, 4, 8), ("rows", 32, 1, 8),
          ("rows", 32, 2, 8), ("rows", 16, None, 8), ("rows", 16, None, 64), ("rows", 16, 8, 64), ("rows", 16, 4, 64))


def fixed_costs(res, shape, preset, q, layout, params, out, num_splits):
    """The q rotation at 16/32/64 rows per program, and every merge variant on a workspace of
    this shape (finite maxima, positive sums), each checked against the first merge's output."""
    s, hq, d = q.shape
    g = hq // layout.num_kv_heads
    acc, ml = _workspace(None, s, hq, num_splits, max(16, triton.next_power_of_2(d)), q.device)
    acc.normal_()
    ml.view(-1, 2)[:, 0].normal_()
    ml.view(-1, 2)[:, 1].uniform_(0.5, 2.0)
    ref_rot = rotate_q(q, params.rotation, True, False)
    for rows, cols in ((16, 64), (16, 128), (32, 64), (16, 32)):
        got = rotate_q(q, params.rotation, True, False, rows=rows, cols=cols)
        err = float((got - ref_rot).abs().max())
        us = bench(lambda: rotate_q(q, params.rotation, True, False, rows=rows, cols=cols))
        res.setdefault("fixed", []).append(dict(shape=shape, variant=preset, part=f"rotate_q rows{rows} cols{cols}",
                                                us=us, err=err))
        print(f"{shape} {preset} rotate_q rows{rows} cols{cols}: {us:.1f} us (err vs default {err:.1e})", flush=True)
    first = None
    for kind, rows, chunks, unroll in MERGES:
        o = torch.full_like(out, float("nan"))
        _launch_merge(acc, ml, params.rotation, o, layout, g, num_splits, False, chunks=chunks, impl=kind, rows=rows,
                      unroll=unroll)
        first = o if first is None else first
        err = float((o.float() - first.float()).abs().max())
        us = bench(lambda: _launch_merge(acc, ml, params.rotation, out, layout, g, num_splits, False, chunks=chunks,
                                         impl=kind, rows=rows, unroll=unroll))
        name = f"merge {kind} rows{rows} chunks{chunks or 'auto'} unroll{unroll}"
        res.setdefault("fixed", []).append(dict(shape=shape, variant=preset, part=name, us=us, err=err))
        print(f"{shape} {preset} {name}: {us:.1f} us (err vs heads {err:.1e})", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="*", default=["B32x16K", "B8x64K"])
    ap.add_argument("--presets", nargs="*", default=["tq4", "turboquant_4bit_nc"])
    ap.add_argument("--prefetch", nargs="*", type=int, default=[0], help="ring depth in steps (0: the launcher's)")
    ap.add_argument("--hint", nargs="*", type=int, default=[0, 1])
    ap.add_argument("--warps", nargs="*", type=int, default=[4, 8])
    ap.add_argument("--splits", nargs="*", type=int, default=[0], help="0: the default from the shapes")
    ap.add_argument("--maxnreg", nargs="*", type=int, default=[-1], help="-1: the launcher's default")
    ap.add_argument("--sub", nargs="*", type=int, default=[0],
                    help="16-token steps per softmax update (0: the plan's)")
    ap.add_argument("--coop", nargs="*", type=int, default=[-1],
                    help="CTA-cooperative stages (0: off, -1: the launcher's plan)")
    ap.add_argument("--table256", nargs="*", type=int, default=[-1],
                    help="0: the 32 KB pair table where the plan takes the PRMT-addressed one (-1: the plan's)")
    ap.add_argument("--late-v", nargs="*", type=int, default=[-1],
                    help="1: read the values from the stage after the softmax update, 0: with the keys (-1: the plan's)")
    ap.add_argument("--parts", action="store_true", help="also time the q rotation, kernel and merge alone")
    ap.add_argument("--fixed", action="store_true",
                    help="also time the q rotation (rows per program) and merge variants (kind, rows, chunks)")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    arr = dict(DECODE_PRESETS)
    configs = [Config(*c) for c in itertools.product(
        args.prefetch, args.hint, args.warps, args.splits, args.maxnreg, args.sub, args.coop,
        args.table256, args.late_v)]
    res = dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__, time=time.strftime("%F %T"),
               gate=[], rows=[])
    g = torch.Generator(device="cuda").manual_seed(3)
    ok_cfg = {}
    for preset in args.presets:  # correctness gate per config (the split count aside)
        layout, params, q, cache, bt, lens, exp, tol = oracle_case(preset, arr[preset], 32, 8, 128, g)
        for cfg in configs:
            key = cfg._replace(splits=0)
            out = torch.full_like(q, float("nan"))
            try:
                launch(q, cache, bt, lens, layout, params, out, num_splits=cfg.splits or 5, **cfg.kwargs())()
            except Exception as e:  # noqa: BLE001 -- a config that does not compile or apply
                why = str(e).splitlines()[0][:120]
                print(f"gate {preset} {cfg.tag}: skipped ({why})", flush=True)
                continue
            err = float(np.abs(out.float().cpu().numpy() - exp).max())
            ok = bool(np.isfinite(err) and err <= tol)
            ok_cfg[preset, key] = ok
            res["gate"].append(dict(preset=preset, **key._asdict(), err=err, ok=ok))
            print(f"gate {preset} {cfg.tag}: err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    for shape, q, sdpa, bt, sl in baseline_runs(args.shapes, g, res["rows"]):
        b, L, hq, hkv, d = shape.batch, shape.seq_len, shape.num_q_heads, shape.num_kv_heads, shape.head_dim
        for preset, layout, params, cache in preset_caches(shape, args.presets, g):
            if mma_plan(layout, hq // hkv) is None:
                print(f"{shape.name} {preset}: the warp-MMA kernel does not apply", flush=True)
                continue
            out = torch.empty_like(q)
            nbytes = b * L * layout.row_bytes
            for cfg in configs:
                if not ok_cfg.get((preset, cfg._replace(splits=0))):
                    continue
                kw = cfg.kwargs()
                resident = resident_for(q, cache, bt, sl, layout, params,
                                        plan_for(layout, hq // hkv, cfg.sub, cfg.coop, cfg.table256, cfg.late_v),
                                        warps=cfg.warps, prefetch=cfg.prefetch or None, hint=cfg.hint,
                                        maxnreg=kw["maxnreg"])
                ns = cfg.splits or num_splits_mma(b, hkv, L, resident)
                us = bench(launch(q, cache, bt, sl, layout, params, out, num_splits=ns, **kw))
                row = dict(shape=shape.name, variant=preset, **cfg._replace(splits=ns)._asdict(),
                           resident_warps=resident, us=us, gbps=nbytes / us / 1e3, ratio=sdpa / us)
                if args.parts:
                    for part in ("rotate", "kernel", "merge"):
                        row[part + "_us"] = bench(launch(q, cache, bt, sl, layout, params, out, num_splits=ns,
                                                         parts=part, **kw))
                res["rows"].append(row)
                print(f"{shape.name} {preset:20s} {cfg.tag} splits{ns:3d} (resident {resident}): {us:8.1f} us "
                      + (f"[rotate {row['rotate_us']:.1f} kernel {row['kernel_us']:.1f} merge {row['merge_us']:.1f}] "
                         if args.parts else "") +
                      f"{row['gbps']:6.0f} GB/s {row['ratio']:.2f}x SDPA", flush=True)
            if args.fixed:
                fixed_costs(res, shape.name, preset, q, layout, params, out, ns)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep_mma.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{res['gpu']} triton {res['triton']}")
    for r in sorted(res["rows"], key=lambda r: (r["shape"], r["variant"], r["us"])):
        if r["variant"] == "sdpa_fp16":
            print(f"{r['shape']:10s} sdpa_fp16 {r['us']:8.1f} us")
        else:
            cfg = Config(**{k: r[k] for k in Config._fields})
            print(f"{r['shape']:10s} {r['variant']:20s} {cfg.tag} splits{r['splits']:3d} {r['us']:8.1f} us "
                  f"{r['ratio']:.2f}x")
    for r in res.get("fixed", []):
        print(f"{r['shape']:10s} {r['variant']:20s} {r['part']:24s} {r['us']:8.1f} us")
    return 0 if all(x["ok"] for x in res["gate"]) else 1


if __name__ == "__main__":
    sys.exit(main())
