"""The tiled prefill: long query rows over a bounded half-precision workspace of gathered keys and
values, one dense attention call per piece of a sequence's keys, the partials merged by
log-sum-exp.

The plan and the combine kernel are :mod:`tqkern.ops.prefill.tiles` (its docstring has the maths
and the memory bound); the gather (each key decoded once into q's dtype) is
:mod:`tqkern.ops.decompress.gather`, and a rotated side is rotated back by one GEMM per round.
The dense kernel (:func:`pick_attend`) on CUDA is cuDNN's fused attention through torch
(``aten::_scaled_dot_product_cudnn_attention``, what SDPA itself runs on Hopper; GQA, fp16/bf16,
returns the log-sum-exp) or, with a window, FlashAttention-2 as torch builds it (bottom-right
window masks); :func:`attend_math` is the same contract in float32
torch ops, for the CPU tests of the plan and the merges. cuDNN's varlen entry was measured at
~45 ms a call (H200, S20), so each dense call takes one sequence, or a run of consecutive
sequences whose pieces have one shape and whose queries are adjacent (a batched call;
:func:`_groups`). ``int8_prefill`` (``int8=True``) takes the same plan with int8 keys (codes and
scales written by the gather, in the key codec's space) and its own dense kernel,
:func:`attend_tiles` with int8 operands (:mod:`tqkern.ops.prefill.attend`, on a GPU and in the
interpreter alike; on sm_90 at head_dim 64, 128 and 256 the Gluon kernel of
:mod:`tqkern.ops.int8_prefill.gluon`); ``prefill`` with a logit soft-cap (which cuDNN's and
FlashAttention-2's kernels lack) takes the same kernel with half-precision operands.

What this path needs from the host: the lengths (``q_len`` and ``seq_len`` of every sequence, as
Python ints): the ones the checks read (a sync) or the caller's ``query_start_loc_cpu`` /
``seq_lens_cpu``, with which the whole call can be captured in a CUDA graph (the plan is then fixed
for the graph's lengths, as a serving stack's captured prefill is).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import triton

from tqkern.layouts import PagedLayout
from tqkern.ops.codecs import layout_args
from tqkern.ops.int8_prefill.gluon import _gluon_attend_kernel, gluon_config, gluon_eligible
from tqkern.ops.int8_prefill.reference import EXACT_QUERY_MAX
from tqkern.ops.int8_prefill.triton import QuantizeConfig, _quantize_q_kernel, quantize_config
from tqkern.ops.prefill.attend import AttendConfig, _tile_attend_kernel, attend_config, attend_tma
from tqkern.ops.prefill.tiles import _combine_kernel, _poison_rows_kernel, _runs_kernel, plan_tiles
from tqkern_torch._validate import check_tensor, interpreting

__all__ = ["tiles_supported", "tile_prefill", "pick_attend", "attend_cudnn", "attend_flash", "attend_math",
           "attend_tiles", "gluon_supported", "quantize_q", "tma_supported", "WORKSPACE_BYTES"]

WORKSPACE_BYTES = 256 << 20  # K + V bytes a prefix round may take (rotated-back copies: up to as much again)
_COMBINE_ROWS = 16
_POISON_ROWS = 1024  # lse rows a program of the one-call route's non-finite check reads
_LOG2E = 1.4426950408889634


def _key_table(p, int8: bool) -> torch.Tensor:
    """The key table the kernels read: the float32 centroids, or for ``int8_prefill`` the
    ``key_int8_table`` (centroids, their int8 image, its scale)."""
    if not int8:
        return p.key_centroids_f32
    if p.key_int8_table is None:
        raise ValueError("params.key_int8_table must be a tensor for int8_prefill, got None (make the "
                         "parameters with tqkern_torch.to_device)")
    return p.key_int8_table


def tiles_supported(q: torch.Tensor, layout: PagedLayout, *, logit_softcap, int8: bool) -> bool:
    """The tiled path serves this call: a CUDA device of sm_80 or later (cuDNN's and
    FlashAttention-2's fused attention; int8 tensor cores), fp16/bf16 queries, head_dim a multiple
    of 8 up to 256 (a logit soft-cap and ``int8_prefill`` take :func:`attend_tiles`). The value
    workspace is in q's dtype: bf16 queries attend bf16 values (as a bf16 model's own attention
    does)."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    d = layout.head_dim
    return d % 8 == 0 and d <= 256 and torch.cuda.get_device_capability(q.device) >= (8, 0)


Attend = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def attend_cudnn(q, k, v, batch: int, *, causal: bool, scale: float, window_left: Optional[int]):
    """cuDNN's fused attention (what torch's SDPA picks on Hopper) over ``batch`` sequences of equal
    lengths, token-major and packed: ``q [batch·L, Hq, D]``, ``k, v [batch·n, Hkv, D]`` →
    ``(out [batch·L, Hq, D], lse float32 [batch·L, Hq])``; causal top-left (the plan gives it
    square blocks only); no window."""
    t, hq, d = q.shape

    def heads_first(x):
        return x.view(batch, x.shape[0] // batch, x.shape[1], d).transpose(1, 2)

    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        heads_first(q), heads_first(k), heads_first(v), None, True, 0.0, causal, False, scale=scale)[:2]
    o, lse = o.transpose(1, 2), lse.reshape(batch, hq, t // batch).transpose(1, 2)
    if batch == 1:  # views
        return o[0], lse[0]
    return o.reshape(t, hq, d), lse.reshape(t, hq)


def attend_flash(q, k, v, batch: int, *, causal: bool, scale: float, window_left: Optional[int]):
    """FlashAttention-2 (torch's build), varlen over the ``batch`` equal sequences, bottom-right
    causal and window masks; :func:`attend_cudnn`'s contract."""
    steps = torch.arange(batch + 1, dtype=torch.int32, device=q.device)  # made on the device: capturable
    lq, lk = q.shape[0] // batch, k.shape[0] // batch
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, steps * lq, steps * lk, lq, lk, 0.0, causal, False, scale=scale,
        window_size_left=window_left, window_size_right=0 if window_left is not None else None)
    return res[0], res[1].transpose(0, 1)


def attend_math(q, k, v, batch: int, *, causal: bool, scale: float, window_left: Optional[int]):
    """:func:`attend_cudnn`'s contract in float32 torch ops (CPU tests), bottom-right masks."""
    lq, lk = q.shape[0] // batch, k.shape[0] // batch
    outs = [_math_one(q[b * lq:(b + 1) * lq], k[b * lk:(b + 1) * lk], v[b * lk:(b + 1) * lk], causal, scale,
                      window_left) for b in range(batch)]
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])


def _math_one(q, k, v, causal: bool, scale: float, window_left: Optional[int]):
    nq, hq, d = q.shape
    nk = k.shape[0]
    g = hq // k.shape[1]
    kb = k.float().repeat_interleave(g, dim=1)
    vb = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kb) * scale
    i = torch.arange(nq)[:, None] + (nk - nq)  # a query's position in key coordinates
    j = torch.arange(nk)[None, :]
    ok = torch.ones(nq, nk, dtype=torch.bool)
    if causal or window_left is not None:
        ok &= j <= i
    if window_left is not None:
        ok &= j >= i - window_left
    ok = ok.to(s.device)
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [hq, nq]
    p = torch.where(ok, torch.exp(s - lse[..., None]), 0.0)  # a NaN query stays NaN
    return torch.einsum("hqk,khd->qhd", p, vb).to(q.dtype), lse.transpose(0, 1)


def quantize_q(q: torch.Tensor, rotation: torch.Tensor, rotate: bool, signed_sylvester: bool = False,
               config: Optional[QuantizeConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``int8_prefill``'s query codes: int8 ``[T, Hq, D]`` and float32 scales ``[T, Hq]`` of ``q``
    (fp16/bf16; ``@ Π`` first when ``rotate``, by the Walsh–Hadamard transform when
    ``signed_sylvester`` at a power-of-two head_dim; ``config`` defaults to
    :func:`~tqkern.ops.int8_prefill.triton.quantize_config`;
    :func:`tqkern.ops.int8_prefill.triton._quantize_q_kernel`)."""
    check_tensor(q, "q", shape=(None, None, None), dtypes=(torch.float16, torch.bfloat16),
                 last_contiguous=q.numel() > 0)  # (an empty q may come with zero strides)
    t, hq, d = q.shape
    check_tensor(rotation, "rotation", shape=(d, d), dtypes=(torch.float32,), device=q.device, contiguous=True)
    q8 = torch.empty((t, hq, d), dtype=torch.int8, device=q.device)
    qs = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    n = t * hq
    cfg = config or quantize_config(rotate, signed_sylvester, d, interpreting())
    if cfg.FWHT and not (rotate and signed_sylvester and d >= 16 and d & (d - 1) == 0):
        raise ValueError("config.FWHT needs rotate and signed_sylvester at a power-of-two head_dim >= 16, got "
                         f"rotate={rotate}, signed_sylvester={signed_sylvester}, head_dim {d}")
    if n:
        _quantize_q_kernel[(triton.cdiv(n, cfg.ROWS * cfg.TILES),)](
            q, rotation, q8, qs, n, q.stride(0), q.stride(1), HQ=hq, D=d, DP=max(16, triton.next_power_of_2(d)),
            ROWS=cfg.ROWS, TILES=cfg.TILES, ROT=cfg.ROT, KC=cfg.KC, IN_BF16=q.dtype == torch.bfloat16,
            DOT_PRECISION=cfg.DOT_PRECISION, FWHT=cfg.FWHT, LOG2D=d.bit_length() - 1 if cfg.FWHT else 0,
            num_warps=cfg.num_warps)
    return q8, qs


def _check_attend_operands(q8, qs, k8, ks, v, batch, int8: bool) -> None:
    """:func:`attend_tiles`'s operands: shapes, dtypes, one device, contiguous last dimensions,
    lengths that split into ``batch`` equal sequences, whole GQA groups."""
    check_tensor(v, "v", shape=(None, None, None), dtypes=(torch.float16, torch.bfloat16), last_contiguous=True)
    n, hkv, d = v.shape
    qk = (torch.int8,) if int8 else (v.dtype,)
    check_tensor(q8, "q codes" if int8 else "q", shape=(None, None, d), dtypes=qk, device=v.device,
                 last_contiguous=q8.numel() > 0)
    check_tensor(k8, "k codes" if int8 else "k", shape=(n, hkv, d), dtypes=qk, device=v.device, last_contiguous=True)
    if int8:
        check_tensor(qs, "q scales", shape=tuple(q8.shape[:2]), dtypes=(torch.float32,), device=v.device,
                     last_contiguous=qs.numel() > 0)
        check_tensor(ks, "k scales", shape=(n, hkv), dtypes=(torch.float32,), device=v.device)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if q8.shape[0] % batch or n % batch:
        raise ValueError(f"q and k rows must split into batch={batch} equal sequences, got {q8.shape[0]} and {n}")
    if q8.shape[1] % hkv:
        raise ValueError(f"q's heads must be a multiple of k's, got {q8.shape[1]} and {hkv}")


def tma_supported(k: torch.Tensor, v: torch.Tensor, dp: int) -> bool:
    """Whether :func:`attend_tiles` reads K and V through tensor descriptors (TMA): both contiguous
    with 16-byte aligned rows and bases, head_dim a power of two (``dp``, the descriptor's box
    width, must not reach into the next head), on an sm_90+ GPU or in the interpreter."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-d tensor [tokens, Hkv, D], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be an int >= 1, got {dp!r}")
    n, hkv, d = v.shape
    if d != dp or n == 0 or not (k.is_contiguous() and v.is_contiguous()):
        return False
    if any(t.data_ptr() % 16 or (hkv * d * t.element_size()) % 16 for t in (k, v)):
        return False
    return interpreting() or (v.device.type == "cuda" and torch.cuda.get_device_capability(v.device) >= (9, 0))


def _descriptors(k: torch.Tensor, v: torch.Tensor, cfg: AttendConfig):
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, hkv, d = v.shape
    return tuple(TensorDescriptor.from_tensor(t.view(n, hkv * d), [cfg.BN, d]) for t in (k, v))


def gluon_supported(q8: torch.Tensor, k8: torch.Tensor, v: torch.Tensor, batch: int, *, window_left: Optional[int],
                    softcap: Optional[float]) -> bool:
    """Whether :func:`attend_tiles` can run int8 operands on the Gluon kernel
    (:mod:`tqkern.ops.int8_prefill.gluon`): its shape rule (:func:`~tqkern.ops.int8_prefill.gluon.gluon_eligible`),
    an sm_90 GPU (warpgroup MMAs; not the interpreter), and contiguous, 16-byte aligned query
    codes, key codes and values (its TMA descriptors' views)."""
    for name, t in (("q codes", q8), ("k codes", k8), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-d tensor [tokens, heads, D], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if interpreting() or v.device.type != "cuda" or torch.cuda.get_device_capability(v.device)[0] != 9:
        return False
    if not gluon_eligible(v.shape[2], window=window_left is not None, softcap=softcap is not None,
                          lq=q8.shape[0] // batch, lk=v.shape[0] // batch):
        return False
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q8, k8, v))


def _gluon_attend(q8, qs, k8, ks, v, o, lse, batch: int, causal: bool, qk_scale: float) -> None:
    """Launch the Gluon kernel on :func:`gluon_supported` operands (``ks`` head-major), writing ``o`` and ``lse``."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    t, hq, d = q8.shape
    cfg = gluon_config(d)

    def desc(x, rows):
        x2 = x.view(x.shape[0], x.shape[1] * d)
        dt = {torch.int8: gl.int8, torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[x.dtype]
        return GluonDescriptor(x2, list(x2.shape), list(x2.stride()), [rows, d],
                               gl.NVMMASharedLayout.get_default_for([rows, d], dt))

    lq, lk = t // batch, v.shape[0] // batch
    _gluon_attend_kernel[(triton.cdiv(lq, cfg.BM), batch * hq)](
        desc(q8, cfg.BM), desc(k8, cfg.BN), desc(v, cfg.BN), qs, ks, o, lse, lq, lk, qs.stride(0), ks.stride(1),
        qk_scale, HQ=hq, G=hq // k8.shape[1], D=d, BM=cfg.BM, BN=cfg.BN, CAUSAL=causal, num_warps=cfg.num_warps)


def attend_tiles(q, k, v, batch: int, *, causal: bool, scale: float, window_left: Optional[int],
                 softcap: Optional[float] = None, config: Optional[AttendConfig] = None, tma: Optional[bool] = None,
                 gluon: Optional[bool] = None):
    """:func:`attend_cudnn`'s contract on :func:`tqkern.ops.prefill.attend._tile_attend_kernel`:
    ``q [batch·L, Hq, D]``, ``k [batch·n, Hkv, D]`` in v's dtype, or with int8 Q·Kᵀ ``q = (codes
    int8 [batch·L, Hq, D], scales float32 [batch·L, Hq])`` and ``k`` likewise; ``v [batch·n, Hkv,
    D]`` fp16/bf16 (the output's dtype); bottom-right causal and window masks; ``softcap`` caps the
    scores. ``tma``: K/V tiles through tensor descriptors (default: where :func:`tma_supported` and
    :func:`~tqkern.ops.prefill.attend.attend_tma` say so, which has the measurements; ``False``
    forces pointer loads; ``True`` where unsupported raises ``ValueError``). ``gluon``: int8
    operands on the Gluon kernel (:mod:`tqkern.ops.int8_prefill.gluon`; default: where
    :func:`gluon_supported` says so and neither ``config`` nor ``tma`` asks for the Triton
    kernel; ``True`` where unsupported raises ``ValueError``)."""
    int8 = isinstance(q, tuple)
    if isinstance(k, tuple) != int8 or (int8 and (len(q) != 2 or len(k) != 2)):
        raise TypeError("q and k must both be tensors, or both (int8 codes, float32 scales) pairs, got "
                        f"{type(q).__name__} and {type(k).__name__}")
    (q8, qs), (k8, ks) = (q, k) if int8 else ((q, q), (k, k))
    _check_attend_operands(q8, qs, k8, ks, v, batch, int8)
    t, hq, d = q8.shape
    hkv = k8.shape[1]
    lq, lk = t // batch, k8.shape[0] // batch
    cfg = config or attend_config(d, int8, interpreting())
    if tma is not None and not isinstance(tma, bool):
        raise TypeError(f"tma must be None, True or False, got {tma!r}")
    can = tma_supported(k8, v, cfg.DP)
    if tma and not can:
        raise ValueError("tma=True needs contiguous, 16-byte aligned, non-empty k and v with a power-of-two "
                         f"head_dim on an sm_90+ GPU or the interpreter, got k {tuple(k8.shape)} "
                         f"{k8.dtype} and v {tuple(v.shape)} {v.dtype} on {v.device}")
    use_tma = (can and attend_tma(d, int8)) if tma is None else tma
    if gluon is not None and not isinstance(gluon, bool):
        raise TypeError(f"gluon must be None, True or False, got {gluon!r}")
    asked = gluon or (gluon is None and config is None and tma is None)  # the default takes it where it can
    on_gluon = int8 and bool(asked) and gluon_supported(q8, k8, v, batch, window_left=window_left, softcap=softcap)
    if gluon and not on_gluon:
        raise ValueError("gluon=True needs int8 operands, head_dim 64, 128 or 256, no window or soft-cap, "
                         "1 <= Lq <= Lk, contiguous 16-byte aligned q codes, k codes and v, on an sm_90 GPU, got q "
                         f"{tuple(q8.shape)} {q8.dtype}, v {tuple(v.shape)} {v.dtype} on {v.device}, batch {batch}")
    k_desc, v_desc = _descriptors(k8, v, cfg) if use_tma and not on_gluon else (k8, v)
    o = torch.empty((t, hq, d), dtype=v.dtype, device=v.device)
    lse = torch.empty((t, hq), dtype=torch.float32, device=v.device)
    if int8 and ks.stride(0) != 1:
        ks = ks.t().contiguous().t()  # head-major (the gather writes it so): each tile's scales one vector load
    if t and on_gluon:
        _gluon_attend(q8, qs, k8, ks, v, o, lse, batch, causal, scale * _LOG2E)
    elif t:
        _tile_attend_kernel[(triton.cdiv(lq, cfg.BM), batch * hq)](
            q8, qs, k8, ks, v, o, lse, k_desc, v_desc, lq, lk, scale if softcap is not None else scale * _LOG2E,
            0.0 if softcap is None else float(softcap), 0 if window_left is None else window_left,
            q8.stride(0), q8.stride(1), qs.stride(0), k8.stride(0), k8.stride(1), ks.stride(0), ks.stride(1),
            v.stride(0), v.stride(1), o.stride(0), o.stride(1), lse.stride(0), HQ=hq, G=hq // hkv, D=d, DP=cfg.DP,
            BM=cfg.BM, BN=cfg.BN, CAUSAL=causal, WINDOW=window_left is not None, SOFTCAP=softcap is not None,
            INT8=int8, TMA=use_tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return o, lse


def pick_attend(q: torch.Tensor, window_left: Optional[int]) -> Attend:
    """The dense kernel for this call: cuDNN on CUDA without a window (fastest on Hopper),
    FlashAttention-2 with one, the torch-ops version elsewhere."""
    if q.device.type != "cuda":
        return attend_math
    if window_left is None and torch.backends.cudnn.is_available() and torch.backends.cudnn.version() >= 90000:
        return attend_cudnn
    return attend_flash


def _combine(a, a_lse, b, b_lse, dst, lse_out, sinks) -> None:
    """``dst, lse_out ← merge((a, a_lse), (b, b_lse), sinks)`` over one sequence's rows (``a``
    None: ``b`` alone); rows with a non-finite lse NaN."""
    t, hq, d = b.shape
    n = t * hq
    aa, al = (b, b_lse) if a is None else (a, a_lse)
    _combine_kernel[(triton.cdiv(n, _COMBINE_ROWS),)](
        aa, al, b, b_lse, b_lse if sinks is None else sinks, dst, lse_out, n, aa.stride(0), aa.stride(1),
        b.stride(0), b.stride(1), dst.stride(0), dst.stride(1), al.stride(0), al.stride(1), b_lse.stride(0),
        b_lse.stride(1), lse_out.stride(0), lse_out.stride(1),
        HQ=hq, D=d, DP=max(16, triton.next_power_of_2(d)), BR=_COMBINE_ROWS, HAS_A=a is not None,
        HAS_SINK=sinks is not None, num_warps=4)


def _groups(rnd, q_lens: list[int]) -> list[list]:
    """A round's pieces in runs of consecutive sequences with equal ``(q_len, length, causal,
    last)``: one dense call each. A run's queries and workspace rows must be adjacent. The rows are
    by construction (:func:`~tqkern.ops.prefill.tiles.plan_tiles` packs a round in sequence
    order); the queries only where every sequence between two pieces of the run has none: one
    with queries but no piece in this round (no prefix, or a shorter one done) breaks the run,
    else its rows would fall inside the call's and be overwritten by the merge."""
    out: list[list] = []
    for pc in rnd:
        key = (q_lens[pc.seq], pc.length, pc.causal, pc.last)
        prev = out[-1][-1] if out else None
        if (prev is not None and (q_lens[prev.seq], prev.length, prev.causal, prev.last) == key
                and not any(q_lens[prev.seq + 1:pc.seq])):
            out[-1].append(pc)
        else:
            out.append([pc])
    return out


class _Running:
    """Each sequence's result between its pieces. A first piece's dense output is held as the dense
    call returned it (no copy) and read by the sequence's next merge; a merge that is not the
    sequence's last writes float32 rows of ``acc`` (allocated on first need): merged in q's dtype, a
    result was rounded once per piece (bf16: 2^-9 each)."""

    def __init__(self, q: torch.Tensor, lse_acc: torch.Tensor, starts: list[int]):
        self.q, self.lse_acc, self.starts = q, lse_acc, starts
        self.held: dict[int, tuple] = {}  # sequence -> (dense output, its lse, row of its first row)
        self.acc: Optional[torch.Tensor] = None

    def hold(self, grp, o: torch.Tensor, lse: torch.Tensor, row: int) -> None:
        for pc in grp:
            self.held[pc.seq] = (o, lse, row)

    def acc_rows(self, a: int, b: int) -> torch.Tensor:
        if self.acc is None:
            self.acc = torch.empty(self.q.shape, dtype=torch.float32, device=self.q.device)
        return self.acc[a:b]

    def source(self, grp, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The running result (rows, lse) of the group's query rows ``a:b``: the rows of one held
        output where every sequence of the group was held in it (their rows are adjacent there as
        here: sequences between them have no queries), else ``acc``'s, held rows copied there first."""
        held = [self.held.pop(pc.seq, None) for pc in grp]
        if all(e is not None and e[0] is held[0][0] for e in held):
            o, lse, row = held[0]
            return o[a - row:b - row], lse[a - row:b - row]
        self.acc_rows(a, b)
        for pc, e in zip(grp, held):
            if e is not None:
                o, lse, row = e
                s0, s1 = self.starts[pc.seq], self.starts[pc.seq + 1]
                _combine(None, None, o[s0 - row:s1 - row], lse[s0 - row:s1 - row], self.acc[s0:s1],
                         self.lse_acc[s0:s1], None)
        return self.acc[a:b], self.lse_acc[a:b]


def tile_prefill(q, cache, block_table, seq_lens_dev, query_start_loc, layout: PagedLayout, p, *, q_lens: list[int],
                 seq_lens: list[int], num_blocks: int, errors: torch.Tensor, scale: float,
                 out: Optional[torch.Tensor], lse: Optional[torch.Tensor], window_left: Optional[int],
                 sinks: Optional[torch.Tensor], workspace_bytes: int = WORKSPACE_BYTES,
                 attend: Optional[Attend] = None, int8: bool = False,
                 logit_softcap: Optional[float] = None, gather=None) -> torch.Tensor:
    """The tiled prefill of ``q`` (validated by the caller; ``q_lens``/``seq_lens`` the host copies
    of ``query_start_loc``'s lengths and ``seq_lens_dev``, valid). Writes and returns ``out``, and
    ``lse`` when given. With ``out`` None a call that is one dense call (every row in one piece, no
    sinks) returns that call's own output when it is contiguous (no copy), else a new tensor.
    ``workspace_bytes`` bounds a prefix round's K and V in q's dtype; a rotated side the gather
    does not rotate back (tq4's dense rotation, a head_dim not a power of two) adds as much again
    for its rotated-back copy. A batch in which some sequence has several pieces also holds its
    first pieces' dense outputs until their next merge and, where a sequence has three or more,
    its running result in float32 (:class:`_Running`).

    ``int8`` (``int8_prefill``): the queries' int8 codes are made once (:func:`quantize_q`, in the
    key codec's space), the keys' by the gather (int8 codes and scales, in the key codec's space:
    never rotated back), and every piece goes to :func:`attend_tiles` (``attend`` is ignored). Its
    sequences have 0 or more than ``EXACT_QUERY_MAX`` new tokens (shorter ones take ``prefill``'s
    scores in ``int8_prefill``'s spec; the frontend routes them elsewhere): ``ValueError`` else. A
    ``logit_softcap`` sends every piece to :func:`attend_tiles` too. ``gather``: the gather
    kernel's :class:`~tqkern.ops.decompress.gather.GatherConfig` (default its ``gather_config``:
    with ``fwht``, on by default, a signed Sylvester rotation is undone in the gather, not by a
    product here, and that side's rotated-back copy is not allocated)."""
    from tqkern.ops.common import halfword_aligned, transform_applies
    from tqkern.ops.decompress.gather import GatherConfig, _gather_kernel, gather_config

    if int8 and any(1 <= n <= EXACT_QUERY_MAX for n in q_lens):
        s = next(i for i, n in enumerate(q_lens) if 1 <= n <= EXACT_QUERY_MAX)
        raise ValueError(f"q_lens must be 0 or > {EXACT_QUERY_MAX} for int8 tiles (shorter sequences take "
                         f"prefill's scores), got q_lens[{s}] = {q_lens[s]}")
    h, d = layout.num_kv_heads, layout.head_dim
    fmt = layout.format
    if gather is not None and not isinstance(gather, GatherConfig):
        raise TypeError(f"gather must be None or a GatherConfig, got {type(gather).__name__}")
    c = {k: v for k, v in layout_args(layout).items() if not k.startswith("PAD")}
    gc = gather_config(c["DP"]) if gather is None else gather
    # a side in its codec's space, or rotated back by the gather's transform (signed Sylvester)
    fwht = gc.fwht and transform_applies(p.signed_sylvester, d)
    in_gather = (fwht and fmt.key.rotated and not int8, fwht and fmt.value.rotated)
    rotated = (fmt.key.rotated and not int8 and not in_gather[0], fmt.value.rotated and not in_gather[1])
    plan = plan_tiles(q_lens, seq_lens, budget_rows=max(1, workspace_bytes // (2 * h * d * q.element_size())),
                      window_left=window_left)
    if int8 or logit_softcap is not None:
        attend = functools.partial(attend_tiles, softcap=logit_softcap)
    attend = attend or pick_attend(q, window_left)
    groups = [_groups(rnd, q_lens) for rnd in plan.rounds]
    one_call = (out is None and sinks is None and len(groups) == 1 and len(groups[0]) == 1
                and plan.rounds[0][0].first and plan.rounds[0][0].last
                and sum(q_lens[pc.seq] for pc in plan.rounds[0]) == q.shape[0])
    out = torch.empty_like(q) if out is None and not one_call else out
    lse_acc = lse if lse is not None else torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    # each side in its codec's space; a rotated side also rotated back (the copy attention reads)
    rows = max(1, plan.workspace_rows)
    ws = [torch.empty((rows, h, d), dtype=torch.int8 if int8 and side == 0 else q.dtype, device=q.device)
          for side in (0, 1)]
    k_scales = torch.empty((h, rows), dtype=torch.float32, device=q.device) if int8 else ws[1]  # head-major
    back = [torch.empty_like(ws[i]) if rotated[i] else ws[i] for i in (0, 1)]
    rot_t = p.rotation.t().to(q.dtype) if any(rotated) else None
    queries = quantize_q(q, p.rotation, fmt.key.rotated, p.signed_sylvester) if int8 else q
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    n_seq = len(q_lens)
    runs = torch.empty((len(plan.rounds), n_seq, 4), dtype=torch.int32, device=q.device)
    cap = block_table.shape[1] * layout.block_size
    _runs_kernel[(len(plan.rounds),)](seq_lens_dev, query_start_loc, runs, n_seq, max(plan.piece_rows, 1),
                                      window_left or 0, cap, HAS_WINDOW=window_left is not None)
    k_table = _key_table(p, int8)
    running = _Running(q, lse_acc, starts)
    for r, rnd in enumerate(plan.rounds):
        longest = max(pc.length for pc in rnd)
        used = sum(pc.length for pc in rnd)
        gr = gc.fitting(longest)
        _gather_kernel[gr.grid(longest, n_seq, h)](
            ws[0], ws[1], cache, block_table, runs[r], k_table, p.value_centroids_f32, errors, num_blocks,
            block_table.stride(0), cap, rows, k_scales, p.rotation, BS=layout.block_size, H=h,
            K_ALIGNED=halfword_aligned(layout, "key"), V_ALIGNED=halfword_aligned(layout, "value"),
            OUT_BF16=q.dtype == torch.bfloat16, K_INT8=int8, K_FWHT=in_gather[0], V_FWHT=in_gather[1],
            LOG2D=d.bit_length() - 1, BT=gr.BT, TILES=gr.TILES, num_warps=gr.num_warps, **c)
        for side in (0, 1):
            if rotated[side]:
                torch.mm(ws[side][:used].view(-1, d), rot_t, out=back[side][:used].view(-1, d))
        for grp in groups[r]:
            pc, last = grp[0], grp[-1]
            a, b = starts[pc.seq], starts[last.seq + 1]
            span = slice(pc.row, last.row + last.length)
            qa = (queries[0][a:b], queries[1][a:b]) if int8 else q[a:b]
            ka = (back[0][span], k_scales[:, span].t()) if int8 else back[0][span]
            o, lp = attend(qa, ka, back[1][span], len(grp), causal=pc.causal, scale=scale, window_left=window_left)
            if one_call:  # the dense call's result, no merge: its rows of a non-finite query NaN here
                t, hq = lp.shape
                _poison_rows_kernel[(triton.cdiv(t * hq, _POISON_ROWS),)](
                    o, lp, t * hq, o.stride(0), o.stride(1), lp.stride(0), lp.stride(1), HQ=hq, D=d,
                    DP=max(16, triton.next_power_of_2(d)), BR=_POISON_ROWS, SUB=_COMBINE_ROWS, num_warps=4)
                if lse is not None:
                    lse.copy_(lp)
                return o if o.is_contiguous() else o.contiguous()
            if pc.first and not pc.last:  # held as returned: the sequences' next merge reads it
                running.hold(grp, o, lp, a)
                continue
            src, src_lse = (None, None) if pc.first else running.source(grp, a, b)
            _combine(src, src_lse, o, lp, out[a:b] if pc.last else running.acc_rows(a, b), lse_acc[a:b],
                     sinks if pc.last else None)
    assert not running.held, "a held piece without a later piece"
    return out
