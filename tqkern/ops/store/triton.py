"""The store launcher: the plan (:func:`~tqkern.ops.store.plan.plan_store`), then
:func:`~tqkern.ops.store.kernel._store_kernel` on its grid. No input checks: the torch frontend
validates."""

from __future__ import annotations

import torch

from tqkern.ops.launch import BoundedCache, KernelLauncher
from tqkern.ops.store.kernel import _store_kernel
from tqkern.ops.store.plan import StorePlan, plan_store
from tqkern.ops.store.warp import _store_warp_kernel
from tqkern.ops.store.wide import SPLIT_SCALE

__all__ = ["_store_kernel", "_store_warp_kernel", "_launch_store", "rotation_parts", "signed_key_offset", "store_plan",
           "vectors_aligned"]


def vectors_aligned(*tensors) -> bool:
    """Every ``[T, H, D]`` 16-bit tensor's vectors start at a multiple of 8 bytes (the warp store
    kernel reads a lane's elements as int64 words; as int32 words where a lane holds two) and ``D``
    is at least 64."""
    for x in tensors:
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise TypeError(f"vectors_aligned takes [T, H, D] tensors, got {type(x).__name__}"
                            f"{' of shape ' + str(tuple(x.shape)) if isinstance(x, torch.Tensor) else ''}")
        if x.shape[-1] < 64 or x.data_ptr() % 8 or x.stride(0) % 4 or x.stride(1) % 4:
            return False
    return True


def store_plan(key, layout, tables, *, signed_sylvester: bool, interpret: bool, value=None,
               symmetric_codebooks: bool = False) -> StorePlan:
    """The plan a store of ``key`` (and ``value``; torch ``[T, H, D]``) with these tables runs."""
    return plan_store(layout, "bf16" if key.dtype == torch.bfloat16 else "fp16",
                      has_mu=tables["key_offset"] is not None, signed_sylvester=signed_sylvester, interpret=interpret,
                      num_vectors=key.shape[0] * key.shape[1],
                      vector_aligned=value is not None and vectors_aligned(key, value),
                      symmetric_codebooks=symmetric_codebooks)


def signed_key_offset(mu: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``μ ⊙ s``, ``s_i = sign(Π[i, 0])`` (+1 where ``Π[i, 0] > 0``, else −1; μ's float32 ``[H, D]``):
    the warp store kernel's key offset for a rotated key side. That kernel multiplies the keys by
    ``s`` (a sign-bit XOR) before the Hadamard transform, so it subtracts ``s ⊙ μ``; the product is
    exact, so the codes are those of ``x − μ`` rotated by Π."""
    return (mu * torch.where(rotation[:, 0] > 0, 1.0, -1.0).to(mu.dtype)).contiguous()


def rotation_parts(rotation: torch.Tensor) -> torch.Tensor:
    """fp16 ``[2, D, D]``: ``16·Π`` (float32 ``rotation``) as ``Π_1 + Π_2``, ``Π_1`` its rounding to
    fp16 and ``Π_2`` the rounding of what ``Π_1`` leaves (each to nearest, ties to even; 16 is a
    power of two, so the product is exact): the operands the column-chunked store reads
    (:mod:`tqkern.ops.store.wide`)."""
    if not isinstance(rotation, torch.Tensor):
        raise TypeError(f"rotation must be a torch.Tensor, got {type(rotation).__name__}")
    if rotation.dim() != 2 or rotation.shape[0] != rotation.shape[1] or not rotation.dtype.is_floating_point:
        raise ValueError(f"rotation must be a square floating-point [D, D] tensor, got {rotation.dtype} "
                         f"{tuple(rotation.shape)}")
    r = rotation.float() * float(SPLIT_SCALE.value)
    hi = r.half()
    return torch.stack([hi, (r - hi.float()).half()]).contiguous()


# Launches of the store kernel by (plan, grid): a repeated store of the same shape calls the
# compiled kernel directly (:class:`tqkern.ops.launch.KernelLauncher`: no per-call binding of the
# plan's constexprs; the decode's host-time lesson).
_LAUNCHERS = BoundedCache(256)


def _launch_store(cache, key, value, slot_mapping, layout, tables, errors, *, interpret: bool,
                  signed_sylvester: bool = False, symmetric_codebooks: bool = False):
    """Launch :func:`_store_kernel`. ``errors``: int32 ``[1]`` device word the kernel ORs its
    :class:`~tqkern.errors.ErrorFlag` bits into.

    ``tables`` holds device tensors: ``rotation`` fp32 [D, D], ``key_boundaries`` / ``value_boundaries``
    fp32, ``key_centroids`` / ``value_centroids`` fp64, ``key_offset`` fp32 [H, D] or None (any
    1-element tensor stands in for an unused table), and optionally ``key_offset_signed``
    (:func:`signed_key_offset`, the table the warp kernel reads for rotated keys) and
    ``rotation_parts`` (:func:`rotation_parts`, the column-chunked store's operands), each made
    here, per call, when absent or None. ``signed_sylvester``: the rotation is
    ``diag(s)·H/√D`` (:func:`tqkern.rotations.is_signed_sylvester`; the ``pm1`` method).
    ``symmetric_codebooks``: every Lloyd-Max boundary table is antisymmetric (the warp kernel's
    half-table search).
    """
    plan = store_plan(key, layout, tables, signed_sylvester=signed_sylvester, interpret=interpret, value=value,
                      symmetric_codebooks=symmetric_codebooks)
    num_tokens = key.shape[0]
    mu = tables["key_offset"]
    if mu is not None and plan.kernel == "warp" and layout.format.key.rotated:
        signed = tables.get("key_offset_signed")
        mu = signed_key_offset(mu, tables["rotation"]) if signed is None else signed
    rot = tables["rotation"]
    if plan.columns:
        parts = tables.get("rotation_parts")
        d = layout.head_dim
        if parts is not None and (tuple(parts.shape) != (2, d, d) or parts.dtype != torch.float16
                                  or not parts.is_contiguous()):
            raise ValueError(f"rotation_parts must be a contiguous torch.float16 tensor of shape (2, {d}, {d}), "
                             f"got {parts.dtype} {tuple(parts.shape)}")
        rot = rotation_parts(rot) if parts is None else parts
    args = (key, value, slot_mapping, cache, rot, tables["key_boundaries"], tables["key_centroids"],
            tables["value_boundaries"], tables["value_centroids"], mu if mu is not None else tables["rotation"],
            errors, num_tokens, cache.shape[0] * layout.block_size, key.stride(0), key.stride(1), value.stride(0),
            value.stride(1))
    grid = plan.grid(num_tokens)
    launcher = _LAUNCHERS.get((plan, grid))
    if launcher is None:  # one per (plan, grid): a decode step's store repeats both
        options = {k: v for k, v in plan.kwargs().items() if k in ("num_warps", "num_stages", "maxnreg")}
        kernel = _store_warp_kernel if plan.kernel == "warp" else _store_kernel
        launcher = _LAUNCHERS.put((plan, grid), KernelLauncher(kernel, grid, dict(plan.constexprs), **options))
    launcher(*args)
