"""The two launches around the decode kernel, planned: the q rotation with the block-table scan
(:class:`RotatePlan`, :func:`scan_split`; :mod:`.rotate`) and the merge of the splits
(:class:`MergePlan`, :func:`merge_chunks`; :mod:`.merge`). Part of the decode plan
(:mod:`.plan`, which re-exports these)."""

from __future__ import annotations

import dataclasses

from tqkern.ops.common import layout_consts, transform_applies

__all__ = ["MergePlan", "RotatePlan", "fwht_constexprs", "merge_chunks", "merge_impl", "merge_transform", "q_transform",
           "rotate_apart", "rotate_cols", "row_chunks", "row_merge_chunks", "row_merge_unroll", "row_split_block",
           "scan_split", "transform_fits"]


@dataclasses.dataclass(frozen=True)
class RotatePlan:
    """The q-rotation launch (:func:`.rotate._rotate_q_kernel`): ``rows`` query rows and ``cols``
    output columns per program in the first ``programs`` rows of the grid; the rest scan the block
    table, ``scan_block`` entries per round (:func:`scan_split`). ``fwht``: the rotation by the
    Walsh–Hadamard transform (:func:`q_transform`), every column a program."""

    grid: tuple[int, int]
    programs: int
    rows: int
    cols: int
    scan_block: int
    rotate: bool
    fwht: bool = False

    def constexprs(self, num_q_heads: int, head_dim: int, block_size: int, interpret: bool) -> dict:
        """The launch's constexprs (the decode's and the prefill's first launch, the sm_90 compile)."""
        return dict(HQ=num_q_heads, D=head_dim, DP=max(16, 1 << (head_dim - 1).bit_length()), ROWS=self.rows,
                    CC=self.cols, ROTATE=self.rotate, DOT_PRECISION="ieee" if interpret else "tf32x3", POISON=True,
                    SCAN=True, BS=block_size, SB=self.scan_block, FWHT=self.fwht,
                    LOG2D=head_dim.bit_length() - 1 if self.fwht else 0)


@dataclasses.dataclass(frozen=True)
class MergePlan:
    """The merge launch: ``impl`` ``"rows"`` (blocks of ``rows`` query rows), ``"row"`` (one query
    row per program, ``rows`` 1) or ``"heads"`` (one GQA group per program), ``chunks``
    output-column chunks, ``unroll`` splits per iteration (per load for ``"row"``);
    ``sinks``: sink logits join the denominator; ``lse``: the normaliser is written; ``fwht``: the
    rotate-back by the Walsh–Hadamard transform (:func:`merge_transform`, or for ``back_grid``
    :func:`transform_fits`). ``back_grid``: the rotate-back as a launch of its own
    (:func:`.merge._rotate_back_kernel`, 16 rows a program; :func:`rotate_apart`): the merge then
    writes each merged row unrotated, in place, over its split 0's partial; empty: the merge
    rotates back itself (or nothing is rotated)."""

    impl: str
    grid: tuple[int, ...]
    rows: int
    chunks: int
    unroll: int
    rotate_back: bool
    sinks: bool = False
    lse: bool = False
    fwht: bool = False
    back_grid: tuple[int, ...] = ()

    @property
    def rotate_apart(self) -> bool:
        """Whether the rotate-back is its own launch after the merge."""
        return bool(self.back_grid)

    def constexprs(self, head_dim: int) -> dict:
        """The rotate-back's transform constexprs of every merge kernel."""
        return fwht_constexprs(self.fwht, head_dim)


def fwht_constexprs(fwht: bool, head_dim: int) -> dict:
    """The merge kernels' ``FWHT`` and ``LOG2D`` (log2 of the power-of-two head_dim; 0 without)."""
    return dict(FWHT=fwht, LOG2D=head_dim.bit_length() - 1 if fwht else 0)


def merge_chunks(programs: int, num_sms: int, dp: int) -> int:
    """Output-column chunks per merge program (a (sequence, KV head) pair, or a block of query
    rows): 1, doubled (to at most DP/16) while the programs cannot fill the GPU. With the
    rotate-back every chunk merges all columns again, so chunks pay only when programs are few.
    Measured (H100, TQ4 rotate-back, per-group merge): B8x64K (64 programs) 22.6 µs unchunked;
    B32x16K (256 programs) 11.8 µs unchunked, 30.6 µs in 4; row-block merge at B32x16K (64
    blocks): 1 chunk 6.9 µs, 2 chunks 5.8, 4 chunks 6.1."""
    nch = 1
    while nch < dp // 16 and programs * nch < num_sms:
        nch *= 2
    return nch


def row_merge_chunks(blocks: int, num_sms: int, dp: int, rotate_back: bool) -> int:
    """Column chunks of the row-block merge over ``blocks`` blocks of rows: :func:`merge_chunks`,
    capped with the rotate-back (each chunk re-merges every column) at 2 for DP ≤ 128 (H100, tq4,
    session 5: B32x16K 1/2/4 chunks 6.3/4.8/5.4 µs, B8x64K 1/2/4/8 11.4/10.3/10.5/10.7 µs) and at 8
    for DP = 256, where few blocks leave the rotate-back's dots on few SMs (H200, session 28 probe,
    merge alone, 16 splits: Gemma-2-9B B8x8K 1/2/4/8/16 chunks 30.0/23.0/9.9/8.4/9.5 µs, Gemma-7B
    B4x8K 29.5/22.9/9.5/8.3/9.1 µs)."""
    nch = merge_chunks(blocks, num_sms, dp)
    return min(8 if dp >= 256 else 2, nch) if rotate_back else nch


def scan_split(entries: int, cols: int) -> tuple[int, int]:
    """``(scan_block, grid rows)`` of the block-table scan over ``entries`` entries beside a rotation
    grid ``cols`` programs wide: at most 1024 entries per program and round, as many programs as
    take each entry once (up to 64), so the scan runs on SMs the rotation leaves idle; none
    without entries."""
    if entries <= 0:
        return 128, 0
    sb = min(1024, max(128, 1 << (entries - 1).bit_length()))
    programs = min(64, -(-entries // sb))
    return sb, -(-programs // cols)


def rotate_cols(dp: int) -> int:
    """Output columns per program of the q rotation at padded head_dim ``dp``: 64, but 32 at DP ≥ 256,
    where 64 leaves few programs each loading a 64 KiB slice of Π. Measured (H200, session 29 probe,
    ``rotate_q`` alone, cols 64 / 32 / 16, µs): Gemma-2-9B B8×8K (128 rows, D256) 10.11 / 3.85 / 7.55,
    Gemma-7B B4×8K 9.79 / 3.80 / 6.51; at DP 128 32 columns gain ≤ 0.3 µs or lose (B32×16K 3.11 /
    3.34 / 6.30, Phi-3 B16×4K 2.85 / 2.59 / 2.85, 1 × 32 heads 2.78 / 2.48 / 2.67)."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 16 or dp & (dp - 1):
        raise ValueError(f"dp must be a power of two >= 16 (head_dim padded), got {dp!r}")
    return 32 if dp >= 256 else 64


def transform_fits(rotated: bool, signed_sylvester: bool, head_dim: int) -> bool:
    """Whether a side's rotation can run as the in-register Walsh–Hadamard transform: the side is
    rotated and its ``Π`` signed Sylvester at a power-of-two head_dim of at least 16 (no padding)."""
    return rotated and head_dim >= 16 and transform_applies(signed_sylvester, head_dim)


def q_transform(rotate: bool, signed_sylvester: bool, head_dim: int) -> bool:
    """Whether the q rotation runs as the in-register Walsh–Hadamard transform: wherever it fits
    (:func:`transform_fits`, for the key codec)."""
    return transform_fits(rotate, signed_sylvester, head_dim)


def merge_transform(rotate_back: bool, signed_sylvester: bool, head_dim: int, impl: str) -> bool:
    """Whether the planned merge rotates back by the in-register Walsh–Hadamard transform: a rotated
    value codec whose ``Π`` is signed Sylvester, the row-block merge (``impl`` ``"rows"``) at
    head_dim 128, where it was measured to win. H100, session 39, tqkern_k5v3, merge alone, product
    at its planned chunks / transform at 1, 2, 4 chunks (µs): B128×1K (1 split) 6.17 / 2.69, 3.35,
    5.06; B32×16K (4 splits) 4.22 / 3.34, 3.16, 3.66; B32×4K 4.21 / 3.29, 3.13, 3.57; but head_dim
    64 (SmolLM2 B32×4K, 16 splits) 5.14 / 5.46, 5.81, 5.83, head_dim 256 (Gemma-2-9B B8×8K, 16
    splits, 8 chunks planned) 8.43 / 8.37, 8.39, 8.62, and the one-row merge at batch 1 (128
    splits) 5.74 / 6.45, 6.48, 6.62. End to end (``paged_decode``, product / transform): B128×1K
    tqkern_k5v3 101.78 / 98.86, k5v4h 97.48 / 94.11; SmolLM2 28.61 / 29.80; Llama-3-8B 1×128K
    102.67 / 104.42; Gemma-2-9B 102.26 / 103.50 (``docs/performance.md``)."""
    return impl == "rows" and head_dim == 128 and transform_fits(rotate_back, signed_sylvester, head_dim)


def rotate_apart(rotate_back: bool, signed_sylvester: bool, head_dim: int, impl: str, num_splits: int) -> bool:
    """Whether the one-row merge leaves the rotate-back to a launch of its own: from 256 splits where
    the rotation is the Walsh–Hadamard transform (:func:`transform_fits`), from 512 for a dense Π.
    With the rotate-back in the merge every column chunk re-reads all its row's partials (8 chunks:
    8x the reads); apart, each chunk reads its own columns once and 16-row programs rotate the merged
    rows. Measured (H200, session 70 probe, merge alone in CUDA graphs, µs, one launch / two with a
    product / two with the transform): 8 rows × 512 splits 8.2 / 5.6 / 4.5; 16 × 256 5.3 / 5.4 / 4.3;
    32 × 264 6.2 / 6.1 / 5.0; 32 × 128 4.2 / 5.4 / 4.2; 28 × 128 4.1 / 5.4 / 4.2; 2 × 16 × 256 5.7 /
    5.8 / 4.6."""
    if impl != "row" or not rotate_back:
        return False
    return num_splits >= (256 if transform_fits(rotate_back, signed_sylvester, head_dim) else 512)


def _rotate_plan(layout, s, hq, max_blocks, rows: int = 16, signed_sylvester: bool = False) -> RotatePlan:
    """Measured on the H100 at 1024 rows, D = 128: 16 rows × all columns 4.6 µs, 32 rows 9.5 µs,
    64 rows 9.8 µs (session 4); 16 rows × 64 columns: ``docs/performance.md``; the columns:
    :func:`rotate_cols` (every column with the transform, :func:`q_transform`; H100, session 39,
    ``rotate_q`` with the scan, product / transform / cast: B128×1K 7.46 / 2.92 / 2.43 µs, B32×16K
    4.22 / 2.30 / 2.06; ``docs/performance.md``)."""
    d = layout.head_dim
    dp = max(16, 1 << (d - 1).bit_length())
    rotate = bool(layout.format.key.rotated)
    fwht = q_transform(rotate, signed_sylvester, d)
    cc = min(rotate_cols(dp), dp) if rotate and not fwht else dp
    programs = -(-(s * hq) // rows)
    sb, scan_rows = scan_split(s * max_blocks, dp // cc)
    return RotatePlan(grid=(programs + scan_rows, dp // cc), programs=programs, rows=rows, cols=cc, scan_block=sb,
                      rotate=rotate, fwht=fwht)


def merge_impl(rotate_back: bool, num_splits: int) -> str:
    """The merge kernel: ``"row"`` (one query row per program, its splits as tiles) from 16 splits
    (17 with the rotate-back), else ``"rows"`` (blocks of 16 query rows) with the rotate-back,
    else ``"heads"`` (one GQA group per program). Measured (H200, session 31 probe, merge alone,
    µs, rows / row at its chunk rule): batch 1 × 32 heads, 128 splits: tq4 (rotate-back) 30.3 /
    5.8, turboquant_4bit_nc 23.3 / 2.4; 256 rows × 33 splits 10.9 / 6.0 and 7.4 / 3.1; 16 splits
    at head_dim 256 (Gemma-2-9B B8×8K) without the rotate-back heads 5.3, rows 4.3, row 2.3-2.6,
    with it rows 8.4, row 7.6-9.5; 1024 rows × 8 splits rows 4.9 / heads 3.0, row 4.5-10.1."""
    if num_splits >= (17 if rotate_back else 16):
        return "row"
    return "rows" if rotate_back else "heads"


def row_chunks(rows: int, num_sms: int, dp: int, rotate_back: bool) -> int:
    """Column chunks of the one-row merge: enough programs for two per SM, at most DP/16 chunks;
    with the rotate-back (each chunk re-reads all its row's partials and takes a slice of Π) one
    per SM, at most DP/32 chunks. Measured (H200, session 31 probe, µs at 1/2/4/8 chunks): tq4
    1 × 32 heads × 128 splits 8.0 / 7.1 / 5.8 / 7.0, 256 rows × 33 splits 6.0 / 7.1 / 10.3 / 17.8,
    1 × 16 heads at head_dim 256 28.8 / 14.6 / 11.0 / 9.5; turboquant_4bit_nc 1 × 32 × 128 5.6 /
    3.4 / 2.3 / 2.4, 256 × 33 4.2 / 3.1 / 3.1 / 4.2."""
    if rotate_back:
        return min(max(1, dp // 32), merge_chunks(rows, num_sms, dp))
    return merge_chunks(rows, 2 * num_sms, dp)


def row_split_block(num_splits: int, dp: int, chunks: int, rotate_back: bool) -> int:
    """Splits per load of the one-row merge: a ``[splits, width]`` float32 tile of at most 4096
    elements (16 KiB), at most the split count rounded up to a power of two; ``width`` the
    program's columns (all DP with the rotate-back, else DP/chunks)."""
    sp = max(2, 1 << (num_splits - 1).bit_length())
    return max(1, min(sp, 4096 // (dp if rotate_back else dp // chunks)))


def row_merge_unroll(rotate_back: bool) -> int:
    """Splits per iteration of the row-block merge: 8 with the rotate-back, else all (up to 64)."""
    return 8 if rotate_back else 64


def _merge_plan(layout, s, hq, num_splits, caps, options, signed_sylvester: bool = False) -> MergePlan:
    """:func:`merge_impl`'s kernel with :func:`row_chunks`, :func:`row_merge_chunks` or
    :func:`merge_chunks` column chunks; the rotate-back by :func:`merge_transform` where it applies
    (the same chunk rules: every chunk reads all columns either way)."""
    dp = layout_consts(layout)["DP"]
    rotate_back = bool(layout.format.value.rotated)
    sms = 1 if caps.interpret else caps.num_sms
    impl = merge_impl(rotate_back, num_splits)
    fwht = merge_transform(rotate_back, signed_sylvester, layout.head_dim, impl)
    if impl == "row":
        apart = rotate_apart(rotate_back, signed_sylvester, layout.head_dim, impl, num_splits)
        in_merge = rotate_back and not apart  # (the merge kernel's own rotate-back)
        chunks = row_chunks(s * hq, sms, dp, in_merge)
        back = ()
        if apart:
            fwht = transform_fits(rotate_back, signed_sylvester, layout.head_dim)
            back = (-(-(s * hq) // 16), 1 if fwht else dp // min(64, dp))
        return MergePlan(impl="row", grid=(s * hq, chunks), rows=1, chunks=chunks,
                         unroll=row_split_block(num_splits, dp, chunks, in_merge), rotate_back=rotate_back,
                         sinks=options.sinks, lse=options.lse, fwht=fwht, back_grid=back)
    if impl == "rows":
        rows = 16
        blocks = -(-(s * hq) // rows)
        chunks = row_merge_chunks(blocks, sms, dp, rotate_back)
        return MergePlan(impl="rows", grid=(blocks, chunks), rows=rows, chunks=chunks,
                         unroll=max(1, min(row_merge_unroll(rotate_back), num_splits)), rotate_back=rotate_back,
                         sinks=options.sinks, lse=options.lse, fwht=fwht)
    chunks = merge_chunks(s * layout.num_kv_heads, sms, dp)
    return MergePlan(impl="heads", grid=(s, layout.num_kv_heads, chunks), rows=0, chunks=chunks, unroll=num_splits,
                     rotate_back=rotate_back, sinks=options.sinks, lse=options.lse, fwht=fwht)
