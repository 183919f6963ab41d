"""The int8 kernels of ``int8_prefill``'s tiled path (no torch): the symmetric int8 codes of
:mod:`.reference` (:func:`int8_codes`; Lloyd-Max keys by the codebook's int8 image,
:func:`image_codes`) and the queries' codes in the key codec's space (:func:`_quantize_q_kernel`).
The keys' codes are made once per key by the gather (:mod:`tqkern.ops.decompress.gather` with
``K_INT8``), not once per query tile; the pieces are attended by :mod:`tqkern.ops.prefill.attend`
with ``INT8``.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from tqkern.ops.codecs import NC_DECODE
from tqkern.ops.common import _fwht_tile, transform_applies
from tqkern.ops.fields import load_tile, token_factors
from tqkern.ops.store.kernel import _rotate, _rotation_operand
from tqkern.ops.store.plan import HOIST_MAX_DP, ROT_NONE, ROTATIONS

__all__ = ["image_codes", "int8_codes", "int8_codes_with", "_quantize_q_kernel", "QuantizeConfig", "quantize_config"]


class QuantizeConfig(NamedTuple):
    """:func:`_quantize_q_kernel`'s launch: rotation method (``ROT``, an index of
    :data:`tqkern.ops.store.plan.ROTATIONS`), ``KC`` (chunk of the ``chunked`` method), ``ROWS`` ×
    ``TILES`` rows a program, ``DOT_PRECISION`` (``chunked``), ``num_warps``; ``FWHT``: the
    rotation by the in-register Walsh–Hadamard transform instead (``ROT`` then ``none``)."""

    ROT: int
    KC: int
    ROWS: int
    TILES: int
    DOT_PRECISION: str
    num_warps: int
    FWHT: bool = False


def quantize_config(rotated: bool, signed_sylvester: bool, head_dim: int, interpret: bool) -> QuantizeConfig:
    """The query quantization for a key codec (``rotated``) with this rotation: a signed Sylvester
    Π at a power-of-two head_dim by the Walsh–Hadamard transform (``q @ Π = (H·(q ⊙ sign s))·|Π₀₀|``,
    float32 butterflies: :func:`~tqkern.ops.common._fwht_tile`), else the store's methods (exact ±1
    products for a signed Sylvester Π the transform does not take — ``pm1`` —, split half-precision parts for
    another Π, float32 chunks past 128) and its tiles (``pm1``: 64 rows × 4 warps, ``split``: 64 ×
    8 warps — at 4 warps its bf16 form spills —, 4 tiles a program; ``chunked``: 32 rows × 8
    warps, 32-column chunks, the fewest spills of the sm_90 compiles tried, 504 stack bytes; no
    rotation: 16 rows × 4 warps). Measured on an H200 at 16K tokens × 32 heads × 128 (fp16, ten
    launches swept, codes equal): ``pm1`` 137 µs (64 × 8 warps × 2 tiles before: 197), ``split``
    183 (the best tried, 16 tiles a program, 168; 4 warps 174), no rotation 72 (16 × 4 warps × 1
    the best). The transform (session 43, H200, same shape, one run, µs fp16 / bf16; ``pm1`` 136.3
    / 138.6 in it): 32 rows × 4 warps × 1 tile 118.4 / 121.5 (kept), 16 × 1 120.0 / 121.2, 32 × 4
    tiles 129.5 / 133.6, 64 × 1 133.6 / 136.0, 64 × 4 166.4 / 169.4, 32 × 4 × 8 warps 159.5 /
    159.8; codes equal to ``pm1``'s but for 18 / 6 of 67M (float ties). Predicted ~60-80 (the HBM
    floor ~42): the butterflies' shuffles bound it, not memory."""
    dp = max(16, triton.next_power_of_2(head_dim))
    if rotated and head_dim >= 16 and transform_applies(signed_sylvester, head_dim):
        return QuantizeConfig(ROTATIONS.index("none"), dp, 32, 1, "ieee", 4, FWHT=True)
    method = "none" if not rotated else "chunked" if dp > HOIST_MAX_DP else "pm1" if signed_sylvester else "split"
    rows, tiles, kc, warps = {"pm1": (64, 4, 64, 4), "split": (64, 4, 64, 8), "chunked": (32, 1, 32, 8)}.get(
        method, (16, 1, 64, 4))
    return QuantizeConfig(ROTATIONS.index(method), min(dp, kc), rows, tiles, "ieee" if interpret else "tf32x3",
                          warps)


@triton.jit
def int8_codes_with(x, s):
    """The int8 codes of the rows of ``x [rows, cols]`` (float32) for given row scales ``s [rows]``:
    ``clamp(rint(x / s), −127, 127)``, ties to even (``floor(t + ½)``, one less where that is odd
    and t was exactly halfway); 0 where ``s`` is 0."""
    t = x / tl.where(s > 0, s, 1.0)[:, None]
    r = tl.floor(t + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where((r - t == 0.5) & odd, r - 1.0, r)
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)


@triton.jit
def int8_codes(x):
    """Symmetric int8 codes and scales of the rows of ``x [rows, cols]`` (float32; padding columns
    must be 0), as :func:`tqkern.ops.int8_prefill.reference.quantize_int8`: ``s = max|x| / 127``,
    codes by :func:`int8_codes_with`; ``s = 0`` and codes 0 for a zero row."""
    s = tl.max(tl.abs(x), axis=1) / 127.0
    return int8_codes_with(x, s), s


@triton.jit
def image_codes(row, h, tmask, tab_ptr, D: tl.constexpr, DP: tl.constexpr, NIBBLE: tl.constexpr, S: tl.constexpr,
                PAR_ALIGNED: tl.constexpr = False):
    """The int8 codes ``[BT, DP]`` and float32 scales ``[BT]`` of Lloyd-Max keys (side ``S``) of the
    tokens at ``row [BT]``, head ``h``, by the codebook's int8 image
    (:func:`tqkern.ops.int8_prefill.reference.int8_image`): ``c8[code]`` and ``α·s_cb``, α the
    stored norm (over ``‖c[codes]‖`` with ``NC_DECODE``). ``tab_ptr``: ``DeviceParams.key_int8_table``
    (the float32 centroids, the image as floats, ``s_cb``). Scales are 0 outside ``tmask`` (those
    tokens' codes are ``c8[0]``: their scores are 0), codes 0 beyond D."""
    NLEV: tl.constexpr = 1 << S.BITS
    f, _ = token_factors(row, h, tmask, S, tl.float32, PAR_ALIGNED)
    if S.NORM_CORRECTION == NC_DECODE:  # ‖c[codes]‖ of the float32 centroids (padded columns read 0)
        c = load_tile(row, h, tmask, DP, -1, NIBBLE, S, D, DP, tab_ptr, tl.float32, False)
        cn = tl.sqrt(tl.sum(c * c, axis=1))
        f = tl.where(cn > 0, f / tl.where(cn > 0, cn, 1.0), 0.0)
    c8 = load_tile(row, h, tmask, DP, -1, NIBBLE, S, D, DP, tab_ptr + NLEV, tl.float32, False)
    s = tl.where(tmask, f * tl.load(tab_ptr + 2 * NLEV), 0.0)
    return c8.to(tl.int8), s


@triton.jit
def _quantize_q_kernel(q_ptr, rot_ptr, q8_ptr, qs_ptr, n_rows, stride_qs, stride_qh, HQ: tl.constexpr,
                       D: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr,
                       ROT: tl.constexpr, KC: tl.constexpr, IN_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       FWHT: tl.constexpr = False, LOG2D: tl.constexpr = 0):
    """Query rows ``r = t·HQ + h`` of ``q`` (fp16/bf16, last dimension contiguous), rotated into the
    key codec's space by the store's rotation method ``ROT`` (:mod:`tqkern.ops.store.plan`:
    ``none``, ``pm1`` — exact ±1 products —, ``split``, ``chunked``; float32 sums), as int8 codes
    ``q8 [n_rows, D]`` and float32 scales ``qs [n_rows]`` (NaN for a row holding a NaN or ±inf:
    the attention kernel then writes a NaN row). ``TILES`` tiles of ``ROWS`` rows a program, the
    rotation operand built once. With ``FWHT`` (a signed Sylvester ``Π = diag(s)·H/√D``, ``D = DP
    = 2^LOG2D``, ``ROT`` none) the rotation is ``(H·(q ⊙ sign s))·|Π₀₀|`` in float32 butterflies."""
    DOT: tl.constexpr = tl.bfloat16 if IN_BF16 else tl.float16
    b0, b1, b2, c = _rotation_operand(rot_ptr, D, DP, ROT, DOT)
    cols = tl.arange(0, DP)
    cm = cols < D
    for i in range(TILES):
        rows = (tl.program_id(0) * TILES + i) * ROWS + tl.arange(0, ROWS)
        rm = rows < n_rows
        src = q_ptr + (rows // HQ).to(tl.int64)[:, None] * stride_qs + (rows % HQ).to(tl.int64)[:, None] * stride_qh
        x = tl.load(src + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0)
        xf = x.to(tl.float32)
        bad = tl.sum(((xf - xf) != 0).to(tl.int32), axis=1) > 0  # a NaN or ±inf in the row (max ignores NaN)
        if FWHT:  # ±q exact, then float32 butterflies, then the one scale (as ``pm1``'s product)
            sgn = tl.load(rot_ptr + cols * D)
            y = _fwht_tile(tl.where(sgn[None, :] > 0, xf, -xf), ROWS, DP, LOG2D) * tl.abs(tl.load(rot_ptr))
        elif ROT == ROT_NONE:
            y = xf
        else:
            y, _ = _rotate(x, src, rm, 0.0, src, rot_ptr, b0, b1, b2, c, False, IN_BF16, False, ROT, D, DP, KC,
                           DOT_PRECISION)
        codes, s = int8_codes(tl.where(cm[None, :], y, 0.0))
        tl.store(q8_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], codes, mask=rm[:, None] & cm[None, :])
        tl.store(qs_ptr + rows, tl.where(bad, float("nan"), s), mask=rm)
