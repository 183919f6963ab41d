"""Float encodings: fp8 e4m3fn, fp16 saturation, bf16 rounding, ties_within.

Expected values come from the bit-level definitions written in this file (a decoder from the
field layout, a brute-force nearest-value encoder) and from hand-picked bit patterns.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from tqkern.numerics import (
    FP8_MAX,
    FP16_MAX,
    decode_float,
    encode_float,
    fp8_e4m3fn_decode,
    fp8_e4m3fn_encode,
    round_float,
    ties_within,
)


# -- fp8 e4m3fn ------------------------------------------------------------------------------

def _e4m3_value(code: int) -> float:
    """Decode from the field layout: s eeee mmm, bias 7, e = 0 subnormal, s1111111 NaN."""
    s = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return s * m * 2.0**-9
    return s * (1 + m / 8) * 2.0 ** (e - 7)


ALL_CODES = np.arange(256, dtype=np.uint8)
FINITE = [c for c in range(256) if not math.isnan(_e4m3_value(c))]


def _brute_encode(x: float) -> int:
    """Nearest finite e4m3fn value after clamping to ±448; a tie goes to the even code
    (mantissa LSB 0); zero keeps the sign of x."""
    x = min(max(x, -448.0), 448.0)
    vals = np.array([_e4m3_value(c) for c in FINITE])
    dist = np.abs(vals - x)
    best = [c for c, dd in zip(FINITE, dist) if dd == dist.min()]
    if x == 0:
        return 0x80 if math.copysign(1.0, x) < 0 else 0x00
    best = [c for c in best if bool(c & 0x80) == (x < 0)]
    if len(best) > 1:
        best = [c for c in best if c % 2 == 0]
    assert len(best) == 1
    return best[0]


def test_fp8_decode_every_code():
    got = fp8_e4m3fn_decode(ALL_CODES)
    want = np.array([_e4m3_value(c) for c in range(256)])
    assert np.array_equal(got, want, equal_nan=True)
    assert np.isnan(got[0x7F]) and np.isnan(got[0xFF])
    assert np.isnan(got).sum() == 2
    assert got[0x7E] == 448.0 == FP8_MAX and got[0xFE] == -448.0
    assert np.signbit(got[0x80]) and got[0x80] == 0.0
    assert got[0x01] == 2.0**-9 and got[0x08] == 2.0**-6


def test_fp8_round_trip_every_finite_code():
    codes = np.array(FINITE, dtype=np.uint8)
    assert len(codes) == 254
    assert np.array_equal(fp8_e4m3fn_encode(fp8_e4m3fn_decode(codes)), codes)


def test_fp8_nan_encodes_to_nan():
    out = fp8_e4m3fn_encode(np.array([np.nan, -np.nan]))
    assert out.tolist() == [0x7F, 0xFF]


@pytest.mark.parametrize("x, code", [
    (448.0, 0x7E), (449.0, 0x7E), (463.9, 0x7E), (464.0, 0x7E), (480.0, 0x7E), (1e6, 0x7E),
    (np.inf, 0x7E), (-448.0, 0xFE), (-500.0, 0xFE), (-np.inf, 0xFE),
    (416.0, 0x7D), (432.0, 0x7E),  # 432 is the 416/448 midpoint; 448 (m = 6) is even
])
def test_fp8_saturates(x, code):
    assert int(fp8_e4m3fn_encode(np.array(x))) == code


@pytest.mark.parametrize("x, value", [
    (1.0625, 1.0),      # midpoint of 1.0 (m=0) and 1.125 (m=1): even is 1.0
    (1.1875, 1.25),     # midpoint of 1.125 (m=1) and 1.25 (m=2): even is 1.25
    (1.0625 + 2**-20, 1.125), (1.0625 - 2**-20, 1.0),
    (15.5, 16.0),       # 15 (e=10, m=7) vs 16: carry into the next binade
    (-1.0625, -1.0), (-1.1875, -1.25),
    (2.0**-10, 0.0),    # half the smallest subnormal: ties to even 0
    (-(2.0**-10), -0.0),
    (2.0**-10 + 2**-30, 2.0**-9),
    (1.5 * 2.0**-9, 2 * 2.0**-9),  # subnormal tie between m=1 and m=2
    (2.5 * 2.0**-9, 2 * 2.0**-9),  # ... between m=2 and m=3
    (7.5 * 2.0**-9, 2.0**-6),      # largest subnormal vs smallest normal: even (normal m=0)
    (6.5 * 2.0**-9, 6 * 2.0**-9),
    (3 * 2.0**-9, 3 * 2.0**-9),    # exact subnormal
])
def test_fp8_hand_picked_rounding(x, value):
    got = fp8_e4m3fn_decode(fp8_e4m3fn_encode(np.array(x)))
    assert got == value and np.signbit(got) == np.signbit(value)
    assert round_float(np.array(x), "float8_e4m3fn") == value


def test_fp8_encode_is_nearest_even_by_brute_force():
    pos = np.array(sorted({abs(_e4m3_value(c)) for c in FINITE}))
    mids = (pos[:-1] + pos[1:]) / 2
    rng = np.random.default_rng(0)
    xs = np.concatenate([
        pos, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
        rng.standard_normal(300) * 30, rng.standard_normal(300) * 0.01, rng.uniform(400, 500, 50),
    ])
    xs = np.concatenate([xs, -xs])
    got = fp8_e4m3fn_encode(xs)
    want = np.array([_brute_encode(float(x)) for x in xs], dtype=np.uint8)
    assert np.array_equal(got, want)


def test_fp8_bytes_via_encode_float():
    b = encode_float(np.array([[1.0, -2.0]]), "float8_e4m3fn")
    assert b.shape == (1, 2, 1) and b.dtype == np.uint8
    assert b[..., 0].tolist() == [[0x38, 0xC0]]
    assert decode_float(b, "float8_e4m3fn").tolist() == [[1.0, -2.0]]


# -- fp16 --------------------------------------------------------------------------------------

@pytest.mark.parametrize("x, value", [
    (65504.0, 65504.0), (65519.0, 65504.0), (65520.0, 65504.0), (70000.0, 65504.0),
    (1e30, 65504.0), (np.inf, 65504.0), (-65520.0, -65504.0), (-np.inf, -65504.0),
    (1.0 + 2.0**-11, 1.0),                   # tie between 1 and 1 + 2^-10: even
    (1.0 + 3 * 2.0**-11, 1.0 + 2 * 2.0**-10),
    (2.0**-25, 0.0), (3 * 2.0**-25, 2 * 2.0**-24),  # subnormal ties
])
def test_fp16_round(x, value):
    assert round_float(np.array(x), "float16") == value


def test_fp16_saturating_bytes():
    b = encode_float(np.array([70000.0, -np.inf, 1.0, -2.0]), "float16")
    assert b.tolist() == [[0xFF, 0x7B], [0xFF, 0xFB], [0x00, 0x3C], [0x00, 0xC0]]
    assert FP16_MAX == 65504.0
    assert decode_float(b, "float16").tolist() == [65504.0, -65504.0, 1.0, -2.0]


def test_fp16_nan_stays_nan():
    assert np.isnan(round_float(np.array(np.nan), "float16"))


# -- bf16 --------------------------------------------------------------------------------------

def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


@pytest.mark.parametrize("f32_bits, bf16_bits", [
    (0x3F800000, 0x3F80),  # 1.0 exactly
    (0x3F808000, 0x3F80),  # halfway 0x3F80 / 0x3F81: even is 0x3F80
    (0x3F818000, 0x3F82),  # halfway 0x3F81 / 0x3F82: even is 0x3F82
    (0x3F808001, 0x3F81),  # just above halfway
    (0x3F807FFF, 0x3F80),  # just below halfway
    (0xBF808000, 0xBF80),  # negative tie
    (0xBF818000, 0xBF82),
    (0x3FFF8000, 0x4000),  # tie that carries into the exponent
    (0x7F7FFFFF, 0x7F7F),  # largest float32 saturates at bf16's largest (IEEE would overflow to inf)
    (0xFF7FFFFF, 0xFF7F),  # and its negative
    (0x00008000, 0x0000),  # subnormal tie to even zero
    (0x00018000, 0x0002),
])
def test_bf16_round_to_nearest_even(f32_bits, bf16_bits):
    x = np.array(_f32(f32_bits))
    b = encode_float(x, "bfloat16")
    assert b.tolist() == [bf16_bits & 0xFF, bf16_bits >> 8]
    assert round_float(x, "bfloat16") == _f32(bf16_bits << 16)
    assert decode_float(b, "bfloat16") == _f32(bf16_bits << 16)


def test_bf16_nan_stays_nan():
    assert np.isnan(round_float(np.array([np.nan]), "bfloat16")).all()
    b = encode_float(np.array(np.nan), "bfloat16")
    assert np.isnan(decode_float(b, "bfloat16"))


# -- float32 and dispatch ------------------------------------------------------------------------

def test_float32_bytes_little_endian():
    b = encode_float(np.array([1.0, 0.1]), "float32")
    assert b.tolist() == [list(struct.pack("<f", 1.0)), list(struct.pack("<f", 0.1))]
    assert decode_float(b, "float32").tolist() == [1.0, float(np.float32(0.1))]


def test_round_trip_shapes():
    x = np.random.default_rng(1).standard_normal((3, 4, 5))
    for dtype, nb in (("float16", 2), ("bfloat16", 2), ("float32", 4)):
        b = encode_float(x, dtype)
        assert b.shape == (3, 4, 5, nb) and b.dtype == np.uint8
        assert np.array_equal(decode_float(b, dtype), round_float(x, dtype))


@pytest.mark.parametrize("dtype", ["float64x", "int8", "float8_e5m2"])
def test_unknown_dtype(dtype):
    with pytest.raises(ValueError, match=r"^dtype must be one of"):
        round_float(np.array(1.0), dtype)
    with pytest.raises(ValueError, match=r"^dtype must be one of"):
        encode_float(np.array(1.0), dtype)


def test_decode_float_wrong_width():
    with pytest.raises(ValueError, match=r"last axis must be 2 bytes for float16, got 4"):
        decode_float(np.zeros((3, 4), np.uint8), "float16")


# -- ties_within -------------------------------------------------------------------------------

def test_ties_within():
    mid16 = 1.0 + 2.0**-11  # an fp16 rounding midpoint
    x = np.array([mid16, 1.0, 1.25, mid16 * (1 + 1e-3), -mid16])
    assert ties_within(x, "float16", 1e-6).tolist() == [True, False, False, False, True]
    # The window is relative: a value 1e-7 (relative) above a midpoint is caught by 1e-6, not 1e-8.
    y = np.array([mid16 * (1 + 1e-7)])
    assert ties_within(y, "float16", 1e-6).tolist() == [True]
    assert ties_within(y, "float16", 1e-8).tolist() == [False]
    # fp8: 1.0625 is a midpoint.
    assert ties_within(np.array([1.0625, 1.0]), "float8_e4m3fn", 1e-6).tolist() == [True, False]
    # float32 midpoint between 1 and 1 + 2^-23.
    assert ties_within(np.array([1.0 + 2.0**-24, 1.0]), "float32", 1e-12).tolist() == [True, False]
