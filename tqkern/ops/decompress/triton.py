"""Decompress slots of a paged cache back to dense float32 K and V (each in its codec's space).

A program reads ``BT`` slots of one KV head; the grid runs heads fastest. A side in its codec's
space (or not rotated) is decoded in float64 (Lloyd-Max from the float64 codebook) and rounded once to float32. A rotated
side read back in original coordinates (``rotate_back``) is decoded in float32 and multiplied by
Πᵀ in the program (``tf32x3`` on the GPU), ``KC`` of its rows at a time (the loop pipelined
``STAGES`` deep): no second launch and no matmul over the whole output. The error stays inside
the oracle comparison's bound for a rotated-back vector
(``4·√D·2⁻²⁴·‖x‖``): each decoded element is within 2⁻²⁴ of its float64 value (relative), and
each product term within a few 2⁻²² (tf32x3 drops the low×low term), summed over D terms of
random sign.

A signed Sylvester rotation (``Π = diag(s)·H/√D``, D a power of two; ``FWHT``) is rotated back
without Π's slices or the store → barrier → reload: ``x_j = Σ_i y_i·Π[j, i] = Π[j, 0]·(H·y)_j``
(``H[j, 0] = 1``), a fast Walsh–Hadamard transform of the float32 tile in registers (``log2 D``
butterfly stages), each output a float32 sum of D terms ``±y_i`` (inside the same bound), then
one product by Π's first column.

A slot id outside ``[0, cache_slots)`` reads nothing: its rows are zeros (negative ids by
definition; too large ones also set ``SLOT_OUT_OF_RANGE`` in ``err_ptr[0]``).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from tqkern.errors import ErrorFlag
from tqkern.ops.codecs import KIND_LLOYD_MAX, KIND_UNIFORM, NC_DECODE, layout_args
from tqkern.ops.common import _fwht_tile, halfword_aligned, transform_applies
from tqkern.ops.fields import load_tile, token_factors

__all__ = ["_decompress_kernel", "_launch_decompress", "decoded_values", "DecompressConfig", "decompress_config",
           "SMALL_ROWS", "transform_applies"]

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
                 NIBBLE: tl.constexpr, S: tl.constexpr, ALIGNED: tl.constexpr):
    """One side of BT slots → float32 ``[BT, D]`` at ``out_ptr_2d`` (Lloyd-Max in float64 from the
    float64 codebook ``cen_ptr``, rounded once; ``ALIGNED``: raw fields read 16 bits at a time)."""
    cols = tl.arange(0, DP)
    y = decoded_values(row, h, tok_mask, cen_ptr, D, DP, NIBBLE, S, tl.float64, ALIGNED).to(tl.float32)
    tl.store(out_ptr_2d + cols[None, :], y, mask=in_range[:, None] & (cols < D)[None, :])


@triton.jit
def _rotate_back_side(out_ptr_2d, row, h, tok_mask, in_range, cen_ptr, rot_ptr, BT: tl.constexpr, D: tl.constexpr,
                      DP: tl.constexpr, NIBBLE: tl.constexpr, S: tl.constexpr, KC: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """One rotated side of BT slots → float32 ``[BT, D]`` at ``out_ptr_2d`` in original coordinates.
    The float32 decode ``y`` is stored there first and read back ``KC`` columns at a time (the
    program's own rows: a barrier orders the store before the reads and the reads before the
    result's store), ``x = Σ_k y[:, k]·Πᵀ[k, :]`` (``rot_ptr``: float32 ``Π [D, D]``): only a
    ``[BT, KC]`` slice of y and a ``[KC, DP]`` slice of Πᵀ sit beside the accumulator. The slice
    of Πᵀ is read as ``Π[:, ks]`` (KC consecutive floats of each row) and transposed in the
    program."""
    cols = tl.arange(0, DP)
    omask = in_range[:, None] & (cols < D)[None, :]
    y = decoded_values(row, h, tok_mask, cen_ptr, D, DP, NIBBLE, S, tl.float32)
    tl.store(out_ptr_2d + cols[None, :], y, mask=omask)
    tl.debug_barrier()
    acc = tl.zeros([BT, DP], dtype=tl.float32)
    for k0 in tl.range(0, DP, KC, num_stages=STAGES):
        ks = k0 + tl.arange(0, KC)
        yk = tl.load(out_ptr_2d + ks[None, :], mask=in_range[:, None] & (ks < D)[None, :], other=0.0)
        rt = tl.trans(tl.load(rot_ptr + cols[:, None] * D + ks[None, :], mask=(cols < D)[:, None] & (ks < D)[None, :],
                              other=0.0))  # [KC, DP]: Πᵀ[ks, :]
        acc = tl.dot(yk, rt, acc, input_precision=DOT_PRECISION)
    tl.debug_barrier()
    tl.store(out_ptr_2d + cols[None, :], acc, mask=omask)


@triton.jit
def _fwht_side(out_ptr_2d, row, h, tok_mask, in_range, cen_ptr, rot_ptr, BT: tl.constexpr, D: tl.constexpr,
               NIBBLE: tl.constexpr, S: tl.constexpr, LOG2D: tl.constexpr):
    """One rotated side of BT slots rotated back by :func:`_fwht_tile` (``Π = diag(s)·H/√D``:
    ``x = Π[:, 0] ⊙ H·y``) → float32 ``[BT, D]`` at ``out_ptr_2d``."""
    cols = tl.arange(0, D)
    y = decoded_values(row, h, tok_mask, cen_ptr, D, D, NIBBLE, S, tl.float32)
    x = _fwht_tile(y, BT, D, LOG2D) * tl.load(rot_ptr + cols * D)[None, :]
    tl.store(out_ptr_2d + cols[None, :], x, mask=in_range[:, None])


@triton.jit
def _decompress_kernel(
    k_out, v_out, cache_ptr, slot_ptr, kc_ptr, vc_ptr, rot_ptr, err_ptr, n, cache_slots,
    BT: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, H: tl.constexpr, ROW_BYTES: tl.constexpr,
    NIBBLE: tl.constexpr, K: tl.constexpr, V: tl.constexpr, ROT_K: tl.constexpr, ROT_V: tl.constexpr,
    KC: tl.constexpr, DOT_PRECISION: tl.constexpr, K_ALIGNED: tl.constexpr, V_ALIGNED: tl.constexpr,
    STAGES: tl.constexpr, FWHT: tl.constexpr = False, LOG2D: tl.constexpr = 0,
):
    pid = tl.program_id(0) // H  # heads fastest: neighbouring programs write neighbouring rows
    h = tl.program_id(0) % H
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
    if ROT_K and FWHT:
        _fwht_side(k_ptr, row, h, tok_mask, in_range, kc_ptr, rot_ptr, BT, D, NIBBLE, K, LOG2D)
    elif ROT_K:
        _rotate_back_side(k_ptr, row, h, tok_mask, in_range, kc_ptr, rot_ptr, BT, D, DP, NIBBLE, K, KC,
                          DOT_PRECISION, STAGES)
    else:
        _decode_side(k_ptr, row, h, tok_mask, in_range, kc_ptr, D, DP, NIBBLE, K, K_ALIGNED)
    if ROT_V and FWHT:
        _fwht_side(v_ptr, row, h, tok_mask, in_range, vc_ptr, rot_ptr, BT, D, NIBBLE, V, LOG2D)
    elif ROT_V:
        _rotate_back_side(v_ptr, row, h, tok_mask, in_range, vc_ptr, rot_ptr, BT, D, DP, NIBBLE, V, KC,
                          DOT_PRECISION, STAGES)
    else:
        _decode_side(v_ptr, row, h, tok_mask, in_range, vc_ptr, D, DP, NIBBLE, V, V_ALIGNED)


class DecompressConfig(NamedTuple):
    """Tiles and compile options of :func:`_decompress_kernel`: ``BT`` slots a program, ``KC``
    columns of the decoded tile a rotate-back product, ``num_stages`` the rotate-back loop's
    pipeline depth; ``fwht``: rotated sides rotated back by the in-register Walsh–Hadamard
    transform (only for a signed Sylvester rotation at a power-of-two head_dim)."""

    BT: int
    KC: int
    num_warps: int
    num_stages: int
    fwht: bool = False


# below this many slot-head rows (N·H) the D128 product path takes 16-slot tiles and the
# Walsh–Hadamard path 4-slot tiles (more programs)
SMALL_ROWS = 16384


def decompress_config(rotate_back: bool, interpret: bool, head_dim: int = 128,
                      signed_sylvester: bool = False, rows: int | None = None) -> DecompressConfig:
    """The program's tiles. The grid runs heads fastest (neighbouring programs write neighbouring
    rows of the output). Without a rotate-back on the GPU: 4 slots, 1 warp. With one: 64 slots,
    32 columns a product, 4 warps, 2 stages where ``head_dim`` pads to 128 (16 slots where the call
    has fewer than ``SMALL_ROWS`` slot-head ``rows``, N·H); 32 slots, 16 columns elsewhere (64 and
    256). The interpreter: 16 slots, 16 columns, 1 stage.

    Measured (session 36, 16,384 tokens, µs, one graph-replayed launch; tq4 / turboquant_4bit_nc
    / tqkern_k5v3 at D128 Hkv8, tqkern_k5v3 at D256 Hkv4). The heads-fastest grid against token
    blocks fastest, same run (H200): in the codec's space 87 / 64 / 77 against 119 / 102 / 110
    (fp16 preset 53 against 86), rotated back 372 / 176 / 291 against 402 / 211 / 326. Then two
    sweeps under it (one H200, one H100 run). In the codec's space 4 slots × 1 warp was the
    fastest or within 4% of it at every preset (H200: 50 / 46 / 52 / 51 against 87 / 66 / 77 / 73
    at 16 × 4 warps; 2 slots × 1 warp as fast on the H100, 1 slot and ≥ 32 slots slower). Rotated
    back at D128, 64 × 32 × 4 warps × 2 stages (H200: 313 / 167 / 258, k5v4h 253, against 365 /
    175 / 295 / 342 at the 32 × 16 tile kept before; 3 stages within 3% on the H100, 128 slots or
    8 warps 1.5–2x slower); at D256 it lost (H100: 588 against 454 for 32 × 16; 128 slots 2432, 2
    warps 17,354: spills), and at D64 it was 10% slower (75 against 68). Session 35's sweep under
    the old grid: docs/performance.md.

    ``signed_sylvester`` (the rotation is ``diag(s)·H/√D``) at a power-of-two ``head_dim`` with a
    rotate-back: the in-register transform (``fwht``), 8 slots × 1 warp (16 in the interpreter).
    Measured (session 37, H100, 16,384 tokens, µs, same run) against the product path's best
    tile: turboquant_4bit_nc 65 against 170, turboquant_k3v4_nc 66 / 165, tqkern_k5v3 87 / 251,
    k5v4h 87 / 247 at D128; tqkern_k5v3 91 / 450 at D256 (Hkv4); turboquant_4bit_nc 35 / 68 at
    D64. 4 slots: within 3% at 4-bit, 8-19% slower at k5v3, k5v4h, D64 and D256; 8 slots × 2
    warps within 5% at 4-bit, 12-22% slower at 5-bit keys; 2, 16 or 32 slots slower everywhere.

    Few rows (``prefill``'s short rows decompress their ≤ 7 tail keys a sequence): measured
    (session 37, H100, tq4's dense rotation at D128 Hkv8, µs) 96 slots 9.8 at 16 × 32 × 4 warps × 2
    stages against 23.7 at 64 slots (32 slots 14.7); 512 slots 13.1 against 24.9; 2048 slots (the
    threshold) 47.3 against 41.6. The transform (session 38, H100, D128 Hkv8, µs, 8 / 4 / 2 slots
    × 1 warp): 512 slots turboquant_4bit_nc 4.9 / 4.1 / 4.6, tqkern_k5v3 5.5 / 5.2 / 6.4; 2048
    slots 9.8 / 9.8 / 12.2 and 12.5 / 14.3 / 19.3. Another run, 8 / 4 slots at 96 / 512 / 2048
    slots: turboquant_4bit_nc D64 Hkv8 2.8 / 2.4, 3.2 / 3.0, 5.8 / 6.2; tqkern_k5v3 D256 Hkv4 8.3 /
    5.0, 8.7 / 6.1, 14.0 / 14.3 (8192 rows: below the threshold)."""
    for name, flag in (("rotate_back", rotate_back), ("interpret", interpret),
                       ("signed_sylvester", signed_sylvester)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__}")
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int)):
        raise TypeError(f"rows must be None or an int, got {type(rows).__name__}")
    if rows is not None and rows < 0:
        raise ValueError(f"rows must be non-negative, got {rows}")
    fwht = rotate_back and transform_applies(signed_sylvester, head_dim)
    if interpret:
        return DecompressConfig(16, 16, 4, 1, fwht)
    if fwht:
        return DecompressConfig(4 if rows is not None and rows < SMALL_ROWS else 8, 16, 1, 1, True)
    if not rotate_back:
        return DecompressConfig(4, 16, 1, 1)
    if triton.next_power_of_2(head_dim) == 128:
        return DecompressConfig(16 if rows is not None and rows < SMALL_ROWS else 64, 32, 4, 2)
    return DecompressConfig(32, 16, 4, 2)


def _launch_decompress(k_out, v_out, cache, slot_ids, layout, tables, errors, *, rotate_back: bool,
                       interpret: bool, config: DecompressConfig | None = None, signed_sylvester: bool = False):
    """Fill ``k_out, v_out [N, H, D]`` float32 from ``slot_ids [N]``; no checks. ``errors``: the
    int32 ``[1]`` error word. ``tables["rotation"]``: float32 ``Π [D, D]`` (read where a rotated
    side is rotated back), ``diag(s)·H/√D`` where ``signed_sylvester`` (the default config's
    ``fwht`` then; a given ``config`` with ``fwht`` asserts it)."""
    c = layout_args(layout)
    fmt = layout.format
    d = layout.head_dim
    n = slot_ids.shape[0]
    cfg = config or decompress_config(rotate_back, interpret, d, signed_sylvester, n * layout.num_kv_heads)
    if cfg.fwht and d & (d - 1):
        raise ValueError(f"config.fwht needs a power-of-two head_dim, got {d}")
    grid = (triton.cdiv(n, cfg.BT) * layout.num_kv_heads,)
    consts = {k: v for k, v in c.items() if not k.startswith("PAD")}
    _decompress_kernel[grid](k_out, v_out, cache, slot_ids, tables["key_centroids"], tables["value_centroids"],
                             tables["rotation"], errors, n, cache.shape[0] * layout.block_size,
                             BT=cfg.BT, H=layout.num_kv_heads, ROT_K=rotate_back and fmt.key.rotated,
                             ROT_V=rotate_back and fmt.value.rotated, KC=cfg.KC,
                             DOT_PRECISION="ieee" if interpret else "tf32x3", K_ALIGNED=halfword_aligned(layout, "key"),
                             V_ALIGNED=halfword_aligned(layout, "value"), STAGES=cfg.num_stages,
                             FWHT=cfg.fwht, LOG2D=d.bit_length() - 1 if cfg.fwht else 0,
                             num_warps=cfg.num_warps, **consts)
