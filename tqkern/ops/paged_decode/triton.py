"""Paged decode launcher: a :class:`~.plan.DecodePlan` (from :func:`.plan.plan_decode`) turned into
three prepared launches — q rotation with the block-table scan, decode, merge — and run.

Call path: the frontend (``tqkern_torch.attention``) calls :func:`paged_decode_launch`, which
looks the shapes up in the one plan cache (:func:`prepare`: plan and its
:class:`~tqkern.ops.launch.KernelLauncher` objects, built once per layout, shapes and device)
and launches them. :func:`_launch_paged_decode` runs decode + merge on an already rotated q (tests,
benchmarks). ``docs/architecture.md`` lists every module.
"""

from __future__ import annotations

import functools
import types

import torch
import triton.language as tl
from triton.runtime.errors import OutOfResources

from tqkern.layouts import PagedLayout
from tqkern.ops.launch import BoundedCache, KernelLauncher, current_stream
from tqkern.ops.paged_decode.general import _paged_decode_kernel
from tqkern.ops.paged_decode.merge import _merge_kernel, _merge_row_kernel, _merge_rows_kernel, _rotate_back_kernel
from tqkern.ops.paged_decode.mma_kernel import _paged_decode_coop_kernel, _paged_decode_mma_kernel
from tqkern.ops.paged_decode.mma_launch import _size_dynamic_smem
from tqkern.ops.paged_decode.mma_plans import DynamicSmemUnsupported, MmaPlan, ctas_per_sm
from tqkern.ops.paged_decode.plan import (MMA_FP8_MIN_CAPABILITY, MMA_MIN_CAPABILITY, DecodeOptions, DecodePlan,
                                          DeviceCaps, decode_path, fast_path_plan, needs_lut_bytes, num_splits_for, plan_decode,
                                          workspace_numel)
from tqkern.ops.paged_decode.rotate import _rotate_q_kernel

__all__ = ["_launch_paged_decode", "check_workspace", "decode_options", "decode_path", "device_caps", "fast_path_plan",
           "launch_mma_plan", "num_splits_for", "paged_decode_launch", "prepare", "workspace_numel", "MMA_MIN_CAPABILITY",
           "MMA_FP8_MIN_CAPABILITY"]

_KERNELS = {"mma": _paged_decode_mma_kernel, "coop": _paged_decode_coop_kernel, "general": _paged_decode_kernel}


@functools.lru_cache(maxsize=16)
def _caps_of(index: int) -> DeviceCaps:
    p = torch.cuda.get_device_properties(index)
    return DeviceCaps(capability=tuple(torch.cuda.get_device_capability(index)), num_sms=p.multi_processor_count,
                      smem_per_block_optin=int(getattr(p, "shared_memory_per_block_optin", 0)),
                      smem_per_sm=int(getattr(p, "shared_memory_per_multiprocessor", 233472)))


_INTERPRETER = DeviceCaps.interpreter()


def device_caps(device: torch.device) -> DeviceCaps:
    """The :class:`DeviceCaps` of a torch device (CPU: Triton's interpreter)."""
    if device.type != "cuda":
        return _INTERPRETER
    return _caps_of(device.index if device.index is not None else torch.cuda.current_device())


class Prepared:
    """A plan with its launches: ``rotate``, ``decode``, ``merge`` (:class:`KernelLauncher`), ``back``
    (the rotate-back's own launch where ``plan.merge.rotate_apart``, else ``None``), and
    ``value_table``: which float32 table the decode reads as its second codebook."""

    __slots__ = ("plan", "rotate", "decode", "merge", "back", "value_table")

    def __init__(self, plan: DecodePlan, decode: KernelLauncher):
        self.plan, self.decode = plan, decode
        lay, r, m = plan.layout, plan.rotate, plan.merge
        d = lay.head_dim
        dp = max(16, 1 << (d - 1).bit_length())
        precision = "ieee" if plan.caps.interpret else "tf32x3"
        # programmatic dependent launch (plan.pdl): the rotation lets the decode start, which waits
        # for it; the merge starts early and waits for the decode
        pdl, early = (dict(PDL=True), dict(launch_pdl=True)) if plan.pdl else ({}, {})
        self.rotate = KernelLauncher(_rotate_q_kernel, r.grid,
                                     dict(r.constexprs(plan.num_q_heads, d, lay.block_size, plan.caps.interpret),
                                          **pdl), num_warps=4)
        common = dict(D=d, DP=dp, CC=dp // m.chunks, ROTATE_BACK=m.rotate_back, DOT_PRECISION=precision, POISON=True,
                      SINKS=m.sinks, LSE=m.lse, **m.constexprs(d), **pdl)
        sp = max(2, 1 << (plan.num_splits - 1).bit_length())
        self.back = None
        if m.impl == "row":
            for k in ("DOT_PRECISION", "FWHT", "LOG2D"):
                common.pop(k)
            if m.rotate_apart:  # the merge writes unrotated rows; their own launch rotates them back
                common["ROTATE_BACK"] = False
                self.back = KernelLauncher(_rotate_back_kernel, m.back_grid,
                                           dict(HQ=plan.num_q_heads, D=d, DP=dp, ROWS=16, CC=dp // m.back_grid[1],
                                                DOT_PRECISION=precision, **m.constexprs(d), **pdl),
                                           num_warps=4, **early)
            self.merge = KernelLauncher(_merge_row_kernel, m.grid, dict(HQ=plan.num_q_heads, SP=sp, SB=m.unroll,
                                                                        **common), num_warps=4, **early)
        elif m.impl == "rows":
            self.merge = KernelLauncher(_merge_rows_kernel, m.grid, dict(HQ=plan.num_q_heads, ROWS=m.rows, SP=sp,
                                                                         UNROLL=m.unroll, **common),
                                        num_warps=4, **early)
        else:
            g = plan.group
            self.merge = KernelLauncher(_merge_kernel, m.grid, dict(G=g, GP=max(16, 1 << (g - 1).bit_length()),
                                                                    HQ=plan.num_q_heads, NUM_SPLITS=plan.num_splits,
                                                                    SP=sp, **common), num_warps=4, **early)
        k = plan.decode
        self.value_table = "value"
        if k.kernel != "general" and not (k.constexpr("K_AT") and not k.constexpr("V_UNIFORM")):
            self.value_table = "key"  # (the value codebook is read only for value pairs below the keys' entries)


def _launcher(kernel, pdl: bool = False) -> KernelLauncher:
    """The launcher of a decode :class:`~.plan.KernelPlan` (cooperative kernels: their dynamic
    shared memory sized before the binary loads); ``pdl``: as a plan with ``DecodePlan.pdl``
    launches it (the ``PDL`` constexpr and Triton's ``launch_pdl``)."""
    cx = dict(kernel.constexprs)
    if "DOT" in cx:
        cx["DOT"] = tl.bfloat16 if cx["DOT"] == "bf16" else tl.float16
    options = dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages)
    if pdl:  # (launched early: the kernel waits for the q rotation before reading its outputs)
        cx["PDL"] = True
        options["launch_pdl"] = True
    if kernel.maxnreg:
        options["maxnreg"] = kernel.maxnreg
    prepare = None
    if kernel.kernel == "coop":
        prepare = functools.partial(_size_dynamic_smem, plan=MmaPlan.of_constexprs(dict(kernel.constexprs)))
    return KernelLauncher(_KERNELS[kernel.kernel], kernel.grid, cx, prepare=prepare, **options)


# the one cache: the planner's input -> Prepared (plan, launchers, compiled kernels)
_PREPARED = BoundedCache(1024)


def _plan_key(layout, s, hq, max_blocks, caps, same_codebooks, cache, num_splits, path, general, options,
              signed_sylvester) -> tuple:
    """The planner's input, the key of :data:`_PREPARED`."""
    return (layout, s, hq, max_blocks, caps, same_codebooks, cache.data_ptr() % 16 == 0, num_splits, path,
            tuple(sorted(general.items())) if general else (), options, signed_sylvester)


_NO_OPTIONS = DecodeOptions()
_LOG2E = 1.4426950408889634


def decode_options(window_left=None, logit_softcap=None, sinks=None, lse=None) -> DecodeOptions:
    """The :class:`~.plan.DecodeOptions` of a call's option values (``None``: not used)."""
    if window_left is None and logit_softcap is None and sinks is None and lse is None:
        return _NO_OPTIONS
    return DecodeOptions(window=window_left is not None, softcap=logit_softcap is not None, sinks=sinks is not None,
                         lse=lse is not None)


def _option_args(window_left, logit_softcap, sm_scale: float) -> tuple:
    """The decode kernels' option arguments ``(window_left, softcap_scale, softcap_cap)``: the
    window clamped to 2^30 (no sequence is longer), ``2·scale·log2(e)/c`` and ``c·log2(e)``."""
    if logit_softcap is None:
        scale_c, cap = 0.0, 0.0
    else:
        scale_c, cap = 2.0 * sm_scale * _LOG2E / logit_softcap, logit_softcap * _LOG2E
    return (0 if window_left is None else min(int(window_left), 1 << 30)), scale_c, cap



def _up16(n: int) -> int:
    """``n`` float32 elements rounded up to whole 16-byte units (so every carved view is aligned)."""
    return -(-n // 4) * 4


def prepare(layout: PagedLayout, q_rot, cache, block_table, seq_lens, tables, *, same_codebooks: bool,
            num_splits: int | None = None, path: str = "auto", options: DecodeOptions = _NO_OPTIONS,
            signed_sylvester: bool = False, **general) -> Prepared:
    """The prepared launches for these shapes (planned and compiled once; afterwards a dict
    lookup). The tensors give the shapes, the device and, on a first call, the arguments the
    occupancy compile specializes for. ``options``: which attention options the calls use;
    ``signed_sylvester``: ``tables["rotation"]`` is ``diag(s)·H/√D`` (the q rotation may take
    the Walsh–Hadamard transform); ``general``: the general kernel's tile options."""
    dev = q_rot.device
    caps = device_caps(dev)
    s, hq, _ = q_rot.shape
    key = _plan_key(layout, s, hq, block_table.shape[1], caps, same_codebooks, cache, num_splits, path, general,
                    options, signed_sylvester)
    hit = _PREPARED.get(key)
    if hit is not None:
        return hit
    launchers = {}

    def occupancy(kernel):
        """CTAs of the kernel that one SM holds, from its compiled registers and shared memory."""
        lk = launchers.setdefault(kernel, _launcher(kernel))
        try:
            k = lk.compiled(*_decode_args(kernel, q_rot, cache, block_table, seq_lens, tables, q_rot, q_rot, 1.0, 1))
            extra = needs_lut_bytes(kernel)
            return ctas_per_sm(k, kernel.num_warps, extra, types.SimpleNamespace(
                shared_memory_per_multiprocessor=caps.smem_per_sm))
        except DynamicSmemUnsupported:
            raise
        except Exception as e:  # noqa: BLE001  (an uninspectable kernel costs speed, never correctness)
            if kernel.kernel == "coop":
                raise DynamicSmemUnsupported("the cooperative kernel could not be compiled and sized")
            return 0 if isinstance(e, OutOfResources) else None  # 0: does not fit; the plan gives way

    plan = plan_decode(layout, s, hq, block_table.shape[1], caps, same_codebooks=same_codebooks,
                       cache_aligned=cache.data_ptr() % 16 == 0, num_splits=num_splits, path=path,
                       occupancy=None if caps.interpret else occupancy, options=options,
                       signed_sylvester=signed_sylvester, **general)
    prepared = Prepared(plan, _launcher(plan.decode, True) if plan.pdl else
                        launchers.get(plan.decode) or _launcher(plan.decode))
    return _PREPARED.put(key, prepared)


def _decode_args(kernel, q_rot, cache, block_table, seq_lens, tables, acc, ml, sm_scale, num_splits,
                 window_left=None, logit_softcap=None):
    """Runtime arguments of a decode kernel, in its order (the options off unless given)."""
    scale = sm_scale * 1.4426950408889634
    opts = _option_args(window_left, logit_softcap, sm_scale)
    if kernel.kernel == "general":
        return (q_rot, cache, block_table, seq_lens, tables["key_centroids_f32"], tables["value_centroids_f32"],
                acc, ml, block_table.shape[1], scale, 0, *opts)
    two = dict(kernel.constexprs)
    vcen = tables["value_centroids_f32"] if two.get("K_AT") and not two["V_UNIFORM"] else tables["key_centroids_f32"]
    return (q_rot, cache, block_table, seq_lens, tables["key_centroids_f32"], vcen, acc, ml, q_rot.shape[0],
            block_table.shape[1], scale, num_splits, *opts)


def _decode_and_merge(prep: Prepared, out, q_rot, cache, safe_table, seq_lens, tables, sm_scale, workspace, poison,
                      window_left=None, logit_softcap=None, sinks=None, lse=None, stream=None):
    plan = prep.plan
    if stream is None and q_rot.is_cuda:
        stream = current_stream()
    s, hq, _ = q_rot.shape
    dp = plan.workspace_numel // (s * hq * plan.num_splits) - 2
    acc, ml = _workspace(workspace, s, hq, plan.num_splits, dp, q_rot.device)
    vcen = tables[f"{prep.value_table}_centroids_f32"]
    scale = sm_scale * 1.4426950408889634
    if plan.decode.kernel == "general":
        prep.decode.launch(stream, q_rot, cache, safe_table, seq_lens, tables["key_centroids_f32"], vcen, acc, ml,
                           safe_table.shape[1], scale, 0, *_option_args(window_left, logit_softcap, sm_scale))
    else:
        prep.decode.launch(stream, q_rot, cache, safe_table, seq_lens, tables["key_centroids_f32"], vcen, acc, ml, s,
                           safe_table.shape[1], scale, plan.num_splits,
                           *_option_args(window_left, logit_softcap, sm_scale))
    rot = tables["rotation"]
    sink_arg, lse_arg = ml if sinks is None else sinks, ml if lse is None else lse  # (unread when off)
    if plan.merge.impl == "row" and prep.back is not None:  # row r merged over acc's row r·splits, then rotated
        row = plan.num_splits * dp
        prep.merge.launch(stream, acc, ml, rot, acc, poison, sink_arg, lse_arg, plan.num_splits, hq * row, row)
        prep.back.launch(stream, acc, rot, out, s * hq, row, out.stride(0), out.stride(1))
    elif plan.merge.impl == "row":
        prep.merge.launch(stream, acc, ml, rot, out, poison, sink_arg, lse_arg, plan.num_splits, out.stride(0),
                          out.stride(1))
    elif plan.merge.impl == "rows":
        prep.merge.launch(stream, acc, ml, rot, out, poison, sink_arg, lse_arg, s * hq, plan.num_splits, out.stride(0),
                          out.stride(1))
    else:
        prep.merge.launch(stream, acc, ml, rot, out, poison, sink_arg, lse_arg, out.stride(0), out.stride(1))


def paged_decode_launch(out, q, cache, block_table, seq_lens, layout, tables, errors, num_blocks: int, *,
                        sm_scale: float, same_codebooks: bool, workspace=None, num_splits: int | None = None,
                        window_left: int | None = None, logit_softcap: float | None = None, sinks=None, lse=None,
                        signed_sylvester: bool = False):
    """One decode step: rotate q (marking non-finite rows) and scan the block table in one
    launch, decode, merge into ``out``. ``q``: ``[S, Hq, D]`` fp16/bf16/fp32 with a contiguous
    last dimension; ``cache`` at least one block (``num_blocks``: the caller's real block count,
    0 for an empty cache, into which the scan clamps ids); ``errors``: the int32 error word.
    Options (``None``: off): ``window_left`` int ≥ 0, ``logit_softcap`` float > 0, ``sinks``
    float32 ``[Hq]``, ``lse`` float32 ``[S, Hq]`` (written). ``signed_sylvester``: as
    :func:`prepare`'s. No other checks: the frontend validated everything."""
    s, hq, d = q.shape
    mb = block_table.shape[1]
    options = decode_options(window_left, logit_softcap, sinks, lse)
    # one allocation: the rotated q, the poison vector, the clamped table (int32 bits) (and the
    # split partials unless the caller gives a workspace)
    n_q, n_p, n_t = _up16(s * hq * d), _up16(s * hq), _up16(s * mb)
    prep = _PREPARED.get(_plan_key(layout, s, hq, mb, device_caps(q.device), same_codebooks, cache, num_splits,
                                   "auto", None, options, signed_sylvester))
    n_ws = 0 if workspace is not None or prep is None else prep.plan.workspace_numel
    buf = torch.empty(n_q + n_p + n_t + n_ws, dtype=torch.float32, device=q.device)
    q_rot = buf[: s * hq * d].view(s, hq, d)
    if prep is None:
        prep = prepare(layout, q_rot, cache, block_table, seq_lens, tables, same_codebooks=same_codebooks,
                       num_splits=num_splits, options=options, signed_sylvester=signed_sylvester)
    poison = buf[n_q: n_q + s * hq]
    safe_table = buf[n_q + n_p: n_q + n_p + s * mb].view(torch.int32).view(s, mb)
    if n_ws:
        workspace = buf[n_q + n_p + n_t:]
    stream = current_stream() if q.is_cuda else None
    prep.rotate.launch(stream, q, tables["rotation"], q_rot, poison, block_table, seq_lens, errors, safe_table, s * hq,
                       q.stride(0), q.stride(1), s, mb, num_blocks, prep.plan.rotate.programs)
    _decode_and_merge(prep, out, q_rot, cache, safe_table, seq_lens, tables, sm_scale, workspace, poison,
                      window_left, logit_softcap, sinks, lse, stream)
    return out


def _launch_paged_decode(out, q_rot, cache, block_table, seq_lens, layout, tables, *, sm_scale: float,
                         interpret: bool = False, q_poison=None, workspace=None, num_splits: int | None = None,
                         path: str = "auto", same_codebooks: bool, window_left: int | None = None,
                         logit_softcap: float | None = None, sinks=None, lse=None, **general):
    """Decode + merge on an already rotated ``q_rot`` (float32 ``[S, Hq, D]`` contiguous) and a
    block table whose ids lie in ``[0, cache.shape[0])`` (tests and benchmarks; the frontend goes
    through :func:`paged_decode_launch`). ``q_poison``: float32 ``[S·Hq]`` added to the output
    rows, or ``None`` (zeros). ``path``: ``"auto"``, ``"mma"`` (or ``ValueError`` where it does
    not apply) or ``"general"``; ``general``: ``block_n``, ``num_warps``, ``num_stages``,
    ``maxnreg`` of the general kernel; the options as :func:`paged_decode_launch`'s. ``interpret``
    is implied by the device (kept for callers)."""
    prep = prepare(layout, q_rot, cache, block_table, seq_lens, tables, same_codebooks=same_codebooks,
                   num_splits=num_splits, path=path, options=decode_options(window_left, logit_softcap, sinks, lse),
                   **general)
    if q_poison is None:
        q_poison = torch.zeros(q_rot.shape[0] * q_rot.shape[1], dtype=torch.float32, device=q_rot.device)
    _decode_and_merge(prep, out, q_rot, cache, block_table, seq_lens, tables, sm_scale, workspace, q_poison,
                      window_left, logit_softcap, sinks, lse)
    return out


def launch_mma_plan(q_rot, cache, block_table, seq_lens, layout, plan: dict, tables, acc, ml, *, num_splits: int,
                    sm_scale: float, window_left: int | None = None, logit_softcap: float | None = None) -> None:
    """Launch the warp-MMA kernel for any :func:`.mma_plans.mma_plan`-style ``plan`` (per-warp or
    cooperative), partials only, through a fresh launcher (tests comparing plans bit for bit),
    with the window and soft-cap where given."""
    from tqkern.ops.paged_decode.plan import mma_kernel_plan

    kernel = mma_kernel_plan(layout, plan, q_rot.shape[0], q_rot.shape[1], num_splits,
                             options=decode_options(window_left, logit_softcap))
    _launcher(kernel)(*_decode_args(kernel, q_rot, cache, block_table, seq_lens, tables, acc, ml, sm_scale,
                                    num_splits, window_left, logit_softcap))


def check_workspace(workspace, s: int, hq: int, num_splits: int, dp: int) -> int:
    """ValueError unless ``workspace`` holds ``workspace_numel(s, hq, num_splits, dp)`` float32
    elements from a 16-byte aligned address (the warp-MMA kernel writes its partials by 16-byte
    stores); returns that count."""
    if workspace.data_ptr() % 16:
        raise ValueError(f"workspace must start at a 16-byte aligned address, got one {workspace.data_ptr() % 16} "
                         f"bytes past it (a view at an offset: pass the start of an allocation)")
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
