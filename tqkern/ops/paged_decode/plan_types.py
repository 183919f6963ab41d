"""The decode plan's typed values: what a device offers planning (:class:`DeviceCaps`), which
attention options a launch applies (:class:`DecodeOptions`) and one kernel launch
(:class:`KernelPlan`); :mod:`.plan` builds them into a :class:`~.plan.DecodePlan` (and re-exports
them)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

__all__ = ["DeviceCaps", "DecodeOptions", "KernelPlan", "Occupancy"]


@dataclasses.dataclass(frozen=True)
class DeviceCaps:
    """What planning needs to know of a device. ``interpret``: Triton's CPU interpreter (no
    inline PTX: the general kernel; one SM). ``dynamic_smem``: whether this Triton's compiled
    kernels can be given dynamic shared memory past their own (the cooperative plans need it;
    the launcher finds out when it first sizes one)."""

    capability: tuple[int, int]
    num_sms: int
    smem_per_block_optin: int
    smem_per_sm: int
    interpret: bool = False
    dynamic_smem: bool = True

    def __post_init__(self):
        cap = self.capability
        if not isinstance(cap, tuple) or len(cap) != 2 or not all(isinstance(x, int) for x in cap):
            raise TypeError(f"capability must be a (major, minor) pair of ints, got {cap!r}")
        for name in ("num_sms", "smem_per_block_optin", "smem_per_sm"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")

    @classmethod
    def sm90(cls, num_sms: int = 132) -> "DeviceCaps":
        """An H100 SXM (sm_90, 132 SMs, 227 KB of shared memory per CTA, 228 KB per SM)."""
        return cls(capability=(9, 0), num_sms=num_sms, smem_per_block_optin=232448, smem_per_sm=233472)

    @classmethod
    def interpreter(cls) -> "DeviceCaps":
        """Triton's CPU interpreter."""
        return cls(capability=(0, 0), num_sms=1, smem_per_block_optin=0, smem_per_sm=0, interpret=True,
                   dynamic_smem=False)


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """Which attention options a launch applies (spec: :mod:`tqkern.ops.paged_decode.reference`;
    the values are runtime arguments, so one plan serves every window, cap and sink vector):
    ``window`` and ``softcap`` are constexprs of both decode kernels (their plain kernels are
    compiled without them);
    ``sinks`` (denominator) and ``lse`` (written normaliser) are the merge's and follow either
    kernel, as both write the same partials (unnormalised acc, base-2 max, sum per split)."""

    window: bool = False
    softcap: bool = False
    sinks: bool = False
    lse: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, bool):
                raise TypeError(f"DecodeOptions.{f.name} must be a bool, got {type(v).__name__}")

    def constexprs(self) -> dict:
        """The warp-MMA kernel's constexprs of these options: ``WINDOW`` and ``SOFTCAP`` where on
        (none when off, so that a plain plan and its kernel are the ones before the options)."""
        return {k: True for k, on in (("WINDOW", self.window), ("SOFTCAP", self.softcap)) if on}


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """One kernel launch: ``kernel`` (``"mma"``, ``"coop"`` or ``"general"``), its grid, its
    constexprs (name, value pairs in a fixed order) and compile options."""

    kernel: str
    grid: tuple[int, ...]
    constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int
    maxnreg: int = 0

    def constexpr(self, name: str):
        """The value of one constexpr (``KeyError`` naming it if the plan has none)."""
        for k, v in self.constexprs:
            if k == name:
                return v
        raise KeyError(f"{self.kernel} plan has no constexpr {name!r}")

    def kwargs(self) -> dict:
        """Constexprs plus options, as Triton's launch takes them."""
        out = dict(self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg:
            out["maxnreg"] = self.maxnreg
        return out


# CTAs of a compiled kernel plan that one SM holds; None where unknown, 0 where the kernel does not
# fit on the device at all (its shared memory past the per-CTA opt-in).
Occupancy = Callable[[KernelPlan], Optional[int]]
