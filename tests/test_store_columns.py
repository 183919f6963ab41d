"""The column-chunked store (``tqkern/ops/store/wide.py``: a rotated Lloyd-Max side at head_dim above 128
takes Π's columns a chunk at a time): its tiles, head_dims below their padding, non-finite rows, Π's fp16
parts (``DeviceParams.rotation_parts``) and the pipelined row-block loop. Plans and the other store paths:
``tests/test_store_plan.py``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.ops.store.plan import WIDE_LARGE_VECTORS, WIDE_STAGES, plan_store
from tests.test_store_plan import DEV, _layout, _stores_oracle_bytes, needs_gpu, needs_kernels
from tqkern_torch._params import to_device


@needs_kernels
@pytest.mark.parametrize("has_mu", [False, True])
def test_the_column_chunked_stores_large_tile_writes_the_oracle_bytes(has_mu, monkeypatch):
    """tq4 at head_dim 256 through the column-chunked store's 128-vector tile (fp16; the thresholds
    lowered so that 40 tokens x 8 heads take it: two whole tiles and a half one) into a poisoned cache
    at shuffled slots, keys with and without μ: the oracle's bytes wherever it is certain."""
    import tqkern.ops.store.plan as plan_mod

    monkeypatch.setattr(plan_mod, "SMALL_STORE_VECTORS", 64)
    monkeypatch.setattr(plan_mod, "WIDE_LARGE_VECTORS", 100)
    layout = _layout("tq4", 256, h=8)
    plan = plan_store(layout, has_mu=has_mu, vector_aligned=True, num_vectors=40 * 8, interpret=DEV.type != "cuda")
    assert (plan.block_vectors, dict(plan.constexprs)["COLS"], plan.columns, plan.grid(40)) == (128, 64, 64, (3,))
    _stores_oracle_bytes(layout, 40, has_mu, seed=4)


@needs_kernels
@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("has_mu, dtype", [(False, torch.float16), (True, torch.float16),
                                           pytest.param(False, torch.bfloat16, marks=needs_gpu),
                                           pytest.param(True, torch.bfloat16, marks=needs_gpu)])
def test_the_column_chunked_store_reads_non_finite_vectors_as_zeros(has_mu, dtype, large, monkeypatch):
    """tq4 at head_dim 256 (both sides by Π's columns: no whole row is loaded to check it) with a NaN
    or ±inf in some keys only, some values only, and both of one vector, on the short store's tile and
    (thresholds lowered) the 128-vector one, into a poisoned cache at shuffled slots: the oracle's bytes
    (the zero vector's where it reads zeros) and error flags."""
    import tqkern.ops.store.plan as plan_mod
    from tqkern.errors import ErrorFlag

    h, d, n = 4, 256, 24
    if large:
        monkeypatch.setattr(plan_mod, "SMALL_STORE_VECTORS", 64)
        monkeypatch.setattr(plan_mod, "WIDE_LARGE_VECTORS", 90)
    layout = _layout("tq4", d, h=h)
    plan = plan_store(layout, "bf16" if dtype == torch.bfloat16 else "fp16", has_mu=has_mu, vector_aligned=True,
                      num_vectors=n * h, interpret=DEV.type != "cuda")
    assert plan.columns == 64 and plan.block_vectors == (128 if large else 32)
    mu = (np.random.default_rng(6).standard_normal((h, d)) * 0.5).astype(np.float32) if has_mu else None
    params = tqkern.TQParams.default(layout.format, seed=6, key_offset=mu)
    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn(n, h, d, generator=g).to(dtype) for _ in range(2))
    bad = [float("nan"), float("inf"), -float("inf")]
    for i in range(0, n, 2):  # keys only, values only, both; the element anywhere in the row
        for t in ((k,), (v,), (k, v))[i % 3]:
            t[i, (i // 2) % h, (37 * i) % d] = bad[i % 3]
    tqt.read_errors(DEV)
    nb = -(-n // 16) + 2
    cache = torch.randint(0, 256, tuple(layout.cache_shape(nb)), dtype=torch.uint8, generator=g).to(DEV)
    slots = torch.randperm(nb * 16, generator=g)[:n]
    tqt.store(cache, k.to(DEV), v.to(DEV), slots.to(DEV), layout, to_device(params, DEV))
    flags = tqt.read_errors(DEV)
    got = ref.gather_slots(cache.cpu().numpy(), layout, slots.numpy())
    want, unsure, want_flags = ref.compress(k.double().numpy(), v.double().numpy(), params, return_uncertain=True,
                                            return_flags=True)
    assert not np.any((got != want) & ~unsure)
    assert int(flags) == int(want_flags) and want_flags & ErrorFlag.NONFINITE_INPUT


@needs_kernels
@pytest.mark.parametrize("d, cols", [(192, 64), (160, 0)])
def test_chunked_head_dims_below_their_padding_write_the_oracle_bytes(d, cols):
    """tq4 at head_dims that pad to 256: 192 (a multiple of the 64-column chunks: the column-chunked
    store, masked beyond head_dim) and 160 (not: S73's whole-row ``chunked`` product), keys minus μ,
    into a poisoned cache at shuffled slots: the oracle's bytes wherever it is certain."""
    layout = _layout("tq4", d, h=2)
    plan = plan_store(layout, has_mu=True, vector_aligned=True, num_vectors=24 * 2, interpret=DEV.type != "cuda")
    assert plan.rotation == "chunked" and dict(plan.constexprs)["COLS"] == plan.columns == cols
    _stores_oracle_bytes(layout, 24, True, seed=d)


def test_device_params_split_the_rotation_for_the_column_chunked_store():
    """``DeviceParams.rotation_parts`` (head_dim above 128, rotated formats): 16·Π in float32 rounded
    to fp16 (nearest, ties to even) and the rounding of what that leaves, computed here in NumPy;
    together within 2^-22 of 16·Π's largest element; none at head_dim 128 or for unrotated formats."""
    from tqkern.ops.store.triton import rotation_parts

    fmt = tqkern.KVFormat.preset("tq4", 256)
    params = tqkern.TQParams.default(fmt, seed=5)
    p = to_device(params, "cpu")
    r = np.asarray(params.rotation, np.float32) * np.float32(16.0)
    hi = r.astype(np.float16)
    lo = (r - hi.astype(np.float32)).astype(np.float16)
    assert p.rotation_parts.dtype == torch.float16 and p.rotation_parts.shape == (2, 256, 256)
    assert p.rotation_parts.is_contiguous()
    assert np.array_equal(p.rotation_parts[0].numpy(), hi) and np.array_equal(p.rotation_parts[1].numpy(), lo)
    assert np.count_nonzero(lo) > 0.9 * lo.size  # the second part carries bits nearly everywhere
    err = np.abs(hi.astype(np.float64) + lo.astype(np.float64) - np.asarray(params.rotation) * 16.0)
    assert err.max() <= 2.0**-22 * np.abs(r).max() + 2.0**-24  # (+ fp16's subnormal spacing of lo)
    assert torch.equal(rotation_parts(p.rotation), p.rotation_parts)
    with pytest.raises(TypeError, match="rotation must be a torch.Tensor, got ndarray"):
        rotation_parts(r)
    with pytest.raises(ValueError, match=r"rotation must be a square floating-point \[D, D\] tensor, got "
                                         r"torch.float32 \(256, 128\)"):
        rotation_parts(p.rotation[:, :128])
    assert to_device(tqkern.TQParams.default(tqkern.KVFormat.preset("tq4", 128), seed=5), "cpu").rotation_parts is None
    assert to_device(tqkern.TQParams.default(tqkern.KVFormat.preset("fp16", 256)), "cpu").rotation_parts is None


@needs_kernels
@pytest.mark.parametrize("has_mu", [False, True])
def test_the_column_chunked_store_makes_the_rotations_parts_when_the_params_lack_them(has_mu):
    """A ``DeviceParams`` without ``rotation_parts`` (a caller's own): the store makes them per call
    and writes the same bytes as with them, through both loop forms (unrolled with μ, pipelined
    without)."""
    layout = _layout("tq4", 256, h=2)
    mu = (np.random.default_rng(2).standard_normal((2, 256)) * 0.5).astype(np.float32) if has_mu else None
    p = to_device(tqkern.TQParams.default(layout.format, seed=2, key_offset=mu), DEV)
    plan = plan_store(layout, has_mu=has_mu, vector_aligned=True, num_vectors=40, interpret=DEV.type != "cuda")
    assert dict(plan.constexprs)["COL_STAGES"] == (0 if has_mu else WIDE_STAGES) and WIDE_STAGES > 0
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(20, 2, 256, generator=g).half().to(DEV) for _ in range(2))
    slots = torch.randperm(48, generator=g)[:20].to(DEV)
    caches = []
    for params in (p, dataclasses.replace(p, rotation_parts=None)):
        cache = torch.full(tuple(layout.cache_shape(3)), 0xA5, dtype=torch.uint8, device=DEV)
        tqt.store(cache, k, v, slots, layout, params)
        caches.append(cache.cpu())
    assert torch.equal(caches[0], caches[1])
    assert not torch.equal(caches[0], torch.full_like(caches[0], 0xA5))
    # the op itself (no DeviceParams to check them) refuses parts that its kernel would read past
    from tqkern_torch.library import layout_key

    for bad in (p.rotation_parts[:1].contiguous(), p.rotation_parts.float()):
        with pytest.raises(ValueError, match=r"rotation_parts must be a contiguous torch.float16 tensor of shape "
                                             r"\(2, 256, 256\), got"):
            torch.ops.tqkern.store(cache, k, v, slots, p.rotation, p.key_boundaries, p.key_centroids,
                                   p.value_boundaries, p.value_centroids, p.key_offset, layout_key(layout), False, True,
                                   p.key_offset_signed, bad)


def test_the_column_chunked_loop_is_pipelined_for_fp16_inputs_without_a_key_offset():
    """Session 75 (H200): 3 pipelined stages of the row-block loop won for fp16 inputs without μ on
    the 128- and 32-vector tiles (16K x 8 x 256 588.1 -> 518.7 us) and lost for bf16, μ and fp16 on
    the 64-vector tile, which keep the unrolled loop; plans of other methods carry 0."""
    lay = _layout("tq4", d=256)
    for dtype, has_mu, want in (("fp16", False, WIDE_STAGES), ("fp16", True, 0), ("bf16", False, 0),
                                ("bf16", True, 0)):
        for n in (None, 32, WIDE_LARGE_VECTORS - 1):
            plan = plan_store(lay, dtype, has_mu=has_mu, num_vectors=n)
            assert dict(plan.constexprs)["COL_STAGES"] == (0 if plan.block_vectors == 64 else want)
    assert dict(plan_store(_layout("tq4")).constexprs)["COL_STAGES"] == 0
