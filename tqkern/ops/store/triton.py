"""Fused store: normalize, rotate, quantize, pack and write slots into a paged cache.

One kernel serves every codec and both arrangements: the layout becomes constexprs
(:func:`tqkern.ops.codecs.layout_args`), each side's encoding is
:func:`tqkern.ops.fields.encode_side`. A program takes ``BT`` tokens of one KV head.
Norms, uniform scales/codes and stored gains are computed exactly (float64 from the exact
inputs, or a float32 estimate corrected by exact float64 comparisons), so they equal the oracle's
bytes; only the rotation runs in float32 (codes within ``tqkern.ops.quantize.reference.EPS`` of
a boundary may differ, as the spec allows).

Safety (``tqkern.errors``): a slot outside ``[0, num_slots)`` writes nothing (negative: skipped
silently; too large: ``SLOT_OUT_OF_RANGE``); a key or value vector holding a NaN or ±inf is read
as zeros (``NONFINITE_INPUT``); a stored float beyond its dtype's range saturates
(``SATURATED``). Each program ORs its bits into ``err_ptr[0]`` with one atomic, only when set.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqkern.errors import ErrorFlag
from tqkern.ops.codecs import layout_args
from tqkern.ops.common import halfword_aligned
from tqkern.ops.fields import encode_side, finite_rows, flag

__all__ = ["_store_kernel", "_launch_store"]

_ERR_NONFINITE = tl.constexpr(int(ErrorFlag.NONFINITE_INPUT))
_ERR_SLOT = tl.constexpr(int(ErrorFlag.SLOT_OUT_OF_RANGE))


@triton.jit
def _store_kernel(
    key_ptr, value_ptr, slot_ptr, cache_ptr, rot_ptr, kb_ptr, kc_ptr, vb_ptr, vc_ptr, mu_ptr, err_ptr,
    num_tokens, num_slots, stride_kt, stride_kh, stride_vt, stride_vh,
    HAS_MU: tl.constexpr, IN_BF16: tl.constexpr, BT: tl.constexpr, KC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    K_ALIGNED: tl.constexpr, V_ALIGNED: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, ROW_BYTES: tl.constexpr, NIBBLE: tl.constexpr,
    PAD_OFF: tl.constexpr, PAD_STRIDE: tl.constexpr, PAD_BYTES: tl.constexpr, PADP: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr,
):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    tmask = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    tok_mask = tmask & (slot >= 0) & (slot < num_slots)  # never a byte outside the cache
    err = flag(tmask & (slot >= num_slots), _ERR_SLOT)
    row = cache_ptr + tl.where(tok_mask, slot, 0) * ROW_BYTES  # [BT] pointers to each token row
    t64 = t.to(tl.int64)
    k_ptr_2d = key_ptr + t64[:, None] * stride_kt + h * stride_kh
    v_ptr_2d = value_ptr + t64[:, None] * stride_vt + h * stride_vh
    k_ok = finite_rows(k_ptr_2d, tok_mask, D, DP)
    v_ok = finite_rows(v_ptr_2d, tok_mask, D, DP)
    err |= flag(tok_mask & ~(k_ok & v_ok), _ERR_NONFINITE)
    err |= encode_side(k_ptr_2d, mu_ptr + h * D, HAS_MU, IN_BF16, row, h, tok_mask, tok_mask & k_ok, rot_ptr,
                       kb_ptr, kc_ptr, D, DP, KC, BT, NIBBLE, DOT_PRECISION, K_ALIGNED, K)
    err |= encode_side(v_ptr_2d, mu_ptr, False, IN_BF16, row, h, tok_mask, tok_mask & v_ok, rot_ptr, vb_ptr,
                       vc_ptr, D, DP, KC, BT, NIBBLE, DOT_PRECISION, V_ALIGNED, V)
    if PAD_BYTES > 0:
        p = tl.arange(0, PADP)
        tl.store(row[:, None] + PAD_OFF + h * PAD_STRIDE + p[None, :], tl.zeros([BT, PADP], tl.uint8),
                 mask=tok_mask[:, None] & (p < PAD_BYTES)[None, :])
    tl.atomic_or(err_ptr, err, mask=err != 0, sem="relaxed")


def _launch_store(cache, key, value, slot_mapping, layout, tables, errors, *, interpret: bool,
                  block_tokens: int = 16, num_warps: int = 4):
    """Launch :func:`_store_kernel`. No checks: the torch frontend validates. ``errors``: int32
    ``[1]`` device word the kernel ORs its :class:`~tqkern.errors.ErrorFlag` bits into.

    ``tables`` holds device tensors: ``rotation`` fp32 [D, D], ``key_boundaries`` / ``value_boundaries``
    fp32, ``key_centroids`` / ``value_centroids`` fp64, ``key_offset`` fp32 [H, D] or None (any
    1-element tensor stands in for an unused table).
    """
    c = layout_args(layout)
    num_tokens = key.shape[0]
    grid = (triton.cdiv(num_tokens, block_tokens), layout.num_kv_heads)
    mu = tables["key_offset"]
    _store_kernel[grid](
        key, value, slot_mapping, cache, tables["rotation"], tables["key_boundaries"], tables["key_centroids"],
        tables["value_boundaries"], tables["value_centroids"], mu if mu is not None else tables["rotation"], errors,
        num_tokens, cache.shape[0] * layout.block_size, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        HAS_MU=mu is not None, IN_BF16=key.dtype == torch.bfloat16, BT=block_tokens, KC=min(c["DP"], 128),
        K_ALIGNED=halfword_aligned(layout, "key"), V_ALIGNED=halfword_aligned(layout, "value"),
        DOT_PRECISION="ieee" if interpret else "tf32x3",
        num_warps=num_warps, **c,
    )
