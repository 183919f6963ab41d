"""Compile the paged-decode kernel for sm_90 without a GPU and report what ptxas made of it.

Registers, spills, shared memory and an instruction histogram of the SASS (the whole kernel),
so inner-loop changes can be judged before spending device time. Uses the Triton installed
here (its bundled ptxas / nvdisasm); the GPU's Triton may differ by a few versions.

    python benchmarks/aot_inspect.py tq4 turboquant_4bit_nc [--path old|fast|mma] [--sass out.sass]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tqkern  # noqa: E402
from tqkern.ops.paged_decode import triton as pdt  # noqa: E402


class _Capture(Exception):
    pass


def decode_constexprs(layout, hq, path, block_n=None, num_splits=4, probe="", lut="select"):
    """The constexpr kwargs _launch_paged_decode would pass, captured by a stub kernel."""
    got = {}

    class Stub:
        def __getitem__(self, grid):
            def call(*args, **kw):
                got.update(kw)
                raise _Capture
            return call

    orig = pdt._paged_decode_kernel
    pdt._paged_decode_kernel = Stub()
    try:
        import torch

        d = layout.head_dim
        q = torch.zeros(1, hq, d)
        bt = torch.zeros(1, 4, dtype=torch.int32)
        try:
            pdt._launch_paged_decode(torch.zeros(1, hq, d), q, torch.zeros(1, dtype=torch.uint8), bt,
                                     torch.zeros(1, dtype=torch.int32), layout,
                                     {"key_centroids_f32": None, "value_centroids_f32": None, "rotation": None},
                                     sm_scale=1.0, interpret=False, num_splits=num_splits, block_n=block_n,
                                     probe=probe, lut=lut, path=path)
        except _Capture:
            pass
    finally:
        pdt._paged_decode_kernel = orig
    return got


def compile_decode(layout, hq, path="fast", **kw):
    cx = decode_constexprs(layout, hq, path, **kw)
    opts = {"num_warps": cx.pop("num_warps"), "num_stages": cx.pop("num_stages")}
    fn = pdt._paged_decode_kernel
    sig = {}
    ptrs = {"q_ptr": "*fp32", "cache_ptr": "*u8", "bt_ptr": "*i32", "sl_ptr": "*i32", "kc_ptr": "*fp32",
            "vc_ptr": "*fp32", "acc_ptr": "*fp32", "ml_ptr": "*fp32"}
    for name in fn.arg_names:
        if name in ptrs:
            sig[name] = ptrs[name]
        elif name in ("max_blocks", "max_block", "zero"):
            sig[name] = "i32"
        elif name == "sm_scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "constexpr"
    cx = {k: (v if not isinstance(v, tl.dtype) else v) for k, v in cx.items()}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def compile_mma(layout, hq, num_splits=8, warps=4, maxnreg=0, shifted=False, **extra):
    """The warp-MMA decode kernel (tqkern.ops.paged_decode.triton_mma) for ``layout``."""
    from tqkern.ops.paged_decode import triton_mma as tm

    g = hq // layout.num_kv_heads
    plan = tm.mma_plan(layout, g)
    if plan is None:
        raise SystemExit(f"the warp-MMA kernel does not apply to {layout.format} with group {g}")
    plan = tm.per_warp_plan(plan)  # cooperative stages only when asked for (--coop)
    if shifted:
        plan = tm.shifted_plan(plan)
    fn = tm._paged_decode_mma_kernel
    extra = {k: v for k, v in extra.items() if not (k == "PREFETCH" and not v)}
    plan = {**plan, **extra}
    cx = dict(G=g, HKV=layout.num_kv_heads, HQ=hq, NUM_SPLITS=num_splits, WARPS=warps, BS=layout.block_size,
              PREFETCH=plan.pop("PREFETCH", plan["SUB"]), **plan)
    for prm in fn.params:  # constexprs left at their defaults (else they would compile as None)
        if prm.is_constexpr and prm.name not in cx and getattr(prm, "has_default", False):
            cx[prm.name] = prm.default
    ptrs = {"q_ptr": "*fp32", "cache_ptr": "*u8", "bt_ptr": "*i32", "sl_ptr": "*i32", "cen_ptr": "*fp32",
            "vcen_ptr": "*fp32", "acc_ptr": "*fp32", "ml_ptr": "*fp32"}
    sig = {n: ptrs.get(n, "i32" if n in ("num_seqs", "max_blocks", "max_block") else "fp32" if n == "sm_scale_log2"
                       else "constexpr") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1,
                                                                        **({"maxnreg": maxnreg} if maxnreg else {})})


def _tool_on_cubin(compiled, tool, *flags):
    """Run one of Triton's bundled CUDA binary tools on the kernel's cubin; its stdout."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([path, *flags, f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)


def sass_of(compiled):
    return _tool_on_cubin(compiled, "nvdisasm", "-c")


def resources(compiled):
    """(registers, stack bytes) from cuobjdump's resource report."""
    out = _tool_on_cubin(compiled, "cuobjdump", "-res-usage")
    reg = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return int(reg.group(1)) if reg else -1, int(stack.group(1)) if stack else -1


def histogram(sass):
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    return ops


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("presets", nargs="+")
    ap.add_argument("--path", default="fast")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--sass", default="")
    ap.add_argument("--arrangement", default="slot")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--prefetch", type=int, default=0, help="mma: ring depth in steps (0: the launcher's)")
    ap.add_argument("--hint", type=int, default=0)
    ap.add_argument("--maxnreg", type=int, default=0)
    ap.add_argument("--shifted", action="store_true", help="mma: read 4-bit fields as shifted words")
    ap.add_argument("--sub", type=int, default=0, help="mma: 16-token steps per softmax update (0: the plan's)")
    ap.add_argument("--probe", type=int, default=0, help="mma: 1 loads only, 2 no DRAM traffic (timing probes)")
    ap.add_argument("--coop", type=int, default=0, help="mma: CTA-cooperative stages (warps = KV heads)")
    ap.add_argument("--table256", type=int, default=1,
                    help="mma with --coop: 0 forces the 128-byte-entry pair table (1: the plan's choice)")
    ap.add_argument("--late-v", type=int, default=-1,
                    help="mma with --coop: 1 reads the values from the stage after the softmax update (-1: the plan's)")
    args = ap.parse_args(argv)
    for preset in args.presets:
        fmt = tqkern.KVFormat.preset(preset, args.d)
        layout = tqkern.PagedLayout(format=fmt, num_kv_heads=args.hkv, block_size=16, arrangement=args.arrangement)
        if args.path == "mma":
            coop = {}
            if args.coop:  # the launcher's cooperative plan with that many stages
                from tqkern.ops.paged_decode import triton_mma as tm
                # (the launcher's steps per update under stages, e.g. two for turboquant_4bit_nc; --sub overrides)
                base = tm.mma_plan(layout, args.hq // args.hkv)
                sub = args.sub or base["SUB"]
                full = tm.coop_plan(dict(tm.per_warp_plan(base), SUB=sub), layout, args.coop)
                if full is None:
                    raise SystemExit(f"{args.coop} cooperative stages do not apply to {preset}")
                if not args.table256:
                    full = dict(full, LUT_AT=0, NLOW=0)
                if args.late_v >= 0:
                    full = dict(full, LATE_V=args.late_v)
                coop = {k: full[k] for k in ("SUB", "COOP", "RS", "SMEM_OFF", "LUT_AT", "NLOW", "LATE_V") if k in full}
                args.warps = args.hkv
            c = compile_mma(layout, args.hq, warps=args.warps, maxnreg=args.maxnreg, shifted=args.shifted,
                            PREFETCH=args.prefetch, HINT=args.hint, **({"SUB": args.sub} if args.sub and not coop else {}),
                            **({"PROBE": args.probe} if args.probe else {}), **coop)
        else:
            c = compile_decode(layout, args.hq, args.path, block_n=args.block_n)
        sass = sass_of(c)
        if args.sass:
            with open(f"{args.sass}.{preset}.sass", "w") as f:
                f.write(sass)
        h = histogram(sass)
        md = c.metadata
        regs, stack = resources(c)
        print(f"{preset} path={args.path}: regs {regs} stack {stack} smem {md.shared} "
              f"instrs {sum(h.values())}")
        print("  " + " ".join(f"{k}:{v}" for k, v in h.most_common(28)))


if __name__ == "__main__":
    sys.exit(main())
