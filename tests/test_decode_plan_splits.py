"""The decode plan's choice between the cooperative and the per-warp warp-MMA kernels where splits
are short (tqkern/ops/paged_decode/plan.py, ``_mma_decode``): shapes and residency in, kernel and
split count out. No kernel runs here."""

import pytest

from tests.test_decode_plan import _layout, _plan_with


@pytest.mark.parametrize("preset,arr,batch,max_len,per_warp_ctas,want_coop,asks,splits", [
    ("turboquant_k8v4", "slot", 32, 4096, 3, False, 2, 6),  # coop: 8 splits of 512; per-warp: 6 splits
    ("turboquant_k8v4", "slot", 128, 1024, 3, True, 2, 2),  # per-warp would have 1 split
    ("turboquant_k8v4", "slot", 32, 16384, 3, True, 1, 8),  # splits of 2048 tokens
    # 64 splits of 256 tokens either way: the per-warp kernel, then 66 splits (fill_sms: 2 CTAs a split)
    ("turboquant_k8v4", "slot", 1, 16384, 3, False, 2, 66),
    ("turboquant_k8v4", "slot", 1, 32768, 3, True, 2, 64),  # 64 splits of 512 either way (not filled)
    ("turboquant_k8v4", "slot", 1, 65536, 3, True, 2, 128),  # 128 splits of 512 either way
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
    assert asked == ["coop", "mma"][:asks]  # the cooperative plan's residency, then (maybe) the per-warp one
    assert (plan.decode.kernel == "coop") == want_coop
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
    assert asked == ["coop", "mma"]
    assert (plan.decode.kernel == "coop") == want_coop
    assert plan.num_splits == 16
    assert plan.decode.grid == ((8 * 16,) if want_coop else (8 * 8 * 16 // 4,))
