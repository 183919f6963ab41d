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
from tqkern.ops.codecs import KIND_LLOYD_MAX, KIND_UNIFORM, NC_DECODE, layout_args
from tqkern.ops.fields import load_tile, token_factors

__all__ = ["_decompress_kernel", "_launch_decompress", "decoded_values"]

_ERR_SLOT = tl.constexpr(int(ErrorFlag.SLOT_OUT_OF_RANGE))


@triton.jit
def decoded_values(row, h, tok_mask, cen_ptr, D: tl.constexpr, DP: tl.constexpr, NIBBLE: tl.constexpr,
                   S: tl.constexpr, CT: tl.constexpr, ALIGNED: tl.constexpr = False):
    """One side of ``BT`` slots (``row [BT]``: each token's cache row; head ``h``) decoded in its
    codec's space, ``CT`` (float32 or float64) ``[BT, DP]``, zero outside ``tok_mask`` and beyond
    D. Lloyd-Max: ``f · c[code]`` from a centroid table of ``CT``'s precision (``NC_DECODE``: f
    divided by ‖c[codes]‖, as the oracle does); uniform: ``scale · code + zero``; FP8 and raw: the
    stored value. ``ALIGNED``: raw fields start at even bytes (one 16-bit load per element)."""
    cols = tl.arange(0, DP)
    dmask = cols < D
    m2 = tok_mask[:, None] & dmask[None, :]
    if S.KIND == KIND_LLOYD_MAX:
        c = load_tile(row, h, tok_mask, DP, -1, NIBBLE, S, D, DP, cen_ptr, CT, False)
        f, _ = token_factors(row, h, tok_mask, S, CT)
        f = f.to(CT)
        if S.NORM_CORRECTION == NC_DECODE:
            cn = tl.sqrt(tl.sum(c * c, axis=1))
            f = tl.where(cn > 0, f / tl.where(cn > 0, cn, 1.0), 0.0)
        y = f[:, None] * c
    elif S.KIND == KIND_UNIFORM:
        q = load_tile(row, h, tok_mask, DP, -1, NIBBLE, S, D, DP, cen_ptr, tl.float32, False)
        scale, zero = token_factors(row, h, tok_mask, S, tl.float32)
        y = (q * scale[:, None] + zero[:, None]).to(CT)
    else:  # FP8, raw: in float32 the tile is the value (factor 1, zero 0)
        y = load_tile(row, h, tok_mask, DP, -1, NIBBLE, S, D, DP, cen_ptr, tl.float32, ALIGNED).to(CT)
    return tl.where(m2, y, 0.0)


@triton.jit
def _decode_side(out_ptr_2d, row, h, tok_mask, in_range, cen_ptr, D: tl.constexpr, DP: tl.constexpr,
                 NIBBLE: tl.constexpr, S: tl.constexpr):
    """One side of BT slots → float32 ``[BT, D]`` at ``out_ptr_2d`` (Lloyd-Max in float64 from the
    float64 codebook ``cen_ptr``, rounded once)."""
    cols = tl.arange(0, DP)
    y = decoded_values(row, h, tok_mask, cen_ptr, D, DP, NIBBLE, S, tl.float64).to(tl.float32)
    tl.store(out_ptr_2d + cols[None, :], y, mask=in_range[:, None] & (cols < D)[None, :])


@triton.jit
def _decompress_kernel(
    k_out, v_out, cache_ptr, slot_ptr, kc_ptr, vc_ptr, err_ptr, n, cache_slots,
    BT: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, H: tl.constexpr, ROW_BYTES: tl.constexpr,
    NIBBLE: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
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
    _decode_side(k_ptr, row, h, tok_mask, in_range, kc_ptr, D, DP, NIBBLE, K)
    _decode_side(v_ptr, row, h, tok_mask, in_range, vc_ptr, D, DP, NIBBLE, V)


def _launch_decompress(k_out, v_out, cache, slot_ids, layout, tables, errors, *, rotate_back: bool,
                       interpret: bool, block_tokens: int = 16):
    """Fill ``k_out, v_out [N, H, D]`` float32 from ``slot_ids [N]``; no checks. ``errors``: the
    int32 ``[1]`` error word."""
    c = layout_args(layout)
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
