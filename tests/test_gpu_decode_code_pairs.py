"""GPU-only: 5-bit keys through the code-pair table (``coop_variants.code_pair_plan``, ``KP``)."""

import dataclasses

import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tests.test_gpu_decode import _dense_reference, _fill, _vmax
from tqkern_torch.attention import paged_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("preset", ["k5v4h", "tqkern_k5v3"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,hq,d", [(4, 28, 128), (8, 32, 128), (8, 32, 64), (2, 16, 128)])
def test_code_pair_table_matches_single_code_lookups_bit_for_bit(preset, block_size, heads, hq, d):
    """One lookup per pair of 5-bit codes (1024 entries) feeds the MMAs the same fp16 pairs as two
    single-code lookups and a PRMT: every partial (acc, max, sum) equals the single-code plan's bit
    for bit, at 1 and 3 splits (shared-head plans: CTAs) and every stage count that fits, with
    lengths ending mid-step and mid-block, shuffled blocks and random bytes in the unused slots (4 KV
    heads, GQA 7; 8 KV heads,
    GQA 4, head_dim 128 and 64; 2 KV heads, GQA 8, in shared-head CTAs of 4 warps each: the
    single-code plan with the table plan's ring, one-step stages for k5v4h at 128)."""
    import triton

    from tqkern.ops.paged_decode.coop_variants import code_pair_plan
    from tqkern.ops.paged_decode.mma_plans import coop_plan, mma_plan, per_warp_plan
    from tqkern.ops.paged_decode.plan import shared_heads
    from tqkern.ops.paged_decode.triton import _workspace, device_caps, launch_mma_plan

    fmt = tqkern.KVFormat.preset(preset, d)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=heads, block_size=block_size, arrangement="slot")
    params = tqt.to_device(tqkern.TQParams.default(fmt), "cuda")
    plan = mma_plan(layout, hq // heads)
    plan = shared_heads(plan, layout) or plan  # (two KV heads: the shared-head plan, WS = 4)
    pairs = code_pair_plan(plan, layout, device_caps(torch.device("cuda")).smem_per_block_optin)
    assert pairs is not None and pairs.KP == 1
    sl = torch.tensor([1, 15, 16, 17, 77, 600, 999, 1000], dtype=torch.int32, device="cuda")
    max_blocks = -(-1000 // block_size)
    num_blocks = len(sl) * max_blocks + 5
    bt = torch.randperm(num_blocks, device="cuda")[: len(sl) * max_blocks].reshape(len(sl), max_blocks).int()
    cache = _fill(layout, params, num_blocks, sl, bt, seed=block_size)
    q = torch.randn(len(sl), hq, d, device="cuda", dtype=torch.float16)
    q_rot = (q.float() @ params.rotation).contiguous()
    tables = {"key_centroids_f32": params.key_centroids_f32, "value_centroids_f32": params.value_centroids_f32}
    cases = [(dataclasses.replace(pairs, KP=None), pairs)]  # (single-code plan, code-pair plan)
    for n in range(3, pairs.COOP):
        single = coop_plan(per_warp_plan(plan), layout, n)
        cases.append((single, dataclasses.replace(single, KP=1)))
    for splits in ((1, 3) if not plan.WS else (plan.WS, 3 * plan.WS)):
        for single, kp in cases:
            got = []
            for p in (single, kp):
                acc, ml = _workspace(None, len(sl), hq, splits, triton.next_power_of_2(d), q.device)
                acc.fill_(float("nan"))
                ml.fill_(float("nan"))
                launch_mma_plan(q_rot, cache, bt, sl, layout, p, tables, acc, ml, num_splits=splits,
                                sm_scale=d ** -0.5)
                got.append((acc.nan_to_num(7.0), ml.nan_to_num(7.0)))
            assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), (splits, kp.COOP)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("preset", ["k5v4h", "tqkern_k5v3"])
@pytest.mark.parametrize("heads,hq,d", [(4, 28, 128), (8, 32, 128), (8, 32, 64), (2, 16, 128)])
def test_launcher_takes_the_code_pair_table(preset, heads, hq, d, dtype):
    """The planner's own plan at batch 1 × 16K tokens, 4 KV heads (Qwen2.5-7B's GQA 7) and 8
    (Llama-3-8B's GQA 4; head_dim 64: Llama-3.2-1B's) and 2 (Llama-3-70B-TP4's GQA 8, shared-head
    CTAs): the code-pair table, with fp16 and bf16 queries (the output then bf16), against float32
    attention over the decompressed K/V (output poisoned first)."""
    fmt = tqkern.KVFormat.preset(preset, d)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=heads, block_size=16, arrangement="slot")
    params = tqt.to_device(tqkern.TQParams.default(fmt), "cuda")
    n = 16384
    g = torch.Generator(device="cuda").manual_seed(5)
    sl = torch.tensor([n - 5], dtype=torch.int32, device="cuda")
    bt = torch.randperm(n // 16 + 3, device="cuda", generator=g)[: n // 16].reshape(1, -1).int()
    cache = _fill(layout, params, n // 16 + 3, sl, bt, seed=9)
    q = torch.randn(1, hq, d, device="cuda", dtype=getattr(torch, dtype), generator=g)
    plan = tqt.plan_decode(q, cache, bt, layout, params)
    assert plan.decode.kernel == "coop" and plan.decode.constexpr("KP") == 1, plan.describe()
    out = torch.full_like(q, float("nan"))
    paged_decode(q, cache, bt, sl, layout, params, out=out)
    expect = _dense_reference(q, cache, bt, sl, layout, params)
    assert torch.isfinite(out).all()
    assert (out.float() - expect).abs().max() <= 4e-3 * _vmax(cache, bt, sl, layout, params)
