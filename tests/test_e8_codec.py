"""The E8 codec (``tqkern.E8``): its layout, the oracle's bytes for inputs whose codes are known by
construction, the stored norm, the uncertainty of block indices, the fitted scales, and the
guard that keeps it out of the Triton kernels."""

from __future__ import annotations

import numpy as np
import pytest

import tqkern
from tqkern import lattice
from tqkern.layouts import KVFormat, PagedLayout, is_format_name, layout_from_dict, layout_to_dict
from tqkern.ops.codecs import layout_args, layout_consts
from tqkern.ops.compress.reference import compress
from tqkern.ops.decompress.reference import decompress
from tqkern.ops.pack.reference import pack
from tqkern.ops.quantize.reference import EPS, dequantize, quantize
from tqkern.params import TQParams


# -- layout --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, head_dim, key, value", [
    ("e8k32x2v8x2", 64, (40, 1, 2), (24, 1, 2)),  # 41 + 25 bits a block: 70 bytes with the norms
    ("e8k32x4v16x2", 64, (40, 2, 2), (32, 1, 2)),
    ("e8k16x1v8x1", 128, (64, None, 2), (48, None, 2)),
    ("e8k64x4v8x1", 256, (192, 8, 2), (96, None, 2)),
])
def test_family_fields(name, head_dim, key, value):
    fmt = KVFormat.preset(name, head_dim)
    assert is_format_name(name)
    for fields, want in ((fmt.key_fields, key), (fmt.value_fields, value)):
        names = ["codes", "norm", "block_scale"] if want[1] is not None else ["codes", "norm"]
        assert [f.name for f in fields] == names
        assert [f.nbytes for f in fields] == [w for w in (want[0], want[2], want[1]) if w is not None]
    assert fmt.key.norm_correction == "stored" and fmt.value.norm_correction == "none"
    used = sum(w for w in key + value if w is not None)
    assert fmt.slot_bytes == used + used % 2


def test_layout_round_trips_through_a_dict():
    lay = PagedLayout(format=KVFormat.preset("e8k32x4v16x2", 64), num_kv_heads=3, block_size=16)
    assert layout_from_dict(layout_to_dict(lay)) == lay


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(levels=12), ValueError, r"E8.levels must be one of \(8, 16, 32, 64\), got 12"),
    (dict(levels=16.0), TypeError, r"E8.levels must be an int, got float"),
    (dict(levels=16, scales=3), ValueError, r"E8.scales must be one of \(1, 2, 4\), got 3"),
    (dict(levels=16, scales=True), TypeError, r"E8.scales must be an int, got bool"),
    (dict(levels=16, norm_dtype="bfloat16"), ValueError, r"E8.norm_dtype must be one of"),
    (dict(levels=16, norm_correction="decode"), ValueError, r"E8.norm_correction must be one of"),
])
def test_codec_rejects_bad_fields(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        tqkern.E8(**kwargs)


def test_format_rejects_head_dims_and_bit_orders_it_cannot_hold():
    e8 = tqkern.E8(levels=16)
    with pytest.raises(ValueError, match=r"KVFormat.head_dim with an E8 key must be a multiple of 8, got 60"):
        KVFormat(head_dim=60, key=e8, value=e8)
    with pytest.raises(ValueError, match=r"KVFormat.bit_order with an E8 key must be 'lsb', got 'nibble_high_even'"):
        KVFormat(head_dim=64, key=e8, value=tqkern.LloydMax(bits=4), bit_order="nibble_high_even")
    with pytest.raises(ValueError, match=r"e8kQxMvRxN"):
        KVFormat.preset("e8k12x2v8x2", 64)


def test_no_kernel_takes_it():
    lay = PagedLayout(format=KVFormat.preset("e8k32x2v8x2", 64), num_kv_heads=2, block_size=16)
    for f in (layout_args, layout_consts):
        with pytest.raises(NotImplementedError, match=r"layout.format.key is E8\(levels=32.*no Triton kernel"):
            f(lay)


# -- the oracle's bytes ----------------------------------------------------------------------------
def _params(name: str, d: int) -> TQParams:
    return TQParams.default(KVFormat.preset(name, d), seed=3)


@pytest.mark.parametrize("name", ["e8k8x1v8x1", "e8k16x2v32x4", "e8k64x4v16x1"])
def test_decompress_of_hand_packed_slots(name):
    """Slots packed by hand from chosen indices (c with even block sums, coset s, scale t) and a
    norm decode to norm·β_t·(c − q/2 + s/2)/√D: code 7 of a block holds c_7 >> 1 plus s·q/2, c_7's
    lowest bit is the parity of the other seven, the scale indices are an LSB-first stream."""
    d, n = 64, 30
    p = _params(name, d)
    fmt = p.format
    rng = np.random.default_rng(len(name))
    parts, want = [], {}
    for side in ("key", "value"):
        codec = getattr(fmt, side)
        q, m = codec.levels, codec.scales
        c = rng.integers(0, q, size=(n, d // 8, 8))
        c[..., 0] ^= c.sum(-1) % 2
        s = rng.integers(0, 2, size=(n, d // 8))
        t = rng.integers(0, m, size=(n, d // 8))
        norm = rng.uniform(0.25, 8.0, size=n).astype(np.float16)
        codes = c.copy()
        codes[..., 7] = (c[..., 7] >> 1) + s * (q // 2)
        parts.append(pack(codes.reshape(n, d).astype(np.uint8), codec.bits, "lsb"))
        parts.append(norm.view(np.uint8).reshape(n, 2))
        if m > 1:
            parts.append(pack(t.astype(np.uint8), codec.scale_bits, "lsb"))
        betas = np.asarray(lattice.cube_scales(q, m))
        want[side] = (norm.astype(np.float64)[:, None, None] * betas[t][..., None]
                      * (c - q // 2 + 0.5 * s[..., None]) / np.sqrt(d)).reshape(n, d)
    slots = np.concatenate(parts, axis=-1)
    slots = np.concatenate([slots, np.zeros((n, fmt.slot_bytes - slots.shape[-1]), np.uint8)], axis=-1)
    k, v = decompress(slots[:, None, :], p)
    # the same real product, rounded in another order: within a few float64 ulps
    np.testing.assert_allclose(k[:, 0], want["key"], rtol=1e-15, atol=0)
    np.testing.assert_allclose(v[:, 0], want["value"], rtol=1e-15, atol=0)


@pytest.mark.parametrize("name", ["e8k32x2v8x2", "e8k16x4v64x1"])
def test_compress_stores_the_nearest_point(name):
    """compress → decompress gives, per block, norm·(the nearest codebook point of w)/√D (the
    lattice's encoder, tested against brute force on its own), with w = √D·(x/‖x‖)·Π; keys keep
    their norm (stored correction, float16), values store float16(‖v‖)."""
    d, n, h = 64, 25, 2
    p = _params(name, d)
    rng = np.random.default_rng(5)
    x = {"key": rng.standard_normal((n, h, d)) * 3, "value": rng.standard_normal((n, h, d)) * 0.5}
    got = dict(zip(("key", "value"), decompress(compress(x["key"], x["value"], p), p)))
    for side in ("key", "value"):
        codec = getattr(p.format, side)
        betas = lattice.cube_scales(codec.levels, codec.scales)
        nrm = np.linalg.norm(x[side], axis=-1, keepdims=True)
        w = np.sqrt(d) * (x[side] / nrm) @ p.rotation
        point = lattice.decode_blocks(*lattice.encode_blocks(w.reshape(n, h, 8, 8), codec.levels, betas),
                                      codec.levels, betas).reshape(n, h, d) / np.sqrt(d)
        if side == "key":  # the reconstruction keeps ‖k‖ (to the float16 norm field)
            np.testing.assert_allclose(np.linalg.norm(got[side], axis=-1), nrm[..., 0], rtol=2.0**-11)
            field = nrm / np.linalg.norm(point, axis=-1, keepdims=True)
        else:
            field = nrm
        np.testing.assert_array_equal(got[side], field.astype(np.float16).astype(np.float64) * point)


def test_quantize_dequantize_match_the_slots():
    p = _params("e8k32x4v8x2", 128)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((40, 1, 128))
    k, v = decompress(compress(x, x, p), p, rotate_back=True)
    for side, got in (("key", k), ("value", v)):
        codec = getattr(p.format, side)
        qz = quantize(x, codec, rotation=p.rotation)
        np.testing.assert_array_equal(got, dequantize(qz, codec, rotation=p.rotation, rotate_back=True))


def test_zero_vector_stores_zeros_and_is_certain():
    p = _params("e8k16x2v8x2", 64)
    z = np.zeros((1, 1, 64))
    slots, unsure = compress(z, z, p, return_uncertain=True)
    k, v = decompress(slots, p)
    assert not unsure.any()
    assert np.all(k == 0) and np.all(v == 0)


# -- uncertainty ---------------------------------------------------------------------------------
@pytest.mark.parametrize("q, m, radius", [(8, 2, 0.004), (16, 4, 0.003), (32, 1, 0.002), (64, 2, 0.001)])
def test_unflagged_blocks_keep_their_indices_under_perturbation(q, m, radius):
    """uncertain_blocks' promise: a block it does not flag keeps (c, s, t) when every coordinate
    moves by at most radius (random moves, and every corner of the box ±radius along a random
    subset), and it flags a minority (the check is not vacuous)."""
    rng = np.random.default_rng(q + m)
    betas = lattice.cube_scales(q, m)
    w = rng.standard_normal((3000, 8)) * 1.1
    flagged = lattice.uncertain_blocks(w, q, betas, radius)
    assert 0 < flagged.mean() < 0.5
    base = lattice.encode_blocks(w, q, betas)
    moves = [rng.uniform(-radius, radius, size=w.shape) for _ in range(6)]
    moves += [radius * rng.choice([-1.0, 1.0], size=w.shape) for _ in range(10)]
    changed = np.zeros(len(w), bool)
    for dw in moves:
        c, s, t = lattice.encode_blocks(w + dw, q, betas)
        changed |= np.any(c != base[0], axis=-1) | (s != base[1]) | (t != base[2])
    assert changed.any()  # the moves are large enough to matter
    assert not np.any(changed & ~flagged)


# -- the fitted scales -----------------------------------------------------------------------------
@pytest.mark.parametrize("q, m", sorted(lattice.CUBE_SCALES))
def test_fitted_scales_are_a_local_optimum(q, m):
    """On a Gaussian sample other than the fitting one, moving the base or the ratio of
    β_t = base/q·ratio^t by 5% raises the mean squared error per coordinate."""
    x = np.random.default_rng(123).standard_normal((16384, 8))
    base, ratio = lattice.CUBE_SCALES[(q, m)]

    def mse(b, r):
        betas = [b / q * r ** t for t in range(m)]
        return ((lattice.decode_blocks(*lattice.encode_blocks(x, q, betas), q, betas) - x) ** 2).mean()

    e = mse(base, ratio)
    assert np.allclose(lattice.cube_scales(q, m), [base / q * ratio ** t for t in range(m)])
    for b, r in ((base * 1.05, ratio), (base / 1.05, ratio)) + (((base, ratio * 1.05), (base, ratio / 1.05))
                                                               if m > 1 else ()):
        assert mse(b, r) > e, (b, r)
