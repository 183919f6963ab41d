"""Decompress slots of a paged cache back to dense float32 K and V (each in its codec's space).

A program reads ``BT`` slots of one KV head. Rotating back (``@ Πᵀ``) is left to the launcher's
caller (one matmul over the dense output): this kernel exists for tests, debugging and
prefix reuse, not for the decode hot path.

A slot id outside ``[0, cache_slots)`` reads nothing: its rows are zeros (negative ids by
definition; too large ones also set ``SLOT_OUT_OF_RANGE`` in ``err_ptr[0]``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.errors import ErrorFlag
from tqkern.ops.common import bits_to_f32, fp8e4m3_bits_to_f32, layout_consts, load_bytes, load_packed

__all__ = ["_decompress_kernel", "_launch_decompress"]

_ERR_SLOT = tl.constexpr(int(ErrorFlag.SLOT_OUT_OF_RANGE))


@triton.jit
def _decode_side(out_ptr_2d, row, h, tok_mask, in_range, cen_ptr, D: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr,
                 NIBBLE: tl.constexpr,
                 KIND: tl.constexpr, BITS: tl.constexpr, ROTATED: tl.constexpr, NORM_CORRECTION: tl.constexpr,
                 PARAM_DTYPE: tl.constexpr, A_OFF: tl.constexpr, A_STRIDE: tl.constexpr, A_BYTES: tl.constexpr,
                 B_OFF: tl.constexpr, B_STRIDE: tl.constexpr, C_OFF: tl.constexpr, C_STRIDE: tl.constexpr):
    cols = tl.arange(0, DP)
    dmask = cols < D
    m2 = tok_mask[:, None] & dmask[None, :]
    PB: tl.constexpr = 2 + 2 * PARAM_DTYPE
    if KIND == 0:
        codes = load_packed(row + A_OFF + h * A_STRIDE, tok_mask, BITS, NIBBLE, A_BYTES, DP)
        c = tl.where(dmask[None, :], tl.load(cen_ptr + codes), 0.0)  # float64 centroids
        f = bits_to_f32(load_bytes(row + B_OFF + h * B_STRIDE, PB, tok_mask), PARAM_DTYPE).to(tl.float64)
        if NORM_CORRECTION == 1:
            cn = tl.sqrt(tl.sum(c * c, axis=1))
            f = tl.where(cn > 0, f / tl.where(cn > 0, cn, 1.0), 0.0)
        y = (f[:, None] * c).to(tl.float32)
    elif KIND == 1:
        q = load_packed(row + A_OFF + h * A_STRIDE, tok_mask, BITS, NIBBLE, A_BYTES, DP)
        scale = bits_to_f32(load_bytes(row + B_OFF + h * B_STRIDE, PB, tok_mask), PARAM_DTYPE)
        zero = bits_to_f32(load_bytes(row + C_OFF + h * C_STRIDE, PB, tok_mask), PARAM_DTYPE)
        y = q.to(tl.float32) * scale[:, None] + zero[:, None]
    elif KIND == 2:
        code = tl.load(row[:, None] + A_OFF + h * A_STRIDE + cols[None, :], mask=m2, other=0).to(tl.int32)
        y = fp8e4m3_bits_to_f32(code)
    else:
        base = row[:, None] + A_OFF + h * A_STRIDE + 2 * cols[None, :]
        lo = tl.load(base, mask=m2, other=0).to(tl.int64)
        hi = tl.load(base + 1, mask=m2, other=0).to(tl.int64)
        y = bits_to_f32(lo | (hi << 8), PARAM_DTYPE)
    tl.store(out_ptr_2d + cols[None, :], tl.where(m2, y, 0.0), mask=in_range[:, None] & dmask[None, :])


@triton.jit
def _decompress_kernel(
    k_out, v_out, cache_ptr, slot_ptr, kc_ptr, vc_ptr, err_ptr, n, cache_slots,
    BT: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, H: tl.constexpr, ROW_BYTES: tl.constexpr,
    NIBBLE: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_ROTATED: tl.constexpr, K_NORM_CORRECTION: tl.constexpr,
    K_PARAM_DTYPE: tl.constexpr, K_A_OFF: tl.constexpr, K_A_STRIDE: tl.constexpr, K_A_BYTES: tl.constexpr,
    K_B_OFF: tl.constexpr, K_B_STRIDE: tl.constexpr, K_C_OFF: tl.constexpr, K_C_STRIDE: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_ROTATED: tl.constexpr, V_NORM_CORRECTION: tl.constexpr,
    V_PARAM_DTYPE: tl.constexpr, V_A_OFF: tl.constexpr, V_A_STRIDE: tl.constexpr, V_A_BYTES: tl.constexpr,
    V_B_OFF: tl.constexpr, V_B_STRIDE: tl.constexpr, V_C_OFF: tl.constexpr, V_C_STRIDE: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    t = pid * BT + tl.arange(0, BT)
    in_range = t < n
    slot = tl.load(slot_ptr + t, mask=in_range, other=-1).to(tl.int64)
    tok_mask = in_range & (slot >= 0) & (slot < cache_slots)
    bad = tl.max((in_range & (slot >= cache_slots)).to(tl.int32), axis=0)
    tl.atomic_or(err_ptr, bad * _ERR_SLOT, mask=bad != 0, sem="relaxed")
    row = cache_ptr + tl.where(tok_mask, slot, 0) * ROW_BYTES
    out_off = (t.to(tl.int64) * H + h)[:, None] * D
    k_ptr = k_out + out_off
    v_ptr = v_out + out_off
    _decode_side(k_ptr, row, h, tok_mask, in_range, kc_ptr, D, DP, BT, NIBBLE,
                 K_KIND, K_BITS, K_ROTATED, K_NORM_CORRECTION, K_PARAM_DTYPE, K_A_OFF, K_A_STRIDE, K_A_BYTES,
                 K_B_OFF, K_B_STRIDE, K_C_OFF, K_C_STRIDE)
    _decode_side(v_ptr, row, h, tok_mask, in_range, vc_ptr, D, DP, BT, NIBBLE,
                 V_KIND, V_BITS, V_ROTATED, V_NORM_CORRECTION, V_PARAM_DTYPE, V_A_OFF, V_A_STRIDE, V_A_BYTES,
                 V_B_OFF, V_B_STRIDE, V_C_OFF, V_C_STRIDE)


def _launch_decompress(k_out, v_out, cache, slot_ids, layout, tables, errors, *, rotate_back: bool,
                       interpret: bool, block_tokens: int = 16):
    """Fill ``k_out, v_out [N, H, D]`` float32 from ``slot_ids [N]``; no checks. ``errors``: the
    int32 ``[1]`` error word."""
    c = layout_consts(layout)
    n = slot_ids.shape[0]
    grid = (triton.cdiv(n, block_tokens), layout.num_kv_heads)
    consts = {k: v for k, v in c.items() if not k.startswith("PAD")}
    _decompress_kernel[grid](k_out, v_out, cache, slot_ids, tables["key_centroids"], tables["value_centroids"], errors, n,
                             cache.shape[0] * layout.block_size,
                             BT=block_tokens, H=layout.num_kv_heads, **consts)
    if rotate_back:
        fmt = layout.format
        r = tables["rotation"].T
        if fmt.key.rotated:
            k_out.copy_(k_out @ r)
        if fmt.value.rotated:
            v_out.copy_(v_out @ r)
