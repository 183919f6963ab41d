"""The warp-MMA plans' split counts: ``num_splits_mma`` (one wave of resident warps) and
``fill_sms`` (more splits where a launch of few (sequence, KV head) pairs fills few SMs)."""

from __future__ import annotations

import math

import pytest


@pytest.mark.parametrize("batch, max_len, resident, want", [
    (1, 131072, 1056, 128), (1, 65536, 1056, 128),  # batch 1, >= 512 tokens per split: up to 128
    (1, 32768, 1056, 64), (1, 16384, 1056, 64),  # 128 splits would be 256 / 128 tokens each
    (2, 65536, 2112, 64),  # 128 splits of 16 pairs: 2,048 warps
    (32, 16384, 1056, 4), (8, 65536, 1056, 16),  # one wave of resident warps binds
    (1, 512, 1056, 2),  # at least 256 tokens per split
])
def test_warp_mma_split_counts(batch, max_len, resident, want):
    """``num_splits_mma`` at 8 KV heads: the cases its docstring's H100 measurements decided."""
    import tqkern.ops.paged_decode.mma_plans as plans

    assert plans.num_splits_mma(batch, 8, max_len, resident) == want


@pytest.mark.parametrize("n,pairs,max_len,resident,per_split,step,want", [
    (16, 8, 4096, 1056, 1, 1, 64),  # Llama-3-8B 1x4K, coop CTAs of 8 heads: 64 tokens a split at least
    (64, 8, 16384, 1056, 1, 1, 128),  # 1x16K: 128 splits at most
    (64, 8, 16384, 1584, 2, 1, 66),  # the per-warp kernel (2 CTAs a split): one CTA an SM, 132
    (64, 8, 32768, 1584, 2, 1, 66),  # ... at 32K too
    (32, 16, 8192, 1584, 4, 1, 33),  # batch 2 (4 CTAs a split), 16 pairs: at most 64, then one CTA an SM
    (64, 16, 16384, 1056, 1, 1, 64),  # half the resident warps already (1024 of 1056): kept
    (8, 256, 16384, 2112, 1, 1, 8),  # B32x16K (two 8-warp CTAs an SM): kept
    (64, 2, 16384, 1056, 0.25, 4, 128),  # Llama-3-70B-TP4's shared-head plan (WS 4): multiples of 4
    (16, 2, 2048, 1056, 0.25, 4, 32),  # 2K tokens: 64 a split
    (8, 8, 4096, 1056, 8, 1, 16),  # 8 CTAs a split: 16 splits fill the SMs (128 CTAs)
    (20, 8, 4096, 1056, 8, 1, 20),  # never fewer splits than given
])
def test_fill_sms_raises_splits_of_few_pairs(n, pairs, max_len, resident, per_split, step, want):
    """``fill_sms``: at most half the resident warps in use → the most splits up to one warp per
    resident warp, ≥ 64 tokens each, 128 (64 above 8 pairs), one CTA per SM (132); in multiples
    of ``step``. Counts worked by hand."""
    from tqkern.ops.paged_decode.mma_plans import fill_sms

    def ctas(m):
        return math.ceil(m * per_split)

    assert fill_sms(n, pairs, max_len, resident, ctas, 132, step) == want
    assert ctas(want) <= 132 or want == n


@pytest.mark.parametrize("n,pairs,max_len,want", [
    (128, 1, 131072, 512),  # one KV head, 1x128K: 32 CTAs at 128 -> 512 splits of 256 tokens (128 CTAs)
    (128, 1, 32768, 256),  # 1x32K: 128 tokens a split at least
    (128, 1, 16384, 128),  # 1x16K: no longer than 128 splits of 128 tokens
    (128, 2, 65536, 264),  # 2 pairs: one CTA an SM binds (132 CTAs)
    (128, 4, 32768, 128),  # 4 pairs: 128 splits already fill more than half the SMs
])
def test_fill_sms_long_splits_of_the_per_warp_kernel(n, pairs, max_len, want):
    """``fill_sms(long=True)``: where 128 splits' CTAs (4 warps, a warp a split) fill at most half
    the 132 SMs, up to 512 splits of >= 128 tokens within one CTA an SM; elsewhere as without it.
    Counts worked by hand (528 resident warps)."""
    from tqkern.ops.paged_decode.mma_plans import fill_sms

    def ctas(m):
        return math.ceil(m * pairs / 4)

    assert fill_sms(n, pairs, max_len, 528, ctas, 132, 1, long=True) == want
    assert fill_sms(n, pairs, max_len, 528, ctas, 132, 1) == min(n, want)


def test_fill_sms_checks_the_grid_it_picks():
    """A grid not proportional to the splits (here m²/8 CTAs): the count whose grid fits, not
    the proportional estimate (64 splits would be 512 CTAs)."""
    from tqkern.ops.paged_decode.mma_plans import fill_sms

    assert fill_sms(8, 1, 4096, 1056, lambda m: m * m // 8, 132) == 32


@pytest.mark.parametrize("name,bad", [("num_splits", 0), ("pairs", -1), ("max_len", 2.0), ("resident_warps", True),
                                      ("num_sms", "132"), ("step", 0)])
def test_fill_sms_rejects_bad_arguments(name, bad):
    from tqkern.ops.paged_decode.mma_plans import fill_sms

    args = dict(num_splits=16, pairs=8, max_len=4096, resident_warps=1056, ctas=lambda m: m, num_sms=132, step=1)
    with pytest.raises(ValueError, match=f"{name} must be a positive int, got {bad!r}"):
        fill_sms(**{**args, name: bad})
    with pytest.raises(TypeError, match="ctas must be a callable"):
        fill_sms(**{**args, "ctas": 132})
    with pytest.raises(TypeError, match="long must be a bool, got int"):
        fill_sms(**{**args, "long": 1})
