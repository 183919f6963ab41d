"""Gather runs of sequence positions from a paged cache into dense half-precision K and V, in the
original coordinates: the workspace of the tiled prefill (``tqkern_torch.prefill_tiles``).

A run ``e`` is four int32s ``(seq, start, length, row)``: positions ``start .. start+length−1``
of sequence ``seq`` (through its row of the block table) land in rows ``row ..`` of
``k_out, v_out [R, H, D]`` (fp16 or bf16, contiguous; with ``K_INT8`` the keys go to ``k_out`` as
the int8 codes of :mod:`tqkern.ops.int8_prefill.reference` and their float32 scales to ``ks_out
[H, R]``, head-major (the attention kernel loads each tile's scales as one vector):
``int8_prefill``'s workspace, the codes made once per key: for Lloyd-Max keys from the codebook's
int8 image, ``kc_ptr`` then being ``DeviceParams.key_int8_table``; else from the float32
reconstruction). A program takes ``TILES`` tiles of ``BT``
positions of one run and one KV head (grid ``(H, tiles of the longest run, runs)``: heads fastest).

Maths. Each side's reconstruction in its codec's space (float32,
:func:`~tqkern.ops.decompress.triton.decoded_values`) rounded once to the output dtype; a rotated
side is rotated back by the caller (one tensor-core product over the whole workspace: in this
kernel the ``[D, D]`` operand cost 128 registers per thread and the H100's shared memory, and the
kernel ran at 4–7% of copy bandwidth, S20), or, with ``K_FWHT`` / ``V_FWHT`` (a signed Sylvester
rotation, ``rot_ptr`` its float32 ``Π``), here by the Walsh–Hadamard transform in float32 before
the one rounding. A key is the reconstruction of ``key − μ``: attention
scores shift by ``q·μ`` per query row, which the softmax (and a log-sum-exp merge of partials)
cancels, so the workspace never adds μ back.

Safety: a block id outside ``[0, num_blocks)`` is clamped into it and sets
``BLOCK_OUT_OF_RANGE``; positions past a run's length, outside ``[0, max_pos)`` (the block-table
row's ``max_blocks·block_size``) or landing past workspace row ``ws_rows`` are neither read nor
written, whatever the runs hold.

No torch here.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from tqkern.errors import ErrorFlag
from tqkern.ops.common import _fwht_tile
from tqkern.ops.decompress.triton import decoded_values
from tqkern.ops.codecs import KIND_LLOYD_MAX
from tqkern.ops.int8_prefill.triton import image_codes, int8_codes

__all__ = ["_gather_kernel", "GatherConfig", "gather_config"]

_ERR_BLOCK = tl.constexpr(int(ErrorFlag.BLOCK_OUT_OF_RANGE))
GRID_AXIS_MAX = 65535  # CUDA's limit on a grid's second and third axes


class GatherConfig(NamedTuple):
    """``BT`` positions per tile, ``TILES`` per program, ``num_warps``; ``fwht``: a rotated side
    with a signed Sylvester rotation is written rotated back (the in-register Walsh–Hadamard
    transform of ``decompress``) instead of in its codec's space."""

    BT: int
    TILES: int
    num_warps: int
    fwht: bool = False

    def grid(self, longest: int, runs: int, heads: int) -> tuple[int, int, int]:
        """Heads fastest (axis 0), then position tiles, then runs: the KV heads of one token row
        are read and written by neighbouring programs (as in ``decompress``, S36). CUDA's second
        and third grid axes hold at most 65,535 programs: ``ValueError`` beyond."""
        tiles = -(-longest // (self.BT * self.TILES))
        if tiles > GRID_AXIS_MAX or runs > GRID_AXIS_MAX:
            raise ValueError(f"a gather round takes at most {GRID_AXIS_MAX} position tiles and runs, got {tiles} tiles "
                             f"(longest run {longest}) and {runs} runs")
        return (heads, tiles, runs)

    def fitting(self, longest: int) -> "GatherConfig":
        """This config, or where a run of ``longest`` positions needs more than 65,535 programs
        on the position axis, the same with ``TILES`` doubled until it fits (a run of a million
        positions or more: one KV head at head_dim 64 fills the default workspace with 2^20
        rows)."""
        cfg = self
        while -(-longest // (cfg.BT * cfg.TILES)) > GRID_AXIS_MAX:
            cfg = cfg._replace(TILES=cfg.TILES * 2)
        return cfg


def gather_config(dp: int) -> GatherConfig:
    """The tiles for padded head_dim ``dp``: 16 positions, one tile per program, 1 warp (2 at 256
    columns); ``fwht`` on (a signed Sylvester rotation is undone here, and the caller allocates no
    rotated-back copy for that side; ``int8_prefill``'s keys stay in the codec's space anyway).

    Measured end to end (session 37, H100, ``prefill`` µs, Hq32/Hkv8/D128; turboquant_4bit_nc /
    tq4 / tqkern_k5v3): 8 × 1K chunks on 16K prefixes 4292 / 4632 / 4518 at 16 × 1 × 1 warp
    against 4417 / 4941 / 4687 at the 64 × 2 × 4 warps before (32 × 1 × 2 and 64 × 1 × 4 within
    1.2% of the old tiles); 1 × 16K 3862 / 3983 / 3988 against 3831 / 4010 / 3990. The heads-fastest
    grid against token tiles fastest: within 1.2% end to end.

    ``fwht`` against the caller's product, same run (tq4's dense rotation keeps the product either
    way): three H100 runs at 16 × 1 × 1 (sessions 37, 38, 38), turboquant_4bit_nc (keys rotated)
    1 × 16K +1.7%, +0.3%, −0.5%, chunks −0.1%, +0.2%, −0.2% (the third run timed the unchanged
    production config three times: 1.5% apart); tqkern_k5v3 (both sides) chunks −3.2%, −3.2%,
    −3.1%, 1 × 16K −1.2%, −0.5% (runs 2 and 3); turboquant_k3v4_nc (run 3) −1.1% / −0.1%. The
    value side alone (tqkern_k5v3, run 3, what ``int8_prefill`` takes): −2.0% / +0.2%; the keys
    alone −2.7% / −0.5%. Other tiles (run 2): 8 positions −2.2% / +1.6% for turboquant_4bit_nc, 2
    or 4 warps 1–3% slower."""
    return GatherConfig(16, 1, 1 if dp <= 128 else 2, True)


@triton.jit
def _gather_kernel(
    k_out, v_out, cache_ptr, block_table_ptr, run_ptr, kc_ptr, vc_ptr, err_ptr, num_blocks, stride_bt, max_pos,
    ws_rows, ks_out, rot_ptr,
    BT: tl.constexpr, TILES: tl.constexpr, BS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    ROW_BYTES: tl.constexpr, NIBBLE: tl.constexpr, K_ALIGNED: tl.constexpr, V_ALIGNED: tl.constexpr,
    OUT_BF16: tl.constexpr, K: tl.constexpr, V: tl.constexpr, K_INT8: tl.constexpr = False,
    K_FWHT: tl.constexpr = False, V_FWHT: tl.constexpr = False, LOG2D: tl.constexpr = 0,
):
    OUT: tl.constexpr = tl.bfloat16 if OUT_BF16 else tl.float16
    h = tl.program_id(0)
    tile0 = tl.program_id(1) * TILES
    e = tl.program_id(2)
    seq = tl.load(run_ptr + 4 * e).to(tl.int64)
    start = tl.load(run_ptr + 4 * e + 1)
    length = tl.load(run_ptr + 4 * e + 2)
    out_row = tl.load(run_ptr + 4 * e + 3).to(tl.int64)
    bt_row = block_table_ptr + seq * stride_bt
    cols = tl.arange(0, DP)
    if K_FWHT or V_FWHT:  # Π = diag(s)·H/√D: x = Π[:, 0] ⊙ H·y (DP == D)
        sgn = tl.load(rot_ptr + cols * D)[None, :]
    bad = h * 0
    for i in range(TILES):
        j = (tile0 + i) * BT + tl.arange(0, BT)
        pos = start + j
        # whatever the runs say: positions inside the block-table row, rows inside the workspace
        live = (j < length) & (pos >= 0) & (pos < max_pos) & (out_row + j < ws_rows)
        blk = tl.load(bt_row + pos // BS, mask=live, other=0)
        bad |= tl.max((live & ((blk < 0) | (blk >= num_blocks))).to(tl.int32), axis=0)
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1)
        row = cache_ptr + (blk.to(tl.int64) * BS + pos % BS) * ROW_BYTES
        out_off = (((out_row + j) * H + h) * D)[:, None] + cols[None, :]
        m2 = live[:, None] & (cols < D)[None, :]
        if K_INT8:
            if K.KIND == KIND_LLOYD_MAX:  # the codebook's int8 image (kc_ptr: key_int8_table)
                c, s = image_codes(row, h, live, kc_ptr, D, DP, NIBBLE, K)
            else:
                c, s = int8_codes(decoded_values(row, h, live, kc_ptr, D, DP, NIBBLE, K, tl.float32, K_ALIGNED))
            tl.store(k_out + out_off, c, mask=m2)
            tl.store(ks_out + h * ws_rows + out_row + j, s, mask=live)
        else:
            y = decoded_values(row, h, live, kc_ptr, D, DP, NIBBLE, K, tl.float32, K_ALIGNED)
            if K_FWHT:
                y = _fwht_tile(y, BT, D, LOG2D) * sgn
            tl.store(k_out + out_off, y.to(OUT), mask=m2)
        y = decoded_values(row, h, live, vc_ptr, D, DP, NIBBLE, V, tl.float32, V_ALIGNED)
        if V_FWHT:
            y = _fwht_tile(y, BT, D, LOG2D) * sgn
        tl.store(v_out + out_off, y.to(OUT), mask=m2)
    tl.atomic_or(err_ptr, bad * _ERR_BLOCK, mask=bad != 0, sem="relaxed")
