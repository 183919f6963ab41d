"""The general kernel's plan (:mod:`.general`): its read plan (:func:`fast_path_plan`), tile
(BN, warps, stages) and split count (:func:`num_splits_for`), for :func:`.plan.plan_decode`, which
runs it where the warp-MMA kernel does not apply (the fp16 preset, layouts ``mma_plan`` rejects,
caches not 16-byte aligned, GPUs below sm_80, the interpreter). Pure: nothing here compiles."""

from __future__ import annotations

import math

from tqkern.layouts import PagedLayout
from tqkern.ops.codecs import DT_BF16, DT_F16, Kind, layout_args, layout_consts
from tqkern.ops.common import halfword_aligned
from tqkern.ops.paged_decode.plan_types import KernelPlan

__all__ = ["num_splits_for", "fast_path_plan", "general_decode"]

_LONG_SPLIT_TOKENS = 2048  # num_splits_for's default: splits this long fill whole rounds of resident CTAs


def num_splits_for(num_seqs: int, num_kv_heads: int, max_len: int, num_sms: int, block_n: int,
                   resident_ctas: int | None = None, min_tokens: int = _LONG_SPLIT_TOKENS,
                   most: int = 64) -> int:
    """The general kernel's splits: ~4 programs per SM, never fewer than 4·BN tokens per split.

    With ``resident_ctas`` (programs the GPU holds at once) and long splits (≥ ``min_tokens`` of
    ``max_len`` each), the count ``k`` up to that one with the fewest waves per unit of work
    (``ceil(programs·k / resident_ctas) / k``; the smallest such ``k``), so that the last wave is
    not a fraction of the GPU. Measured on the H100 (fp16 path, B8×64K: 64 programs per split,
    396 resident): 9 splits (1.45 waves) 770 µs, 6 splits (0.97 waves) 712 µs; shorter splits
    gain nothing from it (SmolLM2 B32×4K: 4 splits, one wave, 45.7 µs; 6 splits 43.2 µs), but for
    fp16 caches at head_dim ≥ 96 on the H200 (``min_tokens=0``; S53, Gemma-2-9B B8×8K: 4 splits
    136.0 µs, 9 152.4).

    Where that launch has fewer programs than SMs (batch 1–2 at short contexts), ~2 programs per
    SM instead, with splits of ≥ BN tokens, at most ``most``. Measured (H200, session 62, fp16 cache,
    head_dim 128, µs, SDPA fp16 in brackets): Llama-3-8B 1×4K 8 → 32 splits 15.5 → 11.0 (9.2), 1×8K
    16 → 33 16.8 → 14.7 (11.2); Qwen2.5-7B 1×4K 8 → 32 15.7 → 9.2 (7.7), 1×16K 32 → 64 17.5 → 14.3
    (12.2); Llama-3-70B-TP4 1×16K 32 → 64 15.2 → 12.0 (9.9). Above 64 (``most`` up to 256: the
    planner's fp16 caches at head_dim 96–128), a count whose splits leave none empty at ``max_len``
    (a kernel split spans whole BN tiles: 264 splits of 131072 tokens are 256 of 512 and 8 empty).
    Measured (H200, session 70, fp16 cache, head_dim 128, µs at 64 / 128 / 256 / 264 / 512 splits,
    SDPA fp16 in brackets): one KV head, Llama-3-70B-TP8 1×128K 46.7 / 33.2 / **27.8** / 29.3 / 29.8
    (27.9), Llama-3-405B-TP8 1×32K 14.5 / 12.8 / **12.1** / 12.5 / 14.4 (11.8); two KV heads
    (Llama-3-405B-TP4) 1×128K 55.1 / **43.8** / 47.4 (38.3), 1×32K 18.0 / **14.6** / 18.8 (12.5).
    Four KV heads already hold 256 programs at 64 (Qwen2.5-7B 1×64K: 42.3 / 45.4 / 49.0).

    Depends only on shapes (never on ``seq_lens`` values), so a CUDA graph captured for a batch
    shape stays valid whatever lengths it replays with."""
    if not isinstance(most, int) or isinstance(most, bool) or most < 1:
        raise ValueError(f"most must be a positive int, got {most!r}")
    if resident_ctas is not None and (not isinstance(resident_ctas, int) or resident_ctas < 1):
        raise ValueError(f"resident_ctas must be None or a positive int, got {resident_ctas!r}")
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0:
        raise ValueError(f"min_tokens must be a non-negative int, got {min_tokens!r}")
    programs = max(1, num_seqs * num_kv_heads)
    want = max(1, math.ceil(4 * num_sms / programs))
    cap = max(1, max_len // (4 * block_n))
    n = int(min(want, cap, 64))
    if resident_ctas and max_len // n >= min_tokens:
        n = min(range(1, n + 1), key=lambda k: (math.ceil(programs * k / resident_ctas) / k, k))
    if programs * n < num_sms:  # fewer programs than SMs: ~2 per SM, splits of >= BN tokens (S62)
        n = max(n, min(math.ceil(2 * num_sms / programs), max_len // block_n, most))
        if n > 64:  # none empty at max_len (S70)
            per = -(-(-(-max_len // n)) // block_n) * block_n  # the kernel's tokens a split
            n = -(-max_len // per)
    return n


def fast_path_plan(layout) -> dict:
    """The general kernel's read plan: which sides take the 4-bit word path and how their words
    are read (``K_FAST``/``V_FAST``: 4 aligned words, 2 funnel-shifted words, 1 16-bit halves, 0
    the general path), and whether their per-token float fields allow one typed load
    (``*_PAR_ALIGNED``)."""
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a tqkern.PagedLayout, got {type(layout).__name__}")
    c = layout_consts(layout)
    d, dp, rb = layout.head_dim, c["DP"], layout.row_bytes
    raw_bf16 = _raw_bf16(c)
    plan = {}
    for p in ("K", "V"):
        a_off, a_stride = c[f"{p}_A_OFF"], c[f"{p}_A_STRIDE"]
        unit = 0
        if _four_bit_codes(c, p) and dp == d and not raw_bf16:
            if a_off % 4 == 0 and a_stride % 4 == 0 and rb % 4 == 0:
                unit = 4
            elif a_off % 2 == 0 and a_stride % 2 == 0 and rb % 4 == 0 and d % 8 == 0:
                unit = 2
            elif a_off % 2 == 0 and a_stride % 2 == 0 and rb % 2 == 0:
                unit = 1
        nb = 4 if c[f"{p}_PARAM_DTYPE"] == 1 else 2
        plan[f"{p}_FAST"] = unit
        plan[f"{p}_PAR_ALIGNED"] = all(v % nb == 0 for v in (c[f"{p}_B_OFF"], c[f"{p}_B_STRIDE"], c[f"{p}_C_OFF"],
                                                              c[f"{p}_C_STRIDE"], rb))
    return plan


def _four_bit_codes(c: dict, p: str) -> bool:
    """Whether side ``p`` (``"K"``/``"V"``) of layout constants ``c`` holds 4-bit codes (Lloyd-Max
    or uniform): the sides the word and half-tile paths read."""
    return c[f"{p}_KIND"] in (Kind.LLOYD_MAX, Kind.UNIFORM) and c[f"{p}_BITS"] == 4


def _raw_bf16(c: dict) -> bool:
    """Whether a side of layout constants ``c`` is raw bf16 (the dots then run in bf16)."""
    return any(c[f"{p}_KIND"] == Kind.RAW and c[f"{p}_PARAM_DTYPE"] == DT_BF16.value for p in "KV")


def _raw_f16(c: dict) -> bool:
    """Whether both sides of layout constants ``c`` are raw float16 (an uncompressed fp16 cache)."""
    return all(c[f"{p}_KIND"] == Kind.RAW and c[f"{p}_PARAM_DTYPE"] == DT_F16.value for p in "KV")


def general_decode(layout, s, hq, max_blocks, caps, num_splits, occupancy, block_n, num_warps, num_stages, maxnreg,
                   options) -> tuple[KernelPlan, int]:
    """The general kernel's launch and split count (arguments: :func:`.plan.plan_decode`'s)."""
    fast = fast_path_plan(layout)
    # measured (H100, B32x16K, head_dim 128): BN 128 best for the word path, 64 for the rest;
    # funnel-shifted words with 2 stages ran 2.5x slower than with 1. head_dim 256 (H200, S49,
    # Gemma-2-9B B8x8K with a soft-cap, µs): 2 stages lost everywhere but at parity (row-arranged
    # turboquant_k3v4_nc BN 128: 1294 vs 404 with 1; turboquant_3bit_nc BN 64: 1838 vs 550;
    # tqkern_k5v3 BN 64: 3195 vs 678); BN 64 won unless both sides take the word path (slot
    # turboquant_k3v4_nc 411 vs 686 at 128, k5v4h 449 vs 550; tq4 row 276 vs 219 at 128)
    wide = layout.head_dim >= 256
    words = fast["K_FAST"] and fast["V_FAST"] if wide else fast["K_FAST"] or fast["V_FAST"]
    # fp16 caches (H200, S53, docs/performance.md "The fp16 path"): BN 128 with 3 stages at head_dim
    # 96-128 (B32x16K 504.8 -> 484.9 µs; D64 lost), 2 stages at 256 (Gemma-2-9B 197.6 -> 152.4)
    raw16 = layout.head_dim >= 96 and _raw_f16(layout_consts(layout))
    bn0 = block_n if block_n is not None else 128 if words or (raw16 and not wide) else 64
    st0 = num_stages if num_stages is not None else (2 if wide else 3) if raw16 else \
        1 if wide or 2 in (fast["K_FAST"], fast["V_FAST"]) else 2
    # A tile the device cannot hold (occupancy 0: e.g. head_dim 256 row-arranged 3-bit keys at BN
    # 128 with 2 stages, 238 KB on an H200) gives way, in order, to fewer stages, then to half the
    # tokens; options the caller fixed stay fixed.
    tiles = [(bn0, st0)]
    if num_stages is None:
        tiles += [(bn0, st) for st in range(st0 - 1, 0, -1)]
    if block_n is None:
        tiles += [(bn, st0) for bn in (64, 32) if bn < bn0]
    for bn, st in tiles:
        kernel, n = _general_tiles(layout, s, hq, max_blocks, caps, num_splits, occupancy, bn, num_warps, st,
                                   maxnreg, options, fast, rounds=raw16)
        if caps.interpret or occupancy(kernel) != 0:
            break
    return kernel, n  # (where none fits, the last: its launch raises the device's error)


def _general_tiles(layout, s, hq, max_blocks, caps, num_splits, occupancy, block_n, num_warps, num_stages, maxnreg,
                   options, fast, rounds=False):
    c = layout_consts(layout)
    d, dp = layout.head_dim, c["DP"]
    hkv = layout.num_kv_heads
    g = hq // hkv
    raw_bf16 = _raw_bf16(c)

    def halves(side, p) -> bool:
        return _four_bit_codes(c, p) and dp == d and d >= 32 and not fast[f"{p}_FAST"]

    consts = {k: v for k, v in layout_args(layout).items() if not k.startswith("PAD")}
    head = dict(G=g, GP=max(16, 1 << max(0, (g - 1).bit_length())), HQ=hq, BN=block_n, BS=layout.block_size,
                K_HALVES=halves("key", "K"), V_HALVES=halves("value", "V"), DOT="bf16" if raw_bf16 else "fp16",
                K_ALIGNED=halfword_aligned(layout, "key"), V_ALIGNED=halfword_aligned(layout, "value"),
                USE_ASM=not caps.interpret, WINDOW=options.window, SOFTCAP=options.softcap, **fast)

    def kernel(n):
        cx = dict(head, NUM_SPLITS=n, **consts)
        return KernelPlan(kernel="general", grid=(s, hkv, n), constexprs=tuple(cx.items()), num_warps=num_warps,
                          num_stages=num_stages, maxnreg=maxnreg or 0)

    max_len = max_blocks * layout.block_size
    if num_splits is None:
        # fp16 caches at head_dim 96-128 fill the SMs with up to 256 splits at batch 1 (S70)
        most = 256 if rounds and layout.head_dim <= 128 else 64
        num_splits = num_splits_for(s, hkv, max_len, caps.num_sms, block_n, most=most)
        # (fp16 caches: whole rounds at any length; Gemma-2-9B 152.4 -> 136.0 µs)
        long = 0 if rounds else _LONG_SPLIT_TOKENS
        if not caps.interpret and max_len // num_splits >= long:
            ctas = occupancy(kernel(num_splits))
            if ctas:
                num_splits = num_splits_for(s, hkv, max_len, caps.num_sms, block_n, resident_ctas=ctas * caps.num_sms,
                                            min_tokens=long, most=most)
    return kernel(num_splits), num_splits
