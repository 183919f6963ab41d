"""Compile the paged-decode kernel for sm_90 without a GPU and report what ptxas made of it.

Registers, spills, shared memory and an instruction histogram of the SASS (the whole kernel),
so inner-loop changes can be judged before spending device time. Uses the Triton installed
here (its bundled ptxas / nvdisasm); the GPU's Triton may differ by a few versions. The
compile helpers are :mod:`tqkern.ops.paged_decode.aot` (the launchers' own constexprs).

    python benchmarks/aot_inspect.py tq4 turboquant_4bit_nc [--path general|mma] [--coop N] [--sass out]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter replaces the kernels: nothing to compile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tqkern  # noqa: E402
from tqkern.ops.paged_decode import aot  # noqa: E402
from tqkern.ops.paged_decode import mma_plans  # noqa: E402
from tqkern.ops.paged_decode.aot import histogram, resources, sass_of  # noqa: E402,F401 (re-exported)

_COOP_KEYS = ("COOP", "RS", "SMEM_OFF", "LUT_AT", "NLOW", "LATE_V")


def compile_decode(layout, hq, path="general", block_n=None, num_splits=4):
    """The general kernel (``path="general"``) as the launcher would compile it."""
    if path != "general":
        raise ValueError(f"compile_decode compiles the general kernel (path 'general'), got {path!r}")
    return aot.compile_general(layout, hq, num_splits=num_splits, **({"block_n": block_n} if block_n else {}))


def mma_plan_for(layout, hq, coop=-1, sub=0, table256=1, late_v=-1):
    """The launcher's warp-MMA plan for ``layout`` (``coop``: -1 the launcher's choice, 0 the
    per-warp plan, N that many cooperative stages; ``sub``: steps per softmax update, 0 the
    plan's; ``table256 = 0``: the 128-byte-entry table under stages; ``late_v``: -1 the plan's)."""
    g = hq // layout.num_kv_heads
    base = mma_plans.mma_plan(layout, g)
    if base is None:
        raise SystemExit(f"the warp-MMA kernel does not apply to {layout.format} with group {g}")
    if coop == 0:
        plan = mma_plans.per_warp_plan(base)
    elif coop > 0:
        plan = mma_plans.coop_plan(dict(mma_plans.per_warp_plan(base), SUB=sub or base["SUB"]), layout, coop)
        if plan is None:
            raise SystemExit(f"{coop} cooperative stages do not apply to {layout.format}")
    else:
        plan = base
    if sub and coop <= 0:
        plan = dict(plan, SUB=sub)
    if plan.get("COOP") and not table256:
        plan = dict(plan, LUT_AT=0, NLOW=0)
    if plan.get("COOP") and late_v >= 0:
        plan = dict(plan, LATE_V=late_v)
    return plan


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("presets", nargs="+")
    ap.add_argument("--path", default="general", choices=["general", "mma"])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--sass", default="")
    ap.add_argument("--arrangement", default="slot")
    ap.add_argument("--warps", type=int, default=4, help="mma, per-warp plans: warps per CTA")
    ap.add_argument("--prefetch", type=int, default=0, help="mma: ring depth in steps (0: the launcher's)")
    ap.add_argument("--hint", type=int, default=1)
    ap.add_argument("--maxnreg", type=int, default=-1, help="mma: register cap (-1: the launcher's, 0: none)")
    ap.add_argument("--sub", type=int, default=0, help="mma: 16-token steps per softmax update (0: the plan's)")
    ap.add_argument("--coop", type=int, default=-1,
                    help="mma: CTA-cooperative stages (-1: the launcher's plan, 0: the per-warp plan)")
    ap.add_argument("--table256", type=int, default=1,
                    help="mma with stages: 0 forces the 128-byte-entry pair table (1: the plan's choice)")
    ap.add_argument("--late-v", type=int, default=-1,
                    help="mma with stages: 1 reads the values from the stage after the softmax update (-1: the plan's)")
    args = ap.parse_args(argv)
    for preset in args.presets:
        fmt = tqkern.KVFormat.preset(preset, args.d)
        layout = tqkern.PagedLayout(format=fmt, num_kv_heads=args.hkv, block_size=16, arrangement=args.arrangement)
        if args.path == "mma":
            plan = mma_plan_for(layout, args.hq, args.coop, args.sub, args.table256, args.late_v)
            c = aot.compile_mma(layout, args.hq, plan, warps=args.warps, prefetch=args.prefetch or None,
                                hint=args.hint, maxnreg=None if args.maxnreg < 0 else args.maxnreg)
            print(f"{preset}: " + " ".join(f"{k}={plan[k]}" for k in ("SUB",) + _COOP_KEYS if k in plan))
        else:
            c = compile_decode(layout, args.hq, block_n=args.block_n)
        sass = sass_of(c)
        if args.sass:
            with open(f"{args.sass}.{preset}.sass", "w") as f:
                f.write(sass)
        h = histogram(sass)
        regs, stack = resources(c)
        print(f"{preset} path={args.path}: regs {regs} stack {stack} smem {c.metadata.shared} "
              f"instrs {sum(h.values())}")
        print("  " + " ".join(f"{k}:{v}" for k, v in h.most_common(28)))


if __name__ == "__main__":
    sys.exit(main())
