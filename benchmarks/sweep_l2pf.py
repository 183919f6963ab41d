"""Time paged decode with and without the bulk L2 prefetch (``l2pf``: steps / tiles ahead), every
preset, against SDPA fp16 in the same run.

Each (preset, l2pf) first goes through the NumPy oracle on small GQA batches (Hq32/Hkv8/D128
and Hq9/Hkv3/D64, shuffled blocks); one that fails is reported and not timed. Timing is the
public path's work (q rotation, the kernel the layout takes, the merge) with CUDA-graph replay.

    python benchmarks/sweep_l2pf.py --out $OUT [--l2pf 0 1 2 4] [--presets tq4 fp16] [--shapes B32x16K]
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

from benchmarks.bench_decode import baseline_runs, bench, fill_cache, make_layout, preset_caches  # noqa: E402
from benchmarks.shapes import DECODE_PRESETS, DECODE_SHAPES  # noqa: E402
from tqkern import reference as ref  # noqa: E402
from tqkern.ops.paged_decode.triton import _launch_paged_decode, decode_path, rotate_q  # noqa: E402


def launch(q, cache, bt, sl, layout, params, out, l2pf):
    """What ``tqkern_torch.paged_decode`` runs, with the prefetch distance ``l2pf``."""
    tables = params.tables()
    rotated = bool(layout.format.key.rotated)

    def run():
        q_rot = rotate_q(q, params.rotation, rotated, False)
        _launch_paged_decode(out, q_rot, cache, bt, sl, layout, tables, sm_scale=q.shape[-1] ** -0.5,
                             interpret=False, same_codebooks=params.same_codebooks, l2pf=l2pf)
    return run


def gate(res, presets, l2pfs):
    g = torch.Generator(device="cuda").manual_seed(5)
    arr = dict(DECODE_PRESETS)
    ok = set()
    for preset in presets:
        good = {x: True for x in l2pfs}
        for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
            layout, params = make_layout(preset, arr[preset], hkv, d)
            lens = torch.tensor([1, 77, 600, 1000], dtype=torch.int32, device="cuda")
            nb = 4 * 64
            bt = torch.randperm(nb, device="cuda", generator=g).int().reshape(4, 64)
            cache = fill_cache(layout, params, nb, g)
            q = torch.randn(4, hq, d, device="cuda", dtype=torch.float16, generator=g)
            exp = ref.paged_decode(q.float().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(),
                                   lens.cpu().numpy(), layout, params.params)
            tol = 4e-3 * (float(np.abs(exp).max()) * 4 + 1e-6)
            path = decode_path(layout, hq // hkv, same_codebooks=params.same_codebooks)
            for x in l2pfs:
                out = torch.full_like(q, float("nan"))
                launch(q, cache, bt, lens, layout, params, out, x)()
                err = float(np.abs(out.float().cpu().numpy() - exp).max())
                passed = bool(np.isfinite(err) and err <= tol)
                good[x] &= passed
                res["gate"].append(dict(preset=preset, hq=hq, hkv=hkv, d=d, path=path, l2pf=x, err=err, ok=passed))
                print(f"gate {preset:20s} Hq{hq}/Hkv{hkv}/D{d} [{path}] l2pf{x}: err {err:.2e} (tol {tol:.1e}) "
                      f"{'ok' if passed else 'FAIL'}", flush=True)
        ok |= {(preset, x) for x, v in good.items() if v}
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="*", default=[s.name for s in DECODE_SHAPES])
    ap.add_argument("--presets", nargs="*", default=[p for p, _ in DECODE_PRESETS])
    ap.add_argument("--l2pf", nargs="*", type=int, default=[0, 1, 2, 4])
    args = ap.parse_args(argv)
    res = dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__,
               time=time.strftime("%F %T"), gate=[], rows=[])
    ok = gate(res, args.presets, args.l2pf)
    g = torch.Generator(device="cuda").manual_seed(3)
    for shape, q, sdpa, bt, sl in baseline_runs(args.shapes, g, res["rows"]):
        b, L = shape.batch, shape.seq_len
        for preset, layout, params, cache in preset_caches(shape, args.presets, g):
            out = torch.empty_like(q)
            path = decode_path(layout, shape.num_q_heads // shape.num_kv_heads, same_codebooks=params.same_codebooks)
            for x in args.l2pf:
                if (preset, x) not in ok:
                    continue
                us = bench(launch(q, cache, bt, sl, layout, params, out, x))
                nbytes = b * L * layout.row_bytes
                res["rows"].append(dict(shape=shape.name, variant=preset, path=path, l2pf=x, us=us,
                                        gbps=nbytes / us / 1e3, ratio=sdpa / us))
                print(f"{shape.name:15s} {preset:20s} [{path}] l2pf{x}: {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s "
                      f"{sdpa / us:.2f}x SDPA", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep_l2pf.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{res['gpu']} triton {res['triton']} torch {res['torch']}")
    base = {(r["shape"], r["variant"]): r["us"] for r in res["rows"] if r.get("l2pf") == 0}
    for r in res["rows"]:
        if r["variant"] == "sdpa_fp16":
            print(f"{r['shape']:15s} sdpa_fp16 {r['us']:8.1f} us")
        else:
            b0 = base.get((r["shape"], r["variant"]))
            rel = f" ({r['us'] / b0 - 1:+.1%} vs l2pf0)" if b0 else ""
            print(f"{r['shape']:15s} {r['variant']:20s} l2pf{r['l2pf']} {r['us']:8.1f} us {r['ratio']:.2f}x{rel}")
    return 0 if all(x["ok"] for x in res["gate"]) else 1


if __name__ == "__main__":
    sys.exit(main())
