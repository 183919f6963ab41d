"""The Triton store and decompress kernels equal their NumPy oracles.

Bytes: exactly, except bytes the oracle marks uncertain (a code or stored float within EPS of a
decision point, because the kernel rotates in float32). Bytes outside the written slots of a
poisoned cache stay as they were, and so do the bytes around the cache (it is a view into a
larger poisoned buffer) whatever a slot index holds. Non-finite keys and values, slot indices
past the cache and saturating values are injected; the error word's bits equal the oracle's.
Each case runs with the short store's tile or the long store's (drawn); on a GPU the eligible layouts
take the warp kernel (tqkern/ops/store/warp.py), or the tile kernel where the key tensor is drawn
misaligned (a view one or two elements into its buffer).
decompress: to float32 rounding of the oracle's float64.
"""

import contextlib

import numpy as np
import pytest
import torch
import triton
from hypothesis import given, note
from hypothesis import strategies as st

import tqkern.ops.store.plan as store_plan
import tqkern.testing as T
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.errors import ErrorFlag
from tqkern_torch.testing import device_under_test, kernels_available, poisoned_like, store_for_tests, to_torch_kv

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")

DEV = device_under_test()
ON_GPU = DEV.type == "cuda"
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]


@st.composite
def store_cases(draw):
    layout = draw(T.paged_layouts(T.kv_formats(), block_sizes=st.sampled_from([16, 32, 64, 128])), label="layout")
    params = draw(T.tq_params(layout.format, layout.num_kv_heads), label="params")
    num_blocks = draw(st.integers(1, T.scale(3, 12)), label="num_blocks")
    capacity = num_blocks * layout.block_size
    n = draw(st.integers(1, min(capacity, T.scale(40, 600))), label="num_tokens")
    perm = np.random.default_rng(draw(st.integers(0, 2**16), label="slot_seed")).permutation(capacity)[:n]
    skip = draw(st.lists(st.integers(0, n - 1), max_size=3), label="skipped")
    slots = perm.astype(np.int64)
    slots[skip] = -1
    past = draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from([0, 1, 7, 10**6, 2**31 - 1 - capacity])),
                         max_size=2), label="past_the_cache")  # (token, slots beyond the last one)
    for t, extra in past:
        slots[t] = capacity + extra
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    k, v = draw(T.kv_arrays(n, layout.num_kv_heads, layout.head_dim, dtype=np.float32), label="kv")
    bad = draw(st.lists(st.tuples(st.booleans(), st.integers(0, n - 1), st.integers(0, layout.num_kv_heads - 1),
                                  st.integers(0, layout.head_dim - 1), st.sampled_from([np.nan, np.inf, -np.inf])),
                        max_size=3), label="non_finite")  # (key?, token, head, element, value)
    for is_key, t, h, d, x in bad:
        (k if is_key else v)[t, h, d] = x
    misaligned = draw(st.sampled_from([0, 0, 1, 2]), label="key_offset_elements")  # 2: 4 bytes, not 8
    return layout, params, num_blocks, slots, dtype, k, v, misaligned


GUARD = 64  # poisoned bytes on each side of the cache (its tensor is a view into a larger buffer)


def _run_store(layout, params, num_blocks, slots, dtype, k, v, misaligned=0):
    kt, k64 = to_torch_kv(k, dtype, DEV)
    if misaligned:  # a view that many elements into its buffer: not 8-byte aligned (the tile kernel)
        buf = torch.empty(kt.numel() + misaligned, dtype=kt.dtype, device=DEV)
        buf[misaligned:].view(kt.shape).copy_(kt)
        kt = buf[misaligned:].view(kt.shape)
    vt, v64 = to_torch_kv(v, dtype, DEV)
    shape = layout.cache_shape(num_blocks)
    size = int(np.prod(shape))
    buf = poisoned_like((size + 2 * GUARD,), torch.uint8, DEV, seed=num_blocks)
    before = buf.clone()
    cache = buf[GUARD: GUARD + size].view(shape)
    sm = torch.from_numpy(slots).to(DEV)
    tqt.read_errors(DEV)  # clear
    tqt.store(cache, kt, vt, sm, layout, params)
    flags = tqt.read_errors(DEV)
    expect, expect_flags = ref.store(before[GUARD: GUARD + size].view(shape).cpu().numpy(), k64, v64, slots, layout,
                                     params, return_flags=True)
    around = torch.cat([buf[:GUARD], buf[GUARD + size:]])
    assert torch.equal(around, torch.cat([before[:GUARD], before[GUARD + size:]])), "bytes around the cache changed"
    assert flags == expect_flags, f"error word {flags!r}, oracle {expect_flags!r}"
    return cache.cpu().numpy(), expect, k64, v64


@contextlib.contextmanager
def _tile(small: bool):
    """Stores under this take the short store's small tile (as every store of these few tokens
    does) or, with ``small`` False, the long store's tiles (``SMALL_STORE_VECTORS`` below any size)."""
    saved = store_plan.SMALL_STORE_VECTORS
    store_plan.SMALL_STORE_VECTORS = saved if small else -1
    try:
        yield
    finally:
        store_plan.SMALL_STORE_VECTORS = saved


@given(store_cases(), st.booleans())
def test_store_bytes_equal_oracle(case, small_tile):
    layout, params, num_blocks, slots, dtype, k, v, _ = case
    with _tile(small_tile):
        got, expect, k64, v64 = _run_store(*case)
    keep = (slots >= 0) & (slots < num_blocks * layout.block_size)
    _, unsure = ref.compress(k64, v64, params, return_uncertain=True)
    assert unsure.shape[0] == len(slots)
    g = ref.gather_slots(got, layout, slots[keep])
    e = ref.gather_slots(expect, layout, slots[keep])
    bad = (g != e) & ~unsure[keep]
    note(f"uncertain bytes: {int(unsure[keep].sum())} / {unsure[keep].size}, differing: {int((g != e).sum())}")
    assert not bad.any(), f"{int(bad.sum())} certain bytes differ; first at {np.argwhere(bad)[0]}"
    # Nothing outside the written slots changed.
    blank = np.zeros_like(g)
    assert np.array_equal(ref.write_slots(got, layout, blank, slots[keep]),
                          ref.write_slots(expect, layout, blank, slots[keep]))


def _decompress_at(cache, ids, layout, params, rotate_back, tiles):
    """``decompress`` through its launcher at ``tiles = (slots a program, columns a rotate-back
    product, the Walsh–Hadamard rotate-back where the rotation allows it)``, into outputs that held
    NaN."""
    from tqkern.ops.decompress.triton import DecompressConfig, _launch_decompress
    from tqkern_torch._params import to_device
    from tqkern_torch.errors import error_word

    bt, kc, fwht = tiles
    d = layout.head_dim
    dp = triton.next_power_of_2(d)
    p = to_device(params, DEV)
    fwht = fwht and p.signed_sylvester and d == dp  # (the transform serves signed Sylvester rotations only)
    out = [torch.full((ids.shape[0], layout.num_kv_heads, d), float("nan"), device=DEV) for _ in range(2)]
    _launch_decompress(out[0], out[1], cache, ids, layout, p.tables(), error_word(DEV),
                       rotate_back=rotate_back, interpret=not ON_GPU,
                       config=DecompressConfig(bt, min(kc, dp), 1 if bt < 16 else 4, 2 if ON_GPU else 1, fwht))
    return out


# None (the public call) or (slots a program, columns a rotate-back product, the Walsh–Hadamard
# rotate-back where allowed) for the launcher
DECOMPRESS_TILES = st.one_of(st.none(), st.tuples(st.sampled_from([4, 8, 16, 32, 64]), st.sampled_from([16, 32, 64]),
                                                  st.booleans()))


@given(store_cases(), st.booleans(), DECOMPRESS_TILES)
def test_decompress_equals_oracle(case, rotate_back, tiles):
    """Through ``tqt.decompress`` (``tiles`` None), or its launcher at drawn program tiles: every
    tiling the config may choose reads the oracle's values."""
    layout, params, num_blocks, slots, dtype, k, v, _ = case
    cache = poisoned_like(layout.cache_shape(num_blocks), torch.uint8, DEV, seed=num_blocks)
    store_for_tests(cache, k, v, slots, layout, params, dtype)  # (the store's own checks: above)
    got = cache.cpu().numpy()
    ids = torch.from_numpy(slots).to(DEV)
    tqt.read_errors(DEV)
    if tiles is None:
        kd, vd = tqt.decompress(cache, ids, layout, params, rotate_back=rotate_back)
    else:
        kd, vd = _decompress_at(cache, ids, layout, params, rotate_back, tiles)
    keep = (slots >= 0) & (slots < num_blocks * layout.block_size)
    assert bool(tqt.read_errors(DEV) & ErrorFlag.SLOT_OUT_OF_RANGE) == bool(np.any(slots >= num_blocks * layout.block_size))
    ek, ev = ref.decompress(ref.gather_slots(got, layout, slots[keep]), params, rotate_back=rotate_back)
    for name, out, exp in (("key", kd, ek), ("value", vd, ev)):
        out = out.cpu().numpy().astype(np.float64)
        assert np.all(out[~keep] == 0), f"{name}: skipped and out-of-range slots must read as zeros"
        o, x = out[keep], exp
        assert np.all(np.isfinite(o)) and np.all(np.isfinite(x)), name
        # float32 results of float64 maths: a few ulps of the vector's largest entry; rotating
        # back adds one float32 matmul over D terms (error grows like sqrt(D)).
        if rotate_back:
            tol = 4 * np.sqrt(layout.head_dim) * 2.0**-24 * np.linalg.norm(x, axis=-1, keepdims=True)
        else:
            tol = 8 * 2.0**-24 * np.max(np.abs(x), axis=-1, keepdims=True)
        err = np.abs(o - x)
        assert np.all(err <= tol), f"{name}: max error {err.max():.3g}, tolerance {tol.max():.3g}"
