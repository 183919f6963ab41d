"""Compile the store kernel for sm_90 without a GPU, with its plan's own constexprs (CI sees the GPU
kernel, bf16 included, which the interpreter cannot run): :func:`compile_store`, :func:`report`;
``python -m tqkern.ops.store.aot CASE ...`` prints one JSON report per case (in a process without
``TRITON_INTERPRET``: :func:`report_in_subprocess`). Needs Triton only (no torch).

A case is ``"PRESET:ARRANGEMENT:D:HKV[:OPTIONS]"``: a preset of :data:`tqkern.layouts.PRESETS`
(compiled with the rotation its ``TQParams.default`` gets: ``pm1`` for the Hadamard presets,
``split`` for ``haar``), and optional ``+``-joined options among ``bf16`` (bf16 K/V), ``mu`` (a
key offset), ``dense`` (a Hadamard preset's rotation taken as a dense matrix: ``split``), ``small`` (a
short store's plan: :data:`~.plan.SMALL_STORE_VECTORS` vectors), ``warp`` (the plan of aligned inputs,
which takes the warp kernel of :mod:`~.warp` where the layout is eligible), ``decompress`` (not the
store: the ``decompress`` kernel of the layout, :mod:`tqkern.ops.decompress.triton`, at its
:func:`~tqkern.ops.decompress.triton.decompress_config`), ``rotate`` (with ``decompress``: rotated
sides read back in original coordinates).
Runtime arguments are compiled as a launch on contiguous ``[T, HKV, D]`` inputs would see them:
pointers and strides 16-divisible, the token and slot counts unspecialized.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import triton
from triton.compiler import ASTSource

from tqkern.ops.paged_decode.aot import SM90, histogram, resources, sass_of
from tqkern.ops.store.kernel import _store_kernel
from tqkern.ops.store.plan import SMALL_STORE_VECTORS, default_signed_sylvester, plan_store
from tqkern.ops.store.warp import _store_warp_kernel

__all__ = ["compile_decompress", "compile_store", "layout_of_case", "report", "report_in_subprocess"]

_OPTIONS = ("bf16", "mu", "dense", "small", "warp", "asym", "decompress", "rotate")


def _ptr_types(in_dtype: str) -> dict:
    kv = "*bf16" if in_dtype == "bf16" else "*fp16"
    return {"key_ptr": kv, "value_ptr": kv, "slot_ptr": "*i64", "cache_ptr": "*u8", "rot_ptr": "*fp32",
            "kb_ptr": "*fp32", "kc_ptr": "*fp64", "vb_ptr": "*fp32", "vc_ptr": "*fp64", "mu_ptr": "*fp32",
            "err_ptr": "*i32"}


def layout_of_case(preset: str, arrangement: str, d: int, hkv: int):
    """The layout a case names (block size 16)."""
    import tqkern

    return tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, d), num_kv_heads=hkv, block_size=16,
                              arrangement=arrangement)


def compile_store(layout, in_dtype: str = "fp16", *, has_mu: bool = False, signed_sylvester: bool = False,
                  num_vectors: int | None = None, vector_aligned: bool = False, symmetric_codebooks: bool = True):
    """``(compiled, plan)``: the store kernel of :func:`~.plan.plan_store` compiled for sm_90."""
    if not hasattr(_store_kernel, "params"):
        raise RuntimeError("the kernel is interpreted (TRITON_INTERPRET=1): compile in a process without it "
                           "(report_in_subprocess)")
    plan = plan_store(layout, in_dtype, has_mu=has_mu, signed_sylvester=signed_sylvester, num_vectors=num_vectors,
                      vector_aligned=vector_aligned, symmetric_codebooks=symmetric_codebooks)
    fn = _store_warp_kernel if plan.kernel == "warp" else _store_kernel
    ints = [n for n in fn.arg_names if n.startswith(("num_", "stride_"))]
    ptrs = _ptr_types(in_dtype)
    if plan.columns:
        ptrs["rot_ptr"] = "*fp16"  # Π's fp16 parts (tqkern.ops.store.triton.rotation_parts)
    return _compile(fn, ptrs, ints, dict(plan.constexprs), plan.num_warps, plan.maxnreg), plan


def _compile(fn, ptrs: dict, ints: list, constexprs: dict, num_warps: int, maxnreg: int | None = None):
    """``fn`` compiled for sm_90: ``ptrs`` its pointer arguments' types, ``ints`` its int32
    arguments (the rest constexprs); pointers and strides taken 16-divisible; ``maxnreg`` the
    register cap (None: none)."""
    sig = {n: ptrs.get(n) or ("i32" if n in ints else "constexpr") for n in fn.arg_names}
    aligned = [n for n in fn.arg_names if n in ptrs or n.startswith("stride_")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    opts = dict(num_warps=num_warps) if maxnreg is None else dict(num_warps=num_warps, maxnreg=maxnreg)
    return triton.compile(src, target=SM90, options=opts)


def compile_decompress(layout, rotate_back: bool):
    """``(compiled, config)``: the ``decompress`` kernel of ``layout`` compiled for sm_90 at its
    GPU config for the layout's default parameters (the Walsh–Hadamard rotate-back where their
    rotation is signed Sylvester; slot ids int64, the slot count unspecialized)."""
    from tqkern.ops.codecs import layout_args
    from tqkern.ops.common import halfword_aligned
    from tqkern.ops.decompress.triton import _decompress_kernel, decompress_config

    if not hasattr(_decompress_kernel, "params"):
        raise RuntimeError("the kernel is interpreted (TRITON_INTERPRET=1): compile in a process without it")
    cfg = decompress_config(rotate_back, interpret=False, head_dim=layout.head_dim,
                            signed_sylvester=default_signed_sylvester(layout))
    fmt = layout.format
    ptrs = {"k_out": "*fp32", "v_out": "*fp32", "cache_ptr": "*u8", "slot_ptr": "*i64", "kc_ptr": "*fp64",
            "vc_ptr": "*fp64", "rot_ptr": "*fp32", "err_ptr": "*i32"}
    cx = {k: v for k, v in layout_args(layout).items() if not k.startswith("PAD")}
    cx.update(BT=cfg.BT, H=layout.num_kv_heads, ROT_K=rotate_back and fmt.key.rotated,
              ROT_V=rotate_back and fmt.value.rotated, KC=cfg.KC, DOT_PRECISION="tf32x3",
              K_ALIGNED=halfword_aligned(layout, "key"), V_ALIGNED=halfword_aligned(layout, "value"),
              STAGES=cfg.num_stages, FWHT=cfg.fwht, LOG2D=layout.head_dim.bit_length() - 1 if cfg.fwht else 0)
    return _compile(_decompress_kernel, ptrs, ["n", "cache_slots"], cx, cfg.num_warps), cfg


def report(case: str) -> dict:
    """Compile one case: ``name``, ``regs``, ``stack`` (bytes; > 0 means spills), ``instrs``
    (SASS instructions), ``shared`` (bytes), ``plan`` (its one-line description)."""
    parts = case.split(":")
    if len(parts) not in (4, 5):
        raise ValueError(f"case must be PRESET:ARRANGEMENT:D:HKV[:OPTIONS], got {case!r}")
    preset, arr, d, hkv = parts[:4]
    opts = set(parts[4].split("+")) if len(parts) > 4 and parts[4] else set()
    if opts - set(_OPTIONS):
        raise ValueError(f"options must be among {_OPTIONS}, got {sorted(opts - set(_OPTIONS))}")
    layout = layout_of_case(preset, arr, int(d), int(hkv))
    if "decompress" in opts:
        if opts - {"decompress", "rotate"}:
            raise ValueError(f"decompress takes only the rotate option, got {sorted(opts)}")
        compiled, cfg = compile_decompress(layout, "rotate" in opts)
        desc = f"decompress {cfg}"
    elif "rotate" in opts:
        raise ValueError("the rotate option is for decompress cases")
    else:
        compiled, plan = compile_store(layout, "bf16" if "bf16" in opts else "fp16", has_mu="mu" in opts,
                                       signed_sylvester=default_signed_sylvester(layout) and "dense" not in opts,
                                       num_vectors=SMALL_STORE_VECTORS if "small" in opts else None,
                                       vector_aligned="warp" in opts, symmetric_codebooks="asym" not in opts)
        desc = plan.describe()
    regs, stack = resources(compiled)
    return dict(name=case, regs=regs, stack=stack, instrs=sum(histogram(sass_of(compiled)).values()),
                shared=int(compiled.metadata.shared), plan=desc)


def report_in_subprocess(cases: list[str], timeout: float = 900, python: str | None = None) -> list[dict]:
    """:func:`report` of every case, run in a fresh Python (``python``, default this one) without
    ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    res = subprocess.run([python or sys.executable, "-m", "tqkern.ops.store.aot", *cases], capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=root)
    if res.returncode:
        raise RuntimeError(f"sm_90 compile failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout)


if __name__ == "__main__":
    print(json.dumps([report(case) for case in sys.argv[1:]]))
