"""Rotations: orthogonality, Sylvester structure, sign placement, determinism, Haar sign fix."""

from __future__ import annotations

import numpy as np
import pytest

import tqkern
from tqkern.rotations import haar, hadamard, is_signed_sylvester, random_signs, rotation_for, sylvester

POW2 = [2, 4, 8, 16, 32, 64, 128, 256]
NON_POW2 = [6, 10, 80, 96, 100, 160, 192]


def _sylvester_by_popcount(d: int) -> np.ndarray:
    """H_d[i, j] = (−1)^popcount(i & j): the closed form of Sylvester's construction."""
    i = np.arange(d)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
    return np.where(parity == 1, -1.0, 1.0)


def _assert_orthogonal(r: np.ndarray, d: int) -> None:
    assert r.shape == (d, d) and r.dtype == np.float64
    np.testing.assert_allclose(r.T @ r, np.eye(d), rtol=0, atol=1e-12)
    np.testing.assert_allclose(r @ r.T, np.eye(d), rtol=0, atol=1e-12)


@pytest.mark.parametrize("d", POW2 + NON_POW2)
@pytest.mark.parametrize("seed", [None, 0, 12345])
def test_hadamard_orthogonal(d, seed):
    _assert_orthogonal(hadamard(d, seed), d)


@pytest.mark.parametrize("d", [2, 5, 16, 96, 128, 100])
@pytest.mark.parametrize("seed", [0, 1, 2**31])
def test_haar_orthogonal(d, seed):
    _assert_orthogonal(haar(d, seed), d)


@pytest.mark.parametrize("d", POW2)
def test_sylvester_closed_form_and_recursion(d):
    h = sylvester(d)
    assert np.array_equal(h, _sylvester_by_popcount(d))
    if d >= 2:
        g = sylvester(d // 2)
        assert np.array_equal(h, np.block([[g, g], [g, -g]]))
    assert sylvester(1).tolist() == [[1.0]]


@pytest.mark.parametrize("d", POW2)
def test_unsigned_hadamard_is_sylvester_over_sqrt_d(d):
    np.testing.assert_allclose(hadamard(d), _sylvester_by_popcount(d) / np.sqrt(d), rtol=0, atol=1e-15)
    assert np.array_equal(hadamard(d), hadamard(d).T)  # vLLM relies on H being symmetric
    assert np.array_equal(rotation_for("hadamard", d, 99), hadamard(d, None))


@pytest.mark.parametrize("d", POW2)
@pytest.mark.parametrize("seed", [0, 7, 2024])
def test_signs_are_applied_before_the_transform(d, seed):
    s = random_signs(d, seed)
    assert set(np.unique(s).tolist()) <= {-1.0, 1.0}
    r = hadamard(d, seed)
    assert np.array_equal(r, np.diag(s) @ hadamard(d, None))
    # y = x @ Π = (x ⊙ s) @ H/√d: the signs act on x, then the transform.
    x = np.random.default_rng(seed).standard_normal((3, d))
    np.testing.assert_allclose(x @ r, (x * s) @ (_sylvester_by_popcount(d) / np.sqrt(d)),
                               rtol=0, atol=1e-12)
    assert np.array_equal(rotation_for("hadamard_signed", d, seed), r)


def test_random_signs_not_constant():
    s = random_signs(256, 0)
    assert 64 < np.sum(s > 0) < 192
    assert not np.array_equal(random_signs(256, 0), random_signs(256, 1))


@pytest.mark.parametrize("d, p", [(6, 2), (10, 2), (80, 16), (96, 32), (100, 4), (160, 32), (192, 64)])
@pytest.mark.parametrize("seed", [None, 3])
def test_non_power_of_two_is_blocks_of_a_small_hadamard(d, p, seed):
    # Documented structure: Π = diag(s) · (Q_m ⊗ H_p/√p), p the largest power of two in d.
    r = hadamard(d, seed)
    s = np.ones(d) if seed is None else random_signs(d, seed)
    unsigned = r * s[:, None]
    m = d // p
    h = _sylvester_by_popcount(p) / np.sqrt(p)
    q = np.empty((m, m))
    for i in range(m):
        for j in range(m):
            block = unsigned[i * p:(i + 1) * p, j * p:(j + 1) * p]
            q[i, j] = block[0, 0] / h[0, 0]
            np.testing.assert_allclose(block, q[i, j] * h, rtol=0, atol=1e-13)
    _assert_orthogonal(q, m)  # the mixing matrix is orthogonal itself
    assert np.max(np.abs(q)) < 1.0  # ... and actually mixes the groups


@pytest.mark.parametrize("kind", ["hadamard_signed", "haar"])
@pytest.mark.parametrize("d", [64, 96])
def test_deterministic_per_seed_and_seeds_differ(kind, d):
    a = rotation_for(kind, d, 5)
    assert np.array_equal(a, rotation_for(kind, d, 5))
    assert not np.allclose(a, rotation_for(kind, d, 6))


def test_haar_deterministic_and_seeds_differ():
    assert np.array_equal(haar(64, 11), haar(64, 11))
    assert np.max(np.abs(haar(64, 11) - haar(64, 12))) > 0.1


@pytest.mark.parametrize("d, seed", [(4, 0), (64, 1), (128, 42)])
def test_haar_is_sign_fixed_qr_of_a_seeded_gaussian(d, seed):
    # The documented construction: A = standard normal d×d from default_rng(seed), A = QR, the
    # columns of Q multiplied by sign(diag(R)). Then Πᵀ A is upper triangular with a positive
    # diagonal (the R of a QR with R's diagonal positive, which is unique).
    a = np.random.default_rng(seed).standard_normal((d, d))
    r = haar(d, seed).T @ a
    np.testing.assert_allclose(np.tril(r, -1), 0.0, rtol=0, atol=1e-10)
    assert np.all(np.diag(r) > 0)


def test_haar_entries_look_random():
    # A dense Haar matrix: no structure, entries of size ~1/√d.
    r = haar(128, 0)
    assert np.all(r != 0)
    assert 0.8 / np.sqrt(128) < np.std(r) < 1.2 / np.sqrt(128)


@pytest.mark.parametrize("d", [3, 5, 7, 99, 127])
def test_odd_d_raises(d):
    with pytest.raises(ValueError, match=r"^d must be even or a power of two"):
        hadamard(d)
    with pytest.raises(ValueError):
        hadamard(d, 1)


@pytest.mark.parametrize("d", [0, -4, 4.0, "8", None, True])
def test_bad_d(d):
    with pytest.raises(ValueError, match=r"^d must be a positive int"):
        hadamard(d)
    with pytest.raises(ValueError, match=r"^d must be a positive int"):
        haar(d, 0)


@pytest.mark.parametrize("seed, err, msg", [(-1, ValueError, "got -1"), (1.5, TypeError, "got float"),
                                             ("3", TypeError, "got str"), (True, TypeError, "got bool"),
                                             (np.int64(-2), ValueError, "got -2")])
def test_bad_seed(seed, err, msg):
    """Seeds are ints >= 0 (NumPy's own messages, or silence for a bool, before); hadamard also
    takes None (no signs), the others do not."""
    for fn in (lambda: hadamard(64, seed), lambda: haar(8, seed), lambda: random_signs(8, seed),
               lambda: rotation_for("hadamard", 64, seed),
               lambda: tqkern.TQParams.default(tqkern.KVFormat.preset("tq4", 64), seed=seed),
               lambda: tqkern.TQParams.default(tqkern.KVFormat.preset("fp16", 64), seed=seed)):
        with pytest.raises(err, match=rf"^seed must be an int >= 0.*{msg}"):
            fn()
    assert np.array_equal(hadamard(64, np.int64(3)), hadamard(64, 3))
    with pytest.raises(TypeError, match=r"^seed must be an int >= 0, got NoneType"):
        haar(8, None)
    with pytest.raises(TypeError, match=r"^seed must be an int >= 0, got NoneType"):
        tqkern.TQParams.default(tqkern.KVFormat.preset("tq4", 64), seed=None)


def test_sylvester_needs_power_of_two():
    with pytest.raises(ValueError, match=r"^d must be a power of two, got 12"):
        sylvester(12)


def test_rotation_for_unknown_kind():
    with pytest.raises(ValueError, match=r"^kind must be one of .*'givens'"):
        rotation_for("givens", 64, 0)


@pytest.mark.parametrize("d", [1, 2, 16, 64, 128, 256])
@pytest.mark.parametrize("seed", [None, 0, 7])
def test_signed_sylvester_detected_in_float64_and_float32(d, seed):
    h = hadamard(d, seed)
    assert is_signed_sylvester(h)
    assert is_signed_sylvester(h.astype(np.float32))


@pytest.mark.parametrize("d", [4, 64, 128])
def test_other_rotations_are_not_signed_sylvester(d):
    h = hadamard(d, 3)
    assert not is_signed_sylvester(haar(d, 1))
    assert not is_signed_sylvester(h.T)  # H·diag(s): the signs on the columns
    assert not is_signed_sylvester(h[::-1])  # rows in another order
    assert not is_signed_sylvester(h * (1 + 2.0**-18))  # not within 2^-20 of 1/√d
    off = h.copy()
    off[d - 1, d - 1] *= 1 + 2.0**-18  # one entry off
    assert not is_signed_sylvester(off)
    assert not is_signed_sylvester(h[:, : d // 2])


@pytest.mark.parametrize("d", [96, 80])
def test_block_hadamard_is_not_signed_sylvester(d):
    assert not is_signed_sylvester(hadamard(d, 0))
