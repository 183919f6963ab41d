"""Orthogonal rotations Π ∈ R^{d×d}, NumPy float64.

Convention everywhere in tqkern: a row vector x is rotated as ``y = x @ Π`` and rotated back as
``x = y @ Π.T``. (vLLM's Hadamard is symmetric, so both conventions agree; turboquant-vllm writes
``y = x @ Qᵀ``, so its matrix enters tqkern as ``Π = Qᵀ``: ``TQParams(..., rotation=Q.T)``.
A transposed matrix is orthogonal too, so nothing can catch the wrong orientation; see
``docs/layout.md``, *Importing a peer's parameters*.)

- :func:`hadamard`: for d a power of two, ``Π = diag(s) · H_d / √d`` with H_d Sylvester's
  Hadamard matrix (``H_1 = [1]``, ``H_2n = [[H, H], [H, −H]]``) and s a seeded vector of ±1
  (all +1 without a seed): the signs are applied before the transform. For other even d,
  write d = p · m with p the largest power of two dividing d and m odd; then
  ``Π = diag(s) · (Q_m ⊗ H_p/√p)`` with Q_m a seeded Haar-random m×m orthogonal matrix: the
  coordinates form m groups of p consecutive entries, each group gets a fast Walsh-Hadamard
  transform, and Q_m mixes the m groups. It costs d·log2(p) + d·m operations instead of d², stays
  exactly orthogonal, and reduces to the plain transform when m = 1. (d = 96 = 32·3, d = 80 = 16·5.)
- :func:`haar`: a seeded Haar-random orthogonal matrix: QR of a standard Gaussian matrix with the
  columns of Q multiplied by sign(diag(R)) (Mezzadri 2007), which makes the distribution uniform.
"""

from __future__ import annotations

import numpy as np

__all__ = ["hadamard", "haar", "sylvester", "random_signs", "rotation_for", "is_signed_sylvester"]


def _check_dim(d: int) -> None:
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"d must be a positive int, got {d!r}")


def _check_seed(seed, *, none: bool = False) -> None:
    """A NumPy seed: an int >= 0 (``None`` too where ``none``)."""
    if seed is None and none:
        return
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int >= 0{' or None' if none else ''}, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be an int >= 0{' or None' if none else ''}, got {seed}")


def sylvester(d: int) -> np.ndarray:
    """The unnormalised Sylvester Hadamard matrix H_d (entries ±1), d a power of two."""
    _check_dim(d)
    if d & (d - 1):
        raise ValueError(f"d must be a power of two, got {d}")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def random_signs(d: int, seed: int) -> np.ndarray:
    """d seeded ±1 values (float64), drawn as ``2·Bernoulli(1/2) − 1`` from ``default_rng(seed)``."""
    _check_dim(d)
    _check_seed(seed)
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2, size=d).astype(np.float64) * 2 - 1


def haar(d: int, seed: int) -> np.ndarray:
    """A seeded Haar-random orthogonal d×d matrix (float64)."""
    _check_dim(d)
    _check_seed(seed)
    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))[None, :]


def hadamard(d: int, seed: int | None = None) -> np.ndarray:
    """The (signed) Hadamard rotation described in the module docstring; d even or a power of two.

    Args:
        d: dimension.
        seed: seeds the ±1 sign diagonal (and Q_m when d is not a power of two); ``None`` means
            no signs (vLLM) and, for d not a power of two, Q_m from seed 0.
    """
    _check_dim(d)
    _check_seed(seed, none=True)
    p = d & -d  # largest power of two dividing d
    m = d // p
    if m > 1 and p == 1:
        raise ValueError(f"d must be even or a power of two, got {d}")
    h = sylvester(p) / np.sqrt(p)
    rot = h if m == 1 else np.kron(haar(m, 0 if seed is None else seed + 1), h)
    if seed is not None:
        rot = random_signs(d, seed)[:, None] * rot
    return rot


def rotation_for(kind: str, d: int, seed: int) -> np.ndarray:
    """The rotation a :class:`~tqkern.layouts.KVFormat` names: ``"hadamard"`` (unsigned),
    ``"hadamard_signed"`` (signs from ``seed``) or ``"haar"`` (from ``seed``)."""
    _check_seed(seed)  # (unread by the unsigned Hadamard, still a seed)
    if kind == "hadamard":
        return hadamard(d, None)
    if kind == "hadamard_signed":
        return hadamard(d, seed)
    if kind == "haar":
        return haar(d, seed)
    raise ValueError(f"kind must be one of ('hadamard', 'hadamard_signed', 'haar'), got {kind!r}")


def is_signed_sylvester(rotation, *, rtol: float = 2.0**-20) -> bool:
    """Whether ``rotation`` is ``diag(s) · H_d / √d`` (s ∈ {±1}^d, H_d Sylvester's, d a power of
    two): every entry is ``±|Π[0, 0]|``, within ``rtol`` of ``1/√d``, with the sign pattern
    ``s_i · H_d[i, j]`` (``s_i`` the sign of column 0).

    Such a Π is exactly ``(±1 matrix) · c``, so ``x @ Π`` can be computed as a product of x with
    an exact ±1 matrix followed by one scaling by ``c = |Π[0, 0]|`` (the store kernel's ``"pm1"``
    rotation). ``rtol`` admits a float32 copy of the matrix; the scaled product then differs
    from ``x @ Π`` by ≤ ``rtol · Σ|x_i|``, far below the oracle's uncertainty window
    (:data:`tqkern.ops.quantize.reference.EPS` = 2^-16 of ‖x‖)."""
    r = np.asarray(rotation, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] != r.shape[1] or r.shape[0] < 1:
        return False
    d = r.shape[0]
    if d & (d - 1):
        return False
    c = abs(r[0, 0])
    if not abs(c * np.sqrt(d) - 1.0) <= rtol or not np.all(np.abs(np.abs(r) - c) <= rtol * c):
        return False
    signs = np.where(r[:, :1] > 0, 1.0, -1.0)
    return bool(np.array_equal(np.sign(r), signs * sylvester(d)))
