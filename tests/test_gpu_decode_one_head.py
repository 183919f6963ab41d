"""GPU-only: the planner's plans for one and two KV heads (Llama-3-70B / 405B on 4-8 GPUs): the
one-KV-head plan (``one_head_plan``: uniform values, contexts of 16K tokens or more) and the split
counts that fill the SMs at batch 1, through ``paged_decode`` against the NumPy oracle."""

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


@pytest.mark.parametrize("preset,arrangement,group,max_len,want,dtype", [
    ("turboquant_4bit_nc", "slot", 8, 65536, 512, "float16"), ("tq4", "row", 8, 65536, 512, "float16"),
    ("k5v4h", "slot", 16, 32768, 256, "float16"), ("turboquant_k8v4", "slot", 16, 32768, 256, "float16"),
    ("turboquant_4bit_nc", "slot", 8, 65536, 512, "bfloat16"), ("k5v4h", "slot", 16, 32768, 256, "bfloat16"),
    ("tq4", "row", 8, 65536, 512, "bfloat16")])
def test_batch_one_long_splits_match_oracle(preset, arrangement, group, max_len, want, dtype):
    """One KV head at batch 1 (Llama-3-70B / 405B on 8 GPUs, one long sequence): the per-warp
    kernel at the planner's 256-512 splits of 128 tokens (``fill_sms(long=True)``, S69), and an
    explicit 1024 (32-64 tokens a split), merged by the one-row merge; the sequence ends mid-block
    and mid-split, shuffled blocks, poisoned output. Then 2 sequences whose second is 300 tokens
    long (most of its splits empty). fp16 and bf16 queries (the merge then writes bf16). From 256
    splits (k5v4h: the transform) or 512 (tq4: a product) the rotate-back is its own launch (S70)."""
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, 128), num_kv_heads=1, block_size=16,
                                arrangement=arrangement)
    p, q, cache, bt, sl, expect, vmax = _two_sequences(layout, group, max_len, getattr(torch, dtype), 9, group)
    for rows, splits in ((1, None), (1, 1024), (2, None)):
        dp = tqt.plan_decode(q[:rows], cache, bt[:rows], layout, p, num_splits=splits)
        assert dp.decode.kernel == "mma", dp.describe()
        if splits is None and rows == 1:
            assert dp.num_splits == want, dp.describe()
        out = torch.full_like(q[:rows], float("nan"))
        paged_decode(q[:rows], cache, bt[:rows], sl[:rows], layout, p, out=out, num_splits=splits)
        assert torch.isfinite(out).all()
        assert np.abs(out.float().cpu().numpy() - expect[:rows]).max() <= 4e-3 * vmax, (rows, splits)


@pytest.mark.parametrize("hkv,group,max_len,want", [(1, 8, 131072, 256), (1, 16, 32768, 256), (2, 16, 32768, 128)])
def test_fp16_cache_at_batch_one_fills_the_sms(hkv, group, max_len, want):
    """The fp16 cache's general kernel at one and two KV heads, batch 1 (Llama-3-70B-TP8 1×128K,
    405B-TP8 1×32K, 405B-TP4 1×32K): the planner's 128-256 splits of whole BN tiles (S70), merged
    by the one-row merge, against the oracle; the sequence ends mid-block and mid-split, shuffled
    blocks, poisoned output; then 2 sequences whose second is 300 tokens long."""
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset("fp16", 128), num_kv_heads=hkv, block_size=16)
    p, q, cache, bt, sl, expect, vmax = _two_sequences(layout, group, max_len, torch.float16, 13, hkv)
    for rows in (1, 2):
        dp = tqt.plan_decode(q[:rows], cache, bt[:rows], layout, p)
        assert dp.decode.kernel == "general" and dp.num_splits == (want if rows == 1 else want // 2), dp.describe()
        out = torch.full_like(q[:rows], float("nan"))
        paged_decode(q[:rows], cache, bt[:rows], sl[:rows], layout, p, out=out)
        assert torch.isfinite(out).all()
        assert np.abs(out.float().cpu().numpy() - expect[:rows]).max() <= 4e-3 * vmax, rows


def _two_sequences(layout, group, max_len, dtype, seed, fill_seed, device="cuda"):
    """Device params, q ``[2, Hkv·group, 128]``, the filled cache, a shuffled table of ``max_len``
    tokens a sequence, lengths ``[max_len − 77, 300]``, the oracle's output and ``max|V̂|``."""
    params = tqkern.TQParams.default(layout.format)
    p = tqt.to_device(params, device)
    mb = max_len // 16
    sl = torch.tensor([max_len - 77, 300], dtype=torch.int32, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    bt = torch.randperm(2 * mb + 5, device=device, generator=g)[: 2 * mb].reshape(2, mb).int()
    cache = _fill(layout, p, 2 * mb + 5, sl, bt, seed=fill_seed)
    q = torch.randn(2, layout.num_kv_heads * group, 128, device=device, dtype=dtype, generator=g)
    expect = ref.paged_decode(q.double().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(), sl.cpu().numpy(),
                              layout, params)
    return p, q, cache, bt, sl, expect, _vmax(cache, bt, sl, layout, p)
