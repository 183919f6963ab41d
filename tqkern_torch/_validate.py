"""Argument checks at the public boundary: every failure names the argument, expected and actual."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

__all__ = ["check_device", "check_flag", "check_tensor", "interpreting", "use_triton"]


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


def check_even_address(x: torch.Tensor, name: str) -> None:
    """A cache's first byte must sit at an even address: the kernels read and write raw 16-bit
    fields at even offsets from it. Eager calls only (dynamo traces neither ``data_ptr`` nor
    ``storage_offset``)."""
    if not torch.compiler.is_compiling() and x.data_ptr() % 2:
        raise ValueError(f"{name} must start at an even byte address (16-bit fields), got one at an odd address "
                         f"(storage offset {x.storage_offset()})")


def check_device(device, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` (a name such as ``"cpu"``, ``"cuda:0"``, an index, a device),
    refusing names torch does not parse and CUDA where torch has none."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name} must be a torch device or its name ('cpu', 'cuda', 'cuda:0'), got {device!r}") \
            from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} {str(d)!r} is not available: this torch has no usable CUDA device")
    return d


def check_flag(value, name: str) -> bool:
    """A boolean argument (``bool`` or NumPy's), as ``bool``: any other truthy object is refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(device: torch.device) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``;
    otherwise the CPU path falls back to the NumPy oracle."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())
