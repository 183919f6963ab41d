"""compress/decompress oracles: the slot is the codecs' output, byte for byte.

Hypothesis draws formats, parameters and data from :mod:`tqkern.testing`; the field sizes and
offsets the tests expect are computed here from the byte rules (not read from ``tqkern.layouts``),
and the golden slots at the end are worked out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tqkern.codebooks import Codebook
from tqkern.layouts import FP8, PRESETS, KVFormat, LloydMax, Raw, Uniform
from tqkern.numerics import fp8_e4m3fn_encode
from tqkern.ops.compress.reference import compress
from tqkern.ops.decompress.reference import decompress
from tqkern.ops.quantize.reference import dequantize, quantize
from tqkern.params import TQParams
from tqkern.testing import float_arrays, paged_layouts, scale, tq_params

_FLOAT_NB = {"float16": 2, "float32": 4}


def _my_fields(codec, d):
    """[(name, nbytes, kind)] for one codec, from the byte rules in docs/layout.md."""
    if isinstance(codec, LloydMax):
        return [("codes", -(-d * codec.bits // 8), "codes"),
                ("norm", _FLOAT_NB[codec.norm_dtype], codec.norm_dtype)]
    if isinstance(codec, Uniform):
        nb = _FLOAT_NB[codec.param_dtype]
        return [("data", -(-d * codec.bits // 8), "codes"), ("scale", nb, codec.param_dtype),
                ("zero", nb, codec.param_dtype)]
    if isinstance(codec, FP8):
        return [("data", d, "float8_e4m3fn")]
    return [("data", 2 * d, codec.dtype)]


def _my_slot_map(fmt):
    """[(side, name, offset, nbytes, kind)] and the used / total slot bytes."""
    out, off = [], 0
    for side in ("key", "value"):
        for name, nb, kind in _my_fields(getattr(fmt, side), fmt.head_dim):
            out.append((side, name, off, nb, kind))
            off += nb
    a = fmt.slot_alignment
    return out, off, -(-off // a) * a


def _my_unpack(raw, bits, n, bit_order):
    """(codes [..., n], the stream's pad bits or None), decoded from the bit-order rules."""
    if bit_order == "nibble_high_even":
        out = np.empty((*raw.shape[:-1], n), np.uint8)
        out[..., 0::2], out[..., 1::2] = raw >> 4, raw & 15
        return out, None
    stream = np.unpackbits(raw, axis=-1, bitorder="little").astype(np.int64)
    planes = stream[..., : n * bits].reshape(*raw.shape[:-1], n, bits)
    return (planes << np.arange(bits)).sum(-1).astype(np.uint8), stream[..., n * bits:]


@st.composite
def cases(draw, *, formats=None):
    layout = draw(paged_layouts(formats), label="layout")
    fmt, h = layout.format, layout.num_kv_heads
    params = draw(tq_params(fmt, h), label="params")
    n = draw(st.integers(1, scale(6, 64)), label="num_tokens")
    dtype = draw(st.sampled_from([np.float16, np.float32]), label="dtype")
    key = draw(float_arrays((n, h, fmt.head_dim), dtype=dtype), label="key")
    value = draw(float_arrays((n, h, fmt.head_dim), dtype=dtype), label="value")
    return params, key, value


def _codec_inputs(key, value, params):
    k = key.astype(np.float64)
    if params.key_offset is not None:
        k = k - params.key_offset[None]
    return k, value.astype(np.float64)


@given(case=cases())
def test_decompress_of_compress_is_dequantize_of_quantize(case):
    params, key, value = case
    fmt = params.format
    slots = compress(key, value, params)
    got = decompress(slots, params)
    got_back = decompress(slots, params, rotate_back=True)
    for side, x, cb, g, gb in zip(("key", "value"), _codec_inputs(key, value, params),
                                  (params.key_codebook, params.value_codebook), got, got_back):
        codec = getattr(fmt, side)
        q = quantize(x, codec, rotation=params.rotation, codebook=cb)
        want = dequantize(q, codec, rotation=params.rotation, codebook=cb)
        assert g.dtype == np.float64 and g.shape == x.shape
        assert np.array_equal(g, want), side
        want_back = dequantize(q, codec, rotation=params.rotation, codebook=cb, rotate_back=True)
        assert np.array_equal(gb, want_back), side


@given(case=cases())
def test_slot_bytes_fields_and_padding(case):
    params, key, value = case
    fmt = params.format
    slots = compress(key, value, params)
    fields, used, total = _my_slot_map(fmt)
    assert slots.dtype == np.uint8
    assert slots.shape == (*key.shape[:2], total) and total == fmt.slot_bytes
    assert np.all(slots[..., used:] == 0)  # padding bytes
    inputs = dict(zip(("key", "value"), _codec_inputs(key, value, params)))
    cbs = {"key": params.key_codebook, "value": params.value_codebook}
    for side, name, off, nb, kind in fields:
        codec = getattr(fmt, side)
        q = quantize(inputs[side], codec, rotation=params.rotation, codebook=cbs[side])
        raw = slots[..., off: off + nb]
        if kind == "codes":
            codes, pad_bits = _my_unpack(raw, codec.bits, fmt.head_dim, fmt.bit_order)
            assert pad_bits is None or np.all(pad_bits == 0)
            assert np.array_equal(codes, q.codes), (side, name)
        elif name == "data":
            width = nb // fmt.head_dim
            want = q.data
            if kind == "float8_e4m3fn":
                assert np.array_equal(raw, fp8_e4m3fn_encode(want)), side
            elif kind == "float16":
                assert np.array_equal(raw, want.astype("<f2").view(np.uint8).reshape(raw.shape)), side
            else:  # bfloat16: the top half of the float32 (want is exactly representable)
                top = (want.astype("<f4").view("<u4") >> 16).astype("<u2")
                assert np.array_equal(raw, top.view(np.uint8).reshape(raw.shape)), side
            assert width == {"float8_e4m3fn": 1}.get(kind, 2)
        else:
            le = "<f2" if kind == "float16" else "<f4"
            assert np.array_equal(raw.copy().view(le)[..., 0].astype(np.float64), q.params[name]), (side, name)


@given(case=cases())
def test_uncertain_mask_shape_and_exact_parts(case):
    params, key, value = case
    fmt = params.format
    slots, unsure = compress(key, value, params, return_uncertain=True)
    assert np.array_equal(slots, compress(key, value, params))
    assert unsure.dtype == bool and unsure.shape == slots.shape
    fields, used, _ = _my_slot_map(fmt)
    assert not unsure[..., used:].any()  # padding is exact
    for side, name, off, nb, kind in fields:
        codec = getattr(fmt, side)
        if not codec.rotated:  # nothing computed from a rotation: every byte is exact
            assert not unsure[..., off: off + nb].any(), (side, name)
        if isinstance(codec, LloydMax) and codec.norm_correction != "stored" and name == "norm":
            assert not unsure[..., off: off + nb].any()  # ‖x‖ does not depend on Π


@given(case=cases())
def test_uncertain_mask_covers_a_float32_rotation(case):
    # A kernel rotates with a float32 copy of Π. Compressing with that rounded matrix (still
    # orthogonal to ~1e-7) may change bytes only where the oracle said they were uncertain.
    params, key, value = case
    fmt = params.format
    if not fmt.rotated:
        return
    slots, unsure = compress(key, value, params, return_uncertain=True)
    r32 = params.rotation.astype(np.float32).astype(np.float64)
    p32 = TQParams(format=fmt, rotation=r32, key_codebook=params.key_codebook,
                   value_codebook=params.value_codebook, key_offset=params.key_offset)
    changed = compress(key, value, p32) != slots
    assert not np.any(changed & ~unsure)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_uncertain_fraction_is_small_for_presets(name):
    # Observed (seed 0, 256 tokens x 4 heads of N(0,1)/N(0,9) fp16): at most 1.73 % of slot bytes
    # (tqkern_k5v3 at D=256, whose stored-gain norms are uncertain whenever any of the 256 codes
    # is); vLLM presets 0.06-0.17 %, tq4 0.14-0.33 %, fp8/fp16 keys 0 %.
    rng = np.random.default_rng(0)
    for d in (64, 128, 256):
        fmt = KVFormat.preset(name, head_dim=d)
        p = TQParams.default(fmt, seed=1)
        k = rng.standard_normal((256, 4, d)).astype(np.float16)
        v = (rng.standard_normal((256, 4, d)) * 3).astype(np.float16)
        _, unsure = compress(k, v, p, return_uncertain=True)
        assert unsure.mean() < 0.02, (name, d, unsure.mean())
        if fmt.rotated:
            assert unsure.any()  # the mask is not vacuous where a rotation is involved


@given(case=cases())
def test_key_offset_is_subtracted_before_compressing(case):
    params, key, value = case
    if params.key_offset is None:
        return
    plain = TQParams(format=params.format, rotation=params.rotation, key_codebook=params.key_codebook,
                     value_codebook=params.value_codebook)
    shifted = key.astype(np.float64) - params.key_offset[None]
    assert np.array_equal(compress(key, value, params), compress(shifted, value, plain))


# -- edges ------------------------------------------------------------------------------------

ALL_CODECS = [
    LloydMax(bits=3, norm_correction="none"), LloydMax(bits=4, norm_correction="decode"),
    LloydMax(bits=5, norm_correction="stored", norm_dtype="float16"), Uniform(bits=3),
    Uniform(bits=4, rotated=True), FP8(), FP8(rotated=True), Raw(), Raw(dtype="bfloat16"),
]


@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
def test_zero_and_constant_vectors(codec):
    fmt = KVFormat(head_dim=64, key=codec, value=codec)
    p = TQParams.default(fmt, seed=0)
    x = np.zeros((3, 1, 64))
    x[1] = 2.5  # a constant vector
    x[2, 0, 5] = -1.0
    k, v = decompress(compress(x, x, p), p, rotate_back=True)
    assert np.all(k[0] == 0) and np.all(v[0] == 0)
    assert np.all(np.isfinite(k)) and np.all(np.isfinite(v))
    if isinstance(codec, Raw) or (isinstance(codec, FP8) and not codec.rotated):
        # exactly representable inputs come back exactly
        assert np.array_equal(k, x) and np.array_equal(v, x)
    if isinstance(codec, Uniform) and not codec.rotated:
        # a constant vector: scale 1e-8 rounds to fp16 0 and the zero point carries the value
        assert np.array_equal(k[:2], x[:2]) and np.array_equal(v[:2], x[:2])


def test_compress_validates_shapes():
    p = TQParams.default(KVFormat.preset("tq4", head_dim=64), key_offset=np.zeros((2, 64)))
    x = np.zeros((3, 2, 64))
    with pytest.raises(ValueError, match=r"^key must have shape \[num_tokens, num_kv_heads, 64\]"):
        compress(np.zeros((3, 2, 32)), np.zeros((3, 2, 32)), p)
    with pytest.raises(ValueError, match=r"^value must have the shape of key"):
        compress(x, np.zeros((4, 2, 64)), p)
    with pytest.raises(ValueError, match=r"^params\.key_offset must have 3 rows"):
        compress(np.zeros((3, 3, 64)), np.zeros((3, 3, 64)), p)
    with pytest.raises(TypeError, match=r"^params must be a TQParams"):
        compress(x, x, KVFormat.preset("tq4", head_dim=64))
    with pytest.raises(ValueError, match=r"^slots\.shape\[-1\] must be slot_bytes = 72"):
        decompress(np.zeros((1, 2, 71), np.uint8), p)
    with pytest.raises(TypeError, match=r"^slots must be uint8"):
        decompress(np.zeros((1, 2, 72), np.int8), p)


# -- golden slots, worked by hand -----------------------------------------------------------

def _tiny(norm_correction):
    """D=8: a 2-bit Lloyd-Max key with centroids ±0.25, ±0.75 (boundaries −0.5, 0, 0.5) and the
    identity rotation, so rotated coordinates are x/‖x‖ exactly; a 2-bit uniform value; slots
    padded to 16 bytes."""
    fmt = KVFormat(head_dim=8, key=LloydMax(bits=2, norm_dtype="float32", norm_correction=norm_correction),
                   value=Uniform(bits=2), rotation="hadamard", slot_alignment=16)
    p = TQParams(format=fmt, rotation=np.eye(8),
                 key_codebook=Codebook.from_centroids([-0.75, -0.25, 0.25, 0.75], dim=8))
    key = np.array([[[1, -1, 1, -1, 0, -0.0, 0, 0]],     # ‖k‖ = 2, u = ±0.5 (ties), ±0
                    [[3, 0, 0, 0, 0, 0, 0, -4]]])         # ‖k‖ = 5, u = 0.6, 0, −0.8
    value = np.array([[[0, 3, 0.5, 1.5, 2.5, 1, 2, 1.4375]],        # lo 0, hi 3: scale 1
                      [[-2, 1, -1.5, -0.5, 0.5, -1, 0, -0.5625]]])  # the same, shifted by −2
    return fmt, p, key, value


# Key codes, a tie going to the upper bucket: 0.5 -> 3, -0.5 -> 1, 0 and -0 -> 2, 0.6 -> 3,
# -0.8 -> 0, i.e. [3,1,3,1,2,2,2,2] and [3,2,2,2,2,2,2,0]; 2-bit LSB-first packing:
# 3 | 1<<2 | 3<<4 | 1<<6 = 0x77, 2 | 2<<2 | 2<<4 | 2<<6 = 0xAA, 3 | 2<<2 | 2<<4 | 2<<6 = 0xAB,
# 2 | 2<<2 | 2<<4 | 0<<6 = 0x2A.
# Value codes ⌊v − lo + 1/2⌋ (a half rounds up): [0,3,1,2,3,1,2,1] both tokens:
# 0 | 3<<2 | 1<<4 | 2<<6 = 0x9C, 3 | 1<<2 | 2<<4 | 1<<6 = 0x67. fp16 1.0 = 0x3C00, −2.0 = 0xC000.
KEY_CODES = [[0x77, 0xAA], [0xAB, 0x2A]]
VALUE_BYTES = [[0x9C, 0x67, 0x00, 0x3C, 0x00, 0x00], [0x9C, 0x67, 0x00, 0x3C, 0x00, 0xC0]]
C_IDX = np.array([[0.75, -0.25, 0.75, -0.25, 0.25, 0.25, 0.25, 0.25],
                  [0.75, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, -0.75]])
NORMS = [2.0, 5.0]
C_NORM = np.sqrt(1.5)  # ‖c[idx]‖² = 2·0.5625 + 6·0.0625 for both tokens


@pytest.mark.parametrize("norm_correction", ["none", "decode", "stored"])
def test_golden_tiny_slot(norm_correction):
    fmt, p, key, value = _tiny(norm_correction)
    assert fmt.slot_bytes == 16
    slots = compress(key, value, p)
    for t in range(2):
        field = NORMS[t] / C_NORM if norm_correction == "stored" else NORMS[t]
        norm_bytes = list(np.float32(field).tobytes())
        want = KEY_CODES[t] + norm_bytes + VALUE_BYTES[t] + [0] * 4
        assert slots[t, 0].tolist() == want, t
    k, v = decompress(slots, p)
    for t in range(2):
        f = float(np.float32(NORMS[t] / C_NORM if norm_correction == "stored" else NORMS[t]))
        want_k = f * C_IDX[t] / C_NORM if norm_correction == "decode" else f * C_IDX[t]
        assert np.array_equal(k[t, 0], want_k)
        want_v = np.array([0, 3, 1, 2, 3, 1, 2, 1.0]) - 2 * t
        assert np.array_equal(v[t, 0], want_v)


def test_golden_tiny_slot_nibble_high_even():
    # 4-bit codebook k/16 for odd k in [−15, 15]: boundaries −0.875 + 0.125·i. With ‖x‖ = 4 and
    # u = [.5, −.5, .5, −.5, 0, 0, 0, 0]: code(0.5) = 12 (boundaries −0.875..0.5 are ≤ 0.5),
    # code(−0.5) = 4, code(0) = 8. High nibble = even index: 0xC4 0xC4 0x88 0x88.
    cb = Codebook.from_centroids(np.arange(-15, 16, 2) / 16, dim=8)
    codec = LloydMax(bits=4, norm_dtype="float32")
    fmt = KVFormat(head_dim=8, key=codec, value=codec, bit_order="nibble_high_even", rotation="haar",
                   slot_alignment=1)
    p = TQParams(format=fmt, rotation=np.eye(8), key_codebook=cb, value_codebook=cb)
    x = np.array([[[2.0, -2, 2, -2, 0, 0, 0, 0]]])
    slots = compress(x, x, p)
    side = [0xC4, 0xC4, 0x88, 0x88, 0x00, 0x00, 0x80, 0x40]  # fp32 4.0 = 0x40800000
    assert slots[0, 0].tolist() == side + side
    lsb = compress(x, x, TQParams(format=fmt.replace(bit_order="lsb"), rotation=np.eye(8),
                                  key_codebook=cb, value_codebook=cb))
    assert lsb[0, 0, :4].tolist() == [0x4C, 0x4C, 0x88, 0x88]


def test_golden_rotated_hadamard_coordinates():
    # vLLM's rotation y = u @ H/√D: for x = 3·e_0, y = row 0 of H/√8 = 1/√8 everywhere.
    # With centroids ±0.1, ±0.4 (boundaries −0.25, 0, 0.25), 1/√8 ≈ 0.354 codes to 3.
    cb = Codebook.from_centroids([-0.4, -0.1, 0.1, 0.4], dim=8)
    fmt = KVFormat(head_dim=8, key=LloydMax(bits=2, norm_dtype="float16"), value=Raw(),
                   rotation="hadamard", slot_alignment=1)
    i = np.arange(8)
    parity = np.vectorize(lambda b: bin(b).count("1") & 1)(i[:, None] & i[None, :])
    h8 = np.where(parity == 1, -1.0, 1.0) / np.sqrt(8)  # Sylvester H_8 / √8
    p = TQParams(format=fmt, rotation=h8, key_codebook=cb)
    x = np.zeros((1, 1, 8))
    x[0, 0, 0] = 3.0
    x2 = x.copy()
    x2[0, 0, 1] = 4.0  # ‖x‖ = 5, y = (3·H[0] + 4·H[1]) / (5√8): [7, −1, 7, −1, ...]/(5√8)
    slots = compress(np.concatenate([x, x2]), np.concatenate([x, x2]), p)
    assert slots[0, 0, :2].tolist() == [0xFF, 0xFF]  # eight codes 3
    assert slots[0, 0, 2:4].tolist() == [0x00, 0x42]  # fp16 3.0
    # 7/(5√8) ≈ 0.495 -> code 3; −1/(5√8) ≈ −0.071 -> code 1: [3,1,3,1,...] = 0b01110111 = 0x77
    assert slots[1, 0, :2].tolist() == [0x77, 0x77]
    assert slots[1, 0, 2:4].tolist() == [0x00, 0x45]  # fp16 5.0


def test_uniform_exact_half_rounds_up():
    v = np.array([[0.0, 9.0, 4.5, 1.0, 2.0, 3.0, 5.0, 6.0]])
    # t = v·7/9 + 1/2 = 0.5, 7.5, 4, 1.28, 2.06, 2.83, 4.39, 5.17
    q = quantize(v, Uniform(bits=3))
    assert q.codes[0].tolist() == [0, 7, 4, 1, 2, 2, 4, 5]
