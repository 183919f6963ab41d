"""Fused store: normalize, rotate, quantize, pack and write slots into a paged cache.

One kernel serves every codec and both arrangements: the layout becomes constexprs
(:func:`tqkern.ops.common.layout_consts`). A program takes ``BT`` tokens of one KV head.
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
from tqkern.ops.common import (
    f32_to_bf16_bits,
    f32_to_fp8e4m3_bits,
    f64_to_bits,
    f64_to_f16_bits,
    halfword_aligned,
    layout_consts,
    store_bytes,
    store_packed,
)

__all__ = ["_store_kernel", "_launch_store"]

_ERR_NONFINITE = tl.constexpr(int(ErrorFlag.NONFINITE_INPUT))
_ERR_SATURATED = tl.constexpr(int(ErrorFlag.SATURATED))
_ERR_SLOT = tl.constexpr(int(ErrorFlag.SLOT_OUT_OF_RANGE))


@triton.jit
def _rotate(x_ptr_2d, tok_mask, rot_ptr, D: tl.constexpr, DP: tl.constexpr, KC: tl.constexpr,
            BT: tl.constexpr, DOT_PRECISION: tl.constexpr, mu_ptr_1d, HAS_MU: tl.constexpr):
    """y = (x − μ) @ Π in float32 [BT, DP]; x read from global in KC-wide chunks (Π stays in
    on-chip memory one chunk at a time, so D = 256 fits too)."""
    acc = tl.zeros([BT, DP], tl.float32)
    cols = tl.arange(0, DP)
    for k0 in tl.static_range(0, DP, KC):
        kk = k0 + tl.arange(0, KC)
        km = kk < D
        xk = tl.load(x_ptr_2d + kk[None, :], mask=tok_mask[:, None] & km[None, :], other=0.0).to(tl.float32)
        if HAS_MU:  # (a token read as zeros stays zero)
            xk = tl.where(tok_mask[:, None], xk - tl.load(mu_ptr_1d + kk, mask=km, other=0.0)[None, :], 0.0)
        r = tl.load(rot_ptr + kk[:, None] * D + cols[None, :], mask=km[:, None] & (cols < D)[None, :], other=0.0)
        acc += tl.dot(xk, r, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _load_exact(x_ptr_2d, mu_ptr_1d, HAS_MU: tl.constexpr, tok_mask, D: tl.constexpr, DP: tl.constexpr):
    """x − μ in float64 [BT, DP] (exact for fp16/bf16 x and fp32 μ), zero outside."""
    cols = tl.arange(0, DP)
    dmask = cols < D
    m2 = tok_mask[:, None] & dmask[None, :]
    x = tl.load(x_ptr_2d + cols[None, :], mask=m2, other=0.0).to(tl.float64)
    if HAS_MU:
        x = tl.where(m2, x - tl.load(mu_ptr_1d + cols, mask=dmask, other=0.0).to(tl.float64)[None, :], 0.0)
    return x


@triton.jit
def _uniform_codes(y, lo, hi, BITS: tl.constexpr):
    """⌊(y − lo)·(2^b − 1)/(hi − lo) + 1/2⌋ exactly (÷1e-8 instead when the scale is floored):
    a float32 estimate, then two exact float64 comparisons move it to the right integer."""
    levels: tl.constexpr = (1 << BITS) - 1
    span = hi - lo
    floored = span / levels < 1e-8
    d = y - lo[:, None]
    num = tl.where(floored[:, None], d, d * levels)
    den = tl.where(floored, 1e-8, span)[:, None]
    q = tl.floor(num.to(tl.float32) / den.to(tl.float32) + 0.5).to(tl.float64)
    q = q - ((q - 0.5) * den > num).to(tl.float64) + ((q + 0.5) * den <= num).to(tl.float64)
    return tl.minimum(tl.maximum(q, 0.0), levels).to(tl.int64)


@triton.jit
def _store_halfwords(row, off, bits, mask, cols, ALIGNED: tl.constexpr):
    """Write 16-bit values ``bits [BT, DP]`` at ``row + off + 2·col``."""
    if ALIGNED:
        p16 = (row + off).to(tl.pointer_type(tl.int16))
        tl.store(p16[:, None] + cols[None, :], bits.to(tl.int16), mask=mask)
    else:
        base = row[:, None] + off + 2 * cols[None, :]
        tl.store(base, (bits & 255).to(tl.uint8), mask=mask)
        tl.store(base + 1, ((bits >> 8) & 255).to(tl.uint8), mask=mask)


@triton.jit
def _finite_rows(x_ptr_2d, tok_mask, D: tl.constexpr, DP: tl.constexpr):
    """bool [BT]: the token's vector (D elements at ``x_ptr_2d``) holds no NaN or ±inf."""
    cols = tl.arange(0, DP)
    x = tl.load(x_ptr_2d + cols[None, :], mask=tok_mask[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)
    return tl.sum(((x - x) != 0).to(tl.int32), axis=1) == 0  # x − x is NaN exactly for NaN and ±inf


@triton.jit
def _saturates(v, PARAM_DTYPE: tl.constexpr):
    """|v| beyond the largest finite value of a stored float (DT: 0 f16, 1 f32)."""
    if PARAM_DTYPE == 0:
        return tl.abs(v) > 65504.0
    return tl.abs(v) > 3.4028234663852886e38


@triton.jit
def _any_col(cond):
    """bool [BT]: some column of the row of ``cond [BT, DP]`` holds."""
    return tl.max(cond.to(tl.int32), axis=1) > 0


@triton.jit
def _flag(cond, BIT: tl.constexpr):
    """BIT if any element of ``cond [BT]`` holds, else 0 (an int32 scalar)."""
    return tl.max(cond.to(tl.int32), axis=0) * BIT


@triton.jit
def _encode_side(x_ptr_2d, mu_ptr_1d, HAS_MU: tl.constexpr, IN_BF16: tl.constexpr, row, h, tok_mask, ld_mask,
                 rot_ptr, bnd_ptr, cen_ptr, D: tl.constexpr, DP: tl.constexpr, KC: tl.constexpr, BT: tl.constexpr,
                 NIBBLE: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGNED: tl.constexpr,
                 KIND: tl.constexpr, BITS: tl.constexpr, ROTATED: tl.constexpr, NORM_CORRECTION: tl.constexpr,
                 PARAM_DTYPE: tl.constexpr, A_OFF: tl.constexpr, A_STRIDE: tl.constexpr, A_BYTES: tl.constexpr,
                 B_OFF: tl.constexpr, B_STRIDE: tl.constexpr, C_OFF: tl.constexpr, C_STRIDE: tl.constexpr):
    """Encode one side of BT tokens of head h into its fields: the vectors are read where
    ``ld_mask`` (zeros elsewhere: the non-finite ones), written where ``tok_mask``. Returns the
    error bits (``SATURATED``) as an int32 scalar."""
    cols = tl.arange(0, DP)
    dmask = cols < D
    m2 = ld_mask[:, None] & dmask[None, :]
    w2 = tok_mask[:, None] & dmask[None, :]
    PB: tl.constexpr = 2 + 2 * PARAM_DTYPE  # bytes of a stored f16 / f32
    if KIND == 0:  # Lloyd-Max
        x = _load_exact(x_ptr_2d, mu_ptr_1d, HAS_MU, ld_mask, D, DP)
        n = tl.sqrt(tl.sum(x * x, axis=1))  # float64: the norm bytes equal the oracle's
        inv = tl.where(n > 0, 1.0 / tl.where(n > 0, n, 1.0), 0.0).to(tl.float32)
        y = _rotate(x_ptr_2d, ld_mask, rot_ptr, D, DP, KC, BT, DOT_PRECISION, mu_ptr_1d, HAS_MU) * inv[:, None]
        idx = tl.zeros([BT, DP], tl.int32)
        for lvl in tl.static_range(BITS):  # binary search over the sorted boundaries; ties go up
            cand = idx + (1 << (BITS - 1 - lvl))
            thr = tl.load(bnd_ptr + cand - 1)
            idx = tl.where(y >= thr, cand, idx)
        idx = tl.where(dmask[None, :], idx, 0)
        store_packed(row + A_OFF + h * A_STRIDE, idx.to(tl.int64), tok_mask, BITS, NIBBLE, A_BYTES, BT, DP)
        if NORM_CORRECTION == 2:
            c = tl.where(dmask[None, :], tl.load(cen_ptr + idx), 0.0)
            cn = tl.sqrt(tl.sum(c * c, axis=1))
            n = n / tl.where(cn > 0, cn, 1.0)
        store_bytes(row + B_OFF + h * B_STRIDE, f64_to_bits(n, PARAM_DTYPE), PB, tok_mask)
        err = _flag(tok_mask & _saturates(n, PARAM_DTYPE), _ERR_SATURATED)
    elif KIND == 1:  # uniform asymmetric
        if ROTATED:
            y = _rotate(x_ptr_2d, ld_mask, rot_ptr, D, DP, KC, BT, DOT_PRECISION, mu_ptr_1d, HAS_MU).to(tl.float64)
        else:
            y = _load_exact(x_ptr_2d, mu_ptr_1d, HAS_MU, ld_mask, D, DP)
        lo = tl.min(tl.where(dmask[None, :], y, float("inf")), axis=1)
        hi = tl.max(tl.where(dmask[None, :], y, float("-inf")), axis=1)
        scale = tl.maximum((hi - lo) / ((1 << BITS) - 1), 1e-8)
        q = tl.where(dmask[None, :], _uniform_codes(y, lo, hi, BITS), 0)
        store_packed(row + A_OFF + h * A_STRIDE, q, tok_mask, BITS, NIBBLE, A_BYTES, BT, DP)
        store_bytes(row + B_OFF + h * B_STRIDE, f64_to_bits(scale, PARAM_DTYPE), PB, tok_mask)
        store_bytes(row + C_OFF + h * C_STRIDE, f64_to_bits(lo, PARAM_DTYPE), PB, tok_mask)
        err = _flag(tok_mask & (_saturates(scale, PARAM_DTYPE) | _saturates(lo, PARAM_DTYPE)), _ERR_SATURATED)
    elif KIND == 2:  # FP8 E4M3
        if ROTATED:
            y = _rotate(x_ptr_2d, ld_mask, rot_ptr, D, DP, KC, BT, DOT_PRECISION, mu_ptr_1d, HAS_MU)
        else:
            y = tl.load(x_ptr_2d + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            if HAS_MU:
                y = _load_exact(x_ptr_2d, mu_ptr_1d, HAS_MU, ld_mask, D, DP).to(tl.float32)
        code = f32_to_fp8e4m3_bits(y)
        tl.store(row[:, None] + A_OFF + h * A_STRIDE + cols[None, :], code.to(tl.uint8), mask=w2)
        err = _flag(_any_col(w2 & (tl.abs(y) > 448.0)), _ERR_SATURATED)
    else:  # raw fp16 / bf16
        if HAS_MU:
            xr = _load_exact(x_ptr_2d, mu_ptr_1d, HAS_MU, ld_mask, D, DP)
            bits = f32_to_bf16_bits(xr.to(tl.float32)) if PARAM_DTYPE == 2 else f64_to_f16_bits(xr)
            big = tl.abs(xr) > (3.3895313892515355e38 if PARAM_DTYPE == 2 else 65504.0)
        else:
            xn = tl.load(x_ptr_2d + cols[None, :], mask=m2, other=0.0)
            big = tl.zeros([BT, DP], tl.int32) != 0
            if (PARAM_DTYPE == 2) == IN_BF16:  # same dtype: copy the bits
                bits = xn.to(tl.int16, bitcast=True).to(tl.int32)
            elif PARAM_DTYPE == 2:
                bits = f32_to_bf16_bits(xn.to(tl.float32))
            else:
                bits = f64_to_f16_bits(xn.to(tl.float64))
                big = tl.abs(xn.to(tl.float32)) > 65504.0
        _store_halfwords(row, A_OFF + h * A_STRIDE, bits, w2, cols, ALIGNED)
        err = _flag(_any_col(w2 & big), _ERR_SATURATED)
    return err


@triton.jit
def _store_kernel(
    key_ptr, value_ptr, slot_ptr, cache_ptr, rot_ptr, kb_ptr, kc_ptr, vb_ptr, vc_ptr, mu_ptr, err_ptr,
    num_tokens, num_slots, stride_kt, stride_kh, stride_vt, stride_vh,
    HAS_MU: tl.constexpr, IN_BF16: tl.constexpr, BT: tl.constexpr, KC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    K_ALIGNED: tl.constexpr, V_ALIGNED: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, ROW_BYTES: tl.constexpr, NIBBLE: tl.constexpr,
    PAD_OFF: tl.constexpr, PAD_STRIDE: tl.constexpr, PAD_BYTES: tl.constexpr, PADP: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_ROTATED: tl.constexpr, K_NORM_CORRECTION: tl.constexpr,
    K_PARAM_DTYPE: tl.constexpr, K_A_OFF: tl.constexpr, K_A_STRIDE: tl.constexpr, K_A_BYTES: tl.constexpr,
    K_B_OFF: tl.constexpr, K_B_STRIDE: tl.constexpr, K_C_OFF: tl.constexpr, K_C_STRIDE: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_ROTATED: tl.constexpr, V_NORM_CORRECTION: tl.constexpr,
    V_PARAM_DTYPE: tl.constexpr, V_A_OFF: tl.constexpr, V_A_STRIDE: tl.constexpr, V_A_BYTES: tl.constexpr,
    V_B_OFF: tl.constexpr, V_B_STRIDE: tl.constexpr, V_C_OFF: tl.constexpr, V_C_STRIDE: tl.constexpr,
):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    tmask = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    tok_mask = tmask & (slot >= 0) & (slot < num_slots)  # never a byte outside the cache
    err = _flag(tmask & (slot >= num_slots), _ERR_SLOT)
    row = cache_ptr + tl.where(tok_mask, slot, 0) * ROW_BYTES  # [BT] pointers to each token row
    t64 = t.to(tl.int64)
    k_ptr_2d = key_ptr + t64[:, None] * stride_kt + h * stride_kh
    v_ptr_2d = value_ptr + t64[:, None] * stride_vt + h * stride_vh
    k_ok = _finite_rows(k_ptr_2d, tok_mask, D, DP)
    v_ok = _finite_rows(v_ptr_2d, tok_mask, D, DP)
    err |= _flag(tok_mask & ~(k_ok & v_ok), _ERR_NONFINITE)
    err |= _encode_side(k_ptr_2d, mu_ptr + h * D, HAS_MU, IN_BF16, row, h, tok_mask, tok_mask & k_ok, rot_ptr,
                        kb_ptr, kc_ptr, D, DP, KC, BT, NIBBLE, DOT_PRECISION, K_ALIGNED,
                        K_KIND, K_BITS, K_ROTATED, K_NORM_CORRECTION, K_PARAM_DTYPE, K_A_OFF, K_A_STRIDE, K_A_BYTES,
                        K_B_OFF, K_B_STRIDE, K_C_OFF, K_C_STRIDE)
    err |= _encode_side(v_ptr_2d, mu_ptr, False, IN_BF16, row, h, tok_mask, tok_mask & v_ok, rot_ptr, vb_ptr,
                        vc_ptr, D, DP, KC, BT, NIBBLE, DOT_PRECISION, V_ALIGNED,
                        V_KIND, V_BITS, V_ROTATED, V_NORM_CORRECTION, V_PARAM_DTYPE, V_A_OFF, V_A_STRIDE, V_A_BYTES,
                        V_B_OFF, V_B_STRIDE, V_C_OFF, V_C_STRIDE)
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
    c = layout_consts(layout)
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
