"""The store plan (``tqkern/ops/store/plan.py``): which rotation method each layout and parameter
set gets, the grid, bad input; and the two store paths the random property tests reach only by
chance: uniform codes at exact halves (the float64 fix-up) and the ``pm1`` rotation against a
dense one on the same Hadamard matrix."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.ops.launch import BoundedCache
from tqkern.ops.store.plan import (ROTATIONS, SMALL_STORE_VECTORS, SPLIT_FEW_VECTORS, StorePlan, plan_store,
                                   rotation_method)
from tqkern_torch._params import to_device
from tqkern_torch.testing import device_under_test, kernels_available

DEV = device_under_test()
needs_kernels = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")
needs_gpu = pytest.mark.skipif(DEV.type != "cuda", reason="GPU only (bf16; or head_dim 64's 16 x 4 x 1 tile, the short "
                                                           "stores' own, on 257 programs: 13 s in the interpreter)")


def _layout(preset, d=128, h=8, arrangement="slot"):
    return tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, d), num_kv_heads=h, block_size=16,
                              arrangement=arrangement)


@pytest.mark.parametrize("preset, sylvester, want", [
    ("turboquant_4bit_nc", True, "pm1"), ("tqkern_k5v3", True, "pm1"), ("tq4", False, "split"),
    ("turboquant_4bit_nc", False, "split"), ("turboquant_k8v4", False, "none"), ("fp16", True, "none"),
])
def test_rotation_method_per_preset(preset, sylvester, want):
    assert rotation_method(_layout(preset), False, sylvester, False) == want
    assert plan_store(_layout(preset), signed_sylvester=sylvester).rotation == want


def test_unrotated_quantized_codes_take_the_small_tile():
    """Measured on the H100 (plan.py's docstring): k8v4 stores 1.8x faster in 16-vector tiles of 4
    warps; raw fp16 keeps 64 vectors x 8 warps."""
    for arrangement in ("slot", "row"):
        k8 = plan_store(_layout("turboquant_k8v4", arrangement=arrangement))
        assert (k8.rotation, k8.block_vectors, k8.num_warps, k8.tiles) == ("none", 16, 4, 1)
    raw = plan_store(_layout("fp16"))
    assert (raw.rotation, raw.block_vectors, raw.num_warps, raw.tiles) == ("none", 64, 8, 1)
    nc = plan_store(_layout("turboquant_4bit_nc"), signed_sylvester=True)
    assert (nc.block_vectors, nc.num_warps, nc.tiles) == (64, 8, 2)


@pytest.mark.parametrize("preset, sylvester", [("turboquant_4bit_nc", True), ("tq4", False), ("tqkern_k5v3", True),
                                               ("turboquant_k8v4", False), ("fp16", True)])
def test_short_stores_take_the_small_tile(preset, sylvester):
    """Up to SMALL_STORE_VECTORS (token, head) vectors every quantizing plan runs 16 vectors x 4
    warps x 1 tile (measured 3-7x faster on the H100 for a decode step: plan.py's docstring);
    longer stores and raw fp16 keep their tile. The rotation method does not change."""
    long = plan_store(_layout(preset), signed_sylvester=sylvester)
    for n in (0, 1, SMALL_STORE_VECTORS):
        short = plan_store(_layout(preset), signed_sylvester=sylvester, num_vectors=n)
        assert short.rotation == long.rotation
        want = (64, 8, 1) if preset == "fp16" else (16, 4, 1)
        assert (short.block_vectors, short.num_warps, short.tiles) == want
    after = plan_store(_layout(preset), signed_sylvester=sylvester, num_vectors=SMALL_STORE_VECTORS + 1)
    assert after is long or long.rotation == "split"  # (a dense rotation's few vectors: the next test)
    for bad in (-1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="num_vectors must be None or an int >= 0"):
            plan_store(_layout(preset), num_vectors=bad)


@pytest.mark.parametrize("d, want", [(64, (16, 4, 1)), (128, (64, 8, 1))])
def test_dense_rotations_of_few_vectors_take_one_tile_a_program(d, want):
    """A ``split`` store (tq4's dense Π) of more than SMALL_STORE_VECTORS and fewer than
    SPLIT_FEW_VECTORS vectors runs one tile a program (plan.py's docstring: 31-64% faster on an
    H200 at 12K-49K vectors); from SPLIT_FEW_VECTORS, and for long stores, four 64-vector tiles."""
    layout = _layout("tq4", d, h=3)
    long = plan_store(layout, vector_aligned=True)
    assert long.rotation == "split" and (long.block_vectors, long.num_warps, long.tiles) == (64, 8, 4)
    for n in (SMALL_STORE_VECTORS + 1, SPLIT_FEW_VECTORS - 1):
        few = plan_store(layout, vector_aligned=True, num_vectors=n)
        assert few.rotation == "split" and (few.block_vectors, few.num_warps, few.tiles) == want
        assert dict(few.constexprs)["BV"] == want[0] and dict(few.constexprs)["TILES"] == 1
    assert plan_store(layout, vector_aligned=True, num_vectors=SPLIT_FEW_VECTORS) is long
    pm1 = plan_store(_layout("turboquant_4bit_nc", d, h=3), signed_sylvester=True, num_vectors=SPLIT_FEW_VECTORS - 1)
    assert pm1.rotation == "pm1" and pm1.tiles == 2  # (misaligned inputs of a Hadamard preset: not timed, unchanged)


@needs_kernels
@pytest.mark.parametrize("d, tokens, dtype", [(128, 520, torch.float16),
                                              pytest.param(64, 1366, torch.float16, marks=needs_gpu),
                                              pytest.param(128, 520, torch.bfloat16, marks=needs_gpu),
                                              pytest.param(64, 1366, torch.bfloat16, marks=needs_gpu)])
def test_a_dense_rotations_few_vector_tile_writes_the_oracle_bytes(d, tokens, dtype):
    """tq4 stores of just over SMALL_STORE_VECTORS vectors (one tile a program: 16 x 4 at head_dim
    64, 64 x 8 at 128) into a poisoned cache at shuffled slots: the oracle's bytes wherever it is
    certain."""
    h = 3 if d == 64 else 8
    layout = _layout("tq4", d, h=h)
    assert plan_store(layout, "bf16" if dtype == torch.bfloat16 else "fp16", vector_aligned=True,
                      num_vectors=tokens * h).tiles == 1
    params = tqkern.TQParams.default(layout.format, seed=3)
    g = torch.Generator().manual_seed(d)
    k, v = (torch.randn(tokens, h, d, generator=g).to(dtype) for _ in range(2))
    nb = (tokens + 15) // 16 + 2
    slots = torch.randperm(nb * 16, generator=g)[:tokens]
    cache = torch.randint(0, 256, tuple(layout.cache_shape(nb)), dtype=torch.uint8, generator=g).to(DEV)
    tqt.store(cache, k.to(DEV), v.to(DEV), slots.to(DEV), layout, to_device(params, DEV))
    got = ref.gather_slots(cache.cpu().numpy(), layout, slots.numpy())
    want, unsure = ref.compress(k.float().numpy(), v.float().numpy(), params, return_uncertain=True)
    assert not np.any((got != want) & ~unsure)
    assert unsure.mean() < 0.02


def test_wide_head_dim_and_key_offset_take_the_chunked_path():
    assert rotation_method(_layout("turboquant_4bit_nc", d=256), False, True, False) == "chunked"
    assert rotation_method(_layout("tq4"), True, False, False) == "chunked"
    # A key offset on an unrotated key leaves the value's rotation alone.
    fmt = tqkern.KVFormat(head_dim=64, key=tqkern.Uniform(bits=4), value=tqkern.LloydMax(bits=4))
    lay = tqkern.PagedLayout(format=fmt, num_kv_heads=2, block_size=16)
    assert rotation_method(lay, True, True, False) == "pm1"


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tqkern_k5v3", "tq4"])
def test_device_params_know_a_signed_sylvester_rotation(preset):
    fmt = tqkern.KVFormat.preset(preset, 128)
    p = to_device(tqkern.TQParams.default(fmt, seed=3), "cpu")
    assert p.signed_sylvester == (fmt.rotation != "haar")


@pytest.mark.parametrize("preset", ["k5v4h", "tqkern_k5v3", "tq4"])  # signed rotations (turboquant_*: unsigned)
def test_device_params_sign_the_key_offset_for_the_warp_kernel(preset):
    """The warp store kernel subtracts ``s ⊙ μ`` (``s_i = sign(Π[i, 0])``) from the sign-flipped
    keys, so ``DeviceParams.key_offset_signed`` must be exactly that product, from the rotation's
    own first column (the Hadamard presets' ``pm1`` signs), and every other μ table unchanged."""
    from tqkern.ops.store.triton import signed_key_offset

    fmt = tqkern.KVFormat.preset(preset, 64)
    mu = np.random.default_rng(1).normal(0.0, 0.5, (3, 64))
    params = tqkern.TQParams.default(fmt, seed=3, key_offset=mu)
    p = to_device(params, "cpu")
    s = np.where(np.asarray(params.rotation)[:, 0] > 0, 1.0, -1.0)  # float64 Π: same signs as float32
    assert set(np.unique(s)) == {-1.0, 1.0}  # both signs occur: the test can tell μ ⊙ s from μ
    want = params.key_offset.astype(np.float32) * s.astype(np.float32)
    assert p.key_offset_signed.dtype == torch.float32 and p.key_offset_signed.is_contiguous()
    assert np.array_equal(p.key_offset_signed.numpy(), want)
    assert np.array_equal(p.key_offset.numpy(), params.key_offset.astype(np.float32))
    assert torch.equal(signed_key_offset(p.key_offset, p.rotation), p.key_offset_signed)
    assert to_device(tqkern.TQParams.default(fmt, seed=3), "cpu").key_offset_signed is None


def test_plan_grid_constexprs_and_description():
    plan = plan_store(_layout("tqkern_k5v3", h=8), signed_sylvester=True)
    assert isinstance(plan, StorePlan) and plan.rotation in ROTATIONS
    per = plan.vectors_per_program
    assert plan.grid(1) == (1,)
    assert plan.grid(per // 8) == (1,) and plan.grid(per // 8 + 1) == (2,)
    kw = plan.kwargs()
    assert kw["BV"] == plan.block_vectors and kw["TILES"] == plan.tiles and kw["num_warps"] == plan.num_warps
    assert kw["ROT"] == ROTATIONS.index("pm1") and kw["H"] == 8 and kw["HW_FP8"]
    assert not plan_store(_layout("tqkern_k5v3"), interpret=True).kwargs()["HW_FP8"]
    assert "pm1" in plan.describe()
    assert plan_store(_layout("tqkern_k5v3", h=8), signed_sylvester=True) is plan  # cached
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tiles = 3


@pytest.mark.parametrize("preset, d", [("k5v4h", 128), ("turboquant_4bit_nc", 128), ("tqkern_k5v3", 256),
                                      ("turboquant_3bit_nc", 64)])
def test_warp_kernel_caps_registers_for_bf16_inputs_without_a_key_offset(preset, d):
    """The warp kernel compiles bf16 inputs under ``WARP_STORE_MAXNREG_BF16`` registers (measured
    faster on the H200); fp16 inputs, a key offset and the tile kernel keep Triton's choice. The
    cap is a launch option (``kwargs``) and ``describe`` names it."""
    from tqkern.ops.store.plan import WARP_STORE_MAXNREG_BF16

    layout = _layout(preset, d)
    bf16 = plan_store(layout, "bf16", signed_sylvester=True, vector_aligned=True)
    assert bf16.kernel == "warp" and bf16.maxnreg == WARP_STORE_MAXNREG_BF16 == 128
    assert bf16.kwargs()["maxnreg"] == 128 and "<= 128 registers" in bf16.describe()
    for plan in (plan_store(layout, "bf16", has_mu=True, signed_sylvester=True, vector_aligned=True),
                 plan_store(layout, "bf16", signed_sylvester=True)):  # (inputs not aligned: the tile kernel)
        assert plan.maxnreg is None and "maxnreg" not in plan.kwargs() and "registers" not in plan.describe()


@pytest.mark.parametrize("preset, d, cap", [("k5v4h", 128, 112), ("k4v2h", 128, 112), ("tqkern_k5v3", 128, 112),
                                           ("k4v3h", 128, 112), ("k5v4h", 64, None), ("k5v4h", 256, None),
                                           ("tqkern_k5v3", 256, None), ("turboquant_4bit_nc", 128, None),
                                           ("turboquant_3bit_nc", 128, None), ("turboquant_k8v4", 128, None)])
def test_warp_kernel_caps_fp16_inputs_of_stored_correction_formats_at_head_dim_128(preset, d, cap):
    """fp16 inputs without a key offset: ``WARP_STORE_MAXNREG_STORED`` (112) registers where both
    sides are Lloyd-Max with a stored norm correction at head_dim 128 (measured faster on the H200,
    session 56), Triton's choice elsewhere (the uncorrected presets measured slower capped; other
    head_dims untimed); a key offset keeps Triton's choice."""
    from tqkern.ops.store.plan import WARP_STORE_MAXNREG_STORED

    assert WARP_STORE_MAXNREG_STORED == 112
    layout = _layout(preset, d)
    fp16 = plan_store(layout, "fp16", signed_sylvester=True, vector_aligned=True)
    assert fp16.kernel == "warp" and fp16.maxnreg == cap
    assert ("maxnreg" in fp16.kwargs()) == (cap is not None)
    assert ("<= 112 registers" in fp16.describe()) == (cap is not None)
    mu = plan_store(layout, "fp16", has_mu=True, signed_sylvester=True, vector_aligned=True)
    assert mu.maxnreg is None and "maxnreg" not in mu.kwargs()


def test_plan_rejects_bad_input():
    with pytest.raises(TypeError, match="layout"):
        plan_store(tqkern.KVFormat.preset("tq4", 128))
    with pytest.raises(ValueError, match="in_dtype"):
        plan_store(_layout("tq4"), "fp32")
    for flag in ("has_mu", "signed_sylvester", "interpret", "vector_aligned", "symmetric_codebooks"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool, got int"):
            plan_store(_layout("turboquant_4bit_nc"), **{flag: 1})


@needs_kernels
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_uniform_codes_at_exact_halves_round_up(bits):
    # Values on the half-way points of a uniform grid: every code is a tie that float32 cannot
    # decide, so the tile takes the exact float64 path; the bytes must be the oracle's, all certain.
    d, h, n = 64, 2, 40
    levels = (1 << bits) - 1
    fmt = tqkern.KVFormat(head_dim=d, key=tqkern.Raw(), value=tqkern.Uniform(bits=bits))
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=h, block_size=8)
    params = tqkern.TQParams.default(fmt)
    rng = np.random.default_rng(bits)
    q = rng.integers(0, levels, size=(n, h, d)) + 0.5
    q[..., 0], q[..., 1] = 0, levels  # lo = 0, hi = levels: t = the value itself
    scale = 2.0 ** rng.integers(-6, 3, size=(n, h, 1))
    v = (q * scale).astype(np.float16)
    assert np.array_equal(v.astype(np.float64), q * scale)  # exact in fp16
    k = rng.standard_normal((n, h, d)).astype(np.float16)
    cache = tqt.allocate_cache(layout, n // 8, DEV)
    tqt.store(cache, torch.from_numpy(k).to(DEV), torch.from_numpy(v).to(DEV), torch.arange(n, device=DEV),
              layout, params)
    got = cache.cpu().numpy().reshape(n, h, fmt.slot_bytes)
    want, unsure = ref.compress(k, v, params, return_uncertain=True)
    assert not unsure.any()
    assert np.array_equal(got, want)


@needs_kernels
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tqkern_k5v3"])
def test_pm1_rotation_writes_the_bytes_of_the_dense_rotation(preset):
    # The same Hadamard Π, once recognised (pm1) and once as a dense matrix (split): both must
    # give the oracle's bytes, so they agree wherever the oracle is certain.
    d, h, n = 128, 3, 48
    fmt = tqkern.KVFormat.preset(preset, d)
    params = tqkern.TQParams.default(fmt, seed=5)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=h, block_size=16)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(n, h, d, generator=g).half() for _ in range(2))
    dense = to_device(params, DEV)
    assert dense.signed_sylvester
    dense = dataclasses.replace(dense, signed_sylvester=False)
    out = []
    for p in (params, dense):
        cache = tqt.allocate_cache(layout, n // 16, DEV)
        tqt.store(cache, k.to(DEV), v.to(DEV), torch.arange(n, device=DEV), layout, p)
        out.append(cache.cpu().numpy().reshape(n, h, fmt.slot_bytes))
    want, unsure = ref.compress(k.numpy(), v.numpy(), params, return_uncertain=True)
    for got in out:
        assert not np.any((got != want) & ~unsure)
    assert unsure.mean() < 0.02


@needs_kernels
def test_a_repeated_store_reuses_its_launcher_and_the_cache_is_bounded(monkeypatch):
    """A store of the same plan and grid (a decode step's) takes the launcher built by the first
    call; a new grid builds another; the table never grows past its bound."""
    import tqkern.ops.store.triton as store_triton

    monkeypatch.setattr(store_triton, "_LAUNCHERS", BoundedCache(2))
    fmt = tqkern.KVFormat.preset("turboquant_k8v4", 32)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=2, block_size=16)
    params = to_device(tqkern.TQParams.default(fmt, seed=1), DEV)
    cache = tqt.allocate_cache(layout, 40, DEV)
    g = torch.Generator().manual_seed(0)
    for n in (4, 4, 100, 600):
        k, v = (torch.randn(n, 2, 32, generator=g).half().to(DEV) for _ in range(2))
        tqt.store(cache, k, v, torch.arange(n, device=DEV), layout, params)
        if n == 4:
            first = dict(store_triton._LAUNCHERS)
            assert len(first) == 1
    plan = next(iter(first))[0]
    assert plan.grid(4) != plan.grid(100) != plan.grid(600)
    # the first grid went first when the third arrived
    assert [key[1] for key in store_triton._LAUNCHERS] == [plan.grid(100), plan.grid(600)]
    want = ref.compress(k.cpu().numpy(), v.cpu().numpy(), params.params)
    got = cache.cpu().numpy().reshape(-1, 2, fmt.slot_bytes)[:600]
    assert np.array_equal(got, want)
