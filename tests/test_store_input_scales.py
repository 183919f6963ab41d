"""Key and value rows at the ends of their dtype's range store the oracle's bytes.

The store kernels sum squares in float32 where a float16 norm allows it (the warp kernel's
``_sum_sq_f32``) and scale rows by powers of two before fp16 products (the tile kernel's
``F16_ROT``, the column-chunked store): rows whose squares underflow or overflow float32 — bf16
elements below ~2^-63 (2^-133 at the subnormal end) or above ~2^64 — and float16 subnormal rows
are the inputs where those shortcuts could differ from the oracle's float64 arithmetic. Each row
here is a standard normal vector times one power of two from the dtype's range (subnormals
included), keys and values at different scales, into a poisoned cache at shuffled slots: the
oracle's bytes wherever it is certain, and its error flags. bf16 runs on the GPU only (the interpreter has no bf16).
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.errors import ErrorFlag
from tqkern.ops import fields
from tqkern.ops.store.triton import vectors_aligned
from tqkern_torch.errors import read_errors
from tqkern_torch.testing import device_under_test, kernels_available

DEV = device_under_test()
pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")

# powers of two whose rows stay finite in the dtype (a standard normal element reaches ~4.5 here)
SCALES = {
    torch.float16: [-24, -20, -14, -8, 0, 8, 13],
    torch.bfloat16: [-133, -128, -120, -100, -70, -64, -40, 0, 40, 64, 70, 100, 120, 125],
}


def _rows(n: int, h: int, d: int, exps: list, rng) -> np.ndarray:
    """``[n, h, d]`` float32: row (t, hh) is a standard normal vector times 2^exps[(t·h + hh) % len]."""
    x = rng.standard_normal((n, h, d))
    e = np.array([exps[i % len(exps)] for i in range(n * h)], np.float64).reshape(n, h, 1)
    return (x * np.exp2(e)).astype(np.float32)


def _store_rows_at_every_scale(preset: str, d: int, dtype: torch.dtype, misaligned: bool, mu: bool = False):
    """Rows at every scale of ``dtype`` stored into a poisoned cache at shuffled slots: the oracle's
    certain bytes and its flags. ``misaligned``: K/V views starting 2 bytes into their storage (the
    tile kernel; vector-aligned inputs of a Hadamard preset take the warp kernel). ``mu``: with a key
    offset μ ~ N(0, 0.5²)."""
    h = 2
    exps = SCALES[dtype]
    n = 2 * len(exps)
    rng = np.random.default_rng(d)
    fmt = tqkern.KVFormat.preset(preset, d)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=h, block_size=16)
    params = tqkern.TQParams.default(fmt, seed=3, key_offset=rng.normal(0.0, 0.5, (h, d)) if mu else None)
    k = torch.from_numpy(_rows(n, h, d, exps, rng)).to(dtype)
    v = torch.from_numpy(_rows(n, h, d, exps[::-1], rng)).to(dtype)
    assert torch.isfinite(k.float()).all() and torch.isfinite(v.float()).all()
    assert (k.float().abs().amax(-1) > 0).all()  # every row holds a nonzero element
    nb = n // 16 + 2
    slots = torch.from_numpy(rng.permutation(nb * 16)[:n].astype(np.int64))
    cache = torch.from_numpy(rng.integers(0, 256, size=layout.cache_shape(nb), dtype=np.uint8)).to(DEV)
    dp = tqt.to_device(params, DEV)
    kd, vd = k.to(DEV), v.to(DEV)
    if misaligned:
        kd = torch.cat([torch.zeros_like(kd[..., :1]), kd], -1)[..., 1:]
        vd = torch.cat([torch.zeros_like(vd[..., :1]), vd], -1)[..., 1:]
        assert not vectors_aligned(kd) and not vectors_aligned(vd) and torch.equal(kd.cpu(), k)
    read_errors(DEV)  # (clears the device's error word)
    tqt.store(cache, kd, vd, slots.to(DEV), layout, dp)
    flags = read_errors(DEV)
    _, want_flags = ref.store(np.zeros(layout.cache_shape(nb), np.uint8), k.double().numpy(), v.double().numpy(),
                              slots.numpy(), layout, params, return_flags=True)
    assert flags == ErrorFlag(int(want_flags))  # (SATURATED where a float16 norm overflows)
    got = ref.gather_slots(cache.cpu().numpy(), layout, slots.numpy())
    want, unsure = ref.compress(k.double().numpy(), v.double().numpy(), params, return_uncertain=True)
    bad = (got != want) & ~unsure
    rows = sorted({(int(t), int(hh)) for t, hh in zip(*np.nonzero(bad.any(-1)))})
    assert not rows, (f"{preset} {dtype}: certain bytes differ at (token, head) {rows[:6]}, key exponents "
                      f"{[exps[(t * h + hh) % len(exps)] for t, hh in rows[:6]]}")
    assert unsure.mean() < 0.1


@pytest.mark.parametrize("preset, d", [("turboquant_4bit_nc", 128), ("tqkern_k5v3", 128), ("k5v4h", 64),
                                       ("turboquant_k8v4", 64), ("turboquant_k8v4", 128), ("tq4", 128),
                                       ("tq4", 256)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_rows_at_every_scale_of_the_input_dtype_store_the_oracles_bytes(preset, d, dtype):
    if dtype == torch.bfloat16 and DEV.type != "cuda":
        pytest.skip("the interpreter has no bf16")
    _store_rows_at_every_scale(preset, d, dtype, misaligned=False)


@pytest.mark.parametrize("preset, d", [("turboquant_4bit_nc", 128), ("tqkern_k5v3", 128), ("k5v4h", 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_rows_at_every_scale_with_a_key_offset_store_the_oracles_bytes(preset, d, dtype):
    # x − μ (session 78: the warp kernel scales bf16 vectors of ‖x − μ‖ above 2^50 before its
    # transform, float16 and float32 norms deciding alike)
    if dtype == torch.bfloat16 and DEV.type != "cuda":
        pytest.skip("the interpreter has no bf16")
    _store_rows_at_every_scale(preset, d, dtype, misaligned=False, mu=True)


# the tile kernel's other rotations: a signed Hadamard's ±1 operand (pm1: misaligned inputs of a
# Hadamard preset), whole-row chunks at a head_dim above 128 that is not a multiple of 64 (chunked)
@pytest.mark.parametrize("preset, d", [("turboquant_4bit_nc", 128), ("tqkern_k5v3", 128), ("k5v4h", 64),
                                       ("tq4", 160), ("turboquant_3bit_nc", 160)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_misaligned_rows_at_every_scale_store_the_oracles_bytes(preset, d, dtype):
    if dtype == torch.bfloat16 and DEV.type != "cuda":
        pytest.skip("the interpreter has no bf16")
    _store_rows_at_every_scale(preset, d, dtype, misaligned=True)


@pytest.mark.parametrize("preset, d, misaligned", [("turboquant_k8v4", 128, False), ("turboquant_k8v4", 64, False),
                                                   ("turboquant_4bit_nc", 128, False),
                                                   ("turboquant_4bit_nc", 128, True)])
def test_bf16_values_spanning_beyond_float32s_range_store_the_oracles_bytes(preset, d, misaligned):
    # A uniform side's span hi − lo of bf16 rows reaches 2^129: beyond float32 (so y − lo may
    # overflow), and (y − lo)·(2^b − 1) beyond it from ~2^124 (session 78: the tile kernel's
    # float64 fall-back took a float32 estimate of it, and every code came out 2^b − 1). Values
    # with elements near ±2^127, the warp kernel (aligned, head_dim 128), the tile kernel (64,
    # misaligned); each row's value scale saturates (SATURATED).
    if DEV.type != "cuda":
        pytest.skip("the interpreter has no bf16")
    h, n = 2, 40
    rng = np.random.default_rng(d + misaligned)
    fmt = tqkern.KVFormat.preset(preset, d)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=h, block_size=16)
    params = tqkern.TQParams.default(fmt, seed=5)
    k = torch.from_numpy(rng.standard_normal((n, h, d)).astype(np.float32)).to(torch.bfloat16)
    top = rng.uniform(1.0, 1.99, size=(n, h, d)) * np.exp2(127) * rng.choice([-1.0, 1.0], size=(n, h, d))
    small = rng.standard_normal((n, h, d)) * np.exp2(rng.integers(100, 126, size=(n, h, 1)))
    v64 = np.where(rng.random((n, h, d)) < 0.25, top, small)
    v = torch.from_numpy(v64.astype(np.float32)).to(torch.bfloat16)
    assert torch.isfinite(v.float()).all()
    vf = v.double()
    assert (vf.amax(-1) - vf.amin(-1) > 2.0**128).float().mean() > 0.5  # most spans beyond float32
    nb = n // 16 + 2
    slots = torch.from_numpy(rng.permutation(nb * 16)[:n].astype(np.int64))
    cache = torch.from_numpy(rng.integers(0, 256, size=layout.cache_shape(nb), dtype=np.uint8)).to(DEV)
    kd, vd = k.to(DEV), v.to(DEV)
    if misaligned:
        kd = torch.cat([torch.zeros_like(kd[..., :1]), kd], -1)[..., 1:]
        vd = torch.cat([torch.zeros_like(vd[..., :1]), vd], -1)[..., 1:]
        assert not vectors_aligned(kd) and not vectors_aligned(vd)
    read_errors(DEV)
    tqt.store(cache, kd, vd, slots.to(DEV), layout, tqt.to_device(params, DEV))
    flags = read_errors(DEV)
    assert flags == ErrorFlag.SATURATED
    got = ref.gather_slots(cache.cpu().numpy(), layout, slots.numpy())
    want, unsure = ref.compress(k.double().numpy(), v.double().numpy(), params, return_uncertain=True)
    bad = (got != want) & ~unsure
    assert not bad.any(), f"certain bytes differ at (token, head) {np.argwhere(bad.any(-1))[:6].tolist()}"
    assert unsure.mean() < 0.1


@triton.jit
def _tile_uniform_codes_kernel(y_ptr, q_ptr, DP: tl.constexpr, BITS: tl.constexpr):
    """Row r of float64 ``y [R, DP]``: its codes by fields._uniform_codes over the row's bounds."""
    r = tl.program_id(0)
    y = tl.load(y_ptr + r * DP + tl.arange(0, DP))[None, :]
    lo = tl.min(y, axis=1)[:, None]
    hi = tl.max(y, axis=1)[:, None]
    tl.store(q_ptr + r * DP + tl.arange(0, DP)[None, :], fields._uniform_codes(y, lo, hi, BITS))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_tile_kernels_exact_uniform_codes_at_spans_near_float32s_range(bits):
    # fields._uniform_codes (the tile kernel's float64 fall-back) against the oracle's, on rows
    # whose (y − lo)·(2^b − 1) and even span leave float32 (bf16 rows reach 2^128; session 78: a
    # float32 estimate of that product made every such code 2^b − 1), with exact halves among them.
    from tqkern.ops.quantize.reference import _uniform_codes as oracle

    levels = (1 << bits) - 1
    rng = np.random.default_rng(bits)
    rows, dp = 24, 32
    e = rng.integers(124, 128, size=(rows, 1)).astype(np.float64)
    y = rng.uniform(-1.0, 1.0, size=(rows, dp)) * np.exp2(e)
    y[:8] = np.round(rng.uniform(0, levels, size=(8, dp)) * 2) / 2  # halves of the grid...
    y[:8, 0], y[:8, 1] = 0, levels
    y[:8] *= np.exp2(127 - bits)  # ...times 2^(127 − b): span below 2^127, product above 2^128 (exact)
    y = y.astype(np.float32).astype(np.float64)  # float32 values, as the kernel's inputs are
    y[8, 0], y[8, 1] = -3.3e38, 3.3e38  # a span of ~2^129
    y[8] = y[8].astype(np.float32)
    assert ((y.max(1) - y.min(1)) * levels > 3.4028234663852886e38).mean() > 0.5
    q = torch.zeros((rows, dp), dtype=torch.int64, device=DEV)
    _tile_uniform_codes_kernel[(rows,)](torch.from_numpy(y).to(DEV), q, dp, bits)
    want = oracle(y, y.min(1), y.max(1), bits).astype(np.int64)
    assert np.array_equal(q.cpu().numpy(), want)
    assert (want == levels).mean() < 0.5
