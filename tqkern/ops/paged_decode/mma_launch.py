"""Launch the warp-MMA decode kernel (:mod:`.mma_kernel`) for a plan (:mod:`.mma_plans`): its
arguments and constexprs (:func:`_kernel_args`, which :mod:`.aot` compiles from too), the compiled
kernel's residency (:func:`resident_warps`) and, for cooperative plans, the sizing of its dynamic
shared memory before its binary loads (:func:`_size_dynamic_smem`). Partials only: the caller
merges (:mod:`.merge`)."""

from __future__ import annotations

import torch
import triton

from tqkern.ops.paged_decode.mma_kernel import _paged_decode_coop_kernel, _paged_decode_mma_kernel
from tqkern.ops.paged_decode.mma_plans import (DynamicSmemUnsupported, _LUT_BYTES, _needs_lut, coop_smem_bytes,
                                               ctas_per_sm)

__all__ = ["_launch_paged_decode_mma", "resident_warps"]


def _size_dynamic_smem(kernel, plan: dict) -> None:
    """Give the compiled cooperative kernel ``kernel`` its dynamic shared memory before its binary
    is loaded: Triton sizes a launch's dynamic shared memory (and, on load, the >48 KB opt-in)
    from ``metadata.shared``, which counts only Triton's own scratch; the stages are addressed by
    inline PTX past that scratch (``SMEM_OFF``)."""
    want = coop_smem_bytes(plan)
    md = kernel.metadata
    if md.shared == want:
        return
    if md.shared > plan["SMEM_OFF"]:
        raise DynamicSmemUnsupported(f"Triton's shared scratch ({md.shared} bytes) overlaps the stages at "
                                     f"{plan['SMEM_OFF']}")
    packed = getattr(kernel, "packed_metadata", None)
    if getattr(kernel, "module", None) is not None or not (isinstance(packed, tuple) and len(packed) == 3
                                                           and packed[2] == md.shared and hasattr(md, "_replace")):
        raise DynamicSmemUnsupported("cannot size this Triton version's dynamic shared memory (metadata layout "
                                     "unknown)")
    kernel.metadata = md._replace(shared=want)
    kernel.packed_metadata = packed[:2] + (want,)


def _kernel_args(q_rot, cache, block_table, seq_lens, layout, plan, key_centroids_f32, acc, ml, group, num_splits,
                 sm_scale, warps, prefetch, hint, maxnreg=None, value_centroids_f32=None):
    s, hq, _ = q_rot.shape
    if plan.get("COOP"):  # one warp per KV head of a (sequence, split)
        warps = layout.num_kv_heads
    if prefetch is None:  # the ring holds the steps of one iteration (measured: SUB = 2 with 1 step slower)
        prefetch = plan["SUB"]
    # The value codebook is read only for 3-bit Lloyd-Max values next to 5-bit keys.
    vcen = value_centroids_f32 if plan["K_BITS"] == 5 and not plan["V_UNIFORM"] else key_centroids_f32
    args = (q_rot, cache, block_table, seq_lens, key_centroids_f32, vcen, acc, ml, s, block_table.shape[1],
            sm_scale * 1.4426950408889634, num_splits)
    kwargs = dict(G=group, HKV=layout.num_kv_heads, HQ=hq, WARPS=warps, BS=layout.block_size, PREFETCH=prefetch,
                  HINT=hint, **plan, num_warps=warps, num_stages=1)
    if maxnreg is None and plan.get("COOP"):  # two CTAs of 8 warps per SM
        maxnreg = 128
    if maxnreg is None:  # measured (H100): capped at 128 registers ~2% faster for aligned fields (no spill
        # inside the loop); with joined fields the kernel needs ~168 and a cap spills in the loop;
        # two steps per iteration (SUB = 2) hold a two-step ring: 168 (12 warps/SM) measured fastest
        maxnreg = 0 if plan["K_MERGE"] or plan["V_MERGE"] else 168 if plan["SUB"] == 2 else 128
    if maxnreg:
        kwargs["maxnreg"] = maxnreg
    return args, kwargs


_RESIDENT: dict = {}
_COOP_READY: set = set()


def _compile_key(q_rot, layout, plan, group, warps, prefetch, hint, maxnreg) -> tuple:
    """What a launch's compiled kernel depends on (cheap to hash: this runs on every launch); the
    key of :data:`_RESIDENT` and :data:`_COOP_READY`."""
    return (layout, tuple(plan.items()), group, q_rot.shape[1], warps, prefetch, hint, maxnreg,
            q_rot.device.index or 0)


def _compiled(args, kwargs, plan, key):
    """The compiled kernel of a launch (cooperative plans: with their dynamic shared memory sized,
    once per ``key``)."""
    if plan.get("COOP"):
        k = _paged_decode_coop_kernel.warmup(*args, grid=(1,), **kwargs)
        _size_dynamic_smem(k, plan)
        _COOP_READY.add(key)
        return k
    return _paged_decode_mma_kernel.warmup(*args, grid=(1,), **kwargs)


def resident_warps(q_rot, cache, block_table, seq_lens, layout, plan, key_centroids_f32, *, group: int,
                   warps: int = 4, prefetch: int | None = None, hint: int = 1, maxnreg: int | None = None,
                   value_centroids_f32=None) -> int:
    """Warps of this launch's compiled kernel that the GPU holds at once (from its registers and
    shared memory; compiled once, cached); a conservative 8 per SM if the compiled kernel cannot
    be inspected (that costs speed, never correctness)."""
    dev = q_rot.device.index or 0
    key = _compile_key(q_rot, layout, plan, group, warps, prefetch, hint, maxnreg)
    if key not in _RESIDENT:
        args, kwargs = _kernel_args(q_rot, cache, block_table, seq_lens, layout, plan, key_centroids_f32, q_rot,
                                    q_rot, group, 1, 1.0, warps, prefetch, hint, maxnreg, value_centroids_f32)
        props = torch.cuda.get_device_properties(dev)
        warps = kwargs["num_warps"]
        try:
            k = _compiled(args, kwargs, plan, key)  # (cooperative: the table is in metadata.shared)
            ctas = ctas_per_sm(k, warps, 0 if plan.get("COOP") else _LUT_BYTES * _needs_lut(plan), props)
        except Exception:  # noqa: BLE001
            if plan.get("COOP"):  # a cooperative plan must be sized before it can launch at all
                raise
            ctas = max(1, 8 // warps)
        _RESIDENT[key] = ctas * warps * props.multi_processor_count
    return _RESIDENT[key]


def _launch_paged_decode_mma(q_rot, cache, block_table, seq_lens, layout, plan, key_centroids_f32, acc, ml, *,
                             group: int, num_splits: int, sm_scale: float, warps: int = 4,
                             prefetch: int | None = None,
                             hint: int = 1, maxnreg: int | None = None, value_centroids_f32=None):
    """Launch the warp-MMA decode (partials only; the caller merges). ``value_centroids_f32`` is
    required for 3-bit Lloyd-Max values (5-bit keys). No checks."""
    s = q_rot.shape[0]
    total = s * layout.num_kv_heads * num_splits
    args, kwargs = _kernel_args(q_rot, cache, block_table, seq_lens, layout, plan, key_centroids_f32, acc, ml, group,
                                num_splits, sm_scale, warps, prefetch, hint, maxnreg, value_centroids_f32)
    if plan.get("COOP"):
        key = _compile_key(q_rot, layout, plan, group, warps, prefetch, hint, maxnreg)
        if key not in _COOP_READY:
            _compiled(args, kwargs, plan, key)
        _paged_decode_coop_kernel[(s * num_splits,)](*args, **kwargs)
    else:
        _paged_decode_mma_kernel[(triton.cdiv(total, warps),)](*args, **kwargs)
