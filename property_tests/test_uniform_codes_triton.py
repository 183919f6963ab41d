"""The store kernels' uniform codes (the tile kernel's ``tqkern.ops.fields``, the warp kernel's
``tqkern.ops.store.lanes``) equal the oracle's on float32 rows of any binade, bf16's whole range
included.

``_uniform_codes_f32`` (the float32 estimate and its proof, h = 2^-8 from spans of 2^120) and
``_uniform_codes`` (the exact float64 fall-back it takes where the proof fails) each against
:func:`tqkern.ops.quantize.reference._uniform_codes`, exactly: the codes are decided by exact
float64 comparisons, so no tie is uncertain. Rows mix Gaussian elements of a drawn binade,
elements on the grid's exact halves and elements near ±2^127 (spans up to 2^129, where
(y − lo)·(2^b − 1) and y − lo leave float32: session 78 found the fall-back's estimate overflowing
there); columns from the head_dim D to the tile's DP are padding the functions must ignore. The
warp kernel's function runs on one vector of L lanes × E elements (its bounds reduced here over the
lanes, as the kernel's butterflies do), on float16 rows with its float32 ratio and floor (``F32``,
``F32_FLOOR``: fp16 inputs without a key offset) and on any float32 rows without them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

from tqkern.ops import fields
from tqkern.ops.quantize.reference import _uniform_codes as oracle
from tqkern.ops.store import lanes
from tqkern_torch.testing import device_under_test, kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")
DEV = device_under_test()


@triton.jit
def _codes_kernel(y_ptr, q32_ptr, q64_ptr, D: tl.constexpr, DP: tl.constexpr, BV: tl.constexpr,
                  BITS: tl.constexpr):
    """Rows of float32 ``y [BV, DP]``: codes by both tile functions over each row's first D columns."""
    rows = tl.arange(0, BV)[:, None]
    cols = tl.arange(0, DP)[None, :]
    y = tl.load(y_ptr + rows * DP + cols)
    dmask = cols < D
    lo = tl.min(tl.where(dmask, y, float("inf")), axis=1)
    hi = tl.max(tl.where(dmask, y, float("-inf")), axis=1)
    yp = tl.where(dmask, y, 0.0)  # padding holds zeros, as the store's tiles do
    tl.store(q32_ptr + rows * DP + cols, fields._uniform_codes_f32(yp, lo, hi, D, BITS))
    q64 = fields._uniform_codes(yp.to(tl.float64), lo.to(tl.float64)[:, None], hi.to(tl.float64)[:, None], BITS)
    tl.store(q64_ptr + rows * DP + cols, q64)


@st.composite
def rows(draw):
    bits = draw(st.integers(1, 8), label="bits")
    dp = draw(st.sampled_from([16, 32]), label="DP")
    d = draw(st.integers(2, dp), label="D")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    levels = (1 << bits) - 1
    y = np.empty((4, dp))
    for r in range(4):
        kind = draw(st.sampled_from(["gauss", "halves", "top"]), label=f"row{r}")
        e = draw(st.integers(-140, 124), label=f"exp{r}")
        if kind == "gauss":
            y[r] = rng.standard_normal(dp) * 2.0**e
        elif kind == "halves":  # every code a tie (exact in float32 while levels·2^e stays below 2^127)
            q = rng.integers(0, levels + 1, dp) + 0.5
            q[0], q[1] = 0, levels
            y[r] = q * 2.0 ** min(e, 126 - bits)
        else:  # elements near ±2^127 among smaller ones: spans from 2^127 to 2^129
            big = rng.uniform(1.0, 1.99, dp) * 2.0**127 * rng.choice([-1.0, 1.0], dp)
            y[r] = np.where(rng.random(dp) < 0.3, big, rng.standard_normal(dp) * 2.0**e)
    return bits, d, y.astype(np.float32)


@given(rows())
def test_tile_uniform_codes_equal_the_oracles(case):
    bits, d, y32 = case
    dp = y32.shape[1]
    assert np.isfinite(y32).all()
    q32 = torch.full(y32.shape, -1, dtype=torch.int32, device=DEV)
    q64 = torch.full(y32.shape, -1, dtype=torch.int64, device=DEV)
    _codes_kernel[(1,)](torch.from_numpy(y32).to(DEV), q32, q64, d, dp, y32.shape[0], bits)
    y = y32[:, :d].astype(np.float64)
    want = oracle(y, y.min(1), y.max(1), bits).astype(np.int64)
    assert np.array_equal(q64.cpu().numpy()[:, :d], want)
    assert np.array_equal(q32.cpu().numpy()[:, :d].astype(np.int64), want)


@triton.jit
def _lane_codes_kernel(y_ptr, q_ptr, L: tl.constexpr, E: tl.constexpr, BITS: tl.constexpr, F32: tl.constexpr):
    """One vector of float32 ``y [L·E]`` (element E·p + e in lane p): lanes._uniform_codes' codes."""
    lane = tl.arange(0, L)
    ys = ()
    for e in tl.static_range(E):
        ys = ys + (tl.load(y_ptr + lane * E + e),)
    lo = ys[0]
    hi = ys[0]
    for e in tl.static_range(1, E):
        lo = tl.minimum(lo, ys[e])
        hi = tl.maximum(hi, ys[e])
    lo = tl.min(lo, axis=0) + lane * 0.0
    hi = tl.max(hi, axis=0) + lane * 0.0
    codes = lanes._uniform_codes(ys, lo, hi, BITS, E, F32, F32)
    for e in tl.static_range(E):
        tl.store(q_ptr + lane * E + e, codes[e])


@given(rows(), st.booleans(), st.sampled_from([(8, 4), (4, 8), (16, 2)]))
def test_warp_uniform_codes_equal_the_oracles(case, f32, shape):
    bits, _, y32 = case
    lanes_, e = shape
    x = y32.reshape(-1)[: lanes_ * e]
    if f32:  # fp16 rows: the kernel's float32 ratio and floor assume float16 values
        with np.errstate(over="ignore"):
            x = x.astype(np.float16).astype(np.float32)
        x = np.where(np.isfinite(x), x, np.sign(x) * np.float32(65504.0)).astype(np.float32)
    q = torch.full((x.size,), -1, dtype=torch.int32, device=DEV)
    _lane_codes_kernel[(1,)](torch.from_numpy(x.copy()).to(DEV), q, lanes_, e, bits, f32)
    y = x.astype(np.float64)[None, :]
    want = oracle(y, y.min(1), y.max(1), bits).astype(np.int64)[0]
    assert np.array_equal(q.cpu().numpy().astype(np.int64), want)
