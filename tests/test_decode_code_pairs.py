"""The 5-bit code-pair table's plan (``coop_variants.code_pair_plan``, ``MmaPlan.KP``): where the
planner takes it, its shared memory, and bad input. No kernel runs here (GPU:
``tests/test_gpu_decode_code_pairs.py``)."""

import dataclasses

import pytest

import tqkern
from tqkern.ops.paged_decode.coop_variants import code_pair_plan, shared_head_plan
from tqkern.ops.paged_decode.mma_plans import _lut_bytes, coop_plan, coop_smem_bytes, mma_plan, per_warp_plan
from tqkern.ops.paged_decode.plan import DeviceCaps, plan_decode, shared_heads

SM90_OPTIN = 232448
A100 = DeviceCaps(capability=(8, 0), num_sms=108, smem_per_block_optin=166912, smem_per_sm=167936)


def _layout(preset, heads, d=128, block_size=16):
    return tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, d), num_kv_heads=heads, block_size=block_size,
                              arrangement="slot")


@pytest.mark.parametrize("preset,stages", [("k5v4h", 3), ("tqkern_k5v3", 4)])
def test_code_pair_plan_at_4_kv_heads_takes_the_deepest_ring_that_fits(preset, stages):
    """k5v4h's 4-bit value pairs (256 entries) beside 1024 key pairs leave room for 3 of its 4
    stages; tqkern_k5v3's 64 value pairs for all 4. Only ``KP`` and the ring's depth change."""
    layout = _layout(preset, 4)
    plan = mma_plan(layout, 7)
    assert plan.COOP == 4 and plan.K_BITS == 5
    pairs = code_pair_plan(plan, layout)
    assert (pairs.KP, pairs.COOP) == (1, stages)
    assert dataclasses.replace(pairs, KP=None, COOP=4) == plan
    assert pairs.lut_bytes == 128 * (plan.K_AT + 1024) == plan.lut_bytes + 128 * (1024 - 32 if preset == "k5v4h"
                                                                                  else 1088 - 256)
    assert coop_smem_bytes(pairs) <= SM90_OPTIN
    assert coop_smem_bytes(dataclasses.replace(pairs, COOP=stages + 1)) > SM90_OPTIN or stages == plan.COOP


@pytest.mark.parametrize("preset,d,sub,stages", [("k5v4h", 128, 1, 3), ("tqkern_k5v3", 128, 2, 2),
                                                 ("k5v4h", 64, 2, 3), ("tqkern_k5v3", 64, 2, 4)])
def test_code_pair_plan_at_8_kv_heads_takes_the_measured_ring_that_fits(preset, d, sub, stages):
    """At 8 KV heads (8-warp CTAs) and head_dim 128 tqkern_k5v3's table fits beside 2 stages of
    two steps; k5v4h's (256 value pairs below the keys) beside no ring of two-step stages, so 3
    stages of one step. At head_dim 64 (half the stage bytes) 3 and 4 stages of two. The next
    deeper ring of each shape does not fit (or is the plan's own 4); only ``KP``, ``SUB`` and the
    ring change."""
    layout = _layout(preset, 8, d)
    plan = mma_plan(layout, 4)
    assert (plan.COOP, plan.SUB, plan.K_BITS) == (4, 2, 5)
    pairs = code_pair_plan(plan, layout)
    assert (pairs.KP, pairs.SUB, pairs.COOP) == (1, sub, stages)
    assert dataclasses.replace(pairs, KP=None, SUB=2, COOP=4) == plan
    assert coop_smem_bytes(pairs) <= SM90_OPTIN
    assert coop_smem_bytes(dataclasses.replace(pairs, COOP=stages + 1)) > SM90_OPTIN or stages == plan.COOP
    assert coop_smem_bytes(dataclasses.replace(pairs, SUB=2, COOP=2)) > SM90_OPTIN or sub == 2
    assert code_pair_plan(plan, layout, A100.smem_per_block_optin) is None


def _residency(kernel):
    """CTAs an SM as on an H200: two for the 2-stage ring without the table, else one."""
    if kernel.kernel != "coop":
        return 3
    return 2 if kernel.constexpr("COOP") == 2 and not dict(kernel.constexprs).get("KP") else 1


@pytest.mark.parametrize("preset", ["k5v4h", "tqkern_k5v3"])
@pytest.mark.parametrize("batch,tokens", [(1, 131072), (32, 16384), (8, 65536), (32, 4096), (128, 1024),
                                          (256, 1024)])
def test_planner_takes_the_code_pair_table_at_8_kv_heads(preset, batch, tokens):
    """The sm_90 plan of 5-bit keys at 8 KV heads (Hq 32) is the code-pair table's at every shape
    measured, except k5v4h at 256 × 1K, whose table plan would run two rounds of CTAs (256
    sequences of one split on 132 SMs) where the two-CTA plan runs one; tqkern_k5v3's table plan is
    a 2-stage ring already. On an A100 no table."""
    layout = _layout(preset, 8)
    plan = plan_decode(layout, batch, 32, tokens // 16, DeviceCaps.sm90(), same_codebooks=True,
                       occupancy=_residency)
    assert plan.decode.kernel == "coop"
    if preset == "k5v4h" and batch == 256:
        assert "KP" not in dict(plan.decode.constexprs) and plan.decode.constexpr("COOP") == 2
        assert plan.num_splits == 1
    else:
        want = code_pair_plan(mma_plan(layout, 4), layout)
        assert plan.decode.constexpr("KP") == 1 and plan.summary().endswith(", code-pair table")
        assert (plan.decode.constexpr("SUB"), plan.decode.constexpr("COOP")) == (want.SUB, want.COOP)
    a100 = plan_decode(layout, batch, 32, tokens // 16, A100, same_codebooks=True, occupancy=_residency)
    assert "KP" not in dict(a100.decode.constexprs)


def test_code_pair_plan_applies_only_where_measured_and_fitting():
    """None for other key codes, head_dims other than 128 (but 64 at 8 KV heads; 64 at 4 KV heads
    would fit: not measured), 16 KV heads, shared-head plans but 2 KV heads × 4 warps at head_dim
    128, and where the device's shared
    memory per CTA (an A100's 163 KB) holds no ring of 3 stages (at 4 KV heads: a ring of 2 was not
    measured there)."""
    k5 = _layout("k5v4h", 4)
    assert code_pair_plan(mma_plan(k5, 7), k5, A100.smem_per_block_optin) is None
    two_stages = coop_smem_bytes(dataclasses.replace(code_pair_plan(mma_plan(k5, 7), k5), COOP=2))
    assert code_pair_plan(mma_plan(k5, 7), k5, two_stages) is None  # (a ring of 2 was not measured)
    for preset, heads, d in (("tq4", 4, 128), ("turboquant_3bit_nc", 4, 128), ("turboquant_k8v4", 4, 128),
                             ("turboquant_3bit_nc", 8, 128), ("k5v4h", 4, 64), ("tqkern_k5v3", 4, 64)):
        layout = _layout(preset, heads, d)
        plan = mma_plan(layout, 32 // heads)
        assert plan.COOP and code_pair_plan(plan, layout) is None, (preset, heads, d)
    for preset, heads, d in (("k5v4h", 16, 128), ("tqkern_k5v3", 16, 128), ("tqkern_k5v3", 8, 256)):
        layout = _layout(preset, heads, d)  # (cooperative plans the planner does not make: 16-warp CTAs, D256)
        assert code_pair_plan(coop_plan(per_warp_plan(mma_plan(layout, 32 // heads)), layout, 2), layout) is None
    for preset, heads, ws, d in (("k5v4h", 1, 4, 128), ("tqkern_k5v3", 1, 8, 128), ("k5v4h", 2, 2, 128),
                                 ("tqkern_k5v3", 2, 4, 64), ("tq4", 2, 4, 128)):
        layout = _layout(preset, heads, d)  # (one KV head: measured and lost at 3 of 4 shapes, S61)
        shared = shared_head_plan(mma_plan(layout, 8), layout, ws)
        assert shared.WS == ws and code_pair_plan(shared, layout) is None, (preset, heads, ws, d)


@pytest.mark.parametrize("preset,sub,stages", [("k5v4h", 1, 3), ("tqkern_k5v3", 2, 2)])
def test_code_pair_plan_in_shared_head_ctas_at_2_kv_heads(preset, sub, stages):
    """Two KV heads in an 8-warp CTA (the planner's shared-head plan, 4 warps a KV head) take the
    8-KV-head rule: tqkern_k5v3 2 stages of two steps, k5v4h 3 of one; only ``KP``, ``SUB`` and the
    ring change, ``WS`` stays 4."""
    layout = _layout(preset, 2)
    shared = shared_heads(mma_plan(layout, 8), layout)
    assert (shared.WS, shared.SUB, shared.COOP) == (4, 2, 4)
    pairs = code_pair_plan(shared, layout)
    assert (pairs.KP, pairs.SUB, pairs.COOP, pairs.WS) == (1, sub, stages, 4)
    assert dataclasses.replace(pairs, KP=None, SUB=2, COOP=4) == shared
    assert coop_smem_bytes(pairs) <= SM90_OPTIN < coop_smem_bytes(dataclasses.replace(pairs, COOP=stages + 1))
    assert code_pair_plan(shared, layout, A100.smem_per_block_optin) is None


@pytest.mark.parametrize("preset", ["k5v4h", "tqkern_k5v3"])
@pytest.mark.parametrize("hq,batch,tokens", [(16, 32, 16384), (16, 16, 65536), (16, 128, 2048), (8, 64, 8192),
                                             (14, 32, 16384)])
def test_planner_takes_the_code_pair_table_at_2_kv_heads(preset, hq, batch, tokens):
    """At the five two-KV-head shapes measured (Llama-3-70B-TP4, Llama-3-8B-TP4, Qwen2.5-7B-TP2) the
    sm_90 plan is the shared-head plan with the code-pair table, its splits whole CTAs of 4; on an
    A100 (163 KB a CTA: neither the table nor the shared-head ring fits) the per-warp kernel."""
    layout = _layout(preset, 2)
    plan = plan_decode(layout, batch, hq, tokens // 16, DeviceCaps.sm90(), same_codebooks=True,
                       occupancy=_residency)
    want = code_pair_plan(shared_heads(mma_plan(layout, hq // 2), layout), layout)
    assert plan.decode.kernel == "coop" and plan.summary().endswith("4 warps per KV head, code-pair table")
    cx = dict(plan.decode.constexprs)
    assert (cx["KP"], cx["SUB"], cx["COOP"], cx["WS"]) == (1, want.SUB, want.COOP, 4)
    assert plan.num_splits % 4 == 0
    a100 = plan_decode(layout, batch, hq, tokens // 16, A100, same_codebooks=True, occupancy=_residency)
    assert a100.decode.kernel == "mma" and "KP" not in dict(a100.decode.constexprs)


def test_code_pair_plan_bad_input():
    layout = _layout("k5v4h", 4)
    plan = mma_plan(layout, 7)
    with pytest.raises(TypeError, match="cooperative plan"):
        code_pair_plan(per_warp_plan(plan), layout)
    with pytest.raises(TypeError, match="layout must be a tqkern.PagedLayout, got str"):
        code_pair_plan(plan, "k5v4h")
    with pytest.raises(ValueError, match="KP .* needs a cooperative plan of 5-bit keys"):
        dataclasses.replace(per_warp_plan(plan), KP=1)  # the per-warp kernel declares a 36-40 KB table
    tq4 = _layout("tq4", 4)
    with pytest.raises(ValueError, match="got K_BITS=4"):
        dataclasses.replace(mma_plan(tq4, 7), KP=1)
    assert per_warp_plan(code_pair_plan(plan, layout)) == per_warp_plan(plan)  # (KP goes with the stages)


def test_lut_bytes_of_the_code_pair_table():
    assert _lut_bytes(False, False, 5, 256, False, True) == 128 * 1280
    assert _lut_bytes(False, False, 5, 64, False, True) == 128 * 1088
    assert _lut_bytes(False, False, 5, 64) == 128 * 256  # (single codes: the table's 256-entry minimum)


@pytest.mark.parametrize("preset", ["k5v4h", "tqkern_k5v3"])
def test_planner_takes_the_code_pair_table_at_4_kv_heads_on_sm90_only(preset):
    """Qwen2.5-7B's decode (Hq 28, Hkv 4) at batch 1 × 64K and 16 × 32K: the code-pair table on an
    sm_90 device (the summary says so); the single-code cooperative plan on an A100, where it does
    not fit, and where Triton cannot size dynamic shared memory the per-warp kernel as before."""
    layout = _layout(preset, 4)
    for batch, tokens in ((1, 65536), (16, 32768)):
        plan = plan_decode(layout, batch, 28, tokens // 16, DeviceCaps.sm90(), same_codebooks=True,
                           occupancy=lambda k: 1)
        assert plan.decode.kernel == "coop" and plan.decode.constexpr("KP") == 1
        assert plan.summary().endswith(", code-pair table")
        a100 = plan_decode(layout, batch, 28, tokens // 16, A100, same_codebooks=True, occupancy=lambda k: 1)
        assert a100.decode.kernel == "coop" and "KP" not in dict(a100.decode.constexprs)
        assert a100.decode.constexpr("COOP") == 4 and "code-pair" not in a100.summary()
    static = dataclasses.replace(DeviceCaps.sm90(), dynamic_smem=False)
    plan = plan_decode(layout, 1, 28, 4096, static, same_codebooks=True, occupancy=lambda k: 1)
    assert plan.decode.kernel == "mma" and "KP" not in dict(plan.decode.constexprs)
