"""Helpers for tests that run tqkern_torch kernels: the device under test and poisoning."""

from __future__ import annotations

import numpy as np
import torch

from tqkern_torch._validate import interpreting
from tqkern_torch.ops import store

__all__ = ["device_under_test", "kernels_available", "poisoned_like", "store_for_tests", "to_torch_kv"]


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


def store_for_tests(cache: torch.Tensor, k, v, slot_mapping: np.ndarray, layout, params, dtype: torch.dtype) -> None:
    """Write ``k, v [T, H, D]`` (rounded to ``dtype`` first) at ``slot_mapping`` of ``cache``, for
    tests whose subject reads the cache: by the store kernel on a GPU, by the NumPy store oracle
    elsewhere. Both write the same bytes (``property_tests/test_store_triton.py``); the interpreter
    takes seconds a call for the store kernel, the oracle ~0.01 s. ``params``: a host
    :class:`tqkern.TQParams`."""
    from tqkern import reference as ref

    kt, k64 = to_torch_kv(k, dtype, cache.device)
    vt, v64 = to_torch_kv(v, dtype, cache.device)
    if cache.device.type == "cuda":
        store(cache, kt, vt, torch.from_numpy(np.asarray(slot_mapping)).to(cache.device), layout, params)
    else:
        cache.copy_(torch.from_numpy(ref.store(cache.numpy(), k64, v64, slot_mapping, layout, params)))
