"""The decode plan's choice between the cooperative and the per-warp warp-MMA kernels where splits
are short, and the per-warp kernel's register cap at head_dim 128 (tqkern/ops/paged_decode/plan.py,
``_mma_decode``, ``mma_kernel_plan``): shapes and residency in, kernel, split count and cap out. No
kernel runs here."""

import pytest

from tests.test_decode_plan import _layout, _plan_with
from tqkern.ops.paged_decode.mma_plans import mma_plan, per_warp_plan
from tqkern.ops.paged_decode.plan import DeviceCaps, mma_kernel_plan, plan_decode


@pytest.mark.parametrize("preset,arr,batch,max_len,per_warp_ctas,want_coop,asks,splits", [
    ("turboquant_k8v4", "slot", 32, 4096, 3, False, 3, 6),  # coop: 8 splits of 512; per-warp: 6 splits
    ("turboquant_k8v4", "slot", 128, 1024, 3, True, 3, 2),  # per-warp would have 1 split
    ("turboquant_k8v4", "slot", 32, 16384, 3, True, 1, 8),  # splits of 2048 tokens
    # 64 splits of 256 tokens either way: the per-warp kernel, then 66 splits (fill_sms: 2 CTAs a split)
    ("turboquant_k8v4", "slot", 1, 16384, 3, False, 3, 66),
    ("turboquant_k8v4", "slot", 1, 32768, 3, True, 3, 64),  # 64 splits of 512 either way (not filled)
    ("turboquant_k8v4", "slot", 1, 65536, 3, True, 3, 128),  # 128 splits of 512 either way
    ("tq4", "row", 32, 4096, 3, True, 1, 8),  # two-step stages: always cooperative
    ("turboquant_4bit_nc", "slot", 32, 4096, 3, True, 1, 8),
])
def test_short_splits_give_way_to_the_per_warp_kernel(preset, arr, batch, max_len, per_warp_ctas, want_coop, asks,
                                                       splits):
    """One-step cooperative plans with fewer than 1024 tokens per split run the per-warp kernel
    instead when it has at least 2 splits of its own and either longer splits or splits under 512
    tokens (measured at B32x4K / B128x1K, and at batch 1 on an H200); the choice depends on shapes
    only. Split counts by hand: ``num_splits_mma`` of the kernel's resident warps (coop: 2 CTAs of
    8 warps an SM; per-warp: ``per_warp_ctas`` of 4), then the per-warp kernel's raised by
    ``fill_sms`` at batch 1 (one-step cooperative plans keep theirs)."""
    layout = _layout(preset, 128, 8, arr)
    plan, asked = _plan_with(layout, batch, max_len, lambda k: 2 if k.kernel == "coop" else per_warp_ctas)
    # the cooperative plan's residency, then (maybe) the per-warp one's: without and with head_dim 128's
    # 168-register cap (test_head_dim_128_per_warp_plans_with_one_step_take_168_registers)
    assert asked == ["coop"] + ["mma"] * (asks - 1)
    assert (plan.decode.kernel == "coop") == want_coop
    assert want_coop or plan.decode.maxnreg == 168  # (the same residency at either cap here)
    assert plan.num_splits == splits
    assert plan.decode.grid == ((batch * plan.num_splits,) if want_coop else (batch * 8 * plan.num_splits // 4,))


@pytest.mark.parametrize("d,want_coop", [(128, True), (256, False)])
def test_short_splits_above_head_dim_128_give_way_at_any_length(d, want_coop):
    """Gemma-2-9B's layer (8 KV heads, 16 query heads) at B8x8K, the same residency at both
    head_dims (coop: one CTA of 8 warps an SM, per-warp: two of 4): 16 splits of 512 tokens either
    way. At head_dim 128 the cooperative plan stays (no longer per-warp splits, not under 512
    tokens); at 256 the per-warp kernel takes them (the rule below 512 tokens was measured at
    head_dim 128 only)."""
    layout = _layout("turboquant_k8v4", d, 8)
    plan, asked = _plan_with(layout, 8, 8192, lambda k: 1 if k.kernel == "coop" else 2, hq=16)
    assert asked == ["coop", "mma"] + ["mma"] * (d == 128)  # (head_dim 128: with and without the 168 cap)
    assert (plan.decode.kernel == "coop") == want_coop
    assert plan.num_splits == 16
    assert plan.decode.grid == ((8 * 16,) if want_coop else (8 * 8 * 16 // 4,))


def test_head_dim_128_per_warp_plans_with_one_step_take_168_registers():
    """The per-warp kernel at head_dim 128 with one step per update and fields not joined (FP8
    keys: joined values too) is capped at 168 registers (measured faster than 128 on an H200 at two
    KV heads, S66); head_dim 64 keeps 128, and 4-bit keys next to joined values stay uncapped."""
    def cap(preset, d, heads):
        plan = per_warp_plan(mma_plan(_layout(preset, d, heads), 8))
        return plan, mma_kernel_plan(_layout(preset, d, heads), plan, 4, 8 * heads, 16).maxnreg

    for preset in ("turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4"):
        plan, n = cap(preset, 128, 2)
        assert plan.SUB == 1 and not plan.K_MERGE and n == 168, preset
    plan, n = cap("turboquant_k8v4", 128, 2)
    assert plan.V_MERGE and n == 168  # FP8 keys with joined values
    plan, n = cap("turboquant_3bit_nc", 64, 3)
    assert plan.SUB == 1 and n == 128
    plan, n = cap("turboquant_4bit_nc", 128, 8)
    assert plan.V_MERGE and not plan.K_FP8 and n == 0
    plan = per_warp_plan(mma_plan(_layout("turboquant_4bit_nc", 128, 2), 8))
    assert mma_kernel_plan(_layout("turboquant_4bit_nc", 128, 2), plan, 4, 16, 16, d128_cap=False).maxnreg == 128
    with pytest.raises(TypeError, match="d128_cap must be a bool, got int"):
        mma_kernel_plan(_layout("turboquant_4bit_nc", 128, 2), plan, 4, 16, 16, d128_cap=1)
    # the planner keeps 168 only where the plan is otherwise the older cap's: not where it moves the split
    # count (an SM holds 4 CTAs of the kernel at 128 registers, 3 at 168; 132 SMs) ...
    def occupancy(k):
        return {128: 4, 168: 3}.get(k.maxnreg, 4)

    for preset, older in (("turboquant_4bit_nc", 128), ("turboquant_k8v4", 0)):
        lay = _layout(preset, 128, 2)
        few = plan_decode(lay, 32, 16, 1024, DeviceCaps.sm90(), same_codebooks=True, occupancy=occupancy)
        assert (few.decode.kernel, few.num_splits, few.decode.maxnreg) == ("mma", 16, 168)  # 256 CTAs
        many = plan_decode(lay, 64, 8, 512, DeviceCaps.sm90(), same_codebooks=True, occupancy=occupancy)
        assert (many.decode.kernel, many.num_splits, many.decode.maxnreg) == ("mma", 16, older)  # 168: 12
    # ... nor the choice between the cooperative and the per-warp kernel (B32x4K, 8 KV heads: with the
    # 168 cap's residency the per-warp kernel would take 6 splits instead of the cooperative 8)
    lay = _layout("turboquant_k8v4", 128, 8)
    plan = plan_decode(lay, 32, 32, 256, DeviceCaps.sm90(), same_codebooks=True,
                       occupancy=lambda k: 2 if k.kernel == "coop" else {0: 4, 168: 3}[k.maxnreg])
    assert (plan.decode.kernel, plan.num_splits) == ("coop", 8)


@pytest.mark.parametrize("preset,arr,d,batch,max_len,want_coop,splits", [
    ("tq4", "row", 96, 1, 32768, False, 64),  # the ring: 64 CTAs of 16 warps (<= 66): per-warp, 256 CTAs
    ("k5v4h", "slot", 128, 1, 16384, False, 64),
    ("turboquant_4bit_nc", "slot", 128, 1, 16384, False, 64),
    ("tq4", "row", 96, 2, 16384, True, 64),  # 128 CTAs: the ring stays
    ("tqkern_k5v3", "slot", 96, 16, 4096, True, 8),
])
def test_two_step_rings_at_16_kv_heads_give_way_where_they_fill_half_the_sms(preset, arr, d, batch, max_len,
                                                                              want_coop, splits):
    """At 16 KV heads (one 16-warp CTA an SM) a two-step cooperative ring whose launch holds at
    most half the SMs' CTAs (batch 1) runs the per-warp kernel instead (measured on an H200 in S67).
    Counts by hand, 132 SMs: the ring's ``num_splits_mma`` of 2112 warps, 16 pairs a sequence: 64
    (batch 1-2: its cap), 8 at B16x4K (``max_len`` // 512); per-warp (3 CTAs of 4 warps an SM, one
    query column: the full wave of 1584 warps): 64 splits of 16 warps, 256 CTAs."""
    layout = _layout(preset, d, 16, arr)
    plan, _ = _plan_with(layout, batch, max_len, lambda k: 1 if k.kernel == "coop" else 3, hq=16)
    assert plan.decode.kernel == ("coop" if want_coop else "mma")
    assert plan.num_splits == splits
    assert plan.decode.grid == ((batch * splits,) if want_coop else (batch * 16 * splits // 4,))


@pytest.mark.parametrize("hq,splits", [(16, 64), (8, 33)])
def test_two_column_tiles_count_as_two_warps_in_the_per_warp_wave(hq, splits):
    """The per-warp kernel's half wave (``PER_WARP_WAVE``) counts a warp of two query column tiles
    (GQA 16: Llama-3-405B-TP8) twice, as the two warps it replaced: 16 sequences at one KV head, 2
    CTAs of 4 warps an SM (1056 warps): 1056 / 16 = 66, capped at 64 splits (256 CTAs, in the round
    of 264 the count ends in), where one tile (GQA 8) takes the half wave's 33 (132 CTAs)."""
    layout = _layout("tq4", 128, 1, "row")
    plan, _ = _plan_with(layout, 16, 32768, lambda k: 2, hq=hq)
    assert plan.decode.kernel == "mma" and dict(plan.decode.constexprs)["QT"] == (2 if hq == 16 else 1)
    assert plan.num_splits == splits
    assert plan.decode.grid == (16 * splits // 4,)


@pytest.mark.parametrize("preset,batch,max_len,hkv,want_kernel,want", [
    ("turboquant_4bit_nc", 1, 131072, 1, "mma", 512), ("tq4", 1, 65536, 1, "mma", 512),
    ("k5v4h", 1, 32768, 1, "mma", 256), ("turboquant_k8v4", 1, 16384, 1, "mma", 128),
    ("turboquant_4bit_nc", 4, 32768, 1, "mma", 128),  # 128 CTAs at 128 splits: not raised
    ("turboquant_4bit_nc", 1, 131072, 8, "coop", 128),  # cooperative rings keep 128
])
def test_per_warp_plans_of_few_pairs_take_up_to_512_splits(preset, batch, max_len, hkv, want_kernel, want):
    """Batch 1 at one KV head (Llama-3-70B / 405B on 8 GPUs, head_dim 128): the per-warp kernel's
    split count rises past 128 to one CTA an SM, splits of >= 128 tokens (S69, H200: 1x128K 39.2 ->
    18.2 µs for turboquant_4bit_nc); offline residency (2 CTAs of 4 warps an SM, half of them)."""
    layout = _layout(preset, 128, hkv, "row" if preset == "tq4" else "slot")
    plan = plan_decode(layout, batch, 8 * hkv, max_len // 16, DeviceCaps.sm90(), same_codebooks=True)
    assert plan.decode.kernel == want_kernel, plan.describe()
    assert plan.num_splits == want, plan.describe()
