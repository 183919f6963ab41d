"""Reading slots back: the NumPy oracle of ``decompress`` and of paged-cache gathers.

``decompress(slots, params)``: slots ``[..., H, slot_bytes]`` uint8 → ``(key, value)`` float64
``[..., H, D]``. Each side is dequantized from its fields exactly as
:func:`tqkern.ops.quantize.reference.dequantize` states (stored floats decoded exactly, codes
unpacked with ``format.bit_order``). By default each side is returned in its codec's own space:
rotated (``y = x @ Π``) for rotated codecs, original coordinates otherwise; this is what the
rotated-space attention kernels consume. With ``rotate_back=True`` both are in original
coordinates. The key is the reconstruction of ``key − μ``: the key offset is *not* added back
(attention does not need it; add ``params.key_offset`` yourself for the raw key).

``gather_slots(cache, layout, slot_ids)``: the slots at physical slot indices ``slot_ids [N]``
(``slot = block * block_size + offset``) of a paged cache in ``layout``'s arrangement, as
``[N, H, slot_bytes]``. ``gather_sequences(cache, layout, block_table, seq_lens)`` gathers every
token of every sequence: a list of ``[seq_len, H, slot_bytes]``.

Non-finite values: stored floats decode exactly, NaN and ±inf included, and propagate; a slot
written by ``store`` holds none (``docs/layout.md``, "Non-finite and out-of-range values"). A
slot id past the cache is a ``ValueError`` here; the ``decompress`` kernel returns zeros for it
and sets ``SLOT_OUT_OF_RANGE`` in the error word.
"""

from __future__ import annotations

import numpy as np

from tqkern.layouts import PagedLayout
from tqkern.numerics import decode_float
from tqkern.ops.pack.reference import unpack
from tqkern.ops.quantize.reference import Quantized, dequantize
from tqkern.params import TQParams

__all__ = ["decompress", "gather_slots", "gather_sequences", "slot_ids_for", "cache_rows"]


def _parse_side(slots: np.ndarray, fmt, side: str) -> Quantized:
    codec = getattr(fmt, side)
    q = Quantized(codes=None, data=None)
    for qual, f, off in fmt.slot_fields():
        if not qual.startswith(side + "."):
            continue
        raw = slots[..., off: off + f.nbytes]
        if f.dtype == "codes":
            q.codes = unpack(raw, codec.bits, fmt.head_dim, fmt.bit_order)
        elif f.name == "data":
            nb = f.nbytes // fmt.head_dim
            q.data = decode_float(raw.reshape(*raw.shape[:-1], fmt.head_dim, nb), f.dtype)
        else:
            q.params[f.name] = decode_float(raw, f.dtype)
    return q


def decompress(slots, params: TQParams, *, rotate_back: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Dequantize slots ``[..., slot_bytes]`` (uint8) to ``(key, value)`` float64 ``[..., D]``."""
    if not isinstance(params, TQParams):
        raise TypeError(f"params must be a TQParams, got {type(params).__name__}")
    fmt = params.format
    slots = np.asarray(slots)
    if slots.dtype != np.uint8:
        raise TypeError(f"slots must be uint8, got {slots.dtype}")
    if slots.shape[-1] != fmt.slot_bytes:
        raise ValueError(f"slots.shape[-1] must be slot_bytes = {fmt.slot_bytes}, got {slots.shape[-1]}")
    out = []
    for side, cb in (("key", params.key_codebook), ("value", params.value_codebook)):
        codec = getattr(fmt, side)
        q = _parse_side(slots, fmt, side)
        out.append(dequantize(q, codec, rotation=params.rotation, codebook=cb, rotate_back=rotate_back))
    return out[0], out[1]


def cache_rows(cache: np.ndarray, layout: PagedLayout) -> np.ndarray:
    """The cache as token rows ``[num_blocks * block_size, row_bytes]`` (a view when possible)."""
    cache = np.asarray(cache)
    if cache.dtype != np.uint8:
        raise TypeError(f"cache must be uint8, got {cache.dtype}")
    if cache.ndim < 2 or cache.shape[1:] != layout.cache_shape(0)[1:]:
        raise ValueError(f"cache must have shape {('num_blocks',) + layout.cache_shape(0)[1:]}, got {cache.shape}")
    return cache.reshape(-1, layout.row_bytes)


def _row_field_columns(layout: PagedLayout) -> np.ndarray:
    """Column indices ``[H, slot_bytes]``: where each byte of each head's slot sits in a row."""
    fmt = layout.format
    cols = np.zeros((layout.num_kv_heads, fmt.slot_bytes), np.int64)
    h = np.arange(layout.num_kv_heads)[:, None]
    for qual, f, off in fmt.slot_fields():
        a = layout.field(qual)
        cols[:, off: off + f.nbytes] = a.offset + h * a.head_stride + np.arange(f.nbytes)[None]
    if fmt.pad_bytes:
        a = layout.pad_address()
        start = fmt.key_bytes + fmt.value_bytes
        cols[:, start:] = a.offset + h * a.head_stride + np.arange(fmt.pad_bytes)[None]
    return cols


def gather_slots(cache, layout: PagedLayout, slot_ids) -> np.ndarray:
    """Slots ``[N, H, slot_bytes]`` at physical slot indices ``slot_ids [N]``."""
    rows = cache_rows(cache, layout)
    ids = np.asarray(slot_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= rows.shape[0]):
        raise ValueError(f"slot_ids must be in [0, {rows.shape[0]}), got range [{ids.min()}, {ids.max()}]")
    return rows[ids][:, _row_field_columns(layout)]


def slot_ids_for(block_table, seq_len: int, block_size: int) -> np.ndarray:
    """Physical slot indices ``[seq_len]`` of one sequence's tokens 0..seq_len−1."""
    pos = np.arange(seq_len)
    bt = np.asarray(block_table, dtype=np.int64)
    return bt[pos // block_size] * block_size + pos % block_size


def gather_sequences(cache, layout: PagedLayout, block_table, seq_lens) -> list[np.ndarray]:
    """Each sequence's slots ``[seq_len, H, slot_bytes]`` (a list, one per sequence)."""
    bt = np.asarray(block_table)
    sl = np.asarray(seq_lens)
    if bt.ndim != 2 or sl.shape != (bt.shape[0],):
        raise ValueError(f"block_table must be [num_seqs, max_blocks] and seq_lens [num_seqs], "
                         f"got {bt.shape} and {sl.shape}")
    if sl.size and (sl.min() < 0 or sl.max() > bt.shape[1] * layout.block_size):
        raise ValueError(f"seq_lens must be in [0, {bt.shape[1] * layout.block_size}] "
                         f"(max_blocks * block_size), got max {sl.max()}")
    return [gather_slots(cache, layout, slot_ids_for(bt[s], int(sl[s]), layout.block_size))
            for s in range(bt.shape[0])]
