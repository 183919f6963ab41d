"""Lloyd-Max codebooks: golden centroids, structure, convergence, validation.

Convergence is checked against conditional means integrated here, independently of the solver:
the Gaussian's in closed form through ``math.erfc``, the Beta's by composite Gauss-Legendre
quadrature of t·f(t) and f(t) (20 nodes on each of 64 panels per cell).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tqkern.codebooks import Codebook, lloyd_max, lloyd_max_vllm

# Golden values, 4 decimals: positive halves, multiplied by √d. Gaussian: the N(0, 1) quantizers
# Max (1960) tabulates; beta: the exact-density optimum, recorded by the tqkern authors.
GAUSSIAN = {
    1: [0.7979],
    2: [0.4528, 1.5104],
    3: [0.2451, 0.7560, 1.3439, 2.1519],
    4: [0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326],
}
BETA = {
    (128, 3): [0.2444, 0.7533, 1.3366, 2.1315],
    (128, 4): [0.1279, 0.3864, 0.6536, 0.9371, 1.2478, 1.6043, 2.0459, 2.6889],
    (64, 4): [0.1274, 0.3847, 0.6505, 0.9319, 1.2394, 1.5908, 2.0233, 2.6464],
}


@pytest.mark.parametrize("dim", [64, 100, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_golden(bits, dim):
    c = lloyd_max(bits, dim, "gaussian").centroids * math.sqrt(dim)
    half = np.array(GAUSSIAN[bits])
    np.testing.assert_allclose(c[2 ** (bits - 1):], half, rtol=0, atol=1e-4)
    np.testing.assert_allclose(c[: 2 ** (bits - 1)], -half[::-1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("dim, bits", sorted(BETA))
def test_beta_golden(dim, bits):
    c = lloyd_max(bits, dim, "beta").centroids * math.sqrt(dim)
    half = np.array(BETA[dim, bits])
    np.testing.assert_allclose(c[2 ** (bits - 1):], half, rtol=0, atol=1e-4)
    np.testing.assert_allclose(c[: 2 ** (bits - 1)], -half[::-1], rtol=0, atol=1e-4)


def test_default_distribution_is_beta():
    assert lloyd_max(4, 128) == lloyd_max(4, 128, "beta")
    assert lloyd_max(4, 128) != lloyd_max(4, 128, "gaussian")


def test_gaussian_scales_as_one_over_sqrt_d():
    for bits in (2, 6):
        a = lloyd_max(bits, 64, "gaussian").centroids * 8
        b = lloyd_max(bits, 256, "gaussian").centroids * 16
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("distribution", ["beta", "gaussian"])
@pytest.mark.parametrize("bits, dim", [(1, 2), (2, 3), (3, 64), (4, 128), (5, 96), (8, 256), (8, 1024)])
def test_structure(bits, dim, distribution):
    cb = lloyd_max(bits, dim, distribution)
    c, b = cb.centroids, cb.boundaries
    assert (cb.bits, cb.dim, cb.distribution) == (bits, dim, distribution)
    assert c.dtype == b.dtype == np.float64
    assert c.shape == (2**bits,) and b.shape == (2**bits - 1,)
    assert np.all(np.diff(c) > 0)
    assert np.array_equal(c, -c[::-1])  # exactly symmetric
    assert np.array_equal(b, (c[:-1] + c[1:]) / 2)
    assert b[2 ** (bits - 1) - 1] == 0.0  # the middle boundary: a zero coordinate codes up
    if distribution == "beta":
        assert np.all(np.abs(c) < 1)
    assert not c.flags.writeable and not b.flags.writeable
    with pytest.raises(ValueError):
        c[0] = 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cb.bits = 3


def test_cached():
    assert lloyd_max(3, 128, "beta") is lloyd_max(3, 128, "beta")
    assert lloyd_max(5, 64, "gaussian") is lloyd_max(5, 64, "gaussian")
    assert lloyd_max(3, 128, "beta") is not lloyd_max(3, 64, "beta")


@pytest.mark.parametrize("bits", [0, 9, -1, 2.5, "4", None])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match=r"^bits must"):
        lloyd_max(bits, 128, "beta")


@pytest.mark.parametrize("dim", [1, 0, -4, 128.5, "128", None])
def test_bad_dim(dim):
    with pytest.raises(ValueError, match=r"^dim must"):
        lloyd_max(4, dim, "beta")


@pytest.mark.parametrize("distribution", ["uniform", "normal", "Beta", None])
def test_bad_distribution(distribution):
    with pytest.raises(ValueError, match=r"^distribution must .*" + repr(distribution)):
        lloyd_max(4, 128, distribution)


def test_validation_is_not_bypassed_by_the_cache():
    lloyd_max(4, 128, "beta")
    lloyd_max(1, 128, "beta")
    with pytest.raises(ValueError, match=r"^bits must"):
        lloyd_max(4.0, 128, "beta")
    with pytest.raises(ValueError, match=r"^bits must"):
        lloyd_max(True, 128, "beta")
    with pytest.raises(ValueError, match=r"^dim must"):
        lloyd_max(4, 128.0, "beta")


# -- Codebook's own checks -------------------------------------------------------------------

def test_constructor_checks_the_table_whoever_builds_it():
    """The kernels index a centroid table by a code of ``bits`` bits without a mask: a direct
    ``Codebook(...)`` whose table is shorter than 2**bits (or not a table) is refused, as
    :meth:`Codebook.from_centroids` refuses it."""
    good = lloyd_max(2, 16)
    kw = dict(bits=2, dim=16, distribution="x", centroids=good.centroids, boundaries=good.boundaries, distortion=0.0)
    cb = Codebook(**{**kw, "centroids": list(good.centroids)})  # copied to read-only float64
    assert cb.centroids.dtype == np.float64 and not cb.centroids.flags.writeable
    np.testing.assert_array_equal(cb.centroids, good.centroids)
    cases = [
        (dict(centroids=np.array([-0.1, 0.1]), boundaries=np.array([0.0])), ValueError,
         r"Codebook.centroids must have shape \(4,\) \(2\*\*bits for bits = 2\), got \(2,\)"),
        (dict(bits=9), ValueError, "Codebook.bits must be an int in 1..8, got 9"),
        (dict(bits=True), ValueError, "Codebook.bits must be an int in 1..8, got True"),
        (dict(dim=0), ValueError, "Codebook.dim must be an int >= 1, got 0"),
        (dict(centroids=good.centroids[::-1].copy()), ValueError, "Codebook.centroids must be finite and strictly"),
        (dict(centroids="abcd"), TypeError, "Codebook.centroids must be an array of real numbers, got str"),
        (dict(boundaries=good.boundaries[:2]), ValueError, r"boundaries must have shape \(3,\)"),
    ]
    for change, exc, match in cases:
        with pytest.raises(exc, match=match):
            Codebook(**{**kw, **change})


# -- Codebook.from_centroids and index ------------------------------------------------------

def test_from_centroids_wraps_and_copies():
    src = np.array([-3.0, -1.0, 1.0, 3.0])
    cb = Codebook.from_centroids(src, dim=16)
    src[0] = -100.0
    assert cb.centroids.tolist() == [-3.0, -1.0, 1.0, 3.0]
    assert cb.boundaries.tolist() == [-2.0, 0.0, 2.0]
    assert (cb.bits, cb.dim, cb.distribution) == (2, 16, "custom")
    assert math.isnan(cb.distortion)
    assert not cb.centroids.flags.writeable and not cb.boundaries.flags.writeable
    assert Codebook.from_centroids([-0.5, 0.5], dim=8, distribution="vllm").distribution == "vllm"
    assert Codebook.from_centroids(np.linspace(-1, 1, 256), dim=8).bits == 8


@pytest.mark.parametrize("centroids", [[], [1.0], [0.0, 1.0, 2.0], np.arange(6.0), np.arange(512.0)])
def test_from_centroids_bad_count(centroids):
    with pytest.raises(ValueError, match=r"^centroids must have 2\*\*bits entries"):
        Codebook.from_centroids(centroids, dim=8)


@pytest.mark.parametrize("centroids", [
    [1.0, 0.0], [0.0, 0.0], [-1.0, 0.0, 0.0, 1.0], [-1.0, 1.0, 0.5, 2.0], [0.0, np.nan],
    [-np.inf, 0.0], [0.0, np.inf],
])
def test_from_centroids_not_ascending_or_not_finite(centroids):
    with pytest.raises(ValueError, match=r"^centroids must be finite and strictly ascending"):
        Codebook.from_centroids(centroids, dim=8)


def test_index_counts_boundaries_at_or_below_with_ties_going_up():
    cb = Codebook.from_centroids([-3.0, -1.0, 1.0, 3.0], dim=8)  # boundaries -2, 0, 2
    t = np.array([-10.0, -2.0000001, -2.0, -1.0, -0.0, 0.0, 1e-300, 1.999, 2.0, 10.0])
    idx = cb.index(t)
    assert idx.dtype == np.uint8
    assert idx.tolist() == [0, 0, 1, 1, 2, 2, 2, 2, 3, 3]
    big = lloyd_max(8, 128, "beta")
    assert big.index(np.array([-1.0, big.boundaries[200], 1.0])).tolist() == [0, 201, 255]


# -- convergence, against independent integration -------------------------------------------

_GX, _GW = np.polynomial.legendre.leggauss(20)


def _beta_cells(boundaries, dim, panels=64):
    """(mass, conditional mean, d · E[(t − mean)² ; cell]) of f_d ∝ (1 − t²)^((d − 3)/2) per cell,
    unnormalised mass, integrated in θ = arcsin t (f_d(t) dt ∝ cos^(d−2) θ dθ)."""
    th = np.arcsin(np.concatenate([[-1.0], boundaries, [1.0]]))
    masses, means, seconds = [], [], []
    for a, b in zip(th[:-1], th[1:]):
        p = np.linspace(a, b, panels + 1)
        mid, half = (p[:-1] + p[1:]) / 2, (p[1:] - p[:-1]) / 2
        x = (mid[:, None] + half[:, None] * _GX[None]).ravel()
        w = (half[:, None] * _GW[None]).ravel() * np.cos(x) ** (dim - 2)
        t = np.sin(x)
        masses.append(w.sum())
        means.append((w * t).sum() / w.sum())
        seconds.append((w * t * t).sum())
    return np.array(masses), np.array(means), np.array(seconds)


def _gauss_cells(boundaries):
    """(mass, conditional mean, second moment) of N(0, 1) per cell, closed form."""
    e = [-math.inf, *boundaries.tolist(), math.inf]
    q = lambda x: 0.5 * math.erfc(x / math.sqrt(2))  # noqa: E731  P(X ≥ x)
    phi = lambda x: 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    xphi = lambda x: 0.0 if math.isinf(x) else x * phi(x)  # noqa: E731
    masses, means, seconds = [], [], []
    for a, b in zip(e[:-1], e[1:]):
        if a >= 0:
            m = q(a) - q(b)
        elif b <= 0:
            m = q(-b) - q(-a)
        else:
            m = 1.0 - q(-a) - q(b)
        masses.append(m)
        means.append((phi(a) - phi(b)) / m)
        seconds.append(m + xphi(a) - xphi(b))  # ∫ x² φ = [Φ − xφ]
    return np.array(masses), np.array(means), np.array(seconds)


@pytest.mark.parametrize("bits", [1, 5, 8])
@pytest.mark.parametrize("dim", [2, 3, 4, 7, 64, 1024])
def test_beta_is_a_lloyd_fixed_point(bits, dim):
    cb = lloyd_max(bits, dim, "beta")
    _, means, _ = _beta_cells(cb.boundaries, dim)
    # Each centroid is its cell's conditional mean (the solver claims 1e-14 · σ).
    assert np.max(np.abs(means - cb.centroids)) * math.sqrt(dim) < 1e-10


@pytest.mark.parametrize("bits", [1, 2, 5, 8])
@pytest.mark.parametrize("dim", [2, 64, 1024])
def test_gaussian_is_a_lloyd_fixed_point(bits, dim):
    cb = lloyd_max(bits, dim, "gaussian")
    s = math.sqrt(dim)
    _, means, _ = _gauss_cells(cb.boundaries * s)
    assert np.max(np.abs(means - cb.centroids * s)) < 1e-10


@pytest.mark.parametrize("bits", range(1, 9))
def test_beta_d3_is_the_uniform_quantizer(bits):
    # d = 3: a coordinate of a random unit vector in R^3 is uniform on [−1, 1], whose Lloyd-Max
    # quantizer has centroids (2i + 1)/2^b − 1.
    i = np.arange(2**bits)
    np.testing.assert_allclose(lloyd_max(bits, 3, "beta").centroids, (2 * i + 1) / 2**bits - 1,
                               rtol=0, atol=1e-12)
    # and its distortion d · Δ²/12 with Δ = 2/2^b.
    assert lloyd_max(bits, 3, "beta").distortion == pytest.approx(3 * (2 / 2**bits) ** 2 / 12, rel=1e-9)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6])
def test_distortion_attribute(bits):
    for dim in (64, 128):
        cb = lloyd_max(bits, dim, "beta")
        mass, means, second = _beta_cells(cb.boundaries, dim)
        # E[(t − c)²] over each cell = E[t²; cell] − 2c·E[t; cell] + c²·P(cell), normalised.
        c = cb.centroids
        mse = np.sum(second - 2 * c * means * mass + c * c * mass) / mass.sum()
        assert cb.distortion == pytest.approx(dim * mse, rel=1e-9)
    cb = lloyd_max(bits, 128, "gaussian")
    mass, means, second = _gauss_cells(cb.boundaries * math.sqrt(128))
    c = cb.centroids * math.sqrt(128)
    assert cb.distortion == pytest.approx(np.sum(second - 2 * c * means * mass + c * c * mass), rel=1e-9)


# -- caller boundaries (Codebook.from_centroids(..., boundaries=)) ---------------------------

def test_from_centroids_keeps_caller_boundaries_exactly():
    c = np.array([-3.0, -1.0, 1.0, 3.0])
    b32 = np.array([-1.5, 0.25, 2.5], np.float32)
    src = b32.copy()
    cb = Codebook.from_centroids(c, dim=8, boundaries=src)
    src[0] = -2.9  # the codebook holds its own copy
    assert cb.boundaries.dtype == np.float64 and cb.boundaries.tolist() == [-1.5, 0.25, 2.5]
    assert not cb.boundaries.flags.writeable
    # A float32 table one ulp off the midpoints survives exactly (it used to be replaced by them).
    c32 = np.array([-0.3, -0.1, 0.1, 0.3], np.float32)
    mids = (c32[:-1].astype(np.float64) + c32[1:]) / 2
    peer = np.nextafter(mids.astype(np.float32), np.float32(np.inf))
    got = Codebook.from_centroids(c32, dim=8, boundaries=peer).boundaries
    assert np.array_equal(got, peer.astype(np.float64)) and not np.array_equal(got, mids)


def test_caller_boundaries_decide_the_codes():
    c = [-3.0, -1.0, 1.0, 3.0]
    mid = Codebook.from_centroids(c, dim=8)  # boundaries -2, 0, 2
    own = Codebook.from_centroids(c, dim=8, boundaries=[-1.5, 0.25, 2.5])
    t = np.array([-1.8, -1.5, -1.2, 0.1, 0.25, 2.2, 2.5, 2.7, -5.0, 5.0])
    assert mid.index(t).tolist() == [1, 1, 1, 2, 2, 3, 3, 3, 0, 3]
    assert own.index(t).tolist() == [0, 1, 1, 1, 2, 2, 3, 3, 0, 3]  # ties still go up


def test_boundaries_take_part_in_equality_and_hash():
    c = [-3.0, -1.0, 1.0, 3.0]
    a = Codebook.from_centroids(c, dim=8, boundaries=[-1.5, 0.25, 2.5])
    b = Codebook.from_centroids(c, dim=8, boundaries=[-1.5, 0.25, 2.5])
    m = Codebook.from_centroids(c, dim=8)
    assert a == b and hash(a) == hash(b)
    assert a != m and hash(a) != hash(m)
    assert m == Codebook.from_centroids(c, dim=8, boundaries=[-2.0, 0.0, 2.0])
    assert len({a, b, m}) == 2


@pytest.mark.parametrize("boundaries", [[-2.0, 0.0], [-2.0, 0.0, 2.0, 2.5], [[-2.0, 0.0, 2.0]], np.zeros((3, 1))])
def test_boundaries_bad_shape(boundaries):
    with pytest.raises(ValueError, match=r"^boundaries must have shape \(3,\) .* got \("):
        Codebook.from_centroids([-3.0, -1.0, 1.0, 3.0], dim=8, boundaries=boundaries)


@pytest.mark.parametrize("boundaries, where", [
    ([-2.0, np.nan, 2.0], 1),      # not finite
    ([-2.0, 0.0, np.inf], 2),
    ([-3.0, 0.0, 2.0], 0),         # on a centroid
    ([-2.0, 1.0, 2.0], 1),
    ([-2.0, 0.0, 3.5], 2),         # outside its cell
    ([-0.5, -0.7, 2.0], 0),        # descending
    ([-2.0, 2.0, 0.0], 1),
])
def test_boundaries_not_between_their_centroids(boundaries, where):
    with pytest.raises(ValueError, match=rf"^boundaries must be finite with centroids\[i\] < boundaries\[i\] < "
                                         rf"centroids\[i \+ 1\], got boundaries\[{where}\] = "):
        Codebook.from_centroids([-3.0, -1.0, 1.0, 3.0], dim=8, boundaries=boundaries)


def test_boundaries_not_numbers():
    with pytest.raises(TypeError, match=r"^boundaries must be an array of real numbers, got list"):
        Codebook.from_centroids([-3.0, -1.0, 1.0, 3.0], dim=8, boundaries=["a", "b", "c"])


# -- vLLM's numerically solved codebook ------------------------------------------------------
# vLLM's float32 centroids (positive halves; vLLM's results are exactly symmetric), as bit
# patterns: produced by running vLLM's own solve_lloyd_max source (the trapezoid version of
# vllm/model_executor/layers/quantization/turboquant/centroids.py) on CPython 3 / x86-64 glibc.
VLLM_F32_BITS = {
    (3, 128): [0x3CB16317, 0x3D88C955, 0x3DF3243D, 0x3E42A09F],
    (4, 128): [0x3C39FBAE, 0x3D0C8559, 0x3D6DD0E1, 0x3DAA99F2, 0x3DE3682B, 0x3E126F17, 0x3E3B36E7, 0x3E772CC4],
    (4, 64): [0x3C83828A, 0x3D46B9FF, 0x3DA82948, 0x3DF1444A, 0x3E20CD0C, 0x3E4F16C0, 0x3E846170, 0x3EAEC76E],
}


def _vllm_formula(bits, d):
    """vLLM's solve, written here from its description (plain Python floats, i.e. float64):
    N(0, σ²) with σ² = 1/d; 2^b centroids start at lo + (hi − lo)(i + ½)/2^b, lo = −3.5σ,
    hi = 3.5σ; a step integrates x·p and p over each cell [e_i, e_{i+1}] (outer edges 3·lo and
    3·hi, inner edges the centroid midpoints) with the trapezoid rule on 200 equal pieces, summed
    as ½(f(a) + f(b)) then f(a + k·h) for k = 1..199 in turn, times h; the new centroid is the
    quotient (or the old one if ∫p ≤ 1e-15). Up to 200 steps; when no centroid moves by 1e-10 the
    loop ends with the centroids from before that step. The result is rounded to float32."""
    var = 1.0 / d
    sd = math.sqrt(var)

    def p(x):
        return (1.0 / math.sqrt(2 * math.pi * var)) * math.exp(-x * x / (2 * var))

    def trapezoid(f, a, b):
        h = (b - a) / 200
        acc = 0.5 * (f(a) + f(b))
        for k in range(1, 200):
            acc += f(a + k * h)
        return acc * h

    levels = 2**bits
    lo, hi = -3.5 * sd, 3.5 * sd
    cs = [lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(200):
        edges = [lo * 3] + [(cs[i] + cs[i + 1]) / 2.0 for i in range(levels - 1)] + [hi * 3]
        nxt = []
        for i in range(levels):
            mass = trapezoid(p, edges[i], edges[i + 1])
            first = trapezoid(lambda x: x * p(x), edges[i], edges[i + 1])
            nxt.append(first / mass if mass > 1e-15 else cs[i])
        if max(abs(u - v) for u, v in zip(nxt, cs)) < 1e-10:
            break
        cs = nxt
    return np.array(cs, dtype=np.float32)


@pytest.mark.parametrize("bits, dim", [(1, 128), (2, 64), (3, 96), (3, 2)])
def test_vllm_codebook_equals_the_formula(bits, dim):
    cb = lloyd_max_vllm(bits, dim)
    want = _vllm_formula(bits, dim)
    assert np.array_equal(cb.centroids, want.astype(np.float64))


@pytest.mark.parametrize("bits, dim", sorted(VLLM_F32_BITS))
def test_vllm_codebook_golden_bits(bits, dim):
    half = np.array(VLLM_F32_BITS[bits, dim], np.uint32).view(np.float32)
    want = np.concatenate([-half[::-1], half]).astype(np.float64)
    assert np.array_equal(lloyd_max_vllm(bits, dim).centroids, want)


@pytest.mark.parametrize("bits, dim", [(2, 128), (3, 128), (4, 128), (4, 64), (5, 256)])
def test_vllm_codebook_structure(bits, dim):
    cb = lloyd_max_vllm(bits, dim)
    c32 = cb.centroids.astype(np.float32)
    assert (cb.bits, cb.dim, cb.distribution) == (bits, dim, "vllm") and math.isnan(cb.distortion)
    assert np.array_equal(c32.astype(np.float64), cb.centroids)  # float32 values, held exactly
    # vLLM's store compares against midpoints computed in float32 from the float32 centroids.
    mids32 = (c32[:-1] + c32[1:]) / np.float32(2)
    assert mids32.dtype == np.float32 and np.array_equal(cb.boundaries, mids32.astype(np.float64))
    assert not cb.centroids.flags.writeable and not cb.boundaries.flags.writeable
    assert lloyd_max_vllm(bits, dim) is cb


@pytest.mark.parametrize("bits", [3, 4])
def test_vllm_codebook_differs_from_the_exact_one(bits):
    # The documented gap (PRIOR_ART, docs/layout.md): 6-7e-4 relative at 3 and 4 bits.
    v = lloyd_max_vllm(bits, 128).centroids
    g = lloyd_max(bits, 128, "gaussian").centroids
    rel = np.max(np.abs(v / g - 1))
    assert 5e-4 < rel < 8e-4
    # so codes near the boundaries differ: a dense sweep of N(0, 1/128) coordinates.
    t = np.random.default_rng(0).standard_normal(200_000) / math.sqrt(128)
    diff = np.mean(lloyd_max_vllm(bits, 128).index(t) != lloyd_max(bits, 128, "gaussian").index(t))
    assert 1e-4 < diff < 1e-2


@pytest.mark.parametrize("bits", [0, 9, 2.0, True, None])
def test_vllm_codebook_bad_bits(bits):
    with pytest.raises(ValueError, match=r"^bits must be an int in \[1, 8\], got "):
        lloyd_max_vllm(bits, 128)


@pytest.mark.parametrize("dim", [1, 0, 128.0, "128"])
def test_vllm_codebook_bad_dim(dim):
    with pytest.raises(ValueError, match=r"^dim must be an int >= 2, got "):
        lloyd_max_vllm(4, dim)
