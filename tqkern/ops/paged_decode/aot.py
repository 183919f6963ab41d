"""Compile the paged-decode kernels for sm_90 without a GPU, with the launchers' own constexprs.

Triton's bundled ``ptxas`` turns the kernels into a cubin for an H100 (``GPUTarget("cuda", 90,
32)``) on any machine; its bundled ``cuobjdump`` / ``nvdisasm`` report registers, stack bytes
(spills) and the SASS. Used by ``tests/test_sm90_compile.py`` (CI sees the GPU kernels) and
from the command line below (inner-loop changes judged before spending device time).

The constexprs and options come from the launchers themselves
(:func:`tqkern.ops.paged_decode.plan.plan_decode` and its
:func:`~tqkern.ops.paged_decode.plan.mma_kernel_plan`), so a compiled plan is the one a launch
would run. Runtime arguments are compiled as a launch on 16-byte aligned tensors with
unspecialized integers would see them (the cooperative kernel specializes nothing).

Triton's interpreter (``TRITON_INTERPRET=1``) replaces every ``@triton.jit`` function, so these
helpers need a process without it: ``python -m tqkern.ops.paged_decode.aot CASE ...`` compiles
cases in a fresh process (that variable removed) and prints one JSON report per compiled kernel.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tqkern.ops.paged_decode.general import _paged_decode_kernel
from tqkern.ops.paged_decode.mma_kernel import _paged_decode_mma_kernel
from tqkern.ops.paged_decode.coop_variants import code_pair_plan, two_cta_plan
from tqkern.ops.paged_decode.mma_plans import mma_plan, per_warp_plan
from tqkern.ops.paged_decode.plan import DeviceCaps, mma_kernel_plan, one_head_plan, plan_decode, shared_heads

__all__ = ["SM90", "compile_general", "compile_mma", "general_launch", "histogram", "launcher_plans",
           "mma_launch", "occupancy_sm90", "report", "report_in_subprocess", "resources", "sass_of", "tool_path"]

SM90 = GPUTarget("cuda", 90, 32)
_PTRS = ("q_ptr", "cache_ptr", "bt_ptr", "sl_ptr", "cen_ptr", "vcen_ptr", "kc_ptr", "vc_ptr", "acc_ptr", "ml_ptr")
_INTS = ("num_seqs", "max_blocks", "NUM_SPLITS", "zero", "window_left")
_FLOATS = ("sm_scale_log2", "softcap_scale", "softcap_cap")


def tool_path(tool: str) -> str:
    """Path of one of Triton's bundled CUDA binary tools (``ptxas``, ``cuobjdump``, ``nvdisasm``)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def _compile(fn, constexprs: dict, options: dict, specialize: bool):
    """``fn`` compiled for sm_90: pointers fp32/u8/i32 (16-byte aligned when ``specialize``),
    the runtime integers i32, the runtime floats (``sm_scale_log2``, the soft-cap's) fp32, every other parameter a constexpr (those
    not given at their defaults)."""
    if not hasattr(fn, "params"):
        raise RuntimeError("the kernels are interpreted (TRITON_INTERPRET=1): compile in a process without it "
                           "(report_in_subprocess)")
    cx = dict(constexprs)
    for prm in fn.params:
        if prm.is_constexpr and prm.name not in cx and getattr(prm, "has_default", False):
            cx[prm.name] = prm.default
    sig = {}
    for name in fn.arg_names:
        if name in _PTRS:
            sig[name] = "*u8" if name == "cache_ptr" else "*i32" if name in ("bt_ptr", "sl_ptr") else "*fp32"
        elif name in _INTS and name not in cx:
            sig[name] = "i32"
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "constexpr"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names if n in _PTRS} \
        if specialize else {}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()},
                    attrs=attrs)
    return triton.compile(src, target=SM90, options=options)


def mma_launch(layout, hq: int, plan, **launch) -> tuple[dict, dict]:
    """(constexprs, compile options) of a warp-MMA launch of ``plan`` (``launch``: the
    launcher's optional ``warps``, ``prefetch``, ``hint``, ``maxnreg``, ``options``, ``pdl``), from the
    decode plan's :func:`~tqkern.ops.paged_decode.plan.mma_kernel_plan`."""
    k = mma_kernel_plan(layout, plan, 1, hq, plan.WS or 1, warps=launch.get("warps", 4),
                        prefetch=launch.get("prefetch"),
                        hint=launch.get("hint", 1), maxnreg=launch.get("maxnreg"), options=launch.get("options"))
    kw = k.kwargs()
    opts = {k: kw.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
    return _early(kw, opts, launch)


def _early(kw: dict, opts: dict, launch: dict) -> tuple[dict, dict]:
    """``launch["pdl"]``: the kernel as a plan with ``DecodePlan.pdl`` launches it (programmatic
    dependent launch: the ``PDL`` constexpr and Triton's ``launch_pdl``)."""
    if launch.get("pdl"):
        kw["PDL"] = True
        opts["launch_pdl"] = True
    return kw, opts


def compile_mma(layout, hq: int, plan, **launch):
    """The warp-MMA decode kernel of ``plan`` (cooperative plans: the unspecialized wrapper the
    launcher uses for them), compiled for sm_90 as :func:`mma_launch` describes it."""
    cx, opts = mma_launch(layout, hq, plan, **launch)
    return _compile(_paged_decode_mma_kernel, cx, opts, specialize=not plan.COOP)


def general_launch(layout, hq: int, *, num_splits: int = 4, **launch) -> tuple[dict, dict]:
    """(constexprs, compile options) of the general kernel in the decode plan for ``path="general"``
    on an sm_90 device (``launch``: its optional ``block_n``, ``num_warps``, ``num_stages``,
    ``maxnreg``)."""
    plan = plan_decode(layout, 1, hq, 4, DeviceCaps.sm90(), same_codebooks=False, num_splits=num_splits,
                       path="general", **{k: v for k, v in launch.items() if k != "pdl"})
    kw = plan.decode.kwargs()
    kw["DOT"] = triton.language.bfloat16 if kw["DOT"] == "bf16" else triton.language.float16
    opts = {k: kw.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
    return _early(kw, opts, launch)


def compile_general(layout, hq: int, **launch):
    """The general decode kernel (``path="general"``) for ``layout``, compiled for sm_90."""
    cx, opts = general_launch(layout, hq, **launch)
    return _compile(_paged_decode_kernel, cx, opts, specialize=True)


def occupancy_sm90(kernel) -> int:
    """CTAs of a decode :class:`~tqkern.ops.paged_decode.plan.KernelPlan` that one H100 SM holds,
    from its offline sm_90 compile (registers from ``cuobjdump``, Triton's shared memory, the
    per-warp kernel's pair table): the ``occupancy`` that ``tqkern plan --compile`` gives
    :func:`~tqkern.ops.paged_decode.plan.plan_decode`. The cooperative kernel's shared memory is
    its plan's (:func:`~.mma_plans.coop_smem_bytes`)."""
    from tqkern.ops.paged_decode.mma_plans import MmaPlan, coop_smem_bytes
    from tqkern.ops.paged_decode.plan import needs_lut_bytes

    kw = kernel.kwargs()
    if "DOT" in kw:
        kw["DOT"] = triton.language.bfloat16 if kw["DOT"] == "bf16" else triton.language.float16
    opts = {k: kw.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
    fn = _paged_decode_kernel if kernel.kernel == "general" else _paged_decode_mma_kernel
    compiled = _compile(fn, kw, opts, specialize=kernel.kernel != "coop")
    regs, _ = resources(compiled)
    smem = coop_smem_bytes(MmaPlan.of_constexprs(dict(kernel.constexprs))) if kernel.kernel == "coop" else \
        int(compiled.metadata.shared) + needs_lut_bytes(kernel)
    per_warp = -(-regs * 32 // 256) * 256
    warps = kernel.num_warps
    return max(1, min(65536 // (per_warp * warps), 233472 // (smem + 1024), 64 // warps, 32))


def launcher_plans(layout, group: int) -> dict:
    """Every warp-MMA plan the launcher can emit for ``layout`` and ``group``: ``"per_warp"``
    (no cooperative stages: a device with too little shared memory, the short-split rule, or
    after a sizing failure) and, where :func:`~.mma_plans.mma_plan` takes them, ``"coop"`` (with
    the PRMT-addressed table where :func:`~.mma_plans.table256_plan` fits) and ``"coop2"`` (two
    CTAs per SM: :func:`~.coop_variants.two_cta_plan`) and ``"pairs"`` (the 5-bit code-pair table:
    :func:`~.coop_variants.code_pair_plan`), or ``"shared"`` where the planner takes a
    shared-head plan (:func:`~.plan.shared_heads`; with its ``"pairs"``), ``"one_head"`` where it takes
    :func:`~.plan.one_head_plan` at long contexts. Empty where the warp-MMA kernel does not apply."""
    plan = mma_plan(layout, group)
    if plan is None:
        return {}
    out = {"per_warp": per_warp_plan(plan)}
    if plan.COOP:
        out["coop"] = plan
        two = two_cta_plan(plan, layout)
        if two is not None:
            out["coop2"] = two
        pairs = code_pair_plan(plan, layout)
        if pairs is not None:
            out["pairs"] = pairs
    else:
        shared = shared_heads(plan, layout)
        if shared is not None:
            out["shared"] = shared
            pairs = code_pair_plan(shared, layout)
            if pairs is not None:
                out["pairs"] = pairs
        one = one_head_plan(plan, layout, 1 << 30)  # (at contexts the rule takes: any long one)
        if one is not None:
            out["one_head"] = one
    return out


def _tool_on_cubin(compiled, tool: str, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([tool_path(tool), *flags, f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def sass_of(compiled) -> str:
    """The kernel's SASS (``nvdisasm -c``)."""
    return _tool_on_cubin(compiled, "nvdisasm", "-c")


def resources(compiled) -> tuple[int, int]:
    """(registers, stack bytes) from ``cuobjdump -res-usage``; stack bytes > 0 mean spills (or
    a local array)."""
    out = _tool_on_cubin(compiled, "cuobjdump", "-res-usage")
    reg = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return int(reg.group(1)) if reg else -1, int(stack.group(1)) if stack else -1


def histogram(sass: str) -> collections.Counter:
    """Instruction counts by opcode (without modifiers) of a SASS listing."""
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    return ops


PLAN_NAMES = ("per_warp", "coop", "coop2", "pairs", "shared", "one_head")  # :func:`launcher_plans`' keys


def _case_todo(case: str):
    """``(layout, hq, launch options, [(report name, plan or None)])`` of a case (see :func:`report`)."""
    import tqkern

    kind, preset, arr, d, hkv, hq, *opts = case.split(":")
    only = opts.pop() if kind == "mma" and opts and opts[-1] in PLAN_NAMES else None
    base = case if only is None else case[: -len(only) - 1]
    d, hkv, hq = int(d), int(hkv), int(hq)
    launch = {}
    if opts:
        if len(opts) != 1:
            raise ValueError(f"a case takes one options field (names joined by '+'), got {case!r}")
        from tqkern.ops.paged_decode.plan import DecodeOptions

        names = opts[0].split("+")
        if "pdl" in names:  # (not an attention option: the plan's early launch)
            names.remove("pdl")
            launch["pdl"] = True
        if names:
            launch["options"] = DecodeOptions(**{name: True for name in names})
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, d), num_kv_heads=hkv, block_size=16,
                                arrangement=arr)
    if kind == "mma":
        plans = launcher_plans(layout, hq // hkv)
        if not plans:
            raise ValueError(f"the warp-MMA kernel does not apply to {case}")
        if only is not None and only not in plans:
            raise ValueError(f"the launcher emits no {only!r} plan for {base} (it emits {sorted(plans)})")
        todo = [(f"{base}:{name}", plan) for name, plan in plans.items() if only in (None, name)]
    elif kind == "general":
        todo = [(case, None)]
    else:
        raise ValueError(f"case kind must be 'mma' or 'general', got {kind!r}")
    return layout, hq, launch, todo


def plan_names(case: str) -> list[str]:
    """The report names :func:`report` gives ``case`` (one per plan the launcher emits), without
    compiling anything."""
    return [name for name, _ in _case_todo(case)[3]]


def report(case: str) -> list[dict]:
    """Compile one case and report each kernel: ``case`` is ``"mma:PRESET:ARRANGEMENT:D:HKV:HQ[:OPTIONS][:PLAN]"``
    (every plan of :func:`launcher_plans`, or the one named ``PLAN``, a key of it) or
    ``"general:PRESET:ARRANGEMENT:D:HKV:HQ[:OPTIONS]"`` (the general kernel); ``OPTIONS``:
    :class:`~.plan.DecodeOptions` fields joined by ``+``, e.g. ``window+softcap``, and ``pdl``
    (the kernel as an early-launched plan runs it, :func:`.plan.use_pdl`). Each report:
    ``name`` (the case with its plan's name), ``regs``, ``stack`` (bytes), ``instrs`` (SASS
    instructions), ``maxnreg`` (the launcher's register cap, 0 for none)."""
    layout, hq, launch, todo = _case_todo(case)
    out = []
    for name, plan in todo:
        if plan is None:
            compiled, (_, opts) = compile_general(layout, hq, **launch), general_launch(layout, hq, **launch)
        else:
            compiled, (_, opts) = compile_mma(layout, hq, plan, **launch), mma_launch(layout, hq, plan, **launch)
        regs, stack = resources(compiled)
        out.append(dict(name=name, regs=regs, stack=stack, instrs=sum(histogram(sass_of(compiled)).values()),
                        maxnreg=int(opts.get("maxnreg", 0))))
    return out


def report_in_subprocess(cases: list[str], timeout: float = 900) -> list[dict]:
    """:func:`report` of every case, run in a fresh Python without ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", "tqkern.ops.paged_decode.aot", *cases], capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=root)
    if res.returncode:
        raise RuntimeError(f"sm_90 compile failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout)


if __name__ == "__main__":
    print(json.dumps([r for case in sys.argv[1:] for r in report(case)]))
