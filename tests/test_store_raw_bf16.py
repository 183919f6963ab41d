"""bf16 inputs stored into fp16 caches: every finite bfloat16 bit pattern, against the oracle's bytes
(nearest even, fp16 subnormals, saturation at ±65504 with the error flag, −0.0's sign). GPU only: the
interpreter has no bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.errors import ErrorFlag
from tqkern_torch.errors import read_errors
from tqkern_torch.testing import device_under_test, poisoned_like

DEV = device_under_test()


@pytest.mark.gpu
@pytest.mark.skipif(DEV.type != "cuda", reason="the interpreter has no bf16")
def test_every_finite_bf16_value_stores_the_oracles_fp16_bytes():
    bits = np.arange(1 << 16, dtype=np.uint32)
    finite = ((bits >> 7) & 0xFF) != 0xFF
    vals = (bits[finite] << 16).view(np.float32)  # bf16 values, exact in float32
    d, h = 64, 2
    n = -(-vals.size // (d * h))
    x = np.zeros(n * h * d, np.float32)
    x[:vals.size] = vals
    x = x.reshape(n, h, d)
    fmt = tqkern.KVFormat.preset("fp16", d)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=h, block_size=16)
    params = tqkern.TQParams.default(fmt)
    k = torch.from_numpy(x).to(torch.bfloat16)
    v = torch.from_numpy(x[::-1].copy()).to(torch.bfloat16)
    assert np.array_equal(k.float().numpy(), x)
    blocks = -(-n // 16)
    slots = torch.randperm(blocks * 16, generator=torch.Generator().manual_seed(0))[:n]
    # random bytes before the store (a byte the kernel leaves alone cannot match a zeroed cache by chance)
    cache = poisoned_like(tuple(layout.cache_shape(blocks)), torch.uint8, DEV, seed=1)
    before = cache.cpu().numpy()
    read_errors(DEV)  # (clear)
    tqt.store(cache, k.to(DEV), v.to(DEV), slots.to(DEV), layout, params)
    assert read_errors(DEV) == ErrorFlag.SATURATED  # (values beyond ±65504 saturate, flagged)
    want = ref.store(before, k.double().numpy(), v.double().numpy(), slots.numpy(), layout, params)
    got = cache.cpu().numpy()
    assert np.array_equal(got, want), np.argwhere(got != want)[:8]
