"""GPU-only: the planner's one-KV-head plan (``one_head_plan``: Llama-3-70B / 405B on 8 GPUs, uniform
values, contexts of 16K tokens or more) through ``paged_decode`` against the NumPy oracle."""

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern_torch.attention import paged_decode
from tests.test_gpu_decode import _fill, _vmax

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("preset,group", [("turboquant_4bit_nc", 8), ("turboquant_3bit_nc", 16),
                                          ("turboquant_k3v4_nc", 8)])
def test_one_head_plan_matches_oracle(preset, group):
    """A 16K-token block table (the plan's threshold) with lengths ending mid-step, mid-stage,
    in a split's first step and at the table's end, beside short sequences that make the plan's
    8 CTAs a sequence fill one CTA an SM; shuffled blocks, poisoned outputs; the planner's own
    split count (32) and an explicit 8. The first 4 sequences alone (under one CTA an SM) take the
    per-warp kernel at the planner's split count (S68), checked too."""
    fmt = tqkern.KVFormat.preset(preset, 128)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=1, block_size=16, arrangement="slot")
    params = tqkern.TQParams.default(fmt)
    p = tqt.to_device(params, "cuda")
    n = -(-torch.cuda.get_device_properties(0).multi_processor_count // 8)  # (17 on 132 SMs)
    sl = torch.tensor([16384, 9001, 517, 1] + [33] * (n - 4), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    num_blocks = n * 1024 + 7
    bt = torch.randperm(num_blocks, device="cuda", generator=g)[: n * 1024].reshape(n, 1024).int()
    cache = _fill(layout, p, num_blocks, sl, bt, seed=group)
    q = torch.randn(n, group, 128, device="cuda", dtype=torch.float16, generator=g)
    expect = ref.paged_decode(q.double().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(), sl.cpu().numpy(),
                              layout, params)
    vmax = _vmax(cache, bt, sl, layout, p)
    for rows, splits in ((n, None), (n, 8), (4, None)):
        dp = tqt.plan_decode(q[:rows], cache, bt[:rows], layout, p, num_splits=splits)
        if rows == n:
            assert dp.decode.kernel == "coop" and dp.decode.constexpr("WS") == 4, dp.describe()
            assert dp.num_splits == (32 if splits is None else 8)
        else:
            assert dp.decode.kernel == "mma" and dp.num_splits > 32, dp.describe()
        out = torch.full_like(q[:rows], float("nan"))
        paged_decode(q[:rows], cache, bt[:rows], sl[:rows], layout, p, out=out, num_splits=splits)
        assert torch.isfinite(out).all()
        assert np.abs(out.float().cpu().numpy() - expect[:rows]).max() <= 4e-3 * vmax, (rows, splits)
