"""Measured TurboQuant_mse distortion on random unit vectors against reference figures.

D_mse = E‖u − û‖² over 10^4 uniformly random unit vectors u ∈ R^128, Haar-rotated, quantized
and dequantized by the oracle (norm_correction "none"), for b = 1..4 and both codebooks.

The Gaussian-codebook figures are the N(0, 1) Lloyd-Max optimum (Max 1960; the d → ∞ limit;
the TurboQuant paper rounds them to 0.36 / 0.117 / 0.03 / 0.009); the beta figures are the
exact-density optimum at d = 128, recorded by the tqkern authors. On unit vectors at d = 128
the rotated coordinates follow the Beta density, where the Gaussian codebook does slightly
better than that limit (its expectation, integrated below, is 0.7 % / 1.3 % /
1.7 % / 1.8 % under those values for b = 1..4), so the 2 % bound is nearly tight there; the
tighter check against the exact expectation (within 4 standard errors) is the sharper test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tqkern.codebooks import lloyd_max
from tqkern.layouts import LloydMax
from tqkern.ops.quantize.reference import dequantize, quantize
from tqkern.rotations import haar

D = 128
N = 10_000
REFERENCE_DMSE = {
    "gaussian": {1: 0.3634, 2: 0.1175, 3: 0.03455, 4: 0.0095},
    "beta": {1: 0.3609, 2: 0.1160, 3: 0.0340, 4: 0.00931},
}
_GX, _GW = np.polynomial.legendre.leggauss(20)


def _exact_beta_expectation(centroids: np.ndarray, boundaries: np.ndarray, d: int) -> float:
    """d · E[(t − c(t))²] for t with density ∝ (1 − t²)^((d−3)/2) on [−1, 1], integrated in
    θ = arcsin t with composite Gauss-Legendre quadrature (64 panels of 20 nodes per cell)."""
    th = np.arcsin(np.concatenate([[-1.0], np.clip(boundaries, -1, 1), [1.0]]))
    total = err = 0.0
    for a, b, c in zip(th[:-1], th[1:], centroids):
        p = np.linspace(a, b, 65)
        mid, half = (p[:-1] + p[1:]) / 2, (p[1:] - p[:-1]) / 2
        x = (mid[:, None] + half[:, None] * _GX[None]).ravel()
        w = (half[:, None] * _GW[None]).ravel() * np.cos(x) ** (d - 2)
        total += w.sum()
        err += (w * (np.sin(x) - c) ** 2).sum()
    return d * err / total


@pytest.fixture(scope="module")
def unit_vectors():
    x = np.random.default_rng(20240601).standard_normal((N, D))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def rotation():
    return haar(D, 17)


@pytest.mark.parametrize("distribution", ["gaussian", "beta"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_measured_distortion(bits, distribution, unit_vectors, rotation):
    codec = LloydMax(bits=bits, distribution=distribution, norm_dtype="float32", norm_correction="none")
    cb = lloyd_max(bits, D, distribution)
    q = quantize(unit_vectors, codec, rotation=rotation, codebook=cb)
    assert np.all(q.params["norm"] == 1.0)
    u_hat = dequantize(q, codec, rotation=rotation, codebook=cb, rotate_back=True)
    per_vector = np.sum((unit_vectors - u_hat) ** 2, axis=1)
    measured = per_vector.mean()
    assert measured == pytest.approx(REFERENCE_DMSE[distribution][bits], rel=0.02)
    # Sharper: the exact expectation for this codebook, within 4 standard errors.
    exact = _exact_beta_expectation(cb.centroids, cb.boundaries, D)
    se = per_vector.std() / math.sqrt(N)
    assert abs(measured - exact) < 4 * se, (measured, exact, se)
    assert se < 0.003 * exact  # the sample is large enough for the bound above to mean something


@pytest.mark.parametrize("distribution", ["gaussian", "beta"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_distortion_attribute(bits, distribution):
    assert lloyd_max(bits, D, distribution).distortion == pytest.approx(
        REFERENCE_DMSE[distribution][bits], rel=0.005)


def test_beta_codebook_beats_gaussian_on_unit_vectors():
    # The exact-Beta optimum is optimal for the true coordinate law: its expected distortion is
    # below the Gaussian codebook's at every bit width.
    for bits in (1, 2, 3, 4):
        g, b = lloyd_max(bits, D, "gaussian"), lloyd_max(bits, D, "beta")
        assert _exact_beta_expectation(b.centroids, b.boundaries, D) < _exact_beta_expectation(
            g.centroids, g.boundaries, D)


def test_theorem_1_bounds():
    # Zandieh et al., Theorem 1: 4^−b ≤ D_mse ≤ (√3·π/2)·4^−b.
    for bits in (1, 2, 3, 4):
        for dist in ("gaussian", "beta"):
            dm = lloyd_max(bits, D, dist).distortion
            assert 4.0**-bits <= dm <= math.sqrt(3) * math.pi / 2 * 4.0**-bits
