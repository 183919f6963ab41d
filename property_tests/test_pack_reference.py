"""pack/unpack oracle: agrees with the bitstream definition, round trips, pads with zero bits.

The expected bytes are built here bit by bit from the definition in docs/layout.md: code j of
b bits occupies stream bits [j·b, j·b + b), least significant first; stream bit i is bit
(i mod 8) of byte ⌊i/8⌋. For ``nibble_high_even`` byte j is (c[2j] << 4) | c[2j+1].
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tqkern.ops.pack.reference import pack, packed_bytes, unpack

lengths = st.one_of(st.integers(1, 300), st.integers(1, 37).map(lambda k: 8 * k))
batch_shapes = st.sampled_from([(), (1,), (3,), (2, 2)])


@st.composite
def code_arrays(draw, bits, n=lengths):
    length = draw(n, label="n")
    shape = (*draw(batch_shapes, label="batch"), length)
    hi = (1 << bits) - 1
    elements = st.one_of(st.integers(0, hi), st.sampled_from([0, hi]))  # extremes often
    return draw(hnp.arrays(np.uint8, shape, elements=elements), label="codes")


def _brute_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    n = codes.shape[-1]
    flat = codes.reshape(-1, n)
    out = np.zeros((flat.shape[0], (n * bits + 7) // 8), np.uint8)
    for r in range(flat.shape[0]):
        for j in range(n):
            c = int(flat[r, j])
            for k in range(bits):
                i = j * bits + k
                if (c >> k) & 1:
                    out[r, i // 8] |= 1 << (i % 8)
    return out.reshape(*codes.shape[:-1], out.shape[-1])


@pytest.mark.parametrize("bits", range(1, 9))
@given(data=st.data())
def test_lsb_pack_is_the_bitstream(data, bits):
    codes = data.draw(code_arrays(bits))
    n = codes.shape[-1]
    packed = pack(codes, bits, "lsb")
    assert packed.dtype == np.uint8
    assert packed.shape == (*codes.shape[:-1], -(-n * bits // 8)) == (*codes.shape[:-1], packed_bytes(n, bits))
    assert np.array_equal(packed, _brute_pack(codes, bits))
    # The pad bits (stream bits n·b .. 8·⌈n·b/8⌉ − 1) are zero.
    used = n * bits - 8 * (packed.shape[-1] - 1)  # bits used in the last byte, 1..8
    assert np.all(packed[..., -1] >> used == 0)
    assert np.array_equal(unpack(packed, bits, n, "lsb"), codes)


@given(data=st.data())
def test_nibble_high_even(data):
    codes = data.draw(code_arrays(4, st.integers(1, 150).map(lambda k: 2 * k)))
    n = codes.shape[-1]
    packed = pack(codes, 4, "nibble_high_even")
    assert packed.dtype == np.uint8 and packed.shape == (*codes.shape[:-1], n // 2)
    for j in range(n // 2):
        expect = (codes[..., 2 * j].astype(int) << 4) | codes[..., 2 * j + 1]
        assert np.array_equal(packed[..., j], expect)
    assert np.array_equal(unpack(packed, 4, n, "nibble_high_even"), codes)
    # The two 4-bit orders are each other's nibble swap.
    lsb = pack(codes, 4, "lsb")
    assert np.array_equal(lsb, ((packed & 15) << 4) | (packed >> 4))


@pytest.mark.parametrize("bits", range(1, 9))
@given(data=st.data())
def test_unpack_then_pack_is_identity_on_streams_with_zero_padding(data, bits):
    n = data.draw(lengths, label="n")
    nb = packed_bytes(n, bits)
    raw = data.draw(hnp.arrays(np.uint8, (2, nb)), label="bytes")
    used = n * bits - 8 * (nb - 1)
    raw[:, -1] &= (1 << used) - 1  # clear the pad bits
    codes = unpack(raw, bits, n, "lsb")
    assert codes.shape == (2, n) and int(codes.max(initial=0)) < 1 << bits
    assert np.array_equal(pack(codes, bits, "lsb"), raw)


def test_hand_packed_examples():
    # 3-bit codes 1..5, each written LSB first: stream 100 010 110 001 101 + one pad bit.
    c = np.array([1, 2, 3, 4, 5], np.uint8)
    # bits: c0 -> s0..2 = 1,0,0; c1 -> s3..5 = 0,1,0; c2 -> s6..8 = 1,1,0; c3 -> s9..11 = 0,0,1;
    # c4 -> s12..14 = 1,0,1. byte0 = s0..7 = 1,0,0,0,1,0,1,1 -> 0b11010001 = 0xD1;
    # byte1 = s8..15 = 0,0,0,1,1,0,1,0(pad) -> 0b01011000 = 0x58.
    assert pack(c, 3).tolist() == [0xD1, 0x58]
    # 4-bit LSB: even index in the low nibble; nibble_high_even: in the high nibble.
    c = np.array([0x1, 0x2, 0xA, 0xF], np.uint8)
    assert pack(c, 4, "lsb").tolist() == [0x21, 0xFA]
    assert pack(c, 4, "nibble_high_even").tolist() == [0x12, 0xAF]
    # 1-bit: a plain little-endian bit set.
    assert pack(np.array([1, 0, 0, 0, 0, 0, 0, 1, 1], np.uint8), 1).tolist() == [0x81, 0x01]
    # 8-bit: a code is its byte.
    c = np.array([0, 7, 255], np.uint8)
    assert pack(c, 8).tolist() == [0, 7, 255]
    # 5-bit: 31, 0 -> 11111 00000 -> byte0 = 0b00011111, byte1 = 0b00000000 (2 code bits + pad)
    assert pack(np.array([31, 0], np.uint8), 5).tolist() == [0x1F, 0x00]
    assert pack(np.array([0, 31], np.uint8), 5).tolist() == [0xE0, 0x03]


@pytest.mark.parametrize("bits", [0, 9, -1, 2.0, True])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match=r"^bits must be an int in \[1, 8\]"):
        pack(np.zeros(8, np.uint8), bits)
    with pytest.raises(ValueError, match=r"^bits must be an int in \[1, 8\]"):
        unpack(np.zeros(1, np.uint8), bits, 8)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"^codes must be < 2\*\*bits = 8, got max 8"):
        pack(np.array([0, 8], np.uint8), 3)
    with pytest.raises(TypeError, match=r"^codes must be uint8, got int64"):
        pack(np.array([0, 1], np.int64), 3)
    with pytest.raises(ValueError, match=r"^bits must be 4 with bit_order='nibble_high_even', got 3"):
        pack(np.zeros(8, np.uint8), 3, "nibble_high_even")
    with pytest.raises(ValueError, match=r"^codes\.shape\[-1\] must be even"):
        pack(np.zeros(7, np.uint8), 4, "nibble_high_even")
    with pytest.raises(ValueError, match=r"^bit_order must be one of"):
        pack(np.zeros(8, np.uint8), 4, "msb")
    with pytest.raises(ValueError, match=r"^packed\.shape\[-1\] must be 3 for n=8, bits=3, got 4"):
        unpack(np.zeros(4, np.uint8), 3, 8)
    with pytest.raises(TypeError, match=r"^packed must be uint8"):
        unpack(np.zeros(3, np.int8), 3, 8)
