"""Variants of the warp-MMA decode kernel's cooperative plan (:func:`.mma_plans.coop_plan`) that the
decode planner (:mod:`.plan`) weighs per device and launch: CTAs whose warps share one or two KV
heads (:func:`shared_head_plan`), a shallower ring for two CTAs an SM (:func:`two_cta_plan`), and the
table of 5-bit code pairs (:func:`code_pair_plan`). Nothing here compiles or launches."""

from __future__ import annotations

import dataclasses

from tqkern.layouts import PagedLayout
from tqkern.ops.paged_decode.mma_plans import (_SMEM_OPTIN, _SMEM_PER_SM, _SMEM_RESERVED, MmaPlan, _coop_shape,
                                               coop_plan, coop_smem_bytes, per_warp_plan)

__all__ = ["code_pair_plan", "shared_head_plan", "two_cta_plan"]


def shared_head_plan(plan: MmaPlan, layout: PagedLayout, ws: int, stages: int | None = None,
                     sub: int | None = None) -> MmaPlan | None:
    """``plan`` made cooperative, with the stage shape :func:`mma_plan` gives 4–16 KV heads, for a
    layout of one or two KV heads, whose CTA would otherwise be one or two warps: ``ws`` warps per
    KV head (``WS``), each a split of the CTA's range taking ``SUB`` steps of every stage of
    ``SUB·ws`` steps (the split count of a launch is then a multiple of ``ws``). ``None`` where no
    such plan applies: more than two KV heads, query heads in more than one warp per KV head
    (``GS > 1``), blocks not a multiple of 16 tokens, a CTA of more than 16 warps, or stages beyond
    one CTA's shared memory. ``stages``: the ring's depth (default: the 4–16-head plan's); ``sub``:
    steps per warp in a stage (``SUB``, 1 or 2; default: the 4–16-head plan's)."""
    if not isinstance(plan, MmaPlan):
        raise TypeError(f"plan must be an MmaPlan from mma_plan, got {type(plan).__name__}")
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a tqkern.PagedLayout, got {type(layout).__name__}")
    if not isinstance(ws, int) or isinstance(ws, bool) or ws not in (2, 4, 8, 16):
        raise ValueError(f"ws must be 2, 4, 8 or 16, got {ws!r}")
    if sub is not None and (not isinstance(sub, int) or isinstance(sub, bool) or sub not in (1, 2)):
        raise ValueError(f"sub must be 1 or 2, got {sub!r}")
    hkv = layout.num_kv_heads
    if hkv > 2 or plan.GS != 1 or hkv * ws > 16:
        return None
    default_sub, default_stages = _coop_shape(bool(plan.V_UNIFORM), bool(plan.K_FP8))
    base = dataclasses.replace(per_warp_plan(plan), SUB=default_sub if sub is None else sub, WS=ws)
    return coop_plan(base, layout, default_stages if stages is None else stages)


def two_cta_plan(plan: MmaPlan, layout: PagedLayout) -> MmaPlan | None:
    """The cooperative ``plan`` of 5-bit keys and Lloyd-Max values (4 stages of two steps beside
    a 36–40 KB pair table: one 8-warp CTA per SM) with a ring of 2 such stages, small enough for
    two CTAs per SM (their 128 registers allow two). ``None`` where ``plan`` is not such a plan, its
    CTA is not 8 warps (the only geometry measured), or two CTAs do not fit one SM's shared memory.
    The decode planner takes it where the launch then fills more than one CTA per SM with splits
    of ≥ 1024 tokens (:func:`.plan.plan_decode`; measured in ``docs/performance.md``, "S40: two
    CTAs per SM for 5-bit keys")."""
    if not isinstance(plan, MmaPlan) or not plan.COOP:
        raise TypeError(f"plan must be a cooperative plan (an MmaPlan from coop_plan), got {plan!r:.80}")
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a tqkern.PagedLayout, got {type(layout).__name__}")
    if plan.K_BITS != 5 or plan.V_UNIFORM or plan.COOP <= 2 or layout.num_kv_heads != 8:
        return None
    out = coop_plan(dataclasses.replace(per_warp_plan(plan), SUB=2), layout, 2)
    if out is None or 2 * (coop_smem_bytes(out) + _SMEM_RESERVED) > _SMEM_PER_SM:
        return None
    return out


def code_pair_plan(plan: MmaPlan, layout: PagedLayout, smem_optin: int = _SMEM_OPTIN) -> MmaPlan | None:
    """The cooperative ``plan`` of 5-bit keys at 4 KV heads and head_dim 128, 8 KV heads and
    head_dim 64 or 128, or two KV heads at head_dim 128 in shared-head CTAs of 4 warps each
    (:func:`shared_head_plan`, ``WS = 4``) — CTAs of 4 or 8 warps — with the code-pair table
    (``KP``): entries ``K_AT + j`` hold ``(c[j & 31], c[j >> 5])`` for all 1024 pairs ``j`` of two
    adjacent codes (the 10-bit field of a lane's chunk), so a pair of keys is one lookup instead of
    two and a PRMT. It takes 128 KB more table than the 32 single-code entries, so the ring gets
    shallower: at 4 KV heads the
    deepest ring of 3 to ``plan.COOP`` stages that fits ``smem_optin`` bytes (k5v4h 3, tqkern_k5v3
    4); in 8-warp CTAs the deepest of 2 to ``plan.COOP`` stages of the plan's two steps (head_dim
    128: tqkern_k5v3 2; head_dim 64: k5v4h 3, tqkern_k5v3 4), else 3 stages of one step (``SUB = 1``;
    k5v4h at head_dim 128, whose 256 value pairs leave no room for two of two). ``None`` where it
    does not apply (other key codes, head_dims or KV-head counts, one KV head, PRMT-addressed
    plans) or fit: only these shapes were measured.

    Measured (H200, CUDA graphs, µs, the planner's plan without → with it). S59, 4 KV heads:
    Qwen2.5-7B B1×64K k5v4h 35.7 → 33.0, tqkern_k5v3 39.8 → 36.7 (outputs bit-equal); B16×32K 142.7
    → 132.2 and 172.4 → 157.8 (16 → 8 splits: one CTA an SM where two fitted before). S60, 8 KV
    heads (k5v4h / tqkern_k5v3): Llama-3-8B B1×128K 88.7 → 82.5 / 94.7 → 83.6; B32×16K 271.6 →
    260.2 / 297.7 → 264.0; B8×64K 270.3 → 263.5 / 292.6 → 266.8; B32×4K 86.0 → 80.0 / 92.3 → 80.9;
    B128×1K 85.6 → 79.6 / 92.1 → 80.9; Llama-3-8B B256×1K 146.7 → 152.2 (256 CTAs, two rounds of
    one an SM, where the two-CTA plan runs one round of two: the planner keeps that plan where the
    table's launch needs more than one round) / 161.7 → 153.8; head_dim 64, Llama-3.2-1B B64×8K
    153.9 → 139.8 / 167.5 → 162.1 (4 → 2 splits). k5v4h's one-step stages alone (no table) lost
    3.4% at B1×128K (88.7 → 91.7). S61, two KV heads (shared-head CTAs, k5v4h / tqkern_k5v3):
    Llama-3-70B-TP4 B32×16K 96.4 → 89.6 / 101.8 → 91.9; B16×64K 156.7 → 144.3 / 167.2 → 148.7;
    B128×2K 62.1 → 58.1 / 64.3 → 58.6; Llama-3-8B-TP4 B64×8K (Hq 8) 85.5 → 78.6 / 91.4 → 81.1;
    Qwen2.5-7B-TP2 B32×16K (Hq 14) 94.8 → 87.9 / 100.3 → 89.5 (k5v4h's two-step ring does not fit;
    tqkern_k5v3's one-step ring of 3: 94.3 / 153.4 / 60.0 / 83.5 / 92.2). One KV head (4-warp CTAs)
    gained only at Llama-3-405B-TP8 B16×32K (k5v4h 81.4 → 70.9) and lost at B32×16K (82.9 → 90.3),
    B4×128K, and Llama-3-70B-TP8 B8×64K (68.5 → 88.7): not taken."""
    if not isinstance(plan, MmaPlan) or not plan.COOP:
        raise TypeError(f"plan must be a cooperative plan (an MmaPlan from coop_plan), got {plan!r:.80}")
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a tqkern.PagedLayout, got {type(layout).__name__}")
    heads = layout.num_kv_heads
    shapes = ((4, 0, 128), (8, 0, 64), (8, 0, 128), (2, 4, 128))  # (KV heads, WS, head_dim)
    if plan.K_BITS != 5 or plan.LUT_AT or (heads, plan.WS or 0, plan.D) not in shapes:
        return None
    eight_warps = heads * (plan.WS or 1) == 8
    rings = [(plan.SUB, n) for n in range(plan.COOP, 1 if eight_warps else 2, -1)]
    for sub, stages in rings + ([(1, 3)] if eight_warps else []):
        out = dataclasses.replace(plan, KP=1, SUB=sub, COOP=stages)
        if coop_smem_bytes(out) <= smem_optin:
            return out
    return None
