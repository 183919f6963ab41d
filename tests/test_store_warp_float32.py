"""The warp store kernel's float32 shortcuts of session 77, on sides whose codes come from float16
rows without a key offset: a uniform side's codes ratio and stored scale from float32 quotients (the
scale's float16 bytes decided by their error bound or, within 2^-18 of a rounding tie, in float64
for the warp; the zero is ``lo``'s own hardware rounding) and its floor from a float32 comparison
(unrotated) or an exact float64 one; FP8 codes by the hardware's saturating conversion without a
clamp before it. The thresholds' exactness is a CPU fact; the bytes are checked on the GPU.

What no test here tells apart: the scale's float64 fall-back. On every float16 tie below the float32
quotients were exact (session 77, H200: the tie test passes with the fall-back removed), and on
rotated sides the oracle's scale bytes near a tie are uncertain."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.errors import ErrorFlag
from tqkern.ops.quantize.reference import SCALE_FLOOR
from tqkern.ops.store.plan import plan_store
from tqkern_torch.errors import read_errors
from tqkern_torch.testing import device_under_test

DEV = device_under_test()
needs_gpu = pytest.mark.skipif(DEV.type != "cuda", reason="the warp kernel is GPU only (inline PTX)")


@pytest.mark.parametrize("bits", range(1, 9))
def test_the_floor_threshold_is_the_least_span_the_oracle_does_not_floor(bits):
    # lanes._uniform_codes floors where span < fl(1e-8 · levels); the oracle where fl(span / levels) < 1e-8.
    # The quotient is monotone in span, so the two agree on every float64 span iff this holds.
    levels = np.float64((1 << bits) - 1)
    t = np.float64(SCALE_FLOOR * float(levels))  # what the kernel's constexpr product is
    assert t / levels >= SCALE_FLOOR
    assert np.nextafter(t, 0.0) / levels < SCALE_FLOOR


@pytest.mark.parametrize("bits", range(1, 9))
def test_the_float32_floor_of_float16_spans_is_the_oracles(bits):
    # lanes._uniform_codes (F32_FLOOR): float16 spans are multiples of 2^-24; the nearest two to the
    # threshold T compare with float32(T) as with T, and rounding is monotone for the others.
    levels = (1 << bits) - 1
    t = SCALE_FLOOR * levels
    t32 = np.float32(t)
    j = np.floor(t * 2.0**24)
    below, above = j * 2.0**-24, (j + 1) * 2.0**-24
    assert below < t <= above
    assert np.float32(below) < t32 <= np.float32(above)
    assert np.float32(below) == below and np.float32(above) == above


def _tie_spans(levels: int) -> list[tuple[float, float]]:
    """``(lo, hi)`` pairs of float16 values whose ``(hi − lo)/levels`` is exactly the midpoint of two
    adjacent float16 values (a rounding tie of the stored scale) at exponents −13..11: hi = 2^(e+s),
    lo = N·2^(e−11) with N = 2^(11+s) − levels·m odd below 2^11 and m ∈ (2^11, 2^12) odd."""
    s = int(levels).bit_length()
    pairs = []
    for e in range(-13, 12):
        if e + s > 15:
            continue
        for m in range(2049, 4096, 2):
            n = 2 ** (11 + s) - levels * m
            if 0 < n < 2 ** 11:
                pairs.append((n * 2.0 ** (e - 11), 2.0 ** (e + s)))
    return pairs


def _values_on_ties(levels: int, d: int, rows: int, rng) -> np.ndarray:
    """``[rows, d]`` float16 vectors whose min and max are a pair of :func:`_tie_spans` (every other
    row one unit in the last place of ``lo`` away: a near tie), other elements between them."""
    pairs = _tie_spans(levels)
    assert len(pairs) > 20
    out = np.empty((rows, d), np.float16)
    for r in range(rows):
        lo, hi = pairs[rng.integers(len(pairs))]
        lo16 = np.float16(lo)
        assert float(lo16) == lo and float(np.float16(hi)) == hi
        if r % 2:
            lo16 = np.nextafter(lo16, np.float16(-np.inf) if r % 4 == 1 else np.float16(hi))
        x = rng.uniform(float(lo16), hi, size=d).astype(np.float16)
        x = np.clip(x, lo16, np.float16(hi))
        x[rng.permutation(d)[:2]] = [lo16, np.float16(hi)]
        if r % 3 == 0:
            x = -x[::-1].copy()  # negative spans' halves too
        out[r] = x
    return out


def _store_poisoned(layout, params, k: np.ndarray, v: np.ndarray, rng):
    """Store float16 ``k``, ``v`` ``[n, H, D]`` into a cache of random bytes at shuffled slots (n // 16 + 2
    blocks): the written slots ``[n, H, slot_bytes]``, the error flags and the slots."""
    n = k.shape[0]
    nb = n // 16 + 2
    slots = rng.permutation(nb * 16)[:n].astype(np.int64)
    cache = torch.from_numpy(rng.integers(0, 256, size=layout.cache_shape(nb), dtype=np.uint8)).to(DEV)
    read_errors(DEV)
    tqt.store(cache, torch.from_numpy(k).to(DEV), torch.from_numpy(v).to(DEV), torch.from_numpy(slots).to(DEV),
              layout, tqt.to_device(params, DEV))
    flags = read_errors(DEV)
    return ref.gather_slots(cache.cpu().numpy(), layout, slots), flags, slots


@needs_gpu
@pytest.mark.parametrize("preset, d", [("turboquant_k8v4", 128), ("turboquant_4bit_nc", 128),
                                       ("turboquant_3bit_nc", 64), ("turboquant_k3v4_nc", 256)])
def test_scales_on_float16_ties_write_the_oracle_bytes(preset, d):
    fmt = tqkern.KVFormat.preset(preset, d)
    levels = (1 << fmt.value.bits) - 1
    h, n = 4, 96
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=h, block_size=16)
    params = tqkern.TQParams.default(fmt, seed=1)
    assert plan_store(layout, signed_sylvester=True, vector_aligned=True).kernel == "warp"
    rng = np.random.default_rng(levels * d)
    v = _values_on_ties(levels, d, n * h, rng).reshape(n, h, d)
    k = rng.standard_normal((n, h, d)).astype(np.float16)
    got, flags, _ = _store_poisoned(layout, params, k, v, rng)
    assert flags == ErrorFlag(0)
    want, unsure = ref.compress(k.astype(np.float64), v.astype(np.float64), params, return_uncertain=True)
    bad = (got != want) & ~unsure
    assert not bad.any(), f"{preset}: certain bytes differ in {int(bad.any(-1).sum())} of {n * h} vectors"


@needs_gpu
@pytest.mark.parametrize("d", [128, 256])
def test_fp8_keys_beyond_448_saturate_to_the_oracles_bytes(d):
    fmt = tqkern.KVFormat.preset("turboquant_k8v4", d)
    h, n = 2, 64
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=h, block_size=16)
    params = tqkern.TQParams.default(fmt, seed=1)
    assert plan_store(layout, signed_sylvester=True, vector_aligned=True).kernel == "warp"
    rng = np.random.default_rng(d)
    k = rng.standard_normal((n, h, d)) * 64.0
    edge = np.array([447.0, 448.0, 449.0, 455.9, 456.0, 463.9, 464.0, 465.0, 479.0, 480.0, 1000.0, 65504.0])
    big = rng.random((n, h, d)) < 0.1
    k[big] = rng.choice(edge, size=int(big.sum())) * rng.choice([-1.0, 1.0], size=int(big.sum()))
    k[: n // 2] = np.clip(k[: n // 2], -440.0, 440.0)  # half the vectors inside FP8's range
    k = k.astype(np.float16)
    v = rng.standard_normal((n, h, d)).astype(np.float16)
    got, flags, slots = _store_poisoned(layout, params, k, v, rng)
    _, want_flags = ref.store(np.zeros(layout.cache_shape(n // 16 + 2), np.uint8), k.astype(np.float64),
                              v.astype(np.float64), slots, layout, params, return_flags=True)
    assert want_flags & ErrorFlag.SATURATED and flags == ErrorFlag(int(want_flags))
    want = ref.compress(k.astype(np.float64), v.astype(np.float64), params)
    assert np.array_equal(got, want)


def _nearer_boundary_codes(y32: np.ndarray, bits: int, fused: bool) -> np.ndarray:
    """NumPy replay of the warp kernel's uniform codes for rows ``y32 [N, D]`` (float32 values of the
    input): the float32 estimate (``fused``: t from the exact product, as an FMA gives it) and, for every
    element, the float64 decision at the boundary nearer t (``lanes._uniform_codes``'s fall-back)."""
    levels = (1 << bits) - 1
    lo, hi = y32.min(1, keepdims=True), y32.max(1, keepdims=True)
    span = hi.astype(np.float64) - lo
    floored = span < 1e-8 * levels
    r = np.where(floored, 1e8, levels / np.where(floored, 1.0, span)).astype(np.float32)
    d32 = (y32 - lo).astype(np.float32)
    t = d32.astype(np.float64) * r if fused else (d32 * r).astype(np.float64)
    q = np.rint(t)
    d = y32.astype(np.float64) - lo
    num, den = np.where(floored, d, d * levels), np.where(floored, 1e-8, span)
    up = t >= q
    q = q + np.where(up, ((q + 0.5) * den <= num).astype(np.int64), -((q - 0.5) * den > num).astype(np.int64))
    return q.astype(np.int64)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_the_nearer_boundary_alone_decides_the_oracles_uniform_codes(dtype, bits):
    # the oracle moves its estimate by both comparisons; the kernel's fall-back by the nearer one only
    from tqkern.ops.quantize.reference import _uniform_codes
    rng = np.random.default_rng(bits)
    levels = (1 << bits) - 1
    rows = [rng.standard_normal((4000, 64))]
    halves = rng.integers(0, levels, size=(4000, 64)) + 0.5  # every code a tie
    halves[:, 0], halves[:, 1] = 0, levels
    rows.append(halves * 2.0 ** rng.integers(-6, 3, size=(4000, 1)))
    rows.append(rng.standard_normal((500, 64)) * 1e-7)  # floored scales
    # elements across 12 binades: y − lo inexact in float32, estimates too high as well as too low
    rows.append(rng.standard_normal((60000, 64)) * 2.0 ** rng.integers(-12, 1, size=(60000, 64)))
    x = np.concatenate(rows)
    y32 = torch.from_numpy(x).to(getattr(torch, dtype)).float().numpy()
    y = y32.astype(np.float64)
    want = _uniform_codes(y, y.min(1), y.max(1), bits).astype(np.int64)
    for fused in (False, True):
        got = _nearer_boundary_codes(y32, bits, fused)
        assert np.array_equal(got, want), f"{int((got != want).sum())} codes differ (fused={fused})"


def _fwht_f32(x: np.ndarray) -> np.ndarray:
    """The unnormalised Walsh–Hadamard transform of float32 rows, each butterfly rounded to float32."""
    y = x.astype(np.float32).copy()
    d = y.shape[-1]
    hlen = 1
    while hlen < d:
        y = y.reshape(*y.shape[:-1], d // (2 * hlen), 2, hlen)
        a, b = y[..., 0, :], y[..., 1, :]
        y = np.stack([a + b, a - b], axis=-2).reshape(*x.shape)
        hlen *= 2
    return y


@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_warp_kernels_bf16_transform_at_2_to_the_minus_16_is_the_transform_scaled(d):
    # warp._encode scales bf16 rows (no key offset) by 2^-16 before the unnormalised transform, so
    # that rows near bf16's top (2^128) do not overflow float32, and c by 2^16 after: exact only if
    # every butterfly of the scaled rows is the unscaled one times 2^-16, subnormal results included
    # (bf16 values are multiples of 2^-133). Rows from bf16's subnormals up to where the unscaled
    # transform still stays finite, and rows with cancelling pairs.
    rng = np.random.default_rng(d)
    e = rng.integers(-133, 118, size=(4096, 1))
    x = rng.standard_normal((4096, d)) * np.exp2(e) * np.exp2(rng.integers(-30, 1, size=(4096, d)))
    x[::7, 1::2] = -x[::7, ::2]  # exact cancellations
    xb = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).float().numpy()
    assert (np.abs(xb[xb != 0]) < 2.0**-126).any()  # float32 subnormal inputs among them
    with np.errstate(over="raise"):
        full = _fwht_f32(xb)
        scaled = _fwht_f32(xb * np.float32(2.0**-16))
    assert (np.abs(scaled[scaled != 0]) < 2.0**-126).any()  # subnormal partial results too
    assert np.array_equal(scaled.astype(np.float64) * 2.0**16, full.astype(np.float64))
    top = xb[:8] * np.float32(2.0**(127 - 118 - 1))  # rows near bf16's top: the scaled transform stays finite
    assert np.isfinite(_fwht_f32(top * np.float32(2.0**-16))).all()
