"""E8 in a cube: a fixed-rate lattice code of 8-coordinate blocks (NumPy oracle, no torch).

The planned ``E8`` codec (``docs/quality.md`` "E8 lattice codes at 70 bytes") quantizes each block
of 8 consecutive coordinates of a normalized, rotated vector (scaled to unit variance per
coordinate) to a point of the Gosset lattice E8, scaled by one of a few per-block scales. This
module is the maths only: the codebook, the encoder, the decoder and the block indices. The codec
(its fields, norms, bit packing in a slot) and its kernels build on it.

Codebook. For ``q`` levels (a power of two, 4 to 64), ``C_q`` is the set of points ``y = z + s/2``
with ``s`` in {0, 1} (the coset: integer or half-integer coordinates), ``z`` an integer vector with
an even sum (a point of D8) and every ``z_i`` in ``[-q/2, q/2 - 1]``. E8 is D8 together with
D8 + (½, …, ½), so ``C_q`` is the part of E8 in a cube; it has ``q^8`` points, ``8·log2 q`` bits.

Block index. ``c_i = z_i + q/2`` in ``[0, q)``; the sum of the ``c_i`` is even (``8·q/2`` is), so
``c_7``'s lowest bit is the parity of ``c_0 + … + c_6`` and is not stored. One block's index is
``(c_0, …, c_6, c_7 >> 1, s, t)``: ``7·log2 q + (log2 q − 1) + 1`` bits, plus ``log2 m`` bits for
``t``, the index of its scale among ``m`` (a power of two, 1 to 16).

Decoding. ``x̂ = β_t · (c − q/2 + s/2)`` elementwise: a uniform quantizer's decode.

Encoding (float64; ties broken as stated, so the indices are exact):

1. For each scale ``t`` (in order) and each coset ``s`` (0 first): ``w = x / β_t − s/2``;
   ``r = clip(floor(w + ½), −q/2, q/2 − 1)`` per coordinate (round half up, then into the box);
   if ``sum(r)`` is odd, the unit move ``r_i ± 1`` that stays in the box and adds the least
   squared error ``(w_i − r_i ∓ 1)² − (w_i − r_i)²`` is applied (ties: the lowest ``i``, then
   ``+1`` before ``−1``). That is the point of D8 in the box nearest to ``w``: ``r`` is the
   nearest box point per coordinate, an odd change of the sum needs an odd move of some
   coordinate, and each coordinate's squared error is convex, so one unit move is the cheapest.
2. The coset with the smaller ``‖w − z‖²`` wins (ties: ``s = 0``); then the scale with the smaller
   error ``β_t² · ‖x/β_t − y‖²`` (ties: the lowest ``t``).

Every point of ``C_q`` times ``β_t`` encodes to itself when it is the only nearest point (the
tests check it on random codebook points at ``t = 0``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["E8_LEVELS", "E8_SCALES", "check_levels", "check_scales", "nearest_d8_in_box", "encode_blocks",
           "decode_blocks", "index_bits", "uncertain_blocks", "cube_scales", "CUBE_SCALES"]

E8_LEVELS = (4, 8, 16, 32, 64)  # q: levels per coordinate
E8_SCALES = (1, 2, 4, 8, 16)  # m: scales per block


def check_levels(q: object) -> int:
    """``q`` as an int; ``ValueError`` unless one of :data:`E8_LEVELS` (``TypeError`` if not an int)."""
    if isinstance(q, bool) or not isinstance(q, (int, np.integer)):
        raise TypeError(f"q must be an int, got {type(q).__name__}")
    if int(q) not in E8_LEVELS:
        raise ValueError(f"q must be one of {E8_LEVELS}, got {q!r}")
    return int(q)


def check_scales(scales: object) -> np.ndarray:
    """``scales`` as a float64 array of ``m`` positive finite values, ``m`` in :data:`E8_SCALES`."""
    try:
        arr = np.asarray(scales, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"scales must be a sequence of floats, got {type(scales).__name__}") from None
    if arr.ndim != 1 or arr.size not in E8_SCALES:
        raise ValueError(f"scales must hold m in {E8_SCALES} values, got shape {arr.shape}")
    if not (np.all(np.isfinite(arr)) and np.all(arr > 0)):
        raise ValueError(f"scales must be positive and finite, got {arr.tolist()}")
    return arr


def index_bits(q: int, m: int) -> int:
    """Bits of one block's index: ``8·log2 q + log2 m``."""
    q = check_levels(q)
    if isinstance(m, bool) or not isinstance(m, int) or m not in E8_SCALES:
        raise ValueError(f"m must be one of {E8_SCALES}, got {m!r}")
    return 8 * (q.bit_length() - 1) + (m.bit_length() - 1)


def nearest_d8_in_box(w: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The point of D8 (integers, even sum) with every coordinate in ``[lo, hi]`` nearest to each
    row of ``w`` (float64 ``[..., 8]``; ``hi − lo`` odd, so the box holds both parities in every
    coordinate); ties as in the module docstring. Returns float64 ``[..., 8]``."""
    w = np.asarray(w, dtype=np.float64)
    if w.shape[-1:] != (8,):
        raise ValueError(f"w must have a last dimension of 8, got shape {w.shape}")
    if (hi - lo) % 2 != 1:
        raise ValueError(f"hi - lo must be odd, got lo={lo}, hi={hi}")
    r = np.clip(np.floor(w + 0.5), lo, hi)
    odd = (r.sum(-1) % 2) != 0
    if not odd.any():
        return r
    base = (w - r) ** 2
    cost = np.empty(r.shape + (2,))
    for j, d in enumerate((1.0, -1.0)):  # move order: +1 before -1
        moved = r + d
        cost[..., j] = np.where((moved >= lo) & (moved <= hi), (w - moved) ** 2 - base, np.inf)
    flat = cost.reshape(cost.shape[:-2] + (16,))  # (coordinate, move) in order: lowest i first
    k = np.argmin(flat, axis=-1)  # argmin takes the first of equal minima
    i, step = k // 2, np.where(k % 2 == 0, 1.0, -1.0)
    fix = np.zeros_like(r)
    np.put_along_axis(fix, i[..., None], step[..., None], axis=-1)
    return np.where(odd[..., None], r + fix, r)


def encode_blocks(x: np.ndarray, q: int, scales) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encode blocks ``x`` (float64 ``[..., 8]``, finite) into ``C_q`` at the best of ``scales``.

    Returns ``(c, s, t)``: ``c`` int64 ``[..., 8]`` in ``[0, q)`` with an even sum, ``s`` int64
    ``[...]`` (the coset), ``t`` int64 ``[...]`` (the scale's index). Rules: module docstring.
    """
    q = check_levels(q)
    betas = check_scales(scales)
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1:] != (8,):
        raise ValueError(f"x must have a last dimension of 8, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("x must be finite")
    lo, hi = -q // 2, q // 2 - 1
    best_err = best_z = best_s = best_t = None
    for t, beta in enumerate(betas):
        u = x / beta
        z0 = nearest_d8_in_box(u, lo, hi)
        z1 = nearest_d8_in_box(u - 0.5, lo, hi)
        e0 = ((u - z0) ** 2).sum(-1)
        e1 = ((u - 0.5 - z1) ** 2).sum(-1)
        s = (e1 < e0).astype(np.int64)  # ties: s = 0
        z = np.where(s[..., None] == 1, z1, z0)
        err = beta * beta * np.minimum(e0, e1)
        if best_err is None:
            best_err, best_z, best_s, best_t = err, z, s, np.zeros_like(s)
        else:
            better = err < best_err  # ties: the lower t, found first
            best_err = np.where(better, err, best_err)
            best_z = np.where(better[..., None], z, best_z)
            best_s = np.where(better, s, best_s)
            best_t = np.where(better, t, best_t)
    return (best_z - lo).astype(np.int64), best_s, best_t


def decode_blocks(c: np.ndarray, s: np.ndarray, t: np.ndarray, q: int, scales) -> np.ndarray:
    """``β_t · (c − q/2 + s/2)`` (float64 ``[..., 8]``) of indices as :func:`encode_blocks` returns."""
    q = check_levels(q)
    betas = check_scales(scales)
    c, s, t = np.asarray(c), np.asarray(s), np.asarray(t)
    if c.shape[-1:] != (8,) or s.shape != c.shape[:-1] or t.shape != c.shape[:-1]:
        raise ValueError(f"c must be [..., 8] and s, t its leading shape: got {c.shape}, {s.shape}, {t.shape}")
    if c.min(initial=0) < 0 or c.max(initial=0) >= q:
        raise ValueError(f"c must lie in [0, {q}), got [{c.min()}, {c.max()}]")
    if np.any(c.sum(-1) % 2 != 0):
        raise ValueError("c must have an even sum in every block (c_7's lowest bit is the parity of the others)")
    if np.any((s != 0) & (s != 1)):
        raise ValueError("s must be 0 or 1")
    if t.min(initial=0) < 0 or t.max(initial=0) >= betas.size:
        raise ValueError(f"t must lie in [0, {betas.size}), got [{t.min()}, {t.max()}]")
    return betas[t][..., None] * (c - q // 2 + s[..., None] * 0.5)


def uncertain_blocks(x: np.ndarray, q: int, scales, radius: float) -> np.ndarray:
    """bool ``[...]``: the blocks of ``x [..., 8]`` whose indices (:func:`encode_blocks`) may change
    when each coordinate of ``x`` moves by at most ``radius`` (a kernel's rounding error).

    Sufficient conditions for a stable index, each checked with the moved point's worst case (a
    block failing any is uncertain): (a) the chosen candidate's roundings ``⌊u_i + ½⌋`` (``u =
    x/β − s/2``) are more than ``radius/β`` from an integer step that the box clamp does not absorb;
    (b) where its parity was fixed, the least move cost beats the next by more than ``4·radius/β``
    (each cost ``1 ∓ 2(u_i − r_i)`` moves by at most ``2·radius/β``); (c) every other candidate
    (scale, coset) lies more than ``2·√8·radius`` farther than the chosen point (each candidate's
    distance to ``x`` is 1-Lipschitz in ``x``, which moves by at most ``√8·radius``). With
    ``radius = 0`` only exact ties of (b) and (c) are uncertain."""
    q = check_levels(q)
    betas = check_scales(scales)
    x = np.asarray(x, dtype=np.float64)
    lo, hi = -q // 2, q // 2 - 1
    c, s, t = encode_blocks(x, q, betas)
    beta = betas[t][..., None]
    dist = []  # every candidate's distance to x, [..., m, 2]
    for b in betas:
        u = x / b
        for sh in (0.0, 0.5):
            z = nearest_d8_in_box(u - sh, lo, hi)
            dist.append(b * np.sqrt(((u - sh - z) ** 2).sum(-1)))
    dist = np.stack(dist, axis=-1)
    chosen = np.take_along_axis(dist, (2 * t + s)[..., None], axis=-1)[..., 0]
    others = np.where(np.arange(dist.shape[-1]) == (2 * t + s)[..., None], np.inf, dist)
    unsure = others.min(-1) - chosen <= 2 * np.sqrt(8.0) * radius
    u = x / beta - 0.5 * s[..., None]
    step = np.clip(np.rint(u + 0.5), lo + 1, hi)  # the nearest rounding step the clamp keeps
    unsure |= np.any(np.abs(u + 0.5 - step) <= radius / beta, axis=-1)
    r = np.clip(np.floor(u + 0.5), lo, hi)
    odd = r.sum(-1) % 2 != 0
    cost = np.concatenate([np.where(r + d <= hi if d > 0 else r + d >= lo, 1.0 - 2.0 * d * (u - r), np.inf)
                           for d in (1.0, -1.0)], axis=-1)
    two = np.sort(cost, axis=-1)[..., :2]
    unsure |= odd & (two[..., 1] - two[..., 0] <= 4 * radius / beta[..., 0])
    return unsure


# Scales fitted to unit-variance Gaussian blocks (the coordinates of a rotated unit vector times √D):
# β_t = base/q · ratio^t minimizing the mean squared error per coordinate over 32,768 blocks of a
# seeded normal sample (numpy default_rng(0)), a grid search refined by coordinate steps to 0.002.
CUBE_SCALES: dict[tuple[int, int], tuple[float, float]] = {
    # (q, m): (base, ratio)      MSE per coordinate on the fitting sample
    (8, 1): (4.678, 1.0),      # 0.03259
    (8, 2): (3.700, 1.510),    # 0.02428
    (8, 4): (3.120, 1.264),    # 0.02008
    (16, 1): (5.388, 1.0),     # 0.01000
    (16, 2): (4.042, 1.550),   # 0.00663
    (16, 4): (3.172, 1.288),   # 0.00515
    (32, 1): (6.026, 1.0),     # 0.00303
    (32, 2): (4.334, 1.598),   # 0.00180
    (32, 4): (3.394, 1.300),   # 0.00133
    (64, 1): (6.704, 1.0),     # 0.00091
    (64, 2): (4.514, 1.684),   # 0.00048
    (64, 4): (3.304, 1.348),   # 0.00034
}


def cube_scales(q: int, m: int) -> tuple[float, ...]:
    """The ``m`` fitted scales ``β_0 < … < β_{m−1}`` of :data:`CUBE_SCALES` for ``q`` levels."""
    if (q, m) not in CUBE_SCALES:
        raise ValueError(f"(levels, scales) must be one of {sorted(CUBE_SCALES)}, got {(q, m)!r}")
    base, ratio = CUBE_SCALES[(q, m)]
    return tuple(base / q * ratio ** t for t in range(m))
