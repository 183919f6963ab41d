"""The decode plan: every choice a ``paged_decode`` launch makes from the layout, the shapes and
the device, as one typed value (:class:`DecodePlan`), built by one pure function
(:func:`plan_decode`) from a :class:`DeviceCaps` value.

A plan has three launches: the q rotation with the block-table scan (:class:`RotatePlan`,
:mod:`.rotate`), the decode kernel (:class:`KernelPlan`: the warp-MMA kernel of
:mod:`.mma_kernel`, per warp or CTA-cooperative, or the general kernel of :mod:`.general`) and
the merge of the splits (:class:`MergePlan`, :mod:`.merge`), with the attention options it
applies (:class:`DecodeOptions`; these typed values live in :mod:`.plan_types`). Nothing here compiles or launches;
the split count of a long launch depends on how many programs of the compiled kernel the GPU holds
at once, which the caller supplies through ``occupancy`` (the torch launcher compiles the kernel
for it; :mod:`.aot` compiles offline for sm_90). ``tqkern_torch.plan_decode`` returns the plan a
call would run; ``tqkern plan`` prints one.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from tqkern.layouts import PagedLayout
from tqkern.ops.codecs import layout_consts
from tqkern.ops.paged_decode.general_plan import fast_path_plan, general_decode, num_splits_for
from tqkern.ops.paged_decode.coop_variants import code_pair_plan, shared_head_plan, two_cta_plan
from tqkern.ops.paged_decode.mma_plans import (DynamicSmemUnsupported, MmaPlan, _lut_bytes, coop_smem_bytes, fill_sms,
                                               mma_plan, num_splits_mma, per_warp_plan)
from tqkern.ops.paged_decode.plan_types import DecodeOptions, DeviceCaps, KernelPlan, Occupancy
from tqkern.ops.paged_decode.side_plans import (MergePlan, RotatePlan, _merge_plan, _rotate_plan, merge_chunks,
                                                scan_split)

__all__ = ["DeviceCaps", "DecodeOptions", "KernelPlan", "RotatePlan", "scan_split", "MergePlan", "DecodePlan",
           "plan_decode", "decode_path", "check_num_splits", "whole_rounds", "fast_path_plan", "num_splits_for",
           "merge_chunks", "workspace_numel", "shared_heads", "one_head_plan", "use_pdl", "MMA_MIN_CAPABILITY",
           "MMA_FP8_MIN_CAPABILITY"]

# The warp-MMA kernel's PTX: mma.sync m16n8k16 with fp16 operands, ld.global.nc.L2::256B
# (sm_80); cvt.rn.f16x2.e4m3x2 for FP8 keys (sm_89).
MMA_MIN_CAPABILITY = (8, 0)
MMA_FP8_MIN_CAPABILITY = (8, 9)
# The per-warp kernel's splits fill this fraction of the warps the GPU holds where each warp's
# MMA has 8 query-head columns (G = 8: GQA 8, or 16 as two warps). Measured on the H100 (session
# 22, µs, full wave -> half, same run): Llama3-70B-TP8_B32x16K (G 8) turboquant_4bit_nc 92.4 ->
# 69.9, turboquant_k8v4 93.6 -> 69.7; Llama3-405B-TP8_B16x32K (G 8, two warps per KV head) 106.0 ->
# 95.2. Not for fewer columns, where the half wave lost: Gemma-7B_B4x8K (G 1) turboquant_k8v4
# 84.3 -> 99.0, B32x4K (G 4) 89.0 -> 108.7. Why the full-column warps prefer fewer, longer splits
# was not profiled. A warp of two column tiles (QT = 2: GQA 16 in one warp since session 19) counts
# as the two warps it replaced: H200, S67, Llama3-405B-TP8_B16x32K, µs, 33 splits (the half wave
# of such warps) -> 64: turboquant_k8v4 61.5 -> 47.7, tq4 61.0 -> 50.9, k5v4h 69.2 -> 61.1,
# tqkern_k5v3 67.0 -> 57.6 (48 and 66 splits slower than 64).
PER_WARP_WAVE = 0.5
_SHARED_CTA_WARPS = 8  # the CTA of a shared-head plan (one or two KV heads)
_COOP_MIN_TOKENS = 1024  # tokens per split below which one-step cooperative plans may give way
_COOP_SHORT_TOKENS = 512  # ... and below which they give way even where the per-warp splits are no longer
_COOP_SHORT_MAX_DIM = 128  # ... a rule for head_dim up to this (above: they give way at any length under 1024)
_ONE_HEAD_SPLITS = 32  # one KV head's shared-head plan (one_head_plan): 8 CTAs of 4 warps a sequence
_ONE_HEAD_MIN_TOKENS = 16384  # ... at contexts of at least this many tokens (shorter: not measured)
# The per-warp kernel at head_dim 128, one step per update, fields not joined (FP8 keys: joined values
# too): 168 registers, not 128 (H200, S66, µs: Llama-3-70B-TP4 B32×16K turboquant_4bit_nc 89.6 → 78.1,
# turboquant_k8v4 (uncapped before) 85.4 → 78.3, 3-bit keys −2 to −4%; the 128 cap spilled 8–32 bytes
# offline). Not at head_dim 64 (SmolLM2 B32×4K turboquant_3bit_nc +5.7%); docs/performance.md "S66".
_PER_WARP_D128_MAXNREG = 168


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Everything one ``paged_decode`` launch of these shapes runs. ``workspace_numel``: float32
    elements of its split partials (a caller's ``workspace`` must hold that many)."""

    layout: PagedLayout
    num_seqs: int
    num_q_heads: int
    max_blocks: int
    caps: DeviceCaps
    path: str
    num_splits: int
    decode: KernelPlan
    rotate: RotatePlan
    merge: MergePlan
    workspace_numel: int
    options: DecodeOptions = DecodeOptions()
    pdl: bool = False

    @property
    def group(self) -> int:
        return self.num_q_heads // self.layout.num_kv_heads

    def summary(self) -> str:
        """The decode kernel's launch in one line (what ``tqkern bench`` records with each decode
        time): kernel, splits, grid, warps, the early launch, and a cooperative plan's stages and
        warps per KV head."""
        d = self.decode
        cx = dict(d.constexprs)
        out = f"{d.kernel} kernel, {self.num_splits} splits, grid {d.grid}, {d.num_warps} warps"
        if self.pdl:
            out += ", early launch"
        if cx.get("COOP"):
            out += f", {cx['COOP']} stages of {cx['SUB'] * cx.get('WS', 1)} steps"
        if cx.get("WS"):
            out += f", {cx['WS']} warps per KV head"
        if cx.get("KP"):
            out += ", code-pair table"
        return out

    def describe(self) -> str:
        """A readable multi-line summary (what ``tqkern plan`` prints)."""
        d, r = self.decode, self.rotate
        k, v = self.layout.format.key, self.layout.format.value
        lines = [f"layout      K {k.kind}/{k.bits} bits, V {v.kind}/{v.bits} bits, D={self.layout.head_dim} "
                 f"Hkv={self.layout.num_kv_heads} "
                 f"block={self.layout.block_size} {self.layout.arrangement} ({self.layout.row_bytes} B rows)",
                 f"shapes      {self.num_seqs} seqs x {self.num_q_heads} q heads, {self.max_blocks} blocks "
                 f"({self.max_blocks * self.layout.block_size} tokens)",
                 f"device      sm_{self.caps.capability[0]}{self.caps.capability[1]}, {self.caps.num_sms} SMs"
                 + (" (interpreter)" if self.caps.interpret else ""),
                 f"decode      {d.kernel} kernel, {self.num_splits} splits, grid {d.grid}, {d.num_warps} warps, "
                 f"{d.num_stages} stages, maxnreg {d.maxnreg or '-'}"
                 + (", launched early (programmatic dependent launch, the merge too)" if self.pdl else ""),
                 "constexprs  " + " ".join(f"{k}={v}" for k, v in d.constexprs),
                 f"rotate      {'Walsh-Hadamard' if r.fwht else 'product' if r.rotate else 'cast'}, "
                 f"grid {self.rotate.grid}, {self.rotate.rows} rows x {self.rotate.cols} cols, "
                 f"scan {self.rotate.grid[0] - self.rotate.programs} rows x {self.rotate.scan_block}",
                 f"merge       {self.merge.impl}, grid {self.merge.grid}, {self.merge.chunks} chunks"
                 + (", rotate back by Walsh-Hadamard" if self.merge.fwht else ", rotate back" if self.merge.rotate_back
                    else "") + (f" in a launch of its own, grid {self.merge.back_grid}" if self.merge.rotate_apart
                                else ""),
                 f"workspace   {self.workspace_numel} float32",
                 "options     " + (" ".join(f.name for f in dataclasses.fields(self.options)
                                            if getattr(self.options, f.name)) or "-")]
        return "\n".join(lines)


# -- the rules ------------------------------------------------------------------------------------
def decode_path(layout, group: int, *, same_codebooks: bool, interpret: bool = False,
                cache_aligned: bool = True, capability: tuple[int, int] | None = None) -> str:
    """Which kernel runs: ``"mma"`` (the warp-MMA kernel where :func:`.mma_plans.mma_plan`
    takes the layout, and for 4-bit Lloyd-Max values only with the keys' codebook
    (``same_codebooks``, required: the frontend passes ``DeviceParams.same_codebooks``); never
    under the interpreter, which cannot run its inline PTX, nor for a cache not 16-byte aligned,
    nor on a GPU whose compute ``capability`` (major, minor) is below ``MMA_MIN_CAPABILITY``
    (``MMA_FP8_MIN_CAPABILITY`` for FP8 keys); ``None`` skips that check) or ``"general"``."""
    plan = mma_plan(layout, group)
    if interpret or plan is None or not cache_aligned:
        return "general"
    if capability is not None:
        if not isinstance(capability, (tuple, list)) or len(capability) != 2 \
                or not all(isinstance(x, int) for x in capability):
            raise TypeError(f"capability must be a (major, minor) pair of ints, got {capability!r}")
        need = MMA_FP8_MIN_CAPABILITY if plan.K_FP8 else MMA_MIN_CAPABILITY
        if tuple(capability) < need:
            return "general"
    if plan.V_BITS == 4 and not plan.V_UNIFORM and plan.K_AT == 0 and not same_codebooks:  # K and V share pairs
        return "general"
    return "mma"


def whole_rounds(num_splits: int, ctas, num_sms: int, max_splits: int) -> int:
    """``num_splits``, or, where its launch ends in a partial round of CTAs over the SMs
    (``ctas(n)``: the grid of ``n`` splits; round ``r`` = CTAs ``r·num_sms`` onwards), the most
    splits up to ``max_splits`` whose CTAs end in that same round: the round is then full (or as
    full as ``max_splits`` allows) and every SM runs as many CTAs as the others. Never fewer
    splits than ``num_splits``.

    Measured (H200, session 51, the per-warp kernel at G 8, 4-warp CTAs, µs): Llama-3-70B-TP8
    B32×16K, whose half-wave rule gave 24 splits (192 CTAs on 132 SMs: 60 SMs run two, 72 one):
    tq4 61.2 at 24 splits, 57.5 at 32 (256 CTAs), 60.4 at 16; k5v4h 81.4 / 69.1 / 76.7;
    turboquant_4bit_nc, 33 splits by the rule (264 CTAs), 57.0 (56.2 at 32); SDPA fp16 66.6."""
    for name, v in (("num_splits", num_splits), ("num_sms", num_sms), ("max_splits", max_splits)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not callable(ctas):
        raise TypeError(f"ctas must be a callable (splits -> CTAs), got {type(ctas).__name__}")
    c = ctas(num_splits)
    if c % num_sms == 0:
        return num_splits
    end = -(-c // num_sms) * num_sms
    return next((m for m in range(max(max_splits, num_splits), num_splits, -1) if ctas(m) <= end), num_splits)


def workspace_numel(num_seqs: int, num_q_heads: int, num_splits: int, dp: int) -> int:
    """float32 elements of the decode workspace: partial outputs plus (max, sum) per split."""
    return num_seqs * num_q_heads * num_splits * (dp + 2)


# -- the plan -------------------------------------------------------------------------------------


def check_num_splits(num_splits) -> None:
    """A split count a caller fixes: ``None`` (the planner's) or an int in [1, 1024]."""
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= 1024):
        raise ValueError(f"num_splits must be None or an int in [1, 1024], got {num_splits!r}")


def use_pdl(caps: DeviceCaps, decode: KernelPlan) -> bool:
    """Whether the decode and the merge launch early (programmatic dependent launch, sm_90 on):
    where the decode's grid holds at most half as many CTAs as the device has SMs (batch 1,
    short contexts, few KV heads). Measured (H200, session 63): −3 to −12.5% there at every
    shape and preset timed; at 128–132 CTAs from −10% to +52% (Llama-3-8B 1×128K)."""
    if not isinstance(caps, DeviceCaps):
        raise TypeError(f"caps must be a DeviceCaps, got {type(caps).__name__}")
    if not isinstance(decode, KernelPlan):
        raise TypeError(f"decode must be a KernelPlan, got {type(decode).__name__}")
    return not caps.interpret and caps.capability >= (9, 0) and 2 * math.prod(decode.grid) <= caps.num_sms


def plan_decode(layout: PagedLayout, num_seqs: int, num_q_heads: int, max_blocks: int, caps: DeviceCaps, *,
                same_codebooks: bool, cache_aligned: bool = True, num_splits: int | None = None,
                path: str = "auto", occupancy: Occupancy | None = None, block_n: int | None = None,
                num_warps: int = 4, num_stages: int | None = None, maxnreg: int | None = None,
                options: DecodeOptions | None = None, signed_sylvester: bool = False) -> DecodePlan:
    """The plan of one ``paged_decode`` launch (pure: same input, same plan).

    ``path``: ``"auto"`` (:func:`decode_path`), ``"mma"`` (or ``ValueError`` where it does not
    apply) or ``"general"``. ``num_splits``: fixed split count (default: from the shapes and, for
    long splits, ``occupancy``: CTAs of a kernel plan's compiled kernel that one SM holds, or
    ``None`` if unknown — it may raise :class:`.mma_plans.DynamicSmemUnsupported` for a cooperative
    plan, which then gives way to the per-warp kernel). ``block_n``, ``num_warps``,
    ``num_stages``, ``maxnreg``: the general kernel's tile options (defaults measured).
    ``options``: the attention options (:class:`DecodeOptions`, default none), applied by
    either kernel.
    ``signed_sylvester``: the rotation is ``diag(s)·H/√D`` (``DeviceParams.signed_sylvester``):
    the q rotation and the merge's rotate-back may run as the Walsh–Hadamard transform
    (:func:`.side_plans.q_transform`, :func:`.side_plans.merge_transform`)."""
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a tqkern.PagedLayout, got {type(layout).__name__}")
    if not isinstance(caps, DeviceCaps):
        raise TypeError(f"caps must be a DeviceCaps, got {type(caps).__name__}")
    if not isinstance(signed_sylvester, bool):
        raise TypeError(f"signed_sylvester must be a bool, got {type(signed_sylvester).__name__}")
    for name, v in (("num_seqs", num_seqs), ("num_q_heads", num_q_heads), ("max_blocks", max_blocks)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    check_num_splits(num_splits)
    hkv = layout.num_kv_heads
    if num_q_heads % hkv:
        raise ValueError(f"num_q_heads must be a multiple of num_kv_heads = {hkv}, got {num_q_heads}")
    if path not in ("auto", "mma", "general"):
        raise ValueError(f"path must be 'auto', 'mma' or 'general', got {path!r}")
    if options is None:
        options = DecodeOptions()
    if not isinstance(options, DecodeOptions):
        raise TypeError(f"options must be a DecodeOptions or None, got {type(options).__name__}")
    g = num_q_heads // hkv
    occupancy = occupancy or (lambda kernel: None)
    decode = None
    if path in ("auto", "mma"):
        mma = decode_path(layout, g, interpret=caps.interpret, same_codebooks=same_codebooks,
                          cache_aligned=cache_aligned, capability=None if caps.interpret else caps.capability) == "mma"
        if path == "mma" and not mma:
            raise ValueError("the warp-MMA decode kernel does not apply to this layout/group/device")
        if mma:
            decode, num_splits = _mma_decode(layout, num_seqs, num_q_heads, max_blocks, caps, num_splits, occupancy,
                                             options)
    if decode is None:
        decode, num_splits = general_decode(layout, num_seqs, num_q_heads, max_blocks, caps, num_splits, occupancy,
                                            block_n, num_warps, num_stages, maxnreg, options)
    dp = layout_consts(layout)["DP"]
    return DecodePlan(layout=layout, num_seqs=num_seqs, num_q_heads=num_q_heads, max_blocks=max_blocks, caps=caps,
                      path="general" if decode.kernel == "general" else "mma", num_splits=num_splits, decode=decode,
                      rotate=_rotate_plan(layout, num_seqs, num_q_heads, max_blocks, signed_sylvester=signed_sylvester),
                      merge=_merge_plan(layout, num_seqs, num_q_heads, num_splits, caps, options,
                                        signed_sylvester=signed_sylvester),
                      workspace_numel=workspace_numel(num_seqs, num_q_heads, num_splits, dp), options=options,
                      pdl=use_pdl(caps, decode))


def _per_warp_d128_cap(plan: MmaPlan) -> bool:
    """Whether ``plan``'s per-warp kernel takes ``_PER_WARP_D128_MAXNREG`` registers (where the plan is
    otherwise the one without them: :func:`_mma_decode`)."""
    return (not plan.COOP and plan.D == 128 and plan.SUB == 1 and plan.QT == 1 and not plan.K_MERGE
            and (plan.K_FP8 or not plan.V_MERGE))


def mma_kernel_plan(layout, plan: MmaPlan, num_seqs: int, num_q_heads: int, num_splits: int, *, warps: int = 4,
                    prefetch: int | None = None, hint: int = 1, maxnreg: int | None = None,
                    options: DecodeOptions | None = None, d128_cap: bool = True) -> KernelPlan:
    """The launch of the warp-MMA kernel for an :func:`.mma_plans.mma_plan` ``plan``: a
    cooperative plan runs one CTA per (sequence, split) with a warp per KV head, the per-warp
    kernel one warp per (sequence, KV head, split). ``options``: the window and soft-cap
    constexprs (:meth:`DecodeOptions.constexprs`). ``d128_cap``: the head_dim-128 per-warp cap
    (``_PER_WARP_D128_MAXNREG``) where ``maxnreg`` is not given (the planner compares without)."""
    hkv = layout.num_kv_heads
    coop = bool(plan.COOP)
    ws = plan.WS or 1
    if not isinstance(d128_cap, bool):
        raise TypeError(f"d128_cap must be a bool, got {type(d128_cap).__name__}")
    if num_splits % ws:
        raise ValueError(f"num_splits must be a multiple of the plan's {ws} warps per KV head, got {num_splits}")
    if coop:  # one warp per KV head of a (sequence, split), or WS of them (shared_head_plan)
        warps = hkv * ws
    if prefetch is None:  # the ring holds the steps of one iteration (measured: SUB = 2 with 1 step slower)
        prefetch = plan.SUB
    if maxnreg is None and plan.D == 256 and not plan.K_FP8:
        # head_dim 256: 64 value accumulators a lane; every cap spilled inside the loop. Measured
        # (H200, kernel alone, S27 probe; cap → uncapped, µs): Gemma-2-9B B8x8K turboquant_4bit_nc
        # cooperative 97.8 → 61.2, turboquant_3bit_nc 79.6 → 61.6, turboquant_k3v4_nc 86.0 → 62.6,
        # tq4 per-warp 89.3 → 83.9; Gemma-7B B4x8K tq4 94.7 → 74.4, turboquant_3bit_nc 83.0 → 58.2,
        # turboquant_k3v4_nc 93.8 → 62.2; tqkern_k5v3 130.6 → 129.6 (FP8 keys not measured: capped).
        # 5-bit keys (one step per update there, .mma_plans._per_warp_sub), per-warp: measured (H200,
        # S30 probe, Gemma-2-9B B8x8K / Gemma-7B B4x8K, µs, uncapped / 168 / 200 / 232): tqkern_k5v3
        # 125.1 / 111.1 / 104.2 / 104.6 and 114.4 / 113.1 / 117.9 / 109.7 (cap 232); k5v4h (4-bit
        # values: 264 bytes spilled at 168) 99.9 / 135.0 / 122.9 / 107.6 and 104.5 / 139.1 / 126.4 /
        # 109.5 (uncapped, 254 registers)
        if plan.K_BITS == 5 and not plan.COOP:
            maxnreg = 0 if plan.V_BITS == 4 else 232
        else:
            maxnreg = 0
    if maxnreg is None and coop:  # two CTAs of 8 warps per SM (two column tiles: one CTA, uncapped)
        maxnreg = 0 if plan.QT == 2 else 128
    if maxnreg is None:  # measured (H100): capped at 128 registers ~2% faster for aligned fields (no spill
        # inside the loop); with joined fields the kernel needs ~168 and a cap spills in the loop;
        # two steps per iteration (SUB = 2) hold a two-step ring: 168 (12 warps/SM) measured fastest;
        # head_dim 128 with one step: 168 too (_PER_WARP_D128_MAXNREG)
        maxnreg = 0 if plan.K_MERGE or plan.V_MERGE else 168 if plan.SUB == 2 else 128
        if d128_cap and _per_warp_d128_cap(plan):
            maxnreg = _PER_WARP_D128_MAXNREG
        if plan.QT == 2:  # two query column tiles: the second's accumulators spill under either cap
            maxnreg = 0
    heads = hkv * plan.GS  # the kernel's work items per (sequence, split): (KV head, query-head group) pairs
    cx = dict(G=num_q_heads // (heads * plan.QT), HKV=heads, HQ=num_q_heads, WARPS=warps, BS=layout.block_size,
              PREFETCH=prefetch, HINT=hint, **plan.constexprs(), **(options or DecodeOptions()).constexprs())
    total = num_seqs * heads * num_splits
    grid = (num_seqs * num_splits // ws,) if coop else (-(-total // warps),)
    return KernelPlan(kernel="coop" if coop else "mma", grid=grid, constexprs=tuple(cx.items()), num_warps=warps,
                      num_stages=1, maxnreg=maxnreg or 0)


def shared_heads(plan: MmaPlan, layout: PagedLayout) -> MmaPlan | None:
    """The shared-head plan (:func:`.coop_variants.shared_head_plan`, CTAs of 8 warps) the decode
    planner takes instead of the per-warp ``plan``, or ``None``: two KV heads with 5-bit keys at
    head_dim 128 and GQA groups of at most 8 (one query column tile). Other head_dims and two column
    tiles were neither timed nor checked on a GPU with it. Where a CTA can hold about 221 KB (sm_90)
    the planner then adds the code-pair table (:func:`.coop_variants.code_pair_plan`, S61: 6–11%
    less time at the five two-KV-head shapes measured).

    Measured (H200, session 52 probe; docs/performance.md "S52: shared-head CTAs"): k5v4h at
    Llama-3-8B-TP4 B64×8K, Qwen2.5-7B-TP2 B32×16K and Llama-3-70B-TP4 B32×16K / B16×64K / B128×2K
    took 11–45% less time than the per-warp kernel; 4- and 3-bit keys −9% to +17%; at one KV head
    shared 8-warp CTAs lost for every preset but turboquant_4bit_nc at 405B, so one KV head takes
    :func:`one_head_plan` instead."""
    if not isinstance(plan, MmaPlan):
        raise TypeError(f"plan must be an MmaPlan from mma_plan, got {type(plan).__name__}")
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a tqkern.PagedLayout, got {type(layout).__name__}")
    if plan.COOP or layout.num_kv_heads != 2 or plan.K_BITS != 5 or plan.QT != 1 or plan.D != 128:
        return None
    return shared_head_plan(plan, layout, _SHARED_CTA_WARPS // 2)


def one_head_plan(plan: MmaPlan, layout: PagedLayout, max_len: int) -> MmaPlan | None:
    """The shared-head plan the decode planner takes for one KV head with 3- or 4-bit keys and
    uniform values (``turboquant_4bit_nc``, ``turboquant_3bit_nc``, ``turboquant_k3v4_nc``) at
    head_dim 128 and contexts of at least 16K tokens (``max_len``), launched with 32 splits (the
    planner takes it where that grid holds one to two CTAs an SM), or ``None``: CTAs of 4 warps,
    each warp a split taking one step of every stage of a 4-stage ring.

    Measured (H200, S54 probe, per-warp → this): Llama-3-70B-TP8 B32×16K and 405B-TP8 B16×32K
    turboquant_4bit_nc 56.5 → 54.1, 84.1 → 71.9 µs, turboquant_3bit_nc 55.8 → 56.1, 80.8 → 71.3;
    Lloyd-Max values lost or tied, 8-warp CTAs and 64 splits lost. S68: under one CTA an SM (16 sequences,
    128 CTAs) the per-warp kernel took 8–22% less time, 46–53% at 8; at 256 CTAs this plan won by 1–8%."""
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 0:
        raise ValueError(f"max_len must be a non-negative int (tokens), got {max_len!r}")
    if not isinstance(plan, MmaPlan):
        raise TypeError(f"plan must be an MmaPlan from mma_plan, got {type(plan).__name__}")
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a tqkern.PagedLayout, got {type(layout).__name__}")
    if (plan.COOP or layout.num_kv_heads != 1 or plan.K_FP8 or not plan.V_UNIFORM or plan.K_BITS not in (3, 4)
            or plan.D != 128 or max_len < _ONE_HEAD_MIN_TOKENS):
        return None
    return shared_head_plan(plan, layout, 4, stages=4, sub=1)


def _mma_decode(layout, s, hq, max_blocks, caps, num_splits, occupancy, options):
    # The head_dim-128 per-warp cap (_PER_WARP_D128_MAXNREG), measured at the older caps' plans, only
    # changes the cap of the plan those give: where its residency moves the choice (splits, or coop vs
    # per-warp; Llama-3-8B-TP4 B64x8K 16 -> 12 splits offline) the older plan stays (untimed there).
    resident = {}  # (each kernel's residency asked once; plans are cached by the launcher)
    older = _mma_decode_with(layout, s, hq, max_blocks, caps, num_splits, occupancy, options, resident, False)
    base = mma_plan(layout, hq // layout.num_kv_heads)
    if not _per_warp_d128_cap(per_warp_plan(base) if base.COOP else base):
        return older
    new = _mma_decode_with(layout, s, hq, max_blocks, caps, num_splits, occupancy, options, resident, True)
    same = dataclasses.replace(new[0], maxnreg=older[0].maxnreg) == older[0] and new[1] == older[1]
    return new if same else older


def _mma_decode_with(layout, s, hq, max_blocks, caps, num_splits, occupancy, options, resident, d128_cap):
    g = hq // layout.num_kv_heads
    kernel_plan = functools.partial(mma_kernel_plan, options=options, d128_cap=d128_cap)
    plan = mma_plan(layout, g)
    max_len = max_blocks * layout.block_size
    one = one_head_plan(plan, layout, max_len)
    if one is not None and not caps.num_sms <= s * _ONE_HEAD_SPLITS // one.WS <= 2 * caps.num_sms:
        one = None  # (won at 1-2 CTAs an SM; at 128 CTAs, 405B-TP8 B16x32K, per-warp 8-19% faster: S68)
    plan = shared_heads(plan, layout) or one or plan
    if plan.COOP and caps.dynamic_smem:  # 5-bit keys at 2 (shared), 4 or 8 KV heads: the code-pair table
        plan = code_pair_plan(plan, layout, caps.smem_per_block_optin) or plan
    if plan.COOP and (not caps.dynamic_smem or coop_smem_bytes(plan) > caps.smem_per_block_optin):
        plan = per_warp_plan(plan)
    if num_splits is not None:
        if plan.WS and num_splits % plan.WS:  # (a shared-head plan's splits come in multiples of WS)
            plan = per_warp_plan(plan)
        return kernel_plan(layout, plan, s, hq, num_splits), num_splits
    if plan is one:
        return kernel_plan(layout, plan, s, hq, _ONE_HEAD_SPLITS), _ONE_HEAD_SPLITS

    def splits_for(p, fill=False):
        k = kernel_plan(layout, p, s, hq, p.WS or 1)
        if k not in resident:  # (a failed sizing too: the second pass raises it again)
            try:
                resident[k] = occupancy(k)
            except DynamicSmemUnsupported as e:
                resident[k] = e
        if isinstance(ctas := resident[k], DynamicSmemUnsupported):
            raise ctas
        if ctas is None:  # unknown: a conservative 8 warps per SM (speed, never correctness)
            ctas = max(1, 8 // k.num_warps)
        wave = ctas * k.num_warps * caps.num_sms
        pairs = layout.num_kv_heads * p.GS
        grid = lambda m: kernel_plan(layout, p, s, hq, m).grid[0]  # noqa: E731 (CTAs at m splits)

        def filled(n, warps):  # few pairs at short contexts: more splits, up to one CTA per SM
            long = not (p.COOP or p.WS) and layout.head_dim == 128  # (per-warp: up to 512 splits)
            return fill_sms(n, s * pairs, max_len, warps, grid, caps.num_sms, p.WS or 1, long) if fill else n

        if p.WS:  # every warp a split: the one-wave count, in whole CTAs
            return filled(max(1, num_splits_mma(s, pairs, max_len, wave) // p.WS) * p.WS, wave)
        if p.COOP or dict(k.constexprs)["G"] < 8:
            return filled(num_splits_mma(s, pairs, max_len, wave), wave)
        # every MMA column a query head: PER_WARP_WAVE (a warp of two column tiles counts twice),
        # then whole rounds of CTAs over the SMs
        half = int(wave * PER_WARP_WAVE * p.QT)
        return whole_rounds(filled(num_splits_mma(s, pairs, max_len, half), half), grid, caps.num_sms,
                            num_splits_mma(s, pairs, max_len, 1 << 30))

    try:
        n = splits_for(plan)
    except DynamicSmemUnsupported:  # nothing launched yet: the per-warp kernel
        plan = per_warp_plan(plan)
        n = splits_for(plan)
    # Short splits with one-step stages (two CTAs per SM; since session 13 only FP8 keys' plans;
    # not the code-pair table's one-step ring, one CTA an SM, measured at splits of >= 1024 tokens
    # only): the cooperative prologue is not paid back; the per-warp kernel runs instead where
    # it has at least 2 splits of its own (measured, H100: B32x4K turboquant_k8v4 90.1 vs 95.3
    # µs; docs/performance.md "Cooperative stages"). The two-step stages of 3- and 4-bit keys
    # keep their plan (B32x4K turboquant_4bit_nc 75.4 vs per-warp 75.0 µs, k3v4_nc 73.0 vs
    # 77.2, 3bit_nc 72.2 vs 73.1; at B128x1K 79.0 vs 92.2, 76.1 vs 80.2, 74.6 vs 76.3). Where the
    # per-warp kernel would get no longer splits (batch 1-2: both at 64-128), it gives way only below
    # 512 tokens a split (H200, S57, turboquant_k8v4 at D128, µs, cooperative / per-warp: Hkv 8
    # B1x16K 24.0 / 17.6 (256 tokens a split), B1x32K 38.3 / 40.5, B1x64K 43.8 / 49.0; Hkv 4
    # B1x64K 30.2 / 44.2, B2x32K 29.0 / 43.6), at head_dim 128 only. At 256 the cooperative kernel
    # spills (208 bytes offline): the older rule (H200, S66, Gemma-2-9B B8x8K, 16 splits of 512 tokens,
    # cooperative → per-warp: 74.8 → 63.8 µs, global 75.7 → 64.4, local 53.5 → 38.6).
    def one_step(p):  # a cooperative ring of one step a stage, without the code-pair table
        return bool(p.COOP and p.SUB == 1 and not p.KP)

    if one_step(plan) and max_len < _COOP_MIN_TOKENS * n:
        per_warp = per_warp_plan(plan)
        m = splits_for(per_warp)
        if m >= 2 and (m < n or max_len < _COOP_SHORT_TOKENS * n or layout.head_dim > _COOP_SHORT_MAX_DIM):
            plan, n = per_warp, m
    # 5-bit keys with Lloyd-Max values: two CTAs per SM (a 2-stage ring) where the launch then holds
    # more CTAs than SMs with splits of >= 1024 tokens (H200, S40, µs: k5v4h B256x1K 174.1 -> 159.2,
    # B32x16K 301.1 -> 291.0; at 512-token splits it lost: B32x4K 92.3 -> 94.7). Against the code-pair
    # table (one CTA an SM; S60) two CTAs win only where that launch needs a second round of CTAs
    # (pairs / two CTAs: B256x1K 152.2 / 146.7; B32x16K 260.2 / 271.6). (tqkern_k5v3's table plan: 2 stages.)
    two = two_cta_plan(plan, layout) if plan.COOP else None
    if two is not None:
        try:
            fits = (occupancy(kernel_plan(layout, two, s, hq, 1)) or 1) >= 2
            m = splits_for(two) if fits else 0
        except DynamicSmemUnsupported:
            m = 0
        two_rounds = s * n > caps.num_sms  # (the code-pair plan's launch: one CTA an SM)
        if m and s * m > caps.num_sms and max_len >= _COOP_MIN_TOKENS * m and (not plan.KP or two_rounds):
            plan, n = two, m
    # The kernel chosen on the counts above, few (sequence, KV head) pairs at short contexts then take
    # more splits (fill_sms; H200, S62: batch 1 at 4-32K up to 41% less time). Not one-step rings (FP8
    # keys), whose choice above rests on their split length: raised, it would hand batch 1-2 at 32K
    # to the per-warp kernel at 4 KV heads, where it lost by 45-50% (S57).
    if not one_step(plan):
        n = splits_for(plan, fill=True)
    # Two-step rings at 16 KV heads whose launch fills at most half the SMs (batch 1: <= 64 CTAs of
    # 16 warps): the per-warp kernel, whose CTAs reach every SM. H200, S67, µs, per-warp / ring:
    # Phi-3-mini-TP2 1x32K tq4 40.5 / 48.3, k5v4h 49.4 / 65.5, tqkern_k5v3 51.6 / 69.4; 1x8K 17.1 /
    # 18.6, 20.1 / 22.6, 20.6 / 23.6, turboquant_4bit_nc 16.0 / 16.8; Llama-2-7B-TP2 1x16K
    # turboquant_4bit_nc 21.7 / 33.3. At batch 2-16 (128 CTAs) the rings won or tied. (8 KV heads, S68:
    # Llama-3-8B 1x4K / 1x8K, 64 / 128 ring CTAs of 8 warps, per-warp within +-6% both ways: kept.)
    if plan.COOP and plan.SUB == 2 and layout.num_kv_heads == 16 and 2 * s * n <= caps.num_sms:
        plan = per_warp_plan(plan)
        n = splits_for(plan, fill=True)
    return kernel_plan(layout, plan, s, hq, n), n


def needs_lut_bytes(kernel: KernelPlan) -> int:
    """Shared memory the per-warp kernel declares outside Triton (its pair table), for occupancy."""
    if kernel.kernel != "mma":
        return 0
    cx = dict(kernel.constexprs)
    return _lut_bytes(cx.get("K_FP8", False), cx["V_UNIFORM"], cx.get("K_BITS", 4), cx.get("K_AT", 0), False,
                      bool(cx.get("KP", 0)))
