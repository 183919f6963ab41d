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
from tqkern.ops.store.plan import (ROTATIONS, SMALL_STORE_VECTORS, SPLIT_MIN_PROGRAMS, SPLIT_TILE, SPLIT_TILE_MU,
                                   WIDE_LARGE_VECTORS, StorePlan, plan_store, rotation_method, _split_tile)
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
    warps; raw fp16 takes RAW_TILE_ELEMENTS elements a tile (32 vectors at head_dim 128) x 8 warps (S76, H200)."""
    for arrangement in ("slot", "row"):
        k8 = plan_store(_layout("turboquant_k8v4", arrangement=arrangement))
        assert (k8.rotation, k8.block_vectors, k8.num_warps, k8.tiles) == ("none", 16, 4, 1)
    raw = plan_store(_layout("fp16"))
    assert (raw.rotation, raw.block_vectors, raw.num_warps, raw.tiles) == ("none", 32, 8, 1)
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
        want = (32, 8, 1) if preset == "fp16" else (16, 4, 1)  # (raw: RAW_TILE_ELEMENTS / 128 vectors)
        assert (short.block_vectors, short.num_warps, short.tiles) == want
    after = plan_store(_layout(preset), signed_sylvester=sylvester, num_vectors=SMALL_STORE_VECTORS + 1)
    assert after is long or long.rotation == "split"  # (a dense rotation's few vectors: the next test)
    for bad in (-1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="num_vectors must be None or an int >= 0"):
            plan_store(_layout(preset), num_vectors=bad)


@pytest.mark.parametrize("d, dtype, n, want", [
    (128, "fp16", None, (32, 4, 8)), (128, "fp16", 131072, (32, 4, 8)), (128, "fp16", 65536, (32, 4, 8)),
    (128, "fp16", 65535, (32, 4, 8)), (128, "fp16", 65280, (32, 4, 4)), (128, "fp16", 32768, (32, 4, 4)),
    (128, "fp16", 16384, (32, 4, 2)),
    (128, "fp16", 8192, (32, 4, 1)), (128, "fp16", SMALL_STORE_VECTORS + 1, (32, 4, 1)),
    (96, "fp16", 65536, (32, 4, 8)), (64, "fp16", 12288, (32, 4, 1)), (64, "fp16", 49152, (32, 4, 4)),
    (64, "bf16", 49152, (32, 4, 4)), (64, "bf16", None, (32, 4, 8)),
    (128, "bf16", None, (32, 4, 8)), (128, "bf16", 65536, (32, 4, 8)), (128, "bf16", 65280, (32, 4, 4)),
    (96, "bf16", 131072, (32, 4, 8)), (128, "bf16", SMALL_STORE_VECTORS + 1, (32, 4, 1)),
    (128, "mu", None, (16, 4, 8)), (128, "mu", 32768, (16, 4, 8)), (128, "mu", 32640, (16, 4, 4)),
    (64, "mu", 49152, (16, 4, 8)), (128, "mu", SMALL_STORE_VECTORS + 1, (16, 4, 1)),
    (128, "bf16+mu", 65280, (32, 4, 4)), (64, "bf16+mu", 49152, (16, 4, 8)), (96, "bf16+mu", None, (32, 4, 8)),
])
def test_a_dense_rotations_tile_by_dtype_key_offset_and_length(d, dtype, n, want):
    """A ``split`` store (tq4's dense Π) of more than SMALL_STORE_VECTORS vectors: 32 vectors x 4
    warps (16 x 4 for keys minus a key offset but bf16 above head_dim 64), and as many tiles a program
    (up to 8) as leave
    SPLIT_MIN_PROGRAMS programs (plan.py's docstring: the H200 sweeps of sessions 72 and 73); bf16
    inputs and key offsets on fp16 operands; by hand."""
    assert SPLIT_TILE == (32, 4, 8) and SPLIT_TILE_MU == (16, 4, 8) and SPLIT_MIN_PROGRAMS == 256
    has_mu = dtype.endswith("mu")
    in_dtype = "bf16" if dtype.startswith("bf16") else "fp16"
    layout = _layout("tq4", d, h=8)
    plan = plan_store(layout, in_dtype, has_mu=has_mu, vector_aligned=True, num_vectors=n)
    assert plan.rotation == "split" and (plan.block_vectors, plan.num_warps, plan.tiles) == want
    assert dict(plan.constexprs)["BV"] == want[0] and dict(plan.constexprs)["TILES"] == want[2]
    assert dict(plan.constexprs)["F16_ROT"] == (has_mu or in_dtype == "bf16")
    assert _split_tile(128 if d == 96 else d, in_dtype, has_mu, n) == want
    if n is not None:
        assert plan.grid(n // 8)[0] * plan.vectors_per_program >= n - 7
    small = plan_store(layout, in_dtype, has_mu=has_mu, num_vectors=SMALL_STORE_VECTORS)
    assert (small.block_vectors, small.num_warps, small.tiles) == (16, 4, 1)
    pm1 = plan_store(_layout("turboquant_4bit_nc", d if d != 96 else 128, h=8), in_dtype, has_mu=has_mu,
                     signed_sylvester=True, num_vectors=n)
    assert pm1.rotation == "pm1" and (pm1.block_vectors, pm1.tiles) == (64, 2)  # misaligned Hadamard inputs
    assert dict(pm1.constexprs)["F16_ROT"] == (has_mu or in_dtype == "bf16")  # (bf16 rows scaled since S77)
    with pytest.raises(ValueError, match="in_dtype must be 'fp16' or 'bf16'"):
        plan_store(layout, "fp32", num_vectors=n)


def _stores_oracle_bytes(layout, tokens: int, has_mu: bool, seed: int, dtype=torch.float16):
    """Store ``tokens`` random tokens (``dtype``) into ``layout``'s cache (a key offset μ if ``has_mu``),
    poisoned, at shuffled slots; assert the oracle's bytes wherever it is certain, and most certain."""
    h, d = layout.num_kv_heads, layout.head_dim
    mu = (np.random.default_rng(seed).standard_normal((h, d)) * 0.5).astype(np.float32) if has_mu else None
    params = tqkern.TQParams.default(layout.format, seed=seed, key_offset=mu)
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(tokens, h, d, generator=g).to(dtype) for _ in range(2))
    nb = (tokens + 15) // 16 + 2
    slots = torch.randperm(nb * 16, generator=g)[:tokens]
    cache = torch.randint(0, 256, tuple(layout.cache_shape(nb)), dtype=torch.uint8, generator=g).to(DEV)
    tqt.store(cache, k.to(DEV), v.to(DEV), slots.to(DEV), layout, to_device(params, DEV))
    got = ref.gather_slots(cache.cpu().numpy(), layout, slots.numpy())
    want, unsure = ref.compress(k.double().numpy(), v.double().numpy(), params, return_uncertain=True)
    assert not np.any((got != want) & ~unsure)
    assert unsure.mean() < 0.02


@needs_kernels
@pytest.mark.parametrize("d, tokens, dtype, min_programs, tiles", [
    (128, 522, torch.float16, None, 1), (128, 522, torch.float16, 4, 8), (64, 1366, torch.float16, 20, 4),
    pytest.param(64, 1366, torch.float16, None, 1, marks=needs_gpu),
    pytest.param(128, 522, torch.bfloat16, None, 1, marks=needs_gpu),
    pytest.param(128, 522, torch.bfloat16, 4, 8, marks=needs_gpu),
    pytest.param(64, 1366, torch.bfloat16, None, 1, marks=needs_gpu),
    (256, 40, torch.float16, None, 1), pytest.param(256, 522, torch.bfloat16, None, 1, marks=needs_gpu)])
def test_a_dense_rotations_tiles_write_the_oracle_bytes(d, tokens, dtype, min_programs, tiles, monkeypatch):
    """tq4 stores of just over SMALL_STORE_VECTORS vectors (one tile a program), and the same with
    SPLIT_MIN_PROGRAMS lowered so that programs take several tiles (the last one partial), into a
    poisoned cache at shuffled slots: the oracle's bytes wherever it is certain."""
    import tqkern.ops.store.plan as plan_mod

    if min_programs is not None:
        monkeypatch.setattr(plan_mod, "SPLIT_MIN_PROGRAMS", min_programs)
    h = 3 if d == 64 else 8
    layout = _layout("tq4", d, h=h)
    plan = plan_store(layout, "bf16" if dtype == torch.bfloat16 else "fp16", vector_aligned=True,
                      num_vectors=tokens * h, interpret=DEV.type != "cuda")
    assert plan.tiles == tiles and (tiles == 1 or (tokens * h) % plan.vectors_per_program)  # a partial last program
    _stores_oracle_bytes(layout, tokens, False, seed=d, dtype=dtype)


@pytest.mark.parametrize("d, want", [(64, 64), (128, 32), (256, 16)])
def test_raw_stores_tile_holds_a_fixed_number_of_elements(d, want):
    """Raw K/V (the ``fp16`` preset) take RAW_TILE_ELEMENTS / padded head_dim vectors a tile, at most 64."""
    for dtype in ("fp16", "bf16"):
        for n in (None, 8, SMALL_STORE_VECTORS, 10**6):
            plan = plan_store(_layout("fp16", d), dtype, vector_aligned=True, num_vectors=n)
            assert (plan.rotation, plan.block_vectors, plan.num_warps, plan.tiles) == ("none", want, 8, 1)


@pytest.mark.parametrize("preset, d, has_mu, rotation", [("tq4", 128, False, "split"), ("tq4", 128, True, "split"),
                                                        ("tq4", 256, True, "chunked"),
                                                        ("tqkern_k5v3", 96, False, "split"),
                                                        ("turboquant_4bit_nc", 256, True, "chunked")])
def test_tile_plans_search_half_of_a_symmetric_table(preset, d, has_mu, rotation):
    """The tile kernel takes the warp kernel's half-table Lloyd-Max search (session 72) wherever the
    caller vouches for antisymmetric tables: on every Lloyd-Max side of up to 5 bits, never on a
    uniform side, and never without ``symmetric_codebooks``."""
    layout = _layout(preset, d)
    for n in (None, SMALL_STORE_VECTORS, 65535):
        sym = plan_store(layout, has_mu=has_mu, num_vectors=n, symmetric_codebooks=True)
        whole = plan_store(layout, has_mu=has_mu, num_vectors=n)
        assert sym.kernel == whole.kernel == "tile" and sym.rotation == rotation
        fmt = layout.format
        assert dict(sym.constexprs)["K_SYM"] == isinstance(fmt.key, tqkern.LloydMax)
        assert dict(sym.constexprs)["V_SYM"] == isinstance(fmt.value, tqkern.LloydMax)
        assert not dict(whole.constexprs)["K_SYM"] and not dict(whole.constexprs)["V_SYM"]
        assert sym.describe().endswith(", half-table search") and "half" not in whole.describe()


@needs_kernels
@pytest.mark.parametrize("symmetric", [True, False])
def test_the_tile_kernels_lloyd_max_search_writes_the_oracle_bytes(symmetric):
    """tq4 through the tile kernel (a dense rotation) with the default, antisymmetric tables (the
    half-table search) and with lopsided ones (the whole table's), into a poisoned cache at
    shuffled slots, values and keys scaled so that every code is reached: the oracle's bytes
    wherever it is certain."""
    layout = _layout("tq4", 64, h=2)
    base = tqkern.TQParams.default(layout.format, seed=5)
    params = base
    if not symmetric:
        rng = np.random.default_rng(5)
        params = tqkern.TQParams(format=layout.format, rotation=base.rotation,
                                 key_codebook=tqkern.Codebook.from_centroids(np.sort(rng.normal(size=16)) / 8, dim=64),
                                 value_codebook=tqkern.Codebook.from_centroids(
                                     base.value_codebook.centroids + 0.01, dim=64))
    dp = to_device(params, DEV)
    assert dp.symmetric_codebooks == symmetric
    n = 96
    plan = plan_store(layout, signed_sylvester=False, vector_aligned=True, num_vectors=n * 2,
                      interpret=DEV.type != "cuda", symmetric_codebooks=dp.symmetric_codebooks)
    assert plan.kernel == "tile" and dict(plan.constexprs)["K_SYM"] == symmetric
    g = torch.Generator().manual_seed(11)
    k, v = (torch.randn(n, 2, 64, generator=g) * torch.rand(n, 2, 1, generator=g) * 8 for _ in range(2))
    k, v = k.half(), v.half()
    slots = torch.randperm(128, generator=g)[:n]
    cache = torch.randint(0, 256, tuple(layout.cache_shape(8)), dtype=torch.uint8, generator=g).to(DEV)
    tqt.store(cache, k.to(DEV), v.to(DEV), slots.to(DEV), layout, dp)
    got = ref.gather_slots(cache.cpu().numpy(), layout, slots.numpy())
    want, unsure = ref.compress(k.float().numpy(), v.float().numpy(), params, return_uncertain=True)
    assert not np.any((got != want) & ~unsure)
    fmt = layout.format
    for x, codec, cb in ((k, fmt.key, params.key_codebook), (v, fmt.value, params.value_codebook)):
        codes = ref.quantize(x.float().numpy(), codec, rotation=params.rotation, codebook=cb).codes
        assert np.unique(codes).size == 16  # every code of the side is written


def test_wide_head_dim_takes_the_chunked_path_and_a_key_offset_fp16_operands():
    assert rotation_method(_layout("turboquant_4bit_nc", d=256), False, True, False) == "chunked"
    assert rotation_method(_layout("turboquant_4bit_nc", d=256), True, True, False) == "chunked"
    # Since session 73 a key offset on a rotated key keeps the tile kernel's product, on fp16 operands
    # (x − μ in two parts) whatever the input dtype; chunked at head_dim 256 as without one.
    for dtype in ("fp16", "bf16"):
        for layout, sylvester, rot in ((_layout("tq4"), False, "split"), (_layout("tqkern_k5v3"), True, "pm1"),
                                       (_layout("tq4", d=96), False, "split")):
            plan = plan_store(layout, dtype, has_mu=True, signed_sylvester=sylvester)
            assert plan.rotation == rot and dict(plan.constexprs)["F16_ROT"]
            assert "fp16 operands" in plan.describe()
            plain = plan_store(layout, dtype, signed_sylvester=sylvester)  # (bf16: fp16 operands too, pm1 since S77)
            assert dict(plain.constexprs)["F16_ROT"] == (dtype == "bf16")
        assert not dict(plan_store(_layout("tq4", d=256), dtype, has_mu=True).constexprs)["F16_ROT"]
        for n in (None, 32, SMALL_STORE_VECTORS + 1):  # short stores too
            # Lloyd-Max sides take Π's columns 64 at a time over 64-row blocks, 64 vectors x 8 warps (a short
            # store: 32 vectors; from WIDE_LARGE_VECTORS vectors: 128) (sessions 74, 75)
            wide = plan_store(_layout("tq4", d=256), dtype, has_mu=True, num_vectors=n)
            cx = dict(wide.constexprs)
            bv = 32 if n == 32 else 128 if n is None else 64
            assert (wide.block_vectors, wide.num_warps, wide.tiles, cx["KC"], cx["COLS"]) == (bv, 8, 1, 64, 64)
            assert plan_store(_layout("tq4", d=256), dtype, num_vectors=WIDE_LARGE_VECTORS).block_vectors == 128
            assert plan_store(_layout("tq4", d=256), dtype, num_vectors=WIDE_LARGE_VECTORS - 1).block_vectors == 64
            assert "columns 64 at a time" in wide.describe()
            # a rotated side of another kind needs the whole row of y: 16 vectors x 8 warps at KC = 32 (session 73)
            fmt = tqkern.KVFormat(head_dim=256, key=tqkern.LloydMax(bits=4), value=tqkern.Uniform(bits=4, rotated=True))
            lay = tqkern.PagedLayout(format=fmt, num_kv_heads=2, block_size=16)
            row = plan_store(lay, dtype, has_mu=True, num_vectors=n)
            cx = dict(row.constexprs)
            assert (row.block_vectors, row.num_warps, row.tiles, cx["KC"], cx["COLS"]) == (16, 8, 1, 32, 0)
            assert row.rotation == "chunked" and "columns" not in row.describe()
    # A key offset on an unrotated key leaves the value's rotation alone.
    fmt = tqkern.KVFormat(head_dim=64, key=tqkern.Uniform(bits=4), value=tqkern.LloydMax(bits=4))
    lay = tqkern.PagedLayout(format=fmt, num_kv_heads=2, block_size=16)
    assert rotation_method(lay, True, True, False) == "pm1"
    assert not dict(plan_store(lay, has_mu=True, signed_sylvester=True).constexprs)["F16_ROT"]


@needs_kernels
@pytest.mark.parametrize("preset, d, sylvester, dtype", [
    ("tq4", 128, False, torch.float16), ("tqkern_k5v3", 64, True, torch.float16),
    pytest.param("tq4", 128, False, torch.bfloat16, marks=needs_gpu),
    pytest.param("tqkern_k5v3", 128, True, torch.bfloat16, marks=needs_gpu),
    ("tq4", 256, False, torch.float16), ("tqkern_k5v3", 256, True, torch.float16),
    pytest.param("tq4", 256, False, torch.bfloat16, marks=needs_gpu)])
def test_a_key_offset_at_every_scale_of_x_minus_mu_writes_the_oracle_bytes(preset, d, sylvester, dtype):
    """Keys minus μ through the tile kernel's fp16 operands (each row scaled by a power of two, then
    split in two parts) at the scales the scaling must survive: x − μ beyond fp16's range (keys near
    ±60000, μ of the opposite sign), around 1, and far below fp16's subnormals (zero keys, μ down to
    float32's subnormals), rows of each in one store into a poisoned cache at shuffled slots: the
    oracle's bytes wherever it is certain, and most bytes certain. (Before session 73's fp16 operands,
    float32 rows of x − μ below ~2^-126 overflowed the reciprocal of their norm: garbage codes.)"""
    h, n = 2, 48
    layout = _layout(preset, d, h=h)
    rng = np.random.default_rng(d)
    scales = np.array([2.0**-140, 2.0**-120, 2.0**-60, 2.0**-20, 1.0, 2.0**10])
    mu = (rng.standard_normal((h, d)) * 0.5).astype(np.float32)
    k = rng.standard_normal((n, h, d)).astype(np.float32)
    # rows 0-11 huge: k near +-60000 with mu's sign opposite (|x - mu| up to ~1.2e5, beyond fp16)
    k[:12] = np.sign(k[:12]) * 60000.0
    mu_big = -np.sign(k[0]) * 60000.0 * (0.5 + rng.random((h, d)))
    # rows 12-47: zero keys (x − μ = −μ, μ tiny) or ordinary ones, μ scaled per head below
    k[12:30] = 0.0
    params = tqkern.TQParams.default(layout.format, seed=2, key_offset=mu)
    plan = plan_store(layout, "bf16" if dtype == torch.bfloat16 else "fp16", has_mu=True, signed_sylvester=sylvester,
                      num_vectors=n * h, interpret=DEV.type != "cuda")
    cx = dict(plan.constexprs)
    assert plan.kernel == "tile" and (cx["F16_ROT"] if d <= 128 else cx["COLS"] == 64)  # (256: Π's columns)
    for scale in scales:
        m = (mu * scale).astype(np.float32)
        if scale == 2.0**10:
            m = mu_big.astype(np.float32)
        p = tqkern.TQParams(format=layout.format, rotation=params.rotation, key_codebook=params.key_codebook,
                            value_codebook=params.value_codebook, key_offset=m)
        kt = torch.from_numpy(k).to(dtype)
        vt = torch.from_numpy(rng.standard_normal((n, h, d)).astype(np.float32)).to(dtype)
        nb = n // 16 + 2
        slots = torch.from_numpy(rng.permutation(nb * 16)[:n].astype(np.int64))
        cache = torch.from_numpy(rng.integers(0, 256, size=layout.cache_shape(nb), dtype=np.uint8)).to(DEV)
        tqt.store(cache, kt.to(DEV), vt.to(DEV), slots.to(DEV), layout, to_device(p, DEV))
        got = ref.gather_slots(cache.cpu().numpy(), layout, slots.numpy())
        want, unsure = ref.compress(kt.double().numpy(), vt.double().numpy(), p, return_uncertain=True)
        bad = (got != want) & ~unsure
        assert not bad.any(), f"scale 2^{np.log2(scale):.0f}: {int(bad.sum())} certain bytes differ"
        assert unsure.mean() < 0.1  # (tqkern_k5v3's stored norm is uncertain with any of its 64 codes: ~4%)


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
