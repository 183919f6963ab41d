"""Argument checks at the public boundary: every failure names the argument, expected and actual."""

from __future__ import annotations

import os
from typing import Sequence

import torch

__all__ = ["check_tensor", "interpreting", "use_triton"]


def _fmt_shape(shape: Sequence) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_tensor(x, name: str, *, shape: Sequence | None = None, dtypes: Sequence[torch.dtype] | None = None,
                 device: torch.device | None = None, contiguous: bool = False, last_contiguous: bool = False):
    """Check one tensor argument. ``shape`` entries may be ``None`` (any size)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be {want}, got {str(x.dtype).replace('torch.', '')}")
    if shape is not None:
        ok = x.dim() == len(shape) and all(s is None or s == a for s, a in zip(shape, x.shape))
        if not ok:
            want = _fmt_shape(["*" if s is None else s for s in shape])
            raise ValueError(f"{name} must have shape {want}, got {_fmt_shape(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} must be on {device}, got {x.device}")
    if contiguous and not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(x.stride())}")
    if last_contiguous and x.dim() and x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(x.stride())}")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(device: torch.device) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``;
    otherwise the CPU path falls back to the NumPy oracle."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())
