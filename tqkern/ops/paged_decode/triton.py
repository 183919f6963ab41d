"""Paged decode launcher: which kernel runs (:func:`decode_path`), and :func:`_launch_paged_decode`
(decode, then merge).

Call path: the frontend (``tqkern_torch.attention``) rotates q and scans the block table
(:mod:`.rotate`), then calls :func:`_launch_paged_decode`, which either takes the warp-MMA path
(plan: :mod:`.mma_plans`; launch: :mod:`.mma_launch`; kernel: :mod:`.mma_kernel`) or the general
kernel (:mod:`.general`, read plan :func:`fast_path_plan`, splits :func:`num_splits_for`), and
merges the splits (:mod:`.merge`). ``docs/architecture.md`` lists every module.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from tqkern.layouts import PagedLayout
from tqkern.ops.codecs import DT_BF16, Kind, layout_args, layout_consts
from tqkern.ops.common import halfword_aligned
from tqkern.ops.paged_decode import mma_plans as _plans
from tqkern.ops.paged_decode.general import _paged_decode_kernel
from tqkern.ops.paged_decode.merge import _launch_merge
from tqkern.ops.paged_decode.mma_launch import _launch_paged_decode_mma, resident_warps
from tqkern.ops.paged_decode.mma_plans import (DynamicSmemUnsupported, ctas_per_sm, device_plan,
                                               disable_cooperative_stages, mma_plan, num_splits_mma, per_warp_plan)

__all__ = ["_launch_paged_decode", "check_workspace", "decode_path", "fast_path_plan", "num_splits_for",
           "workspace_numel", "MMA_MIN_CAPABILITY", "MMA_FP8_MIN_CAPABILITY"]


def num_splits_for(num_seqs: int, num_kv_heads: int, max_len: int, num_sms: int, block_n: int,
                   resident_ctas: int | None = None) -> int:
    """Splits so that ~4 programs per SM exist, never fewer than 4·BN tokens per split.

    With ``resident_ctas`` (programs the GPU holds at once) and long splits (≥ 2048 tokens of
    ``max_len`` each), the count ``k`` up to that one with the fewest waves per unit of work
    (``ceil(programs·k / resident_ctas) / k``; the smallest such ``k``), so that the last wave is
    not a fraction of the GPU. Measured on the H100 (fp16 path, B8×64K: 64 programs per split,
    396 resident): 9 splits (1.45 waves) 770 µs, 6 splits (0.97 waves) 712 µs; shorter splits
    gain nothing from it (SmolLM2 B32×4K: 4 splits, one wave, 45.7 µs; 6 splits 43.2 µs).

    Depends only on shapes (never on ``seq_lens`` values), so a CUDA graph captured for a batch
    shape stays valid whatever lengths it replays with."""
    if resident_ctas is not None and (not isinstance(resident_ctas, int) or resident_ctas < 1):
        raise ValueError(f"resident_ctas must be None or a positive int, got {resident_ctas!r}")
    programs = max(1, num_seqs * num_kv_heads)
    want = max(1, math.ceil(4 * num_sms / programs))
    cap = max(1, max_len // (4 * block_n))
    n = int(min(want, cap, 64))
    if resident_ctas and max_len // n >= 2048:
        n = min(range(1, n + 1), key=lambda k: (math.ceil(programs * k / resident_ctas) / k, k))
    return n


def fast_path_plan(layout) -> dict:
    """Which sides take the 4-bit word path and how their words are read (``K_FAST``/``V_FAST``:
    4 aligned words, 2 funnel-shifted words, 1 16-bit halves, 0 the general path), and whether
    their per-token float fields allow one typed load (``*_PAR_ALIGNED``)."""
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a tqkern.PagedLayout, got {type(layout).__name__}")
    c = layout_consts(layout)
    d, dp, rb = layout.head_dim, c["DP"], layout.row_bytes
    raw_bf16 = _raw_bf16(c)
    plan = {}
    for side, p in (("key", "K"), ("value", "V")):
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


def _launch_paged_decode(out, q_rot, cache, block_table, seq_lens, layout, tables, *, sm_scale: float,
                         interpret: bool, q_poison=None, workspace=None, num_splits: int | None = None,
                         block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                         path: str = "auto", maxnreg: int | None = None, same_codebooks: bool):
    """Launch decode + merge. ``q_rot`` float32 ``[S, Hq, D]`` contiguous (already rotated when the
    key codec is rotated). ``q_poison``: float32
    ``[S·Hq]`` from :func:`.rotate.rotate_q` (NaN for a non-finite query row, else 0), added to the output
    rows by the merge; ``None``: no poisoning. ``workspace``: optional float32 tensor with at least
    ``workspace_numel(...)`` elements. ``path``: ``"auto"`` (the warp-MMA kernel of
    :mod:`.mma_kernel` where :func:`decode_path` says so, else the word path), ``"mma"`` (that
    kernel, or ``ValueError``), ``"general"`` (the kernel of :mod:`.general`: the 4-bit word path where
    :func:`fast_path_plan` has a read plan, else the general decode). ``same_codebooks``
    (required): whether the key and value codebooks are equal (the warp-MMA kernel's one table
    serves both; ``DeviceParams.same_codebooks``). The block ids in
    use must lie in ``[0, cache.shape[0])`` and the lengths in ``[0, max_blocks·block_size]``: the
    frontend passes the clamped table that :func:`.rotate.rotate_q`'s index scan writes. No other checks."""
    c = layout_consts(layout)
    s, hq, d = q_rot.shape
    hkv = layout.num_kv_heads
    g = hq // hkv
    gp = max(16, triton.next_power_of_2(g))
    dp = c["DP"]
    if path in ("auto", "mma"):
        mma = decode_path(layout, g, interpret=interpret, same_codebooks=same_codebooks,
                          cache_aligned=cache.data_ptr() % 16 == 0,
                          capability=None if interpret else _capability(q_rot.device)) == "mma"
        if path == "mma" and not mma:
            raise ValueError("the warp-MMA decode kernel does not apply to this layout/group/device")
        if mma:
            try:
                acc, ml, num_splits = _launch_mma(q_rot, cache, block_table, seq_lens, layout, tables, g, num_splits,
                                                  workspace, sm_scale)
            except DynamicSmemUnsupported:  # nothing launched yet: the per-warp kernel from now on
                disable_cooperative_stages(q_rot.device)
                acc, ml, num_splits = _launch_mma(q_rot, cache, block_table, seq_lens, layout, tables, g, num_splits,
                                                  workspace, sm_scale)
            _launch_merge(acc, ml, tables["rotation"], out, layout, g, num_splits, interpret, q_poison=q_poison)
            return out
        path = "general"
    if path != "general":
        raise ValueError(f"path must be 'auto', 'mma' or 'general', got {path!r}")
    plan = fast_path_plan(layout)
    if block_n is None:  # measured (H100, B32x16K): 128 best for the word path, 64 for the rest
        block_n = 128 if plan["K_FAST"] or plan["V_FAST"] else 64
    if num_stages is None:  # measured (H100): funnel-shifted words with 2 stages ran 2.5x slower
        num_stages = 1 if 2 in (plan["K_FAST"], plan["V_FAST"]) else 2
    raw_bf16 = _raw_bf16(c)

    def fast(side) -> int:
        return plan[f"{side[0].upper()}_FAST"]

    def halves(side) -> bool:
        return _four_bit_codes(c, side[0].upper()) and dp == d and d >= 32 and not fast(side)
    consts = {k: v for k, v in layout_args(layout).items() if not k.startswith("PAD")}
    kwargs = dict(
        G=g, GP=gp, HQ=hq, BN=block_n, BS=layout.block_size,
        K_HALVES=halves("key"), V_HALVES=halves("value"), DOT=tl.bfloat16 if raw_bf16 else tl.float16,
        K_ALIGNED=halfword_aligned(layout, "key"), V_ALIGNED=halfword_aligned(layout, "value"),
        USE_ASM=not interpret, **plan,
        num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}), **consts,
    )
    max_len = block_table.shape[1] * layout.block_size
    if num_splits is None:
        sms = 1 if interpret else torch.cuda.get_device_properties(q_rot.device).multi_processor_count
        num_splits = num_splits_for(s, hkv, max_len, sms, block_n)
        if not interpret and max_len // num_splits >= 2048:
            key = (layout, hq, path, block_n, num_warps, num_stages, maxnreg, q_rot.device.index or 0)
            ctas = _resident_ctas(key, q_rot, cache, block_table, seq_lens, tables, kwargs, num_splits)
            num_splits = num_splits_for(s, hkv, max_len, sms, block_n, resident_ctas=ctas)
    acc, ml = _workspace(workspace, s, hq, num_splits, dp, q_rot.device)
    _paged_decode_kernel[(s, hkv, num_splits)](
        q_rot, cache, block_table, seq_lens, tables["key_centroids_f32"], tables["value_centroids_f32"], acc, ml,
        block_table.shape[1], sm_scale * 1.4426950408889634, 0, NUM_SPLITS=num_splits,
        **kwargs)
    _launch_merge(acc, ml, tables["rotation"], out, layout, g, num_splits, interpret, q_poison=q_poison)
    return out


_COOP_MIN_TOKENS = 1024  # tokens per split below which one-step cooperative plans may give way
_MMA_LAUNCHES: dict = {}  # (layout, group, shapes, device, stages disabled) -> (plan, num_splits)


def _mma_launch_plan(q_rot, cache, block_table, seq_lens, layout, tables, g, num_splits):
    """The plan and split count of a warp-MMA launch: the device's plan, its split count from the
    shapes (when not given), and the short-split rule; cached per layout, group, shapes and
    device (it depends on nothing else), so a launch does this work once."""
    s, hq, _ = q_rot.shape
    dev = q_rot.device.index or 0
    max_len = block_table.shape[1] * layout.block_size
    key = (layout, g, s, hq, max_len, num_splits, dev, dev in _plans._COOP_DISABLED)
    if key in _MMA_LAUNCHES:
        return _MMA_LAUNCHES[key]
    plan = device_plan(layout, g, q_rot.device)
    if num_splits is None:
        def splits_for(p):
            resident = resident_warps(q_rot, cache, block_table, seq_lens, layout, p, tables["key_centroids_f32"],
                                      group=g, value_centroids_f32=tables["value_centroids_f32"])
            return num_splits_mma(s, layout.num_kv_heads, max_len, resident)
        num_splits = splits_for(plan)
        # Short splits with one-step stages (two CTAs per SM; since session 13 only FP8 keys'
        # plans): the cooperative prologue is not paid back; the per-warp kernel runs instead where
        # it has at least 2 splits of its own (measured, H100: B32x4K turboquant_k8v4 90.1 vs 95.3
        # µs; session 12, with the then one-step plans of 3- and 4-bit keys: turboquant_4bit_nc
        # 75.1 vs 81.5, 3bit_nc 73.3 vs 77.8 -- but turboquant_4bit_nc with 1 split of its own
        # 92.2 vs 84.1: docs/performance.md §45, §47). The two-step stages of 3- and 4-bit keys
        # keep their plan: at B32x4K turboquant_4bit_nc 75.4 vs per-warp 75.0 µs, k3v4_nc 73.0 vs
        # 77.2, 3bit_nc 72.2 vs 73.1; at B128x1K 79.0 vs 92.2, 76.1 vs 80.2, 74.6 vs 76.3.
        if plan.get("COOP") and plan["SUB"] == 1 and max_len < _COOP_MIN_TOKENS * num_splits:
            per_warp = per_warp_plan(plan)
            n = splits_for(per_warp)
            if n >= 2:
                plan, num_splits = per_warp, n
    _MMA_LAUNCHES[key] = plan, num_splits
    return plan, num_splits


def _launch_mma(q_rot, cache, block_table, seq_lens, layout, tables, g, num_splits, workspace, sm_scale):
    """The warp-MMA kernel with the device's plan; returns (acc, ml, num_splits) for the merge."""
    s, hq, _ = q_rot.shape
    plan, num_splits = _mma_launch_plan(q_rot, cache, block_table, seq_lens, layout, tables, g, num_splits)
    acc, ml = _workspace(workspace, s, hq, num_splits, layout_consts(layout)["DP"], q_rot.device)
    _launch_paged_decode_mma(q_rot, cache, block_table, seq_lens, layout, plan, tables["key_centroids_f32"], acc, ml,
                             group=g, num_splits=num_splits, sm_scale=sm_scale,
                             value_centroids_f32=tables["value_centroids_f32"])
    return acc, ml, num_splits


_RESIDENT_CTAS: dict = {}


@functools.lru_cache(maxsize=16)
def _capability_of(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def _capability(device) -> tuple[int, int]:
    """Compute capability of a CUDA ``device`` (cached per device index)."""
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


def _resident_ctas(key, q_rot, cache, block_table, seq_lens, tables, kwargs, num_splits) -> int | None:
    """Programs of the general kernel (compiled for ``kwargs``; cached under ``key``, the launch
    options that determine ``kwargs``, cheap to hash on every launch) that the GPU holds at once,
    from its registers and shared memory; ``None`` if the compiled kernel cannot be inspected
    (the split count then ignores waves: speed, never correctness)."""
    if key not in _RESIDENT_CTAS:
        props = torch.cuda.get_device_properties(q_rot.device)
        try:
            k = _paged_decode_kernel.warmup(
                q_rot, cache, block_table, seq_lens, tables["key_centroids_f32"], tables["value_centroids_f32"],
                q_rot, q_rot, block_table.shape[1], 1.0, 0, NUM_SPLITS=num_splits, grid=(1,), **kwargs)
            _RESIDENT_CTAS[key] = ctas_per_sm(k, kwargs["num_warps"], 0, props) * props.multi_processor_count
        except Exception:  # noqa: BLE001
            _RESIDENT_CTAS[key] = None
    return _RESIDENT_CTAS[key]


def check_workspace(workspace, s: int, hq: int, num_splits: int, dp: int) -> int:
    """ValueError unless ``workspace`` holds ``workspace_numel(s, hq, num_splits, dp)`` float32
    elements; returns that count."""
    need = workspace_numel(s, hq, num_splits, dp)
    if workspace.numel() < need:
        raise ValueError(f"workspace must have at least workspace_numel({s}, {hq}, num_splits={num_splits}, {dp}) = "
                         f"{need} float32 elements, got {workspace.numel()}")
    return need


def _workspace(workspace, s: int, hq: int, num_splits: int, dp: int, device):
    """The (acc, ml) views of a caller's workspace, or of a fresh one."""
    if workspace is None:
        need = workspace_numel(s, hq, num_splits, dp)
        workspace = torch.empty(need, dtype=torch.float32, device=device)
    else:
        need = check_workspace(workspace, s, hq, num_splits, dp)
    return workspace[: s * hq * num_splits * dp], workspace[s * hq * num_splits * dp: need]


# The warp-MMA kernel's PTX: mma.sync m16n8k16 with fp16 operands, ld.global.nc.L2::256B
# (sm_80); cvt.rn.f16x2.e4m3x2 for FP8 keys (sm_89).
MMA_MIN_CAPABILITY = (8, 0)
MMA_FP8_MIN_CAPABILITY = (8, 9)


def decode_path(layout, group: int, *, same_codebooks: bool, interpret: bool = False,
                cache_aligned: bool = True, capability: tuple[int, int] | None = None) -> str:
    """Which kernel ``path="auto"`` runs: ``"mma"`` (the warp-MMA kernel where
    :func:`.mma_plans.mma_plan` takes the layout, and for 4-bit Lloyd-Max values only with the
    keys' codebook (``same_codebooks``, required: the frontend passes
    ``DeviceParams.same_codebooks``); never under the interpreter, which cannot run its inline
    PTX, nor for a cache not 16-byte aligned, nor on a GPU whose compute ``capability`` (major,
    minor) is below ``MMA_MIN_CAPABILITY`` (``MMA_FP8_MIN_CAPABILITY`` for FP8 keys); ``None``
    skips that check) or ``"general"`` (the kernel of :mod:`.general`)."""
    plan = mma_plan(layout, group)
    if interpret or plan is None or not cache_aligned:
        return "general"
    if capability is not None:
        if not isinstance(capability, (tuple, list)) or len(capability) != 2 \
                or not all(isinstance(x, int) for x in capability):
            raise TypeError(f"capability must be a (major, minor) pair of ints, got {capability!r}")
        need = MMA_FP8_MIN_CAPABILITY if plan["K_FP8"] else MMA_MIN_CAPABILITY
        if tuple(capability) < need:
            return "general"
    if plan["V_BITS"] == 4 and not plan["V_UNIFORM"] and not same_codebooks:  # one codebook for K and V
        return "general"
    return "mma"


def workspace_numel(num_seqs: int, num_q_heads: int, num_splits: int, dp: int) -> int:
    """float32 elements of the decode workspace: partial outputs plus (max, sum) per split."""
    return num_seqs * num_q_heads * num_splits * (dp + 2)
