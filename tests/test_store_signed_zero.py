"""A key or value element of exactly −0.0 keeps its sign bit wherever ``store`` writes it as a
float: FP8 keys (0x80), raw float16 fields (0x8000), a uniform side's zero point when the
smallest element is −0.0 — the oracle's bytes (NumPy's conversions keep the sign of zero). The
software conversions took the sign from ``v < 0``, which is false for −0.0: they wrote +0."""

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern_torch.testing import device_under_test, kernels_available

DEV = device_under_test()
pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")


def _inputs(d, n=5, h=2):
    """``n`` tokens × ``h`` heads, each vector non-negative with some elements exactly −0.0 (every
    vector's smallest element is a signed zero), half of them zero-padded at the end."""
    g = np.random.default_rng(0)
    x = np.abs(g.standard_normal((n, h, d)))
    x[..., ::5] = -0.0
    x[::2, :, d // 2:] = -0.0
    return x


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "fp16", "turboquant_4bit_nc", "tq4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_negative_zero_keeps_its_sign_bit(preset, dtype):
    if dtype == torch.bfloat16 and DEV.type != "cuda":
        pytest.skip("the interpreter has no bf16")
    d, h, n = 64, 2, 5
    fmt = tqkern.KVFormat.preset(preset, d)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=h, block_size=16)
    params = tqkern.TQParams.default(fmt, seed=1)
    x = _inputs(d, n, h)
    k, v = (torch.from_numpy(x).to(dtype) for _ in range(2))
    assert torch.signbit(k).any() and not (k < 0).any()
    slots = torch.arange(n, dtype=torch.int64)
    cache = tqt.allocate_cache(layout, 1, DEV)
    tqt.store(cache, k.to(DEV), v.to(DEV), slots.to(DEV), layout, params)
    want = ref.store(np.zeros(layout.cache_shape(1), np.uint8), k.double().numpy(), v.double().numpy(),
                     slots.numpy(), layout, params)
    got = cache.cpu().numpy()
    # the rotated codecs' codes of exact zeros sit on the symmetric codebooks' middle boundary (a
    # tie): compare the float fields, where the sign lives, byte for byte
    for qual, f, off in fmt.slot_fields():
        if f.dtype == "codes":
            continue
        a = layout.field(qual)
        for hh in range(h):
            cols = slice(a.offset + hh * a.head_stride, a.offset + hh * a.head_stride + f.nbytes)
            g_ = got.reshape(-1, layout.row_bytes)[:n, cols]
            w_ = want.reshape(-1, layout.row_bytes)[:n, cols]
            assert np.array_equal(g_, w_), f"{preset} {qual} head {hh}: {g_[g_ != w_][:8]} vs {w_[g_ != w_][:8]}"
