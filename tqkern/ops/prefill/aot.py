"""Compile the prefill kernel for sm_90 without a GPU, with its plan's own constexprs (CI sees the
GPU kernel, bf16 included, which the interpreter cannot run): :func:`compile_prefill`,
:func:`report`; ``python -m tqkern.ops.prefill.aot CASE ...`` prints one JSON report per case
(in a process without ``TRITON_INTERPRET``: :func:`report_in_subprocess`).

A case is ``"PRESET:ARRANGEMENT:D:HKV:HQ:OUT[:OPTIONS]"``: a preset of
:data:`tqkern.layouts.PRESETS` or ``raw_bf16`` (raw bf16 keys and values: the bf16 tensor-core
path), the output dtype ``fp16`` or ``bf16`` (q's), and optional ``+``-joined options among
``window``, ``softcap``, ``sinks``, ``lse`` and ``int8`` (the fused ``int8_prefill`` kernel), or
``gather``: the tiled prefill's gather kernel (:mod:`tqkern.ops.decompress.gather`) for that
layout and output dtype (``gather+int8``: with int8 keys), or ``attend`` (with ``window``,
``softcap``, ``half``): the tiled path's attention kernel (:mod:`tqkern.ops.prefill.attend`,
causal; int8 Q·Kᵀ, or with ``half`` the output dtype's; ``attend+gluon``: ``int8_prefill``'s
Gluon kernel, :mod:`tqkern.ops.int8_prefill.gluon`), or ``quantize``: ``int8_prefill``'s
query quantization (:mod:`tqkern.ops.int8_prefill.triton`; the layout's default rotation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import triton
import triton.language as tl
from triton.compiler import ASTSource

from tqkern.ops.paged_decode.aot import SM90, histogram, resources, sass_of
from tqkern.ops.paged_decode.plan import DeviceCaps
from tqkern.ops.prefill.kernel import _prefill_kernel
from tqkern.ops.prefill.plan import plan_prefill

__all__ = ["compile_prefill", "layout_of_case", "report", "report_in_subprocess"]

_FP32_PTRS = ("q_ptr", "poison_ptr", "kc_ptr", "vc_ptr", "rot_ptr", "sinks_ptr", "lse_ptr")
_I32_PTRS = ("bt_ptr", "sl_ptr", "qsl_ptr")


def layout_of_case(preset: str, arrangement: str, d: int, hkv: int):
    """The layout a case names (``raw_bf16``: raw bf16 keys and values)."""
    import tqkern

    if preset == "raw_bf16":
        fmt = tqkern.KVFormat(head_dim=d, key=tqkern.Raw(dtype="bfloat16"), value=tqkern.Raw(dtype="bfloat16"),
                              rotation="hadamard")
    else:
        fmt = tqkern.KVFormat.preset(preset, d)
    return tqkern.PagedLayout(format=fmt, num_kv_heads=hkv, block_size=16, arrangement=arrangement)


def compile_prefill(layout, hq: int, out_dtype: str = "fp16", **options):
    """The prefill kernel of :func:`~.plan.plan_prefill` (sm_90 caps, ``options``) compiled for
    sm_90: pointers 16-byte aligned, integers i32 (``zero`` unspecialized, as launched)."""
    if not hasattr(_prefill_kernel, "params"):
        raise RuntimeError("the kernel is interpreted (TRITON_INTERPRET=1): compile in a process without it "
                           "(report_in_subprocess)")
    plan = plan_prefill(layout, hq, DeviceCaps.sm90(), **options)
    cx = dict(plan.constexprs)
    cx["DOT"] = tl.bfloat16 if plan.dot == "bf16" else tl.float16
    types = {**{n: "*fp32" for n in _FP32_PTRS}, **{n: "*i32" for n in _I32_PTRS}, "cache_ptr": "*u8",
             "out_ptr": f"*{out_dtype}", "scale_log2": "fp32", "softcap": "fp32"}
    return _compile(_prefill_kernel, cx, types, dict(num_warps=plan.num_warps, num_stages=plan.num_stages)), plan


def _compile(fn, cx: dict, types: dict, options: dict):
    """``fn`` compiled for sm_90 with constexprs ``cx``, pointer/float types from ``types`` (the
    rest i32), every pointer 16-byte aligned."""
    sig = {n: "constexpr" if n in cx else types.get(n, "i32") for n in fn.arg_names}
    ptrs = [n for n, t in sig.items() if t.startswith("*")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()},
                    attrs=attrs)
    return triton.compile(src, target=SM90, options=options)


def compile_tile_attend(layout, hq: int, out_dtype: str = "fp16", window: bool = False, softcap: bool = False,
                        int8: bool = True):
    """The tiled path's attention kernel (causal; ``int8``: ``int8_prefill``'s, else fp16/bf16
    Q·Kᵀ as ``prefill`` with a soft-cap runs it) for this head geometry, sm_90."""
    from tqkern.ops.prefill.attend import _tile_attend_kernel, attend_config, attend_tma

    cfg = attend_config(layout.head_dim, int8, interpret=False)
    cx = dict(HQ=hq, G=hq // layout.num_kv_heads, D=layout.head_dim, DP=cfg.DP, BM=cfg.BM, BN=cfg.BN, CAUSAL=True,
              WINDOW=window, SOFTCAP=softcap, INT8=int8)
    qk = "*i8" if int8 else f"*{out_dtype}"
    tma = cfg.DP == layout.head_dim and attend_tma(layout.head_dim, int8)  # as attend_tiles decides (contiguous K/V)
    desc = (f"tensordesc<{qk[1:]}[{cfg.BN},{cfg.DP}]>", f"tensordesc<{out_dtype}[{cfg.BN},{cfg.DP}]>")
    types = dict(q_ptr=qk, k_ptr=qk, qs_ptr="*fp32", ks_ptr="*fp32", lse_ptr="*fp32", v_ptr=f"*{out_dtype}",
                 o_ptr=f"*{out_dtype}", qk_scale="fp32", softcap="fp32", k_desc=desc[0] if tma else qk,
                 v_desc=desc[1] if tma else f"*{out_dtype}")
    cx["TMA"] = tma
    compiled = _compile(_tile_attend_kernel, cx, types, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return compiled, cfg


def compile_gluon_attend(layout, hq: int, out_dtype: str = "fp16"):
    """``int8_prefill``'s Gluon attention kernel (:mod:`tqkern.ops.int8_prefill.gluon`, causal)
    for this head geometry and value dtype, sm_90a, its descriptors typed as the host makes them
    (contiguous ``[tokens, H·D]`` views, 128-byte swizzled boxes)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from tqkern.ops.int8_prefill.gluon import _gluon_attend_kernel, gluon_config

    d = layout.head_dim
    cfg = gluon_config(d)
    if cfg is None:
        raise ValueError(f"the Gluon attention kernel takes head_dim 64, 128 or 256, got {d}")

    def desc(tag, dtype, rows):
        return f"tensordesc<{tag}[{rows}, {d}],{gl.NVMMASharedLayout.get_default_for([rows, d], dtype)}>"

    vdt = gl.bfloat16 if out_dtype == "bf16" else gl.float16
    fn = _gluon_attend_kernel
    cx = dict(HQ=hq, G=hq // layout.num_kv_heads, D=d, BM=cfg.BM, BN=cfg.BN, CAUSAL=True, num_warps=cfg.num_warps)
    types = dict(q_desc=desc("i8", gl.int8, cfg.BM), k_desc=desc("i8", gl.int8, cfg.BN),
                 v_desc=desc(out_dtype, vdt, cfg.BN), qs_ptr="*fp32", ks_ptr="*fp32", o_ptr=f"*{out_dtype}",
                 lse_ptr="*fp32", qk_scale="fp32")
    sig = {n: "constexpr" if n in cx else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or n in ("Lq", "Lk", "stride_qst", "stride_ksh")}  # lengths as a multiple of 16 launch
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()},
                         attrs=attrs)
    return triton.compile(src, target=SM90, options=dict(num_warps=cfg.num_warps)), cfg


def compile_quantize_q(layout, in_dtype: str = "fp16"):
    """The tiled ``int8_prefill``'s query quantization for the layout's default rotation, sm_90."""
    from tqkern.ops.int8_prefill.triton import _quantize_q_kernel, quantize_config
    from tqkern.ops.store.plan import default_signed_sylvester

    d = layout.head_dim
    cfg = quantize_config(layout.format.key.rotated, default_signed_sylvester(layout), d, interpret=False)
    cx = dict(HQ=8, D=d, DP=max(16, triton.next_power_of_2(d)), ROWS=cfg.ROWS, TILES=cfg.TILES, ROT=cfg.ROT, KC=cfg.KC,
              IN_BF16=in_dtype == "bf16", DOT_PRECISION=cfg.DOT_PRECISION, FWHT=cfg.FWHT,
              LOG2D=d.bit_length() - 1 if cfg.FWHT else 0)
    types = dict(q_ptr=f"*{in_dtype}", rot_ptr="*fp32", q8_ptr="*i8", qs_ptr="*fp32")
    return _compile(_quantize_q_kernel, cx, types, dict(num_warps=cfg.num_warps)), cfg


def compile_gather(layout, out_dtype: str = "fp16", int8: bool = False, fwht: bool = False):
    """The tiled prefill's gather kernel for ``layout`` writing ``out_dtype`` (``int8``: int8 keys
    and their scales; ``fwht``: rotated sides rotated back by the Walsh–Hadamard transform, as
    ``GatherConfig.fwht`` does for a signed Sylvester rotation), compiled for sm_90."""
    from tqkern.ops.codecs import layout_args
    from tqkern.ops.common import halfword_aligned
    from tqkern.ops.decompress.gather import _gather_kernel, gather_config

    c = {k: v for k, v in layout_args(layout).items() if not k.startswith("PAD")}
    gc = gather_config(c["DP"])
    cx = dict(c, BS=layout.block_size, H=layout.num_kv_heads, OUT_BF16=out_dtype == "bf16", BT=gc.BT,
              TILES=gc.TILES, K_ALIGNED=halfword_aligned(layout, "key"), V_ALIGNED=halfword_aligned(layout, "value"),
              K_INT8=int8, K_FWHT=fwht and layout.format.key.rotated and not int8,
              V_FWHT=fwht and layout.format.value.rotated, LOG2D=layout.head_dim.bit_length() - 1)
    types = {"k_out": "*i8" if int8 else f"*{out_dtype}", "v_out": f"*{out_dtype}", "ks_out": "*fp32",
             "cache_ptr": "*u8", "block_table_ptr": "*i32", "run_ptr": "*i32", "err_ptr": "*i32",
             "kc_ptr": "*fp32", "vc_ptr": "*fp32", "rot_ptr": "*fp32"}
    return _compile(_gather_kernel, cx, types, dict(num_warps=gc.num_warps)), gc


def compile_rotate(layout, hq: int, in_dtype: str = "fp16", fwht: bool = False):
    """The q rotation with the block-table scan (:func:`~tqkern.ops.paged_decode.rotate._rotate_q_kernel`)
    as the decode plan launches it (``fwht``: for a signed Sylvester rotation, the Walsh–Hadamard
    transform where :func:`~tqkern.ops.paged_decode.side_plans.q_transform` takes it), sm_90."""
    from tqkern.ops.paged_decode.rotate import _rotate_q_kernel
    from tqkern.ops.paged_decode.side_plans import _rotate_plan

    r = _rotate_plan(layout, 8, hq, 64, signed_sylvester=fwht)
    cx = r.constexprs(hq, layout.head_dim, layout.block_size, interpret=False)
    types = dict(q_ptr=f"*{in_dtype}", rot_ptr="*fp32", out_ptr="*fp32", poison_ptr="*fp32", bt_ptr="*i32",
                 sl_ptr="*i32", err_ptr="*i32", safe_ptr="*i32")
    return _compile(_rotate_q_kernel, cx, types, dict(num_warps=4)), r


def report(case: str) -> dict:
    """Compile one case: ``name``, ``regs``, ``stack`` (bytes; > 0 means spills), ``shared``
    (bytes of shared memory per program), ``instrs`` (SASS instructions), ``plan`` (its one-line
    description)."""
    parts = case.split(":")
    preset, arr, d, hkv, hq, out = parts[:6]
    opts = {o: True for o in (parts[6].split("+") if len(parts) > 6 and parts[6] else [])}
    side = {"gather", "attend", "quantize", "rotate"} & set(opts)
    if side:
        lay = layout_of_case(preset, arr, int(d), int(hkv))
        if "gather" in side:
            compiled, cfg = compile_gather(lay, out, int8="int8" in opts, fwht="fwht" in opts)
        elif "rotate" in side:
            compiled, cfg = compile_rotate(lay, int(hq), out, fwht="fwht" in opts)
        elif "attend" in side and "gluon" in opts:
            compiled, cfg = compile_gluon_attend(lay, int(hq), out)
        elif "attend" in side:
            compiled, cfg = compile_tile_attend(lay, int(hq), out, "window" in opts, "softcap" in opts,
                                                int8="half" not in opts)
        else:
            compiled, cfg = compile_quantize_q(lay, out)
        regs, stack = resources(compiled)
        return dict(name=case, regs=regs, stack=stack, shared=int(compiled.metadata.shared),
                    instrs=sum(histogram(sass_of(compiled)).values()), plan=f"{sorted(side)[0]} {cfg}")
    unknown = set(opts) - {"window", "softcap", "sinks", "lse", "int8"}
    if unknown:
        raise ValueError(f"options must be among window, softcap, sinks, lse, int8, got {sorted(unknown)}")
    if out not in ("fp16", "bf16"):
        raise ValueError(f"the output dtype must be 'fp16' or 'bf16', got {out!r}")
    layout = layout_of_case(preset, arr, int(d), int(hkv))
    compiled, plan = compile_prefill(layout, int(hq), out, **opts)
    regs, stack = resources(compiled)
    return dict(name=case, regs=regs, stack=stack, shared=int(compiled.metadata.shared), instrs=sum(histogram(sass_of(compiled)).values()),
                plan=plan.describe())


def report_in_subprocess(cases: list[str], timeout: float = 900) -> list[dict]:
    """:func:`report` of every case, run in a fresh Python without ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", "tqkern.ops.prefill.aot", *cases], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=root)
    if res.returncode:
        raise RuntimeError(f"sm_90 compile failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout)


if __name__ == "__main__":
    print(json.dumps([report(case) for case in sys.argv[1:]]))
