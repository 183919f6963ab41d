"""The warp-MMA decode kernel's one host-side step outside planning: sizing a cooperative
plan's dynamic shared memory before its compiled binary loads (:func:`_size_dynamic_smem`; the
launcher, :mod:`.triton`, passes it to the kernel's :class:`~tqkern.ops.launch.KernelLauncher`)."""

from __future__ import annotations

from tqkern.ops.paged_decode.mma_plans import DynamicSmemUnsupported, MmaPlan, coop_smem_bytes

__all__ = ["_size_dynamic_smem"]


def _size_dynamic_smem(kernel, plan: MmaPlan) -> None:
    """Give the compiled cooperative kernel ``kernel`` its dynamic shared memory before its binary
    is loaded: Triton sizes a launch's dynamic shared memory (and, on load, the >48 KB opt-in)
    from ``metadata.shared``, which counts only Triton's own scratch; the stages are addressed by
    inline PTX past that scratch (``SMEM_OFF``)."""
    want = coop_smem_bytes(plan)
    md = kernel.metadata
    if md.shared == want:
        return
    if md.shared > plan.SMEM_OFF:
        raise DynamicSmemUnsupported(f"Triton's shared scratch ({md.shared} bytes) overlaps the stages at "
                                     f"{plan.SMEM_OFF}")
    packed = getattr(kernel, "packed_metadata", None)
    if getattr(kernel, "module", None) is not None or not (isinstance(packed, tuple) and len(packed) == 3
                                                           and packed[2] == md.shared and hasattr(md, "_replace")):
        raise DynamicSmemUnsupported("cannot size this Triton version's dynamic shared memory (metadata layout "
                                     "unknown)")
    kernel.metadata = md._replace(shared=want)
    kernel.packed_metadata = packed[:2] + (want,)
