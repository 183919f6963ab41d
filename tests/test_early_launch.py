"""The early launch of the decode and the merge (``DecodePlan.pdl``: programmatic dependent launch
on sm_90 where the decode's grid holds at most half as many CTAs as the device has SMs): which
plans take it, what the launchers pass Triton, and that the kernels' early-launch paths compile
for sm_90 (their bits against the plain launch: ``tests/test_gpu_decode_early_launch.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tqkern
from tqkern.ops.paged_decode.plan import DeviceCaps, KernelPlan, plan_decode, use_pdl


def _layout(preset, d=128, heads=8):
    return tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, d), num_kv_heads=heads, block_size=16,
                              arrangement="slot")


def _occupancy(kernel):
    return {"coop": 2, "mma": 3, "general": 2}[kernel.kernel]


def _kernel(grid):
    return KernelPlan("coop", grid, (), 8, 1)


@pytest.mark.parametrize("grid, sms, want", [
    ((66,), 132, True), ((67,), 132, False),  # at most half the SMs
    ((1, 2, 33), 132, True), ((1, 2, 34), 132, False),  # the general kernel's grid counts every program
    ((64,), 114, False), ((57,), 114, True),  # an H100 PCIe's 114 SMs
])
def test_use_pdl_takes_grids_of_at_most_half_the_sms(grid, sms, want):
    assert use_pdl(DeviceCaps.sm90(num_sms=sms), _kernel(grid)) is want


def test_use_pdl_names_a_wrong_argument():
    with pytest.raises(TypeError, match="caps must be a DeviceCaps, got dict"):
        use_pdl({}, _kernel((8,)))
    with pytest.raises(TypeError, match="decode must be a KernelPlan, got tuple"):
        use_pdl(DeviceCaps.sm90(), (8,))


def test_use_pdl_needs_sm90_and_a_gpu():
    a100 = DeviceCaps(capability=(8, 0), num_sms=108, smem_per_block_optin=166912, smem_per_sm=167936)
    assert not use_pdl(a100, _kernel((8,)))
    assert not use_pdl(DeviceCaps.interpreter(), _kernel((1,)))


@pytest.mark.parametrize("preset, seqs, hq, blocks, want", [
    ("turboquant_4bit_nc", 1, 32, 256, True),  # Llama-3-8B 1x4K: 64 cooperative CTAs
    ("k5v4h", 1, 32, 256, True),
    ("turboquant_4bit_nc", 1, 32, 8192, False),  # 1x128K: 128 CTAs (measured +52% launched early)
    ("turboquant_4bit_nc", 32, 32, 1024, False),  # B32x16K
    ("fp16", 1, 16, 1024, False),  # the general kernel at 1x16K, 8 KV heads: more programs than that
])
def test_plans_launch_early_at_batch_1_short_contexts(preset, seqs, hq, blocks, want):
    plan = plan_decode(_layout(preset), seqs, hq, blocks, DeviceCaps.sm90(), same_codebooks=True,
                       occupancy=_occupancy)
    assert plan.pdl is want, plan.summary()
    assert ("early launch" in plan.summary()) is want and ("launched early" in plan.describe()) is want
    cpu = plan_decode(_layout(preset), seqs, hq, blocks, DeviceCaps.interpreter(), same_codebooks=True)
    assert not cpu.pdl


def test_launchers_pass_the_early_launch_to_triton():
    """With ``plan.pdl`` the rotation compiles its trigger (``PDL``), the decode and the merge
    their waits and Triton's ``launch_pdl``; without it none of them."""
    from tqkern.ops.paged_decode.triton import Prepared, _launcher

    for blocks, pdl in ((256, True), (8192, False)):
        plan = plan_decode(_layout("turboquant_4bit_nc"), 1, 32, blocks, DeviceCaps.sm90(), same_codebooks=True,
                           occupancy=_occupancy)
        assert plan.pdl is pdl
        prep = Prepared(plan, _launcher(plan.decode, plan.pdl))
        assert prep.rotate.kwargs.get("PDL", False) is pdl and "launch_pdl" not in prep.rotate.kwargs
        for launcher in (prep.decode, prep.merge):
            assert launcher.kwargs.get("PDL", False) is pdl and launcher.kwargs.get("launch_pdl", False) is pdl
        assert prep.back is None
    # the one-row merge's rotate-back in a launch of its own (S70) launches early with it
    plan = plan_decode(_layout("k5v4h", heads=1), 1, 16, 2048, DeviceCaps.sm90(), same_codebooks=True,
                       occupancy=_occupancy, signed_sylvester=True)
    assert plan.pdl and plan.merge.rotate_apart, plan.describe()
    prep = Prepared(plan, _launcher(plan.decode, True))
    assert prep.back.kwargs["PDL"] and prep.back.kwargs["launch_pdl"] and prep.back.kwargs["FWHT"]
    assert prep.merge.kwargs["ROTATE_BACK"] is False


_COMPILE = r"""
import json, sys
import triton
from triton.compiler import ASTSource
from tqkern.ops.paged_decode.aot import SM90
from tqkern.ops.paged_decode.merge import _merge_row_kernel, _rotate_back_kernel
from tqkern.ops.paged_decode.rotate import _rotate_q_kernel

INT_PTRS = ("bt_ptr", "sl_ptr", "err_ptr", "safe_ptr")
out = {}
for name, fn, cx, opts in json.loads(sys.argv[1]):
    fn = {"merge": _merge_row_kernel, "rotate": _rotate_q_kernel, "back": _rotate_back_kernel}[fn]
    sig = {a: ("constexpr" if a in cx else "*i32" if a in INT_PTRS else "*fp32" if a.endswith("_ptr") else "i32")
           for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()})
    ptx = triton.compile(src, target=SM90, options=opts).asm["ptx"]
    out[name] = [ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")]
print(json.dumps(out))
"""


def test_rotation_and_merge_compile_their_early_launch_for_sm90():
    """The interpreter cannot run ``griddepcontrol``: the rotation's and the merge's early-launch
    paths (as an early plan's launchers build them) are compiled for sm_90 here, the rotation with
    its trigger and no wait, the merge and the rotate-back's own launch (by the transform) with
    their waits; the rotate-back's product form compiles too (a plain launch)."""
    pytest.importorskip("triton.backends.nvidia")
    from tqkern.ops.paged_decode.triton import Prepared, _launcher

    plan = plan_decode(_layout("tq4"), 1, 32, 256, DeviceCaps.sm90(), same_codebooks=True, occupancy=_occupancy)
    assert plan.pdl and plan.merge.impl == "row"
    prep = Prepared(plan, _launcher(plan.decode, True))
    jobs = []
    # the rotate-back's own launch (S70): k5v4h's by the transform, early; tq4's by the product
    apart = [(name, plan_decode(_layout(preset, heads=1), 1, 16, 2048 * mult, DeviceCaps.sm90(), same_codebooks=True,
                                occupancy=_occupancy, signed_sylvester=preset == "k5v4h"))
             for name, preset, mult in (("back", "k5v4h", 1), ("back_product", "tq4", 2))]
    assert [(p.pdl, p.merge.rotate_apart) for _, p in apart] == [(True, True), (False, True)]  # (tq4: 128 CTAs)
    launchers = [("rotate", "rotate", prep.rotate), ("merge", "merge", prep.merge)]
    launchers += [(name, "back", Prepared(p, _launcher(p.decode, p.pdl)).back) for name, p in apart]
    for name, fn, launcher in launchers:
        kw = dict(launcher.kwargs, PDL=launcher.kwargs.get("PDL", False))  # (a constexpr either way)
        opts = {k: kw.pop(k) for k in ("num_warps", "launch_pdl") if k in kw}
        jobs.append([name, fn, kw, opts])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(jobs)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    assert counts == {"rotate": [0, 1], "merge": [1, 0], "back": [1, 0], "back_product": [0, 0]}
