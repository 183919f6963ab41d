"""The E8-in-a-cube oracle (tqkern/lattice.py) against brute force over its whole codebook at q = 4,
its exactness on codebook points, its index invariants and its errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tqkern.lattice import decode_blocks, encode_blocks, index_bits, nearest_d8_in_box


def _codebook(q: int) -> np.ndarray:
    """Every point of C_q (q^8 of them), enumerated from the definition, not from the encoder."""
    z = np.array(list(itertools.product(range(-q // 2, q // 2), repeat=8)), dtype=np.float64)
    z = z[z.sum(1) % 2 == 0]
    return np.concatenate([z, z + 0.5])


def test_codebook_size_is_q_to_the_8th():
    assert len(_codebook(4)) == 4 ** 8


@pytest.mark.parametrize("scales", [(0.9,), (0.6, 1.1), (0.35, 0.5, 0.8, 1.3)])
def test_encoder_finds_a_nearest_codebook_point(scales):
    """At q = 4 the encoder's error equals the least error over all 65,536 points and every scale."""
    book = _codebook(4)
    rng = np.random.default_rng(len(scales))
    x = rng.standard_normal((200, 8)) * 1.2
    c, s, t = encode_blocks(x, 4, scales)
    got = ((x - decode_blocks(c, s, t, 4, scales)) ** 2).sum(1)
    best = np.min([((x[:, None, :] - b * book[None]) ** 2).sum(2).min(1) for b in scales], axis=0)
    np.testing.assert_allclose(got, best, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("q", [4, 8, 16, 32, 64])
def test_codebook_points_encode_to_themselves(q):
    rng = np.random.default_rng(q)
    z = rng.integers(-q // 2, q // 2, size=(500, 8)).astype(np.float64)
    z[:, 0] = np.where(z.sum(1) % 2 == 0, z[:, 0], np.where(z[:, 0] < q // 2 - 1, z[:, 0] + 1, z[:, 0] - 1))
    s = rng.integers(0, 2, size=500)
    scales = (0.3, 0.45)
    x = scales[0] * (z + 0.5 * s[:, None])
    c, s2, t = encode_blocks(x, q, scales)
    np.testing.assert_array_equal(c, z + q // 2)
    np.testing.assert_array_equal(s2, s)
    np.testing.assert_array_equal(t, 0)  # an exact point at t = 0: ties keep the lowest t


def test_indices_in_range_with_even_sums_and_box_clamping():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3000, 8)) * 40  # far outside the box: clamped
    c, s, t = encode_blocks(x, 16, (0.25, 0.5))
    assert c.min() >= 0 and c.max() <= 15 and np.all(c.sum(1) % 2 == 0)
    assert set(np.unique(s)) <= {0, 1} and set(np.unique(t)) <= {0, 1}


def test_nearest_d8_in_box_ties_and_parity():
    # (0.5, 0, ..., 0): round half up gives (1, 0, ...): odd; moving coordinate 0 back to 0 costs 0,
    # less than any other move
    w = np.array([[0.5, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(nearest_d8_in_box(w, -2, 1), [[0, 0, 0, 0, 0, 0, 0, 0]])
    # all coordinates 0.5 off: rounding gives 8 ones (even): kept
    np.testing.assert_array_equal(nearest_d8_in_box(np.full((1, 8), 0.5), -2, 1), np.ones((1, 8)))
    # (1, 0, ..., 0) exactly, odd: every move costs 1 or more; the least, 1, is first met at i = 0, -1
    np.testing.assert_array_equal(nearest_d8_in_box(np.array([[1.0, 0, 0, 0, 0, 0, 0, 0]]), -2, 1),
                                  [[0, 0, 0, 0, 0, 0, 0, 0]])


def test_gaussian_error_beats_lloyd_max_at_the_whole_bit_below():
    """Unit-variance Gaussian blocks at q = 16, two scales (4.125 bits a coordinate): mean squared
    error below 0.75 of the 4-bit Lloyd-Max quantizer's 0.009497 (Max, 1960)."""
    x = np.random.default_rng(0).standard_normal((20000, 8))
    scales = (4.149 / 16, 4.149 / 16 * 1.48)
    c, s, t = encode_blocks(x, 16, scales)
    assert ((x - decode_blocks(c, s, t, 16, scales)) ** 2).mean() < 0.75 * 0.009497


def test_index_bits():
    assert index_bits(32, 4) == 42 and index_bits(8, 4) == 26 and index_bits(16, 1) == 32


def test_bad_input():
    x = np.zeros((2, 8))
    with pytest.raises(ValueError, match="q must be one of"):
        encode_blocks(x, 12, (1.0,))
    with pytest.raises(TypeError, match="q must be an int, got bool"):
        encode_blocks(x, True, (1.0,))
    for bad in ((), (1.0, 2.0, 3.0), (1.0, -1.0), (float("nan"),)):
        with pytest.raises(ValueError, match="scales must"):
            encode_blocks(x, 16, bad)
    with pytest.raises(TypeError, match="scales must be a sequence of floats"):
        encode_blocks(x, 16, "ab")
    with pytest.raises(ValueError, match="last dimension of 8"):
        encode_blocks(np.zeros((2, 7)), 16, (1.0,))
    with pytest.raises(ValueError, match="finite"):
        encode_blocks(np.full((1, 8), np.inf), 16, (1.0,))
    c, s, t = encode_blocks(x, 16, (1.0,))
    with pytest.raises(ValueError, match=r"c must lie in \[0, 16\)"):
        decode_blocks(c + 16, s, t, 16, (1.0,))
    odd = c.copy()
    odd[:, 0] += 1
    with pytest.raises(ValueError, match="even sum"):
        decode_blocks(odd, s, t, 16, (1.0,))
    with pytest.raises(ValueError, match="t must lie"):
        decode_blocks(c, s, t + 1, 16, (1.0,))
    with pytest.raises(ValueError, match="s must be 0 or 1"):
        decode_blocks(c, s + 2, t, 16, (1.0,))
    with pytest.raises(ValueError, match="m must be one of"):
        index_bits(16, 3)


def test_equal_errors_keep_the_lowest_scale():
    """x = y' (a D8 point) is exact both at scale 1 (y') and at scale 0.5 (2y'): t = 0, the first."""
    rng = np.random.default_rng(3)
    y = rng.integers(-3, 4, size=(200, 8)).astype(np.float64)
    odd = y.sum(1) % 2 != 0
    y[:, 0] += np.where(odd, np.where(y[:, 0] > -3, -1, 1), 0)  # even sums, y_0 within [-3, 3]: 2y in the box
    c, s, t = encode_blocks(y, 16, (0.5, 1.0))
    np.testing.assert_array_equal(t, 0)
    np.testing.assert_array_equal(c, 2 * y + 8)
    np.testing.assert_array_equal(s, 0)


def test_equal_coset_errors_keep_the_integer_coset():
    """(¼, …, ¼) is ½ from both 0 and (½, …, ½): s = 0."""
    c, s, t = encode_blocks(np.full((1, 8), 0.25), 16, (1.0,))
    np.testing.assert_array_equal(s, [0])
    np.testing.assert_array_equal(c, np.full((1, 8), 8))
