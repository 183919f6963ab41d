"""The shared-head decode plans (tqkern/ops/paged_decode/mma_plans.py ``shared_head_plan``, the
planner's ``shared_heads``): one or two KV heads on CTAs whose warps are splits of each head. No
kernel runs here (their GPU tests: tests/test_gpu_decode.py)."""

import pytest

import tqkern
from tqkern.ops.paged_decode.mma_plans import mma_plan, per_warp_plan


def _layout(preset, d, heads, arrangement="slot"):
    return tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, d), num_kv_heads=heads, block_size=16,
                              arrangement=arrangement)


def test_shared_head_plan_shapes_and_refusals():
    """``shared_head_plan``: ``ws`` warps per KV head over stages of ``SUB·ws`` steps, the stage
    shape of the 4–16-head plans (uniform values 2 stages of two steps, Lloyd-Max 4 of two, FP8 keys
    3 of one), stage bytes (and so shared memory) growing with ``ws``; ``None`` past two KV heads,
    for several warps per KV head (``GS > 1``), for a CTA of more than 16 warps, for blocks not a
    multiple of 16 tokens; bad arguments refused by name."""
    from tqkern.ops.paged_decode.mma_plans import _stage_bytes, coop_smem_bytes, shared_head_plan

    one = _layout("turboquant_4bit_nc", 128, 1)
    plan = mma_plan(one, 8)
    assert plan.COOP is None
    got = {ws: shared_head_plan(plan, one, ws) for ws in (2, 4, 8, 16)}
    assert all((p.WS, p.COOP, p.SUB, p.RS) == (ws, 2, 2, one.row_bytes) for ws, p in got.items())
    assert [_stage_bytes(got[ws]) for ws in (2, 4, 8)] == [16 * 2 * ws * one.row_bytes for ws in (2, 4, 8)]
    assert coop_smem_bytes(got[8]) - coop_smem_bytes(got[4]) == 2 * 16 * 2 * 4 * one.row_bytes
    lm = shared_head_plan(mma_plan(_layout("k5v4h", 128, 2), 8), _layout("k5v4h", 128, 2), 4)
    assert (lm.WS, lm.COOP, lm.SUB) == (4, 4, 2)
    fp8 = shared_head_plan(mma_plan(_layout("turboquant_k8v4", 128, 1), 8), _layout("turboquant_k8v4", 128, 1), 8)
    assert (fp8.COOP, fp8.SUB) == (3, 1)
    assert shared_head_plan(plan, one, 8, stages=3).COOP == 3
    assert per_warp_plan(got[8]) == plan  # (the per-warp plan drops WS with the stages)
    assert shared_head_plan(mma_plan(_layout("tq4", 128, 4, "row"), 8), _layout("tq4", 128, 4, "row"), 2) is None
    assert shared_head_plan(mma_plan(one, 32), one, 8) is None  # GQA 32: two warps per KV head (GS 2)
    assert shared_head_plan(mma_plan(_layout("tq4", 128, 2, "row"), 8), _layout("tq4", 128, 2, "row"), 16) is None
    short = tqkern.PagedLayout(format=tqkern.KVFormat.preset("turboquant_4bit_nc", 128), num_kv_heads=1,
                               block_size=8, arrangement="slot")
    assert shared_head_plan(mma_plan(short, 8), short, 8) is None
    with pytest.raises(ValueError, match="ws must be 2, 4, 8 or 16, got 3"):
        shared_head_plan(plan, one, 3)
    with pytest.raises(ValueError, match="ws must be"):
        shared_head_plan(plan, one, True)
    with pytest.raises(TypeError, match="plan must be an MmaPlan"):
        shared_head_plan({}, one, 8)
    with pytest.raises(TypeError, match="layout must be a tqkern.PagedLayout"):
        shared_head_plan(plan, "one", 8)


def test_planner_takes_shared_heads_for_five_bit_keys_at_two_kv_heads():
    """Two KV heads with 5-bit keys (k5v4h, ``install``'s default, at Llama-3-70B on 4 GPUs: Hq 16)
    take 8-warp CTAs of 4 warps per KV head (measured 1.12–1.80x faster on an H200, S52); the
    split count is a multiple of 4 (a one-wave count rounded down), the grid one CTA per
    (sequence, 4 splits); an explicit count that is not a multiple of 4 takes the per-warp kernel.
    One KV head, 4-bit keys, GQA 16 (two column tiles) and head_dim 64 keep the per-warp kernel."""
    from tqkern.ops.paged_decode.plan import DeviceCaps, mma_kernel_plan, plan_decode, shared_heads

    lay = _layout("k5v4h", 128, 2)
    plan = plan_decode(lay, 16, 16, 4096, DeviceCaps.sm90(), same_codebooks=True, occupancy=lambda k: 1)
    cx = dict(plan.decode.constexprs)
    assert (plan.decode.kernel, cx["WS"], plan.decode.num_warps) == ("coop", 4, 8)
    # one 8-warp CTA an SM: 1056 warps / 32 (sequence, KV head) pairs = 33 -> 32
    assert (plan.num_splits, plan.decode.grid) == (32, (16 * 32 // 4,))
    for n, kernel in ((6, "mma"), (8, "coop")):
        assert plan_decode(lay, 16, 16, 4096, DeviceCaps.sm90(), same_codebooks=True,
                           num_splits=n).decode.kernel == kernel
    for lay1, hq in ((_layout("k5v4h", 128, 1), 8), (_layout("tq4", 128, 2, "row"), 16),
                     (_layout("turboquant_4bit_nc", 128, 2), 16), (_layout("k5v4h", 128, 2), 32),
                     (_layout("k5v4h", 64, 2), 14)):
        assert plan_decode(lay1, 16, hq, 4096, DeviceCaps.sm90(), same_codebooks=True).decode.kernel == "mma"
    with pytest.raises(ValueError, match="num_splits must be a multiple of the plan's 4 warps per KV head, got 6"):
        mma_kernel_plan(lay, shared_heads(mma_plan(lay, 8), lay), 16, 16, 6)
    with pytest.raises(TypeError, match="plan must be an MmaPlan"):
        shared_heads(None, lay)
    with pytest.raises(TypeError, match="layout must be a tqkern.PagedLayout"):
        shared_heads(mma_plan(lay, 8), None)
