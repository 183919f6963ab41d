"""Rotation: the NumPy oracle.

``rotate(x, Π) = x @ Π`` and ``rotate(y, Π, inverse=True) = y @ Πᵀ`` over the last axis, computed
in float64 (inputs of any float dtype are converted exactly). Π is a ``[D, D]`` orthogonal matrix
(see :mod:`tqkern.rotations`); ``x`` is ``[..., D]``.

Non-finite values propagate as in IEEE float64 arithmetic (a NaN in a row of ``x`` makes that
output row NaN); ``compress`` never rotates one (it stores non-finite vectors as zeros).
"""

from __future__ import annotations

import numpy as np

__all__ = ["rotate"]


def rotate(x: np.ndarray, rotation: np.ndarray, *, inverse: bool = False) -> np.ndarray:
    """``x @ rotation`` (or ``x @ rotation.T`` with ``inverse``), float64 ``[..., D]``."""
    x = np.asarray(x, dtype=np.float64)
    r = np.asarray(rotation, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] != r.shape[1]:
        raise ValueError(f"rotation must be a square [D, D] matrix, got shape {r.shape}")
    if x.shape[-1] != r.shape[0]:
        raise ValueError(f"x.shape[-1] must be {r.shape[0]}, got {x.shape[-1]}")
    return x @ (r.T if inverse else r)
