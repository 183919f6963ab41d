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
    from tqkern.ops.paged_decode.coop_variants import shared_head_plan
    from tqkern.ops.paged_decode.mma_plans import _stage_bytes, coop_smem_bytes

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


def test_planner_takes_the_one_head_plan_for_uniform_values_at_16k():
    """One KV head with 3- or 4-bit keys and uniform values (Llama-3-70B / 405B on 8 GPUs) at
    contexts of 16K tokens or more takes CTAs of 4 warps over 4 stages of one step, with 32 splits
    (measured faster than the per-warp kernel on an H200, S54); Lloyd-Max values, FP8 keys, 5-bit
    keys, two KV heads, head_dim 64, shorter contexts and grids past two CTAs an SM or under one keep
    their plans; an explicit count that is not a multiple of 4 takes the per-warp kernel."""
    from tqkern.ops.paged_decode.plan import DeviceCaps, one_head_plan, plan_decode

    caps = DeviceCaps.sm90()  # (plan_decode takes the block table's width: 1024 blocks of 16 = 16K tokens)
    for preset, hq in (("turboquant_4bit_nc", 8), ("turboquant_3bit_nc", 16), ("turboquant_k3v4_nc", 8)):
        lay = _layout(preset, 128, 1)
        plan = plan_decode(lay, 32, hq, 1024, caps, same_codebooks=True, occupancy=lambda k: 1)
        cx = dict(plan.decode.constexprs)
        assert (plan.decode.kernel, cx["WS"], cx["SUB"], cx["COOP"], plan.decode.num_warps) == ("coop", 4, 1, 4, 4)
        assert (plan.num_splits, plan.decode.grid) == (32, (32 * 32 // 4,))
        assert plan_decode(lay, 17, hq, 2048, caps, same_codebooks=True).num_splits == 32
        assert plan_decode(lay, 32, hq, 1023, caps, same_codebooks=True).decode.kernel == "mma"
        n_sms = caps.num_sms
        assert plan_decode(lay, n_sms // 4 + 1, hq, 1024, caps, same_codebooks=True).decode.kernel == "mma"
        assert plan_decode(lay, n_sms // 4, hq, 1024, caps, same_codebooks=True).decode.kernel == "coop"
        # under one CTA an SM (8 CTAs a sequence: at most 16 sequences on 132 SMs) the per-warp kernel
        # (S68, H200: Llama-3-405B-TP8 B16x32K and B8x64K, Llama-3-70B-TP8 B16x32K, 8-53% less time)
        assert plan_decode(lay, -(-n_sms // 8), hq, 1024, caps, same_codebooks=True).decode.kernel == "coop"
        for seqs in (n_sms // 8, 8, 1):
            plan = plan_decode(lay, seqs, hq, 2048, caps, same_codebooks=True)
            assert plan.decode.kernel == "mma" and plan.num_splits > 32
        for n, kernel in ((6, "mma"), (8, "coop")):
            assert plan_decode(lay, 32, hq, 1024, caps, same_codebooks=True, num_splits=n).decode.kernel == kernel
    for lay in (_layout("tq4", 128, 1), _layout("k5v4h", 128, 1), _layout("turboquant_k8v4", 128, 1),
                _layout("turboquant_4bit_nc", 64, 1)):
        assert plan_decode(lay, 32, 8, 1024, caps, same_codebooks=True).decode.kernel == "mma"
        assert one_head_plan(mma_plan(lay, 8), lay, 16384) is None
    two = _layout("turboquant_4bit_nc", 128, 2)
    assert one_head_plan(mma_plan(two, 8), two, 16384) is None
    assert plan_decode(two, 32, 16, 1024, caps, same_codebooks=True).decode.kernel == "mma"
    one = _layout("turboquant_4bit_nc", 128, 1)
    with pytest.raises(TypeError, match="plan must be an MmaPlan"):
        one_head_plan(None, one, 16384)
    with pytest.raises(TypeError, match="layout must be a tqkern.PagedLayout"):
        one_head_plan(mma_plan(one, 8), "one", 16384)
    for bad in (-1, 16384.0, True, None):
        with pytest.raises(ValueError, match=f"max_len must be a non-negative int \\(tokens\\), got {bad!r}"):
            one_head_plan(mma_plan(one, 8), one, bad)


def test_shared_head_plan_sub_argument():
    """``shared_head_plan(sub=)``: one or two steps per warp in a stage (stage bytes follow); other
    values refused by name."""
    from tqkern.ops.paged_decode.coop_variants import shared_head_plan
    from tqkern.ops.paged_decode.mma_plans import _stage_bytes

    one = _layout("turboquant_4bit_nc", 128, 1)
    plan = mma_plan(one, 8)
    p1, p2 = (shared_head_plan(plan, one, 4, stages=4, sub=s) for s in (1, 2))
    assert (p1.SUB, p2.SUB, p1.COOP) == (1, 2, 4)
    assert 2 * _stage_bytes(p1) == _stage_bytes(p2)
    for bad in (0, 3, 4, True, 1.0):
        with pytest.raises(ValueError, match=f"sub must be 1 or 2, got {bad!r}"):
            shared_head_plan(plan, one, 4, sub=bad)
