"""CI sees the GPU kernels: the warp-MMA decode plans the launcher can emit for the benchmark
presets (two with a window and a soft-cap), and the general kernel for fp16 (with and without them), compiled
for sm_90 (H100) with Triton's bundled ptxas, on a machine without a GPU. Every plan the launcher
emits has a budget below (checked without compiling); the README's test command compiles the CI
set (``CI``: every plan kind, key and value scheme, head_dim and option at least once), and
``TQKERN_SM90_ALL=1`` compiles all of them (``tests/sm90_budgets.py``).

For each compiled kernel: it compiles; its registers stay within the cap the launcher sets
(``maxnreg``; 255 where it sets none); its stack bytes (spills) and SASS instruction count stay
within the budgets recorded below, so that a refactor which adds spills or instructions to the
inner loop fails here before any device time is spent. The kernels compile in a fresh process
without ``TRITON_INTERPRET`` (the interpreter replaces them), two processes at a time.

Budgets: today's values from Triton 3.9's ptxas (CI's), and ``TRITON36``'s where the GPU
machines' Triton 3.6 exceeds them (:func:`tests.sm90_budgets.budget_of`); instruction budgets
today's count + 3%. A change that lowers a number
should lower its budget too. Shapes and presets: ``tqkern_torch/bench/shapes.py`` (B32x16K's
Hq32/Hkv8/D128, SmolLM2's Hq9/Hkv3/D64, GQA 3, and Llama-3-405B's Hq16/Hkv1/D128, GQA 16 = two
query column tiles per warp, ``QT = 2``; the last two have no cooperative plan of the 4–16-head
kind: 3 and 1 KV heads; one KV head with uniform values has ``plan.one_head_plan``'s 4-warp CTAs;
and Gemma-2-9B's Hq16/Hkv8/D256 for D256's key and value chunks (FP8, 3-bit and 4-bit keys, 3- and
4-bit values); the ``kXvYh`` formats of
``docs/quality.md`` whose values have their own table entries at B32x16K's shape; head_dim 96 at
Phi-3-mini-TP2's Hq16/Hkv16; 5-bit keys at Llama-3-70B-TP4's Hq16/Hkv2, whose shared-head plan
the launcher takes (with the code-pair table since session 61), and at Qwen2.5-7B's Hq28/Hkv4,
whose cooperative plan takes the code-pair table, as B32x16K's 5-bit plans do since session 60).
"""

from __future__ import annotations

import pytest

from tests.sm90_budgets import budget_of, check_budget, compile_reports, compiled_names
from tqkern_torch.bench.shapes import DECODE_PRESETS, decode_shape
from tqkern.ops.paged_decode.aot import plan_names, report_in_subprocess

SHAPES = ("B32x16K", "SmolLM2_B32x4K", "Llama3-405B-TP8_B16x32K")

# name -> (stack bytes, SASS instructions) today (Triton 3.9). Stack > 0: the kernel spills at the
# launcher's 128-register cap (cooperative plans: two CTAs of 8 warps per SM); pinned as budgets.
BUDGETS = {
    "mma:tq4:row:128:8:32:per_warp": (0, 1312),
    "mma:tq4:row:128:8:32:coop": (24, 1200),  # PRMT-addressed table (table256_plan)
    "mma:turboquant_4bit_nc:slot:128:8:32:per_warp": (0, 1160),
    "mma:turboquant_4bit_nc:slot:128:8:32:coop": (48, 1416),
    "mma:turboquant_k8v4:slot:128:8:32:per_warp": (0, 784),  # 168 cap at D128 one-step (S66), 150 regs
    "mma:turboquant_k8v4:slot:128:8:32:coop": (0, 808),
    "mma:turboquant_k3v4_nc:slot:128:8:32:per_warp": (0, 984),  # (168: 151 regs, no spill)
    "mma:turboquant_k3v4_nc:slot:128:8:32:coop": (24, 1288),
    "mma:turboquant_3bit_nc:slot:128:8:32:per_warp": (0, 976),  # (168: 146 regs)
    "mma:turboquant_3bit_nc:slot:128:8:32:coop": (24, 1288),
    "mma:tqkern_k5v3:slot:128:8:32:per_warp": (8, 1808),
    "mma:tqkern_k5v3:slot:128:8:32:coop": (0, 1744),
    "mma:tqkern_k5v3:slot:128:8:32:coop2": (0, 1656),  # two CTAs per SM (S40: a 2-stage ring)
    "mma:tqkern_k5v3:slot:128:8:32:pairs": (0, 1656),  # the code-pair table, 2 stages of two steps (S60)
    "mma:tq4:row:64:3:9:per_warp": (0, 976),
    "mma:turboquant_4bit_nc:slot:64:3:9:per_warp": (0, 824),
    "mma:turboquant_k8v4:slot:64:3:9:per_warp": (0, 568),
    "mma:turboquant_k3v4_nc:slot:64:3:9:per_warp": (0, 800),
    "mma:turboquant_3bit_nc:slot:64:3:9:per_warp": (0, 800),
    "mma:tqkern_k5v3:slot:64:3:9:per_warp": (0, 1248),
    "mma:k5v4h:slot:64:3:9:per_warp": (0, 1320),
    "mma:tq4:row:128:1:16:per_warp": (0, 1680),  # QT = 2 (GQA 16: two column tiles), uncapped
    "mma:turboquant_4bit_nc:slot:128:1:16:per_warp": (0, 1272),
    "mma:turboquant_k8v4:slot:128:1:16:per_warp": (0, 1000),
    "mma:turboquant_k3v4_nc:slot:128:1:16:per_warp": (0, 1240),
    "mma:turboquant_3bit_nc:slot:128:1:16:per_warp": (0, 1248),
    "mma:tqkern_k5v3:slot:128:1:16:per_warp": (0, 2088),
    "mma:k5v4h:slot:128:1:16:per_warp": (0, 2032),  # QT = 2, uncapped (255 registers)
    # (S54) one KV head with uniform values at 16K+ tokens: 4-warp CTAs (plan.one_head_plan), 188-195
    # registers (uncapped)
    "mma:turboquant_4bit_nc:slot:128:1:16:one_head": (0, 1536),
    "mma:turboquant_k3v4_nc:slot:128:1:16:one_head": (0, 1416),
    "mma:turboquant_3bit_nc:slot:128:1:16:one_head": (0, 1440),
    # head_dim 256 (Gemma-2-9B: Hkv 8, GQA 2), FP8 and 3-bit keys with 4-bit uniform values (S21)
    "mma:turboquant_k8v4:slot:256:8:16:per_warp": (16, 1192),
    "mma:turboquant_k8v4:slot:256:8:16:coop": (208, 1296),
    "mma:turboquant_k3v4_nc:slot:256:8:16:per_warp": (0, 1400),
    "mma:turboquant_k3v4_nc:slot:256:8:16:coop": (0, 1928),
    # (S27) 12-byte 3-bit value chunks, 32-byte 4-bit key chunks (two 16-byte loads); 36-bit chunks at D96;
    # D256 plans but FP8 keys' run uncapped (175-254 registers, no spill)
    "mma:turboquant_3bit_nc:slot:256:8:16:per_warp": (0, 1392),
    "mma:turboquant_3bit_nc:slot:256:8:16:coop": (0, 1912),
    "mma:tq4:row:256:8:16:per_warp": (0, 1992),
    "mma:turboquant_3bit_nc:slot:96:16:16:per_warp": (0, 840),
    "mma:turboquant_3bit_nc:slot:96:16:16:coop": (0, 1064),
    # Lloyd-Max values of their own codebook below the keys' table entries (docs/quality.md's
    # per-layer formats; session 23)
    "mma:k4v3h:slot:128:8:32:per_warp": (0, 1720),
    "mma:k4v3h:slot:128:8:32:coop": (48, 1672),
    "mma:k4v2h:slot:128:8:32:per_warp": (0, 1552),
    "mma:k4v2h:slot:128:8:32:coop": (48, 1496),
    "mma:k3v2h:slot:128:8:32:per_warp": (0, 1328),
    "mma:k3v2h:slot:128:8:32:coop": (0, 1360),
    "mma:k5v4h:slot:128:8:32:per_warp": (0, 1808),
    "mma:k5v4h:slot:128:8:32:coop": (0, 1720),
    "mma:k5v4h:slot:128:8:32:coop2": (0, 1632),  # two CTAs per SM (S40: a 2-stage ring)
    "mma:k5v4h:slot:128:8:32:pairs": (0, 1224),  # the code-pair table, 3 stages of one step (S60)
    # head_dim 96 (Phi-3 on 2 GPUs: Hkv 16, GQA 1; session 23); 3-bit values stay on the general kernel
    "mma:tq4:row:96:16:16:per_warp": (0, 1160),
    "mma:turboquant_4bit_nc:slot:96:16:16:per_warp": (0, 848),
    # (16-warp CTAs: the pair table's fill, which they skipped before S27, +72 / +80 instructions)
    "mma:turboquant_4bit_nc:slot:96:16:16:coop": (8, 1048),
    "mma:turboquant_k8v4:slot:96:16:16:per_warp": (0, 608),
    "mma:turboquant_k8v4:slot:96:16:16:coop": (0, 632),
    "mma:turboquant_k3v4_nc:slot:96:16:16:per_warp": (0, 824),
    "mma:turboquant_k3v4_nc:slot:96:16:16:coop": (0, 1056),
    # (S28) a head_dim 96 row whose 12-byte 4-bit key chunks sit at aligned offsets: three single-word
    # loads (before: a compile error, found by the GPU fuzz test)
    "mma:tq4:row:96:3:3:per_warp": (0, 1184),
    # (S67) Lloyd-Max values at 16 KV heads: a cooperative ring of 2 stages of two steps (4 do not fit
    # one CTA; 16 warps: 128 registers at most)
    "mma:tq4:row:96:16:16:coop": (0, 976),
    "mma:k5v4h:slot:96:16:16:per_warp": (0, 1480),
    "mma:k5v4h:slot:96:16:16:coop": (0, 1360),
    "mma:tqkern_k5v3:slot:96:16:16:per_warp": (0, 1504),
    "mma:tqkern_k5v3:slot:96:16:16:coop": (0, 1400),
    "mma:k5v4h:slot:128:16:16:per_warp": (0, 1736),
    "mma:k5v4h:slot:128:16:16:coop": (8, 1584),
    # (S28) 5-bit keys at head_dim 256: one step per update (two steps: 255 registers + 40 B stack);
    # (S30) a 232-register cap for 3-bit values, none for k5v4h's 4-bit values (254 registers)
    "mma:tqkern_k5v3:slot:256:8:16:per_warp": (0, 1792),
    "mma:k5v4h:slot:256:8:16:per_warp": (0, 1856),
    # (S49) the window and the soft-cap on the warp-MMA kernel: Gemma-2-9B's both (234 / 231 registers,
    # uncapped at D256, as without them), a Mistral-style window on the default k5v4h (the cooperative
    # plan spills 40 bytes at its 128-register cap under Triton 3.9 since S59's key lookups, none under 3.6)
    "mma:turboquant_4bit_nc:slot:256:8:16:window+softcap:per_warp": (0, 1560),
    "mma:turboquant_4bit_nc:slot:256:8:16:window+softcap:coop": (0, 2104),
    "mma:k5v4h:slot:128:8:32:window:per_warp": (0, 1816),
    "mma:k5v4h:slot:128:8:32:window:coop": (0, 1728),
    "mma:k5v4h:slot:128:8:32:window:coop2": (0, 1640),
    "mma:k5v4h:slot:128:8:32:window:pairs": (0, 1232),
    # (S52) Llama-3-70B on 4 GPUs (Hq16/Hkv2/D128): 5-bit keys take 8-warp CTAs of 4 warps per KV
    # head (plan.shared_heads; the cooperative kernel at its 128-register cap)
    "mma:k5v4h:slot:128:2:16:per_warp": (0, 1808),
    "mma:k5v4h:slot:128:2:16:shared": (32, 2232),
    "mma:tqkern_k5v3:slot:128:2:16:per_warp": (8, 1816),
    "mma:tqkern_k5v3:slot:128:2:16:shared": (0, 2264),
    # (S61) and their code-pair table (k5v4h 3 stages of one step a warp, tqkern_k5v3 2 of two)
    "mma:k5v4h:slot:128:2:16:pairs": (0, 1400),
    "mma:tqkern_k5v3:slot:128:2:16:pairs": (0, 1976),
    # (S59) Qwen2.5-7B (Hq28/Hkv4/D128): 5-bit keys' cooperative plan and its code-pair table
    # (coop_variants.code_pair_plan: 1024 key pairs, 128 KB more table; its loop 1035 -> 788 instructions
    # for k5v4h, the unrolled fill of 1024 entries +136 outside it)
    "mma:k5v4h:slot:128:4:28:per_warp": (0, 1808),
    "mma:k5v4h:slot:128:4:28:coop": (0, 1784),
    "mma:k5v4h:slot:128:4:28:pairs": (0, 1920),
    "mma:tqkern_k5v3:slot:128:4:28:per_warp": (8, 1808),
    "mma:tqkern_k5v3:slot:128:4:28:coop": (0, 1824),
    "mma:tqkern_k5v3:slot:128:4:28:pairs": (0, 2024),
    # (S53) fp16 caches at head_dim 128: BN 128 with 3 stages (was 64 with 2: 952 / 1096
    # instructions); 191 registers, 197 with a window and a soft-cap
    "general:fp16:slot:128:8:32": (0, 1256),
    "general:fp16:slot:128:8:32:window+softcap": (0, 1408),
    # (S63) launched early (DecodePlan.pdl: programmatic dependent launch at batch 1): the prologue's
    # wait for the q rotation and the merge's early start (+8 instructions in the cooperative kernel)
    "mma:turboquant_4bit_nc:slot:128:8:32:pdl:per_warp": (0, 1160),
    "mma:turboquant_4bit_nc:slot:128:8:32:pdl:coop": (48, 1432),
    "general:fp16:slot:128:8:32:pdl": (0, 1256),
}
# Triton 3.6 (the GPU machines' compiler) where its ptxas exceeds the budgets above (session 44, offline)
TRITON36 = {
    "mma:k5v4h:slot:128:8:32:window:per_warp": (8, 1872),  # (S59, on the H200)
    "mma:k5v4h:slot:128:8:32:coop": (8, 1808),
    "mma:k5v4h:slot:128:8:32:coop2": (8, 1712),
    "mma:turboquant_4bit_nc:slot:128:1:16:one_head": (0, 1632),  # (S54, offline)
    "mma:k5v4h:slot:128:2:16:pairs": (0, 1504),  # (S61, on the H200)
    "general:fp16:slot:128:8:32": (0, 1536),  # (S53, offline: 203 registers)
    "general:fp16:slot:128:8:32:window+softcap": (0, 1712),
}


def _cases() -> list[str]:
    cases = []
    for shape in map(decode_shape, SHAPES):
        dims = f"{shape.head_dim}:{shape.num_kv_heads}:{shape.num_q_heads}"
        cases += [f"mma:{preset}:{arr}:{dims}" for preset, arr in DECODE_PRESETS if preset != "fp16"]
    cases += ["mma:turboquant_k8v4:slot:256:8:16", "mma:turboquant_k3v4_nc:slot:256:8:16",
              "mma:turboquant_3bit_nc:slot:256:8:16", "mma:tq4:row:256:8:16", "mma:turboquant_3bit_nc:slot:96:16:16"]
    cases += [f"mma:{name}:slot:128:8:32" for name in ("k4v3h", "k4v2h", "k3v2h")]
    cases += ["mma:tq4:row:96:16:16"] + [f"mma:{p}:slot:96:16:16" for p in ("turboquant_4bit_nc", "turboquant_k8v4",
                                                                          "turboquant_k3v4_nc")]
    cases += ["mma:tq4:row:96:3:3", "mma:tqkern_k5v3:slot:256:8:16", "mma:k5v4h:slot:256:8:16"]
    cases += ["mma:k5v4h:slot:96:16:16", "mma:tqkern_k5v3:slot:96:16:16", "mma:k5v4h:slot:128:16:16"]
    cases += ["mma:turboquant_4bit_nc:slot:256:8:16:window+softcap", "mma:k5v4h:slot:128:8:32:window"]
    cases += ["mma:k5v4h:slot:128:2:16", "mma:tqkern_k5v3:slot:128:2:16"]
    cases += ["mma:k5v4h:slot:128:4:28", "mma:tqkern_k5v3:slot:128:4:28"]
    cases += ["general:fp16:slot:128:8:32", "general:fp16:slot:128:8:32:window+softcap"]
    cases += ["mma:turboquant_4bit_nc:slot:128:8:32:pdl", "general:fp16:slot:128:8:32:pdl"]
    return cases


# What the README's test command compiles: each plan kind (per_warp, coop, coop2, pairs at 2 and 8
# KV heads, shared, one_head), key scheme (4-bit uniform and Lloyd-Max with the PRMT table, FP8, 3-
# and 5-bit), value scheme (4-, 3- and 2-bit uniform and Lloyd-Max), head_dim 64 / 96 / 128 / 256,
# QT = 2, the window and the soft-cap, the early launch, and the general kernel, at least once
CI = (
    "mma:tq4:row:128:8:32:coop",
    "mma:turboquant_4bit_nc:slot:128:8:32:per_warp",
    "mma:turboquant_k8v4:slot:128:8:32:coop",
    "mma:turboquant_k3v4_nc:slot:128:8:32:per_warp",
    "mma:turboquant_3bit_nc:slot:128:8:32:coop",
    "mma:tqkern_k5v3:slot:128:8:32:coop2",
    "mma:tq4:row:64:3:9:per_warp",
    "mma:tqkern_k5v3:slot:64:3:9:per_warp",
    "mma:turboquant_k8v4:slot:128:1:16:per_warp",
    "mma:turboquant_4bit_nc:slot:128:1:16:one_head",
    "mma:turboquant_k8v4:slot:256:8:16:coop",
    "mma:turboquant_3bit_nc:slot:256:8:16:coop",
    "mma:tq4:row:256:8:16:per_warp",
    "mma:k5v4h:slot:256:8:16:per_warp",
    "mma:turboquant_4bit_nc:slot:256:8:16:window+softcap:coop",
    "mma:k4v2h:slot:128:8:32:coop",
    "mma:turboquant_4bit_nc:slot:96:16:16:coop",
    "mma:tq4:row:96:3:3:per_warp",
    "mma:k5v4h:slot:128:2:16:shared",
    "mma:tqkern_k5v3:slot:128:2:16:pairs",
    "mma:k5v4h:slot:128:8:32:window:pairs",
    "general:fp16:slot:128:8:32:window+softcap",
    "mma:turboquant_4bit_nc:slot:128:8:32:pdl:coop",
)


@pytest.fixture(scope="module")
def reports() -> dict:
    return compile_reports(report_in_subprocess, compiled_names(BUDGETS, CI))


def test_every_launcher_plan_has_a_budget():
    """A plan the launcher newly emits (or no longer emits) must be recorded here (no compile)."""
    assert sorted(name for case in _cases() for name in plan_names(case)) == sorted(BUDGETS)


@pytest.mark.parametrize("name", compiled_names(BUDGETS, CI))
def test_sm90_registers_spills_and_instructions(reports, name):
    check_budget(reports, name, budget_of(name, BUDGETS, TRITON36))


def test_a_case_names_one_plan_or_all():
    """``report``'s case may end in one plan's name (what the CI set compiles); a plan the launcher
    does not emit there is a ValueError naming it; an unbudgeted CI case is one too."""
    base = "mma:k5v4h:slot:128:2:16"
    assert plan_names(base) == [f"{base}:per_warp", f"{base}:shared", f"{base}:pairs"]
    assert plan_names(f"{base}:pairs") == [f"{base}:pairs"]
    assert plan_names("mma:k5v4h:slot:128:8:32:window:coop2") == ["mma:k5v4h:slot:128:8:32:window:coop2"]
    with pytest.raises(ValueError, match="emits no 'one_head' plan"):
        plan_names(f"{base}:one_head")
    with pytest.raises(ValueError, match="CI cases without a budget"):
        compiled_names(BUDGETS, CI + ("mma:tq4:row:128:8:32:pairs",))
