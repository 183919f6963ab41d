"""Sweep the general decode kernel's launch options (tile BN, warps, pipeline stages, splits) for
the presets that run it (tqkern's uncompressed fp16 path by default), against SDPA fp16 in the
same run.

Phase A times every (BN, warps, stages) at the default split count; phase B times the best of
phase A over split counts. Every configuration first goes through the NumPy oracle on a small
GQA batch (shuffled blocks); one that fails is reported and not timed.

    python benchmarks/sweep_general.py --out $OUT [--presets fp16] [--shapes B32x16K B8x64K]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._gpu import require_cuda  # noqa: E402
from benchmarks.bench_decode import baseline_runs, bench, oracle_case, preset_caches  # noqa: E402
from benchmarks.shapes import DECODE_PRESETS, DECODE_SHAPES  # noqa: E402
from tqkern.ops.paged_decode.rotate import rotate_q  # noqa: E402
from tqkern.ops.paged_decode.triton import _launch_paged_decode, num_splits_for  # noqa: E402

# (BN, warps, stages); the first is the launcher's default for uncompressed caches
CONFIGS = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3), (64, 8, 2),
           (32, 4, 3), (32, 4, 4))
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def launch(q, cache, bt, sl, layout, params, out, cfg, splits=None):
    bn, warps, stages = cfg
    tables = params.tables()
    rotated = bool(layout.format.key.rotated)

    def run():
        q_rot = rotate_q(q, params.rotation, rotated, False)
        _launch_paged_decode(out, q_rot, cache, bt, sl, layout, tables, sm_scale=q.shape[-1] ** -0.5,
                             interpret=False, path="general", block_n=bn, num_warps=warps, num_stages=stages,
                             num_splits=splits, same_codebooks=params.same_codebooks)
    return run


def gate(res, presets):
    g = torch.Generator(device="cuda").manual_seed(6)
    arr = dict(DECODE_PRESETS)
    ok = set()
    for preset in presets:
        good = {c: True for c in CONFIGS}
        for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
            layout, params, q, cache, bt, lens, exp, tol = oracle_case(preset, arr[preset], hq, hkv, d, g)
            for cfg in CONFIGS:
                for splits in (None, 7):
                    out = torch.full_like(q, float("nan"))
                    try:
                        launch(q, cache, bt, lens, layout, params, out, cfg, splits)()
                    except Exception as e:  # noqa: BLE001 -- a config that does not compile
                        print(f"gate {preset} {cfg} splits {splits}: skipped ({str(e).splitlines()[0][:100]})")
                        good[cfg] = False
                        continue
                    err = float(np.abs(out.float().cpu().numpy() - exp).max())
                    passed = bool(np.isfinite(err) and err <= tol)
                    good[cfg] &= passed
                    res["gate"].append(dict(preset=preset, hq=hq, d=d, cfg=cfg, splits=splits, err=err, ok=passed))
                    if not passed:
                        print(f"gate {preset} Hq{hq}/D{d} {cfg} splits {splits}: err {err:.2e} FAIL", flush=True)
        ok |= {(preset, c) for c, v in good.items() if v}
        print(f"gate {preset}: {sum(good.values())}/{len(CONFIGS)} configs passed", flush=True)
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="*", default=[s.name for s in DECODE_SHAPES])
    ap.add_argument("--presets", nargs="*", default=["fp16"])
    args = ap.parse_args(argv)
    require_cuda(__file__)
    res = dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__,
               sms=torch.cuda.get_device_properties(0).multi_processor_count, time=time.strftime("%F %T"),
               gate=[], rows=[])
    ok = gate(res, args.presets)
    g = torch.Generator(device="cuda").manual_seed(3)
    for shape, q, sdpa, bt, sl in baseline_runs(args.shapes, g, res["rows"]):
        b, L, hkv = shape.batch, shape.seq_len, shape.num_kv_heads
        for preset, layout, params, cache in preset_caches(shape, args.presets, g):
            out = torch.empty_like(q)
            nbytes = b * L * layout.row_bytes

            def record(cfg, splits, phase):
                ns = splits or num_splits_for(b, hkv, bt.shape[1] * layout.block_size, res["sms"], cfg[0])
                us = bench(launch(q, cache, bt, sl, layout, params, out, cfg, ns))
                res["rows"].append(dict(shape=shape.name, variant=preset, phase=phase, block_n=cfg[0], warps=cfg[1],
                                        stages=cfg[2], splits=ns, us=us, gbps=nbytes / us / 1e3, ratio=sdpa / us))
                print(f"{shape.name:15s} {preset:8s} {phase} BN{cfg[0]:<4d} w{cfg[1]} s{cfg[2]} splits{ns:3d}: "
                      f"{us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s {sdpa / us:.2f}x SDPA", flush=True)
                return us
            times = {cfg: record(cfg, None, "A") for cfg in CONFIGS if (preset, cfg) in ok}
            best = min(times, key=times.get)
            for splits in SPLITS:
                if splits * 16 <= L:
                    record(best, splits, "B")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep_general.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{res['gpu']} triton {res['triton']} torch {res['torch']}")
    for shape in args.shapes:
        rows = [r for r in res["rows"] if r["shape"] == shape]
        sd = [r for r in rows if r["variant"] == "sdpa_fp16"]
        if sd:
            print(f"{shape:15s} sdpa_fp16 {sd[0]['us']:8.1f} us")
        for r in sorted((r for r in rows if r["variant"] != "sdpa_fp16"), key=lambda r: r["us"])[:6]:
            print(f"{shape:15s} {r['variant']:8s} {r['phase']} BN{r['block_n']} w{r['warps']} s{r['stages']} "
                  f"splits{r['splits']}: {r['us']:8.1f} us {r['ratio']:.2f}x")
    return 0 if all(x["ok"] for x in res["gate"]) else 1


if __name__ == "__main__":
    sys.exit(main())
