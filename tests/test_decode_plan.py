"""The decode plan (tqkern/ops/paged_decode/plan.py) and its cache: which kernel and split count a
device gets (DeviceCaps, occupancy), the fallbacks, bad input, and ``tqkern_torch.plan_decode``.
No kernel runs here except the frontend's interpreter path."""

import dataclasses

import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern.ops.launch import BoundedCache
from tqkern.ops.paged_decode.mma_plans import mma_plan, per_warp_plan
from tqkern.ops.paged_decode.plan import DeviceCaps
from tqkern.ops.paged_decode.triton import workspace_numel
from tqkern_torch.testing import device_under_test, kernels_available

DEV = device_under_test()


def _layout(preset, d, heads, arrangement="slot"):
    return tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, d), num_kv_heads=heads, block_size=16,
                              arrangement=arrangement)


def test_plan_reads_the_capability():
    """The plan asks the device's compute capability (``DeviceCaps``): on an sm_70 device a forced
    warp-MMA plan is refused, and "auto" takes the general kernel there."""
    from tqkern.ops.paged_decode.plan import DeviceCaps, plan_decode

    tq4 = _layout("tq4", 128, 8, "row")
    sm70 = dataclasses.replace(DeviceCaps.sm90(), capability=(7, 0))
    with pytest.raises(ValueError, match="does not apply to this layout/group/device"):
        plan_decode(tq4, 1, 32, 1, sm70, same_codebooks=True, path="mma")
    assert plan_decode(tq4, 1, 32, 1, sm70, same_codebooks=True).decode.kernel == "general"
    assert plan_decode(tq4, 1, 32, 1, DeviceCaps.sm90(), same_codebooks=True).decode.kernel == "coop"


def test_plan_drops_stages_without_the_shared_memory():
    """On a GPU whose CTAs cannot have the stages' shared memory, or whose Triton cannot size
    dynamic shared memory, the plan runs the per-warp kernel (the same constexprs without ``COOP``)."""
    from tqkern.ops.paged_decode.plan import DeviceCaps, plan_decode

    layout = _layout("tq4", 128, 8, "row")
    h100 = DeviceCaps.sm90()
    assert plan_decode(layout, 1, 32, 4, h100, same_codebooks=True).decode.constexpr("COOP") == 4
    a100 = DeviceCaps(capability=(8, 0), num_sms=108, smem_per_block_optin=166912, smem_per_sm=167936)
    for caps in (a100, dataclasses.replace(h100, dynamic_smem=False)):
        plan = plan_decode(layout, 1, 32, 4, caps, same_codebooks=True)
        assert plan.decode.kernel == "mma" and dict(plan.decode.constexprs)["SUB"] == 2
        assert "COOP" not in dict(plan.decode.constexprs)
        want = per_warp_plan(mma_plan(layout, 4)).constexprs()
        assert {k: v for k, v in plan.decode.constexprs if k in want} == want
    assert plan_decode(_layout("fp16", 128, 8), 1, 32, 4, h100, same_codebooks=True).decode.kernel == "general"


def _plan_with(layout, batch, max_len, ctas_per_sm, caps=None, hq=32):
    """The plan for ``hq`` query heads on an H100 (132 SMs; or ``caps``) with the compiled kernels'
    residency given by ``ctas_per_sm(kernel plan)``; returns (plan, asked: the kernels whose
    residency was asked)."""
    from tqkern.ops.paged_decode.plan import plan_decode

    asked = []

    def occupancy(kernel):
        asked.append(kernel.kernel)
        return ctas_per_sm(kernel)

    plan = plan_decode(layout, batch, hq, max_len // 16, caps or DeviceCaps.sm90(), same_codebooks=True,
                       occupancy=occupancy)
    return plan, asked


def test_plan_falls_back_to_the_per_warp_kernel_when_sizing_fails():
    """Where the cooperative kernel's dynamic shared memory cannot be sized (another Triton's
    metadata layout), nothing has launched yet: the plan takes the per-warp kernel."""
    import tqkern.ops.paged_decode.mma_plans as plans

    def ctas(kernel):
        if kernel.kernel == "coop":
            raise plans.DynamicSmemUnsupported("metadata layout unknown")
        return 2

    plan, asked = _plan_with(_layout("tq4", 128, 8, "row"), 2, 16, ctas)
    assert asked == ["coop", "mma"] and plan.decode.kernel == "mma" and plan.decode.constexpr("SUB") == 2


def _coop_ctas(kernel):
    """Residency of the compiled kernels as on an H200 (S40 Nsight): the 4-stage cooperative ring of
    5-bit keys one CTA per SM, a 2-stage ring two (but beside the code-pair table: one), the
    per-warp kernel three of 4 warps."""
    if kernel.kernel != "coop":
        return 3
    return 2 if kernel.constexpr("COOP") == 2 and not dict(kernel.constexprs).get("KP") else 1


# An sm_90 device whose CTAs could hold 192,000 bytes: the 4-stage ring of 5-bit keys at 8 KV heads
# fits (k5v4h 191,552), no ring beside the code-pair table does (tqkern_k5v3's smallest: 193,344)
NO_PAIRS = dataclasses.replace(DeviceCaps.sm90(), smem_per_block_optin=192000)


@pytest.mark.parametrize("preset", ["k5v4h", "tqkern_k5v3"])
@pytest.mark.parametrize("batch,max_len,two", [
    (256, 1024, True),  # 256 CTAs of one split: two per SM
    (32, 16384, True),  # 8 splits of 2048 tokens
    (128, 1024, False),  # two CTAs per SM would need 2 splits of 512 tokens
    (32, 4096, False),  # 8 splits of 512
    (1, 131072, False),  # 128 splits either way: one CTA per SM
])
def test_two_ctas_per_sm_for_5_bit_keys_where_splits_stay_long(preset, batch, max_len, two):
    """5-bit keys with Lloyd-Max values, where the code-pair table does not fit, take the 2-stage
    ring (two CTAs per SM) where the launch then holds more CTAs than SMs and its splits keep >=
    1024 tokens; elsewhere the 4-stage ring."""
    import tqkern.ops.paged_decode.mma_plans as plans

    layout = _layout(preset, 128, 8)
    plan, _ = _plan_with(layout, batch, max_len, _coop_ctas, NO_PAIRS)
    assert plan.decode.kernel == "coop"
    assert plan.decode.constexpr("COOP") == (2 if two else 4) and plan.decode.constexpr("SUB") == 2
    resident = (2 if two else 1) * 8 * 132
    assert plan.num_splits == plans.num_splits_mma(batch, 8, max_len, resident)
    if two:
        from tqkern.ops.paged_decode.coop_variants import two_cta_plan
        from tqkern.ops.paged_decode.plan import mma_kernel_plan

        want = mma_kernel_plan(layout, two_cta_plan(mma_plan(layout, 4), layout), batch, 32, plan.num_splits)
        assert plan.decode.constexprs == want.constexprs


def test_two_cta_plan_only_for_5_bit_keys_on_8_kv_heads_and_known_residency():
    """Unknown residency keeps the 4-stage ring; 4-bit keys, uniform values and 4 KV heads have
    no two-CTA plan; the plan is the same kernel with a 2-stage ring that fits two CTAs an SM."""
    from tqkern.ops.paged_decode.coop_variants import two_cta_plan
    from tqkern.ops.paged_decode.mma_plans import coop_smem_bytes

    layout = _layout("k5v4h", 128, 8)
    plan, _ = _plan_with(layout, 256, 1024, lambda k: None, NO_PAIRS)
    assert plan.decode.constexpr("COOP") == 4
    two = two_cta_plan(mma_plan(layout, 4), layout)
    assert (two.COOP, two.SUB) == (2, 2) and 2 * (coop_smem_bytes(two) + 1024) <= 233472
    assert dataclasses.replace(two, COOP=4) == mma_plan(layout, 4)
    for preset, arr, heads in (("tq4", "row", 8), ("turboquant_4bit_nc", "slot", 8), ("k5v4h", "slot", 4),
                               ("tqkern_k5v3", "slot", 4)):
        other = _layout(preset, 128, heads, arr)
        assert two_cta_plan(mma_plan(other, 32 // heads), other) is None, (preset, heads)
    with pytest.raises(TypeError, match="cooperative plan"):
        two_cta_plan(per_warp_plan(mma_plan(layout, 4)), layout)
    with pytest.raises(TypeError, match="layout must be a tqkern.PagedLayout, got str"):
        two_cta_plan(mma_plan(layout, 4), "k5v4h")


@pytest.mark.parametrize("group,want", [(1, 1), (8, 1), (9, 3), (10, 2), (12, 2), (16, 2), (24, 3), (32, 4),
                                        (11, None), (13, None), (40, None), (64, None)])
def test_head_groups_split_large_gqa_groups(group, want):
    """The fewest query-head groups (at most 4) of at most 8 heads each that divide the group."""
    from tqkern.ops.paged_decode.mma_plans import head_groups

    assert head_groups(group) == want
    with pytest.raises(ValueError, match="group must be a positive int"):
        head_groups(0)


@pytest.mark.parametrize("group,want", [(1, (1, 1)), (8, (1, 1)), (9, (3, 1)), (10, (1, 2)), (12, (1, 2)),
                                        (16, (1, 2)), (24, (2, 2)), (32, (2, 2)), (40, (4, 2)), (64, (4, 2)),
                                        (11, None), (72, None)])
def test_head_tiles_pair_query_column_tiles(group, want):
    """``(GS, QT)``: two column tiles per warp where an even split into tiles of at most 8 heads
    exists in at most 4 warps, else :func:`head_groups`'s single tiles."""
    from tqkern.ops.paged_decode.mma_plans import head_tiles

    assert head_tiles(group) == want
    with pytest.raises(ValueError, match="group must be a positive int"):
        head_tiles(True)


@pytest.mark.parametrize("hq,hkv,gs,qt", [(16, 1, 1, 2), (32, 2, 1, 2), (32, 1, 2, 2), (24, 2, 1, 2), (27, 3, 3, 1),
                                          (40, 1, 4, 2)])
def test_gqa_groups_above_8_take_the_per_warp_mma_kernel(hq, hkv, gs, qt):
    """A GQA group above 8 (Llama-3-405B on 8 GPUs: 16 query heads per KV head) takes the
    per-warp MMA kernel with ``GS`` work items per KV head, each ``QT`` column tiles of
    ``G = group / (GS·QT)`` query heads (never the cooperative kernel, whose warps are the KV
    heads), uncapped registers with two tiles; splits count the work items."""
    from tqkern.ops.paged_decode.mma_plans import num_splits_mma
    from tqkern.ops.paged_decode.plan import DeviceCaps, plan_decode

    layout = _layout("tq4", 128, hkv, "row")
    plan = plan_decode(layout, 16, hq, 2048, DeviceCaps.sm90(), same_codebooks=True)
    cx = dict(plan.decode.constexprs)
    assert plan.decode.kernel == "mma" and (cx["GS"], cx["QT"]) == (gs, qt)
    assert (cx["G"], cx["HKV"], cx["HQ"]) == (hq // hkv // gs // qt, hkv * gs, hq)
    wave = 2 * 4 * 132  # (occupancy unknown: 2 CTAs per SM), half of it where G = 8 (PER_WARP_WAVE), a
    # warp of two tiles counting twice
    assert plan.num_splits == num_splits_mma(16, hkv * gs, 2048 * 16, wave * qt // 2 if cx["G"] == 8 else wave)
    assert plan.decode.grid == (-(-16 * hkv * gs * plan.num_splits // 4),)
    if qt == 2:
        assert plan.decode.maxnreg == 0
    # group 44 has no split into at most 4 warps of at most 2 tiles of 8: the general kernel
    assert plan_decode(_layout("tq4", 128, 1, "row"), 4, 44, 64, DeviceCaps.sm90(),
                       same_codebooks=True).decode.kernel == "general"


def test_prepared_plans_are_bounded(monkeypatch):
    """The one plan cache keeps at most its ``maxsize`` entries (shapes change every step as
    batches and block tables grow), dropping the oldest first; a cached plan is reused as is."""
    import tqkern.ops.paged_decode.triton as tri

    monkeypatch.setattr(tri, "_PREPARED", BoundedCache(3))
    layout = _layout("turboquant_4bit_nc", 64, 2)
    cache = torch.zeros(layout.cache_shape(4), dtype=torch.uint8)
    tables = {"rotation": None, "key_centroids_f32": None, "value_centroids_f32": None}
    preps = []
    for mb in (1, 2, 3, 4, 1):
        bt = torch.zeros(1, mb, dtype=torch.int32)
        preps.append(tri.prepare(layout, torch.zeros(1, 4, 64), cache, bt, torch.ones(1, dtype=torch.int32), tables,
                                 same_codebooks=True))
        assert preps[-1].plan.max_blocks == mb
    assert len(tri._PREPARED) == 3 and preps[4] is not preps[0]  # (mb=1 was dropped, then planned again)
    again = tri.prepare(layout, torch.zeros(1, 4, 64), cache, torch.zeros(1, 4, dtype=torch.int32),
                        torch.ones(1, dtype=torch.int32), tables, same_codebooks=True)
    assert again is preps[3]


def test_planner_rejects_bad_input():
    """The pure planner and DeviceCaps name the argument, what it must be and what it got."""
    from tqkern.ops.paged_decode.plan import DeviceCaps, plan_decode

    tq4 = _layout("tq4", 128, 8, "row")
    h100 = DeviceCaps.sm90()
    for name, args in (("num_seqs", (0, 32, 4)), ("num_q_heads", (1, -32, 4)), ("max_blocks", (1, 32, 0)),
                       ("num_seqs", (True, 32, 4))):
        with pytest.raises(ValueError, match=f"{name} must be a positive int, got"):
            plan_decode(tq4, *args, h100, same_codebooks=True)
    with pytest.raises(ValueError, match="num_q_heads must be a multiple of num_kv_heads = 8, got 12"):
        plan_decode(tq4, 1, 12, 4, h100, same_codebooks=True)
    with pytest.raises(ValueError, match="path must be 'auto', 'mma' or 'general', got 'fast'"):
        plan_decode(tq4, 1, 32, 4, h100, same_codebooks=True, path="fast")
    for bad in (0, -3, 1025, 2.5, True):
        with pytest.raises(ValueError, match=rf"num_splits must be None or an int in \[1, 1024\], got {bad!r}"):
            plan_decode(tq4, 1, 32, 4, h100, same_codebooks=True, num_splits=bad)
    assert plan_decode(tq4, 1, 32, 4, h100, same_codebooks=True, num_splits=1024).num_splits == 1024
    with pytest.raises(TypeError, match="layout must be a tqkern.PagedLayout, got KVFormat"):
        plan_decode(tq4.format, 1, 32, 4, h100, same_codebooks=True)
    with pytest.raises(TypeError, match=r"capability must be a \(major, minor\) pair of ints, got \(9,\)"):
        DeviceCaps(capability=(9,), num_sms=132, smem_per_block_optin=0, smem_per_sm=0)
    with pytest.raises(ValueError, match="num_sms must be a non-negative int, got -1"):
        DeviceCaps(capability=(9, 0), num_sms=-1, smem_per_block_optin=0, smem_per_sm=0)


def test_mma_plans_take_one_or_two_steps_per_update():
    """``MmaPlan.SUB`` is 1 or 2, the counts the planner emits and the GPU tests cover (4 gave
    wrong outputs for uniform values on the H200)."""
    plan = mma_plan(_layout("turboquant_4bit_nc", 128, 1, "slot"), 8)
    assert plan.SUB == 1 and dataclasses.replace(plan, SUB=2).SUB == 2
    for bad in (0, 3, 4, 2.0, True):
        with pytest.raises(ValueError, match=rf"SUB \(16-token steps per softmax update\) must be 1 or 2, got {bad!r}"):
            dataclasses.replace(plan, SUB=bad)


def test_frontend_plan_decode_and_its_bad_input():
    """tqkern_torch.plan_decode: the plan of these tensors on this device (named fields), and a
    ValueError/TypeError naming each bad argument."""
    layout = _layout("turboquant_4bit_nc", 64, 2)
    params = tqt.to_device(tqkern.TQParams.default(layout.format, seed=0), DEV)
    q = torch.zeros(3, 4, 64, dtype=torch.float16, device=DEV)
    cache = torch.zeros(layout.cache_shape(8), dtype=torch.uint8, device=DEV)
    bt = torch.zeros(3, 5, dtype=torch.int32, device=DEV)
    plan = tqt.plan_decode(q, cache, bt, layout, params, num_splits=2)
    assert (plan.num_seqs, plan.num_q_heads, plan.max_blocks, plan.num_splits, plan.group) == (3, 4, 5, 2, 2)
    assert plan.workspace_numel == workspace_numel(3, 4, 2, 64)
    with pytest.raises(TypeError, match="q must be float16 or bfloat16, got float32"):
        tqt.plan_decode(q.float(), cache, bt, layout, params)
    with pytest.raises(ValueError, match=r"q must have shape \[num_seqs >= 1, k \* 2, 64\], got \[3, 3, 64\]"):
        tqt.plan_decode(q[:, :3], cache, bt, layout, params)
    with pytest.raises(ValueError, match=r"cache must have shape \[num_blocks, "):
        tqt.plan_decode(q, cache[:, :1].contiguous(), bt, layout, params)
    with pytest.raises(ValueError, match=r"block_table must have shape \[3, \*\], got \[2, 5\]"):
        tqt.plan_decode(q, cache, bt[:2], layout, params)
    with pytest.raises(ValueError, match="block_table must have at least one column, got"):
        tqt.plan_decode(q, cache, bt[:, :0], layout, params)



@pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_a_repeated_call_finds_its_plan_without_planning(monkeypatch):
    """paged_decode looks its shapes up before allocating (its key must be the planner's): the
    second call with the same shapes does not call ``prepare``."""
    import tqkern.ops.paged_decode.triton as tri

    monkeypatch.setattr(tri, "_PREPARED", BoundedCache(1024))
    calls = []
    real = tri.prepare
    monkeypatch.setattr(tri, "prepare", lambda *a, **k: calls.append(1) or real(*a, **k))
    layout = _layout("turboquant_4bit_nc", 64, 2)
    params = tqt.to_device(tqkern.TQParams.default(layout.format, seed=0), DEV)
    q = torch.zeros(2, 4, 64, dtype=torch.float16, device=DEV)
    cache = torch.zeros(layout.cache_shape(4), dtype=torch.uint8, device=DEV)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    sl = torch.full((2,), 20, dtype=torch.int32, device=DEV)
    for _ in range(2):
        tqt.paged_decode(q, cache, bt, sl, layout, params)
    assert len(calls) == 1
    tqt.paged_decode(q, cache, bt, sl, layout, params, logit_softcap=5.0)  # other options: another plan
    assert len(calls) == 2


def test_head_dim_256_takes_the_warp_mma_kernel_up_to_8_query_heads_per_warp():
    """D256 (S27, oracle-checked on the H100 at GQA 1, 2 and 4 for every key and value scheme):
    every preset takes the warp-MMA kernel where one query column tile holds the group; a group
    of more than 8 (two column tiles: twice D256's 64 accumulators per lane) runs the general kernel."""
    def takes(preset, arr, heads, group):
        return mma_plan(_layout(preset, 256, heads, arr), group) is not None

    presets = (("turboquant_k8v4", "slot"), ("turboquant_k3v4_nc", "slot"), ("turboquant_4bit_nc", "slot"),
               ("tq4", "row"), ("turboquant_3bit_nc", "slot"), ("tqkern_k5v3", "row"))
    for heads, group in ((8, 2), (16, 1), (1, 4), (4, 8)):
        assert all(takes(p, a, heads, group) for p, a in presets), (heads, group)
    assert not any(takes(p, a, 1, 16) for p, a in presets)
    assert mma_plan(_layout("turboquant_3bit_nc", 128, 1, "slot"), 16) is not None  # (D128: two tiles)


@pytest.mark.parametrize("preset,hq,hkv,d,half", [
    ("turboquant_4bit_nc", 8, 1, 128, True),    # Llama-3-70B on 8 GPUs: G 8, measured faster at half
    ("turboquant_k8v4", 16, 1, 128, True),      # Llama-3-405B on 8 GPUs: two column tiles of 8 (counting twice)
    ("turboquant_k8v4", 16, 16, 256, False),    # Gemma-7B: G 1, measured slower at half
])
def test_per_warp_splits_fill_half_the_gpu_where_every_mma_column_is_a_query_head(preset, hq, hkv, d, half):
    """The per-warp kernel's split count: a full wave of the warps the GPU holds, or half of it
    (PER_WARP_WAVE) where each warp's MMA has 8 query-head columns, a warp of two column tiles
    counting twice (plan.py's measurements)."""
    from tqkern.ops.paged_decode.mma_plans import num_splits_mma
    from tqkern.ops.paged_decode.plan import PER_WARP_WAVE, DeviceCaps, plan_decode

    layout = _layout(preset, d, hkv, "slot")
    # (1023 blocks: one token short of the 16K at which one KV head with uniform values takes
    # plan.one_head_plan instead of the per-warp kernel)
    plan = plan_decode(layout, 32, hq, 1023, DeviceCaps.sm90(), same_codebooks=True)
    cx = dict(plan.decode.constexprs)
    assert plan.decode.kernel == "mma" and (cx["G"] == 8) == half
    wave = 2 * 4 * 132  # occupancy unknown: 2 CTAs of 4 warps per SM
    pairs = cx["HKV"]
    want = num_splits_mma(32, pairs, 1023 * 16, int(wave * PER_WARP_WAVE * cx["QT"]) if half else wave)
    assert plan.num_splits == want
    if half and cx["QT"] == 1:
        assert want < num_splits_mma(32, pairs, 1023 * 16, wave)


def test_whole_rounds_fills_the_last_round_of_ctas():
    """A launch ending in a partial round of CTAs over the SMs takes the most splits whose CTAs
    still end in that round (at most ``max_splits``); a launch of whole rounds keeps its count."""
    from tqkern.ops.paged_decode.plan import whole_rounds

    def ctas(n):  # 32 sequences, one work item each, 4 warps a CTA
        return -(-32 * n // 4)
    assert whole_rounds(24, ctas, 132, 64) == 33  # 192 CTAs -> 264 = two rounds of 132
    assert whole_rounds(33, ctas, 132, 64) == 33  # 264: whole rounds already
    assert whole_rounds(16, ctas, 132, 64) == 16  # 128 CTAs: 16.5 splits would end the round
    assert whole_rounds(24, ctas, 132, 30) == 30  # capped: 240 CTAs, the most below the cap
    assert whole_rounds(24, ctas, 132, 20) == 24  # a cap below the count never lowers it
    assert whole_rounds(5, lambda n: 3 * n, 132, 64) == 44  # 15 CTAs -> 132
    for args, match in (((0, ctas, 132, 64), "num_splits must be a positive int, got 0"),
                        ((24, ctas, True, 64), "num_sms must be a positive int, got True"),
                        ((24, ctas, 132, 2.0), "max_splits must be a positive int, got 2.0")):
        with pytest.raises(ValueError, match=match):
            whole_rounds(*args)
    with pytest.raises(TypeError, match="ctas must be a callable"):
        whole_rounds(24, 192, 132, 64)


def test_per_warp_plan_at_g8_takes_whole_rounds_of_ctas():
    """Llama-3-70B on 8 GPUs (Hq 8, one KV head, B32×16K) with the H200's residency of tq4's
    per-warp kernel (three 4-warp CTAs an SM): the half wave gives 24 splits = 192 CTAs, which
    leaves 72 of 132 SMs one CTA short; the plan takes 33 splits (264 CTAs)."""
    from tqkern.ops.paged_decode.plan import DeviceCaps, plan_decode

    layout = _layout("tq4", 128, 1, "row")
    plan = plan_decode(layout, 32, 8, 1024, DeviceCaps.sm90(), same_codebooks=True, occupancy=lambda k: 3)
    assert plan.decode.kernel == "mma" and dict(plan.decode.constexprs)["G"] == 8
    assert (plan.num_splits, plan.decode.grid) == (33, (264,))
    # 4 CTAs an SM (turboquant_4bit_nc's 128-register cap): 33 splits by the half wave already
    # (1023 blocks: at 16K tokens it takes plan.one_head_plan instead)
    plan = plan_decode(_layout("turboquant_4bit_nc", 128, 1, "slot"), 32, 8, 1023, DeviceCaps.sm90(),
                       same_codebooks=True, occupancy=lambda k: 4)
    assert (plan.num_splits, plan.decode.grid) == (33, (264,))


@pytest.mark.parametrize("preset,arr", [("tq4", "row"), ("k4v3h", "slot"), ("turboquant_4bit_nc", "slot")])
def test_offline_occupancy_sizes_the_cooperative_kernels(monkeypatch, preset, arr):
    """``tqkern plan --compile``'s occupancy (``aot.occupancy_sm90``) of a cooperative plan: its
    shared memory is the plan's (table and stages), here with the compile stubbed (128 registers:
    two 8-warp CTAs by registers; the shared memory decides). It raised TypeError before session 23."""
    import types

    from tqkern.ops.paged_decode import aot
    from tqkern.ops.paged_decode.mma_plans import coop_smem_bytes
    from tqkern.ops.paged_decode.plan import DeviceCaps, plan_decode

    monkeypatch.setattr(aot, "_compile", lambda fn, cx, opts, specialize: types.SimpleNamespace(
        metadata=types.SimpleNamespace(shared=0)))
    monkeypatch.setattr(aot, "resources", lambda compiled: (128, 0))
    plan = plan_decode(_layout(preset, 128, 8, arr), 32, 32, 1024, DeviceCaps.sm90(), same_codebooks=True)
    assert plan.decode.kernel == "coop"
    smem = coop_smem_bytes(mma_plan(_layout(preset, 128, 8, arr), 4))
    assert aot.occupancy_sm90(plan.decode) == min(2, 233472 // (smem + 1024))


def test_offline_occupancy_of_the_two_cta_plan(monkeypatch):
    """``tqkern plan --compile``'s residency of 5-bit keys' plans: the 4-stage ring one CTA per SM,
    the 2-stage ring two; with it the offline plan of Llama-3-8B B256x1K takes the two-CTA plan."""
    import types

    from tqkern.ops.paged_decode import aot
    from tqkern.ops.paged_decode.coop_variants import two_cta_plan
    from tqkern.ops.paged_decode.plan import DeviceCaps, mma_kernel_plan, plan_decode

    monkeypatch.setattr(aot, "_compile", lambda fn, cx, opts, specialize: types.SimpleNamespace(
        metadata=types.SimpleNamespace(shared=0)))
    monkeypatch.setattr(aot, "resources", lambda compiled: (128, 0))
    layout = _layout("k5v4h", 128, 8)
    four = mma_plan(layout, 4)
    assert aot.occupancy_sm90(mma_kernel_plan(layout, four, 256, 32, 1)) == 1
    assert aot.occupancy_sm90(mma_kernel_plan(layout, two_cta_plan(four, layout), 256, 32, 1)) == 2
    plan = plan_decode(layout, 256, 32, 64, DeviceCaps.sm90(), same_codebooks=True, occupancy=aot.occupancy_sm90)
    assert plan.decode.constexpr("COOP") == 2 and plan.num_splits == 1


@pytest.mark.parametrize("preset,arrangement,heads", [("turboquant_4bit_nc", "slot", 8), ("turboquant_3bit_nc", "slot", 16),
                                                      ("tq4", "row", 8), ("turboquant_k3v4_nc", "slot", 8)])
def test_head_dim_256_warp_mma_kernel_is_not_register_capped(preset, arrangement, heads):
    """head_dim 256's 64 value accumulators a lane spill under the 128/168-register caps of D128's
    plans (measured slower on an H200, S27): per-warp and cooperative plans run uncapped; FP8 keys
    keep their caps (not measured); D128 keeps them."""
    from tqkern.ops.paged_decode.plan import mma_kernel_plan

    plan = mma_plan(_layout(preset, 256, heads, arrangement), 16 // heads)
    for p in (plan, per_warp_plan(plan)):
        assert mma_kernel_plan(_layout(preset, 256, heads, arrangement), p, 4, 16, 8).maxnreg == 0
    d128 = mma_plan(_layout(preset, 128, heads, arrangement), 16 // heads)
    assert d128.COOP and mma_kernel_plan(_layout(preset, 128, heads, arrangement), d128, 4, 16, 8).maxnreg == 128
    k8 = mma_plan(_layout("turboquant_k8v4", 256, 8), 2)
    assert mma_kernel_plan(_layout("turboquant_k8v4", 256, 8), k8, 4, 16, 8).maxnreg == 128


@pytest.mark.parametrize("heads", [8, 16])
def test_head_dim_256_five_bit_keys_take_one_step_per_update(heads):
    """tqkern_k5v3 at head_dim 256: one 16-token step per softmax update (two steps needed 255
    registers and spilled in the loop; measured faster on an H200, S28) under a 232-register cap;
    k5v4h (4-bit values) uncapped (both measured fastest on an H200, S30); other Lloyd-Max-value
    plans keep two steps, and 5-bit keys at D128 too."""
    from tqkern.ops.paged_decode.plan import mma_kernel_plan

    lay = _layout("tqkern_k5v3", 256, heads)
    plan = mma_plan(lay, 16 // heads)
    assert plan.COOP is None and plan.SUB == 1 and per_warp_plan(plan).SUB == 1
    assert mma_kernel_plan(lay, plan, 4, 16, 8).maxnreg == 232
    lay = _layout("k5v4h", 256, heads)
    plan = mma_plan(lay, 16 // heads)
    assert plan.COOP is None and plan.SUB == 1 and mma_kernel_plan(lay, plan, 4, 16, 8).maxnreg == 0
    assert mma_plan(_layout("tq4", 256, heads, "row"), 16 // heads).SUB == 2
    assert per_warp_plan(mma_plan(_layout("tqkern_k5v3", 128, 8), 4)).SUB == 2


def test_plan_summary_names_the_launch():
    """``DecodePlan.summary()`` (what ``tqkern bench`` records with each decode time): the kernel,
    splits, grid and warps, the early launch (grids of ≤ half the SMs), and for cooperative plans their
    stages and warps per KV head."""
    from tqkern.ops.paged_decode.plan import DeviceCaps, plan_decode

    coop = plan_decode(_layout("turboquant_4bit_nc", 128, 8), 32, 32, 1024, DeviceCaps.sm90(), same_codebooks=True,
                       num_splits=4)
    assert coop.summary() == "coop kernel, 4 splits, grid (128,), 8 warps, 2 stages of 2 steps"
    shared = plan_decode(_layout("k5v4h", 128, 2), 16, 16, 4096, DeviceCaps.sm90(), same_codebooks=True,
                         num_splits=8)
    assert shared.summary() == ("coop kernel, 8 splits, grid (32,), 8 warps, early launch, 3 stages of 4 steps, "
                                "4 warps per KV head, code-pair table")
    per_warp = plan_decode(_layout("tq4", 128, 1, "row"), 32, 8, 1024, DeviceCaps.sm90(), same_codebooks=True,
                           num_splits=33)
    assert per_warp.summary() == "mma kernel, 33 splits, grid (264,), 4 warps"
