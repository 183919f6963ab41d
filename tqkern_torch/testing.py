"""Helpers for tests that run tqkern_torch kernels: the device under test and poisoning."""

from __future__ import annotations

import numpy as np
import torch

from tqkern_torch._validate import interpreting

__all__ = ["device_under_test", "kernels_available", "poisoned_like", "to_torch_kv"]


def device_under_test() -> torch.device:
    """CUDA when present, else the CPU (kernels then run through the Triton interpreter)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def kernels_available() -> bool:
    """Whether Triton kernels can run here: a GPU, or the interpreter (``TRITON_INTERPRET=1``)."""
    return torch.cuda.is_available() or interpreting()


def poisoned_like(shape, dtype, device, seed: int = 0) -> torch.Tensor:
    """A tensor full of garbage: random bytes for uint8, NaN for floats."""
    if dtype == torch.uint8:
        g = np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)
        return torch.from_numpy(g).to(device)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def to_torch_kv(x: np.ndarray, dtype: torch.dtype, device) -> tuple[torch.Tensor, np.ndarray]:
    """``x`` as a torch tensor of ``dtype`` and the float64 values it actually holds."""
    t = torch.from_numpy(np.asarray(x, np.float32)).to(dtype).to(device)
    return t, t.float().cpu().numpy().astype(np.float64)
