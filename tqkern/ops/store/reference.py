"""Writing new tokens into a paged cache: the NumPy oracle of ``store``.

``store(cache, key, value, slot_mapping, layout, params)`` with ``key, value [T, H, D]`` and
``slot_mapping [T]`` (int32 or int64): for every token t with ``slot_mapping[t] = s ≥ 0``, the row
of physical slot s (block ``s // block_size``, offset ``s % block_size``) gets, for every head h,
the slot ``compress(key, value, params)[t, h]`` written at the layout's field addresses (padding
bytes written as zero). Tokens with a negative entry are skipped. No other byte of the cache
changes. If two tokens map to the same slot the later one wins (kernels make no such promise:
callers must not repeat a slot). Returns a new cache; the input is not modified.

A token whose entry is ≥ ``num_blocks·block_size`` is skipped too: it writes nothing, and the
:class:`~tqkern.errors.ErrorFlag` bit ``SLOT_OUT_OF_RANGE`` is set (kernels never write outside
the cache, whatever an index holds). With ``return_flags=True`` the oracle returns
``(cache, flags)``: that bit and those of ``compress`` (``NONFINITE_INPUT``, ``SATURATED``,
counted over the tokens that are written).
"""

from __future__ import annotations

import numpy as np

from tqkern.errors import ErrorFlag
from tqkern.layouts import PagedLayout
from tqkern.ops.compress.reference import compress
from tqkern.ops.decompress.reference import _row_field_columns, cache_rows
from tqkern.params import TQParams

__all__ = ["store", "write_slots"]


def write_slots(cache, layout: PagedLayout, slots, slot_mapping, *, return_flags: bool = False):
    """Place precomputed slots ``[T, H, slot_bytes]`` at ``slot_mapping`` (a new cache; entries
    that are negative or ≥ ``num_blocks·block_size`` write nothing, the latter flagged)."""
    cache = np.asarray(cache)
    if cache.dtype != np.uint8:
        raise TypeError(f"cache must be uint8, got {cache.dtype}")
    out = cache.copy()
    rows = cache_rows(out, layout)
    sm = np.asarray(slot_mapping, dtype=np.int64).reshape(-1)
    slots = np.asarray(slots, dtype=np.uint8)
    if slots.shape != (sm.shape[0], layout.num_kv_heads, layout.format.slot_bytes):
        raise ValueError(f"slots must have shape {(sm.shape[0], layout.num_kv_heads, layout.format.slot_bytes)}, "
                         f"got {slots.shape}")
    flags = ErrorFlag.SLOT_OUT_OF_RANGE if np.any(sm >= rows.shape[0]) else ErrorFlag(0)
    cols = _row_field_columns(layout)
    for t in np.nonzero((sm >= 0) & (sm < rows.shape[0]))[0]:
        rows[sm[t], cols] = slots[t]
    return (out, flags) if return_flags else out


def store(cache, key, value, slot_mapping, layout: PagedLayout, params: TQParams, *, return_flags: bool = False):
    """Compress ``key, value [T, H, D]`` and write them at ``slot_mapping [T]``; returns the new
    cache, or ``(cache, flags)`` with ``return_flags``."""
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a PagedLayout, got {type(layout).__name__}")
    if not isinstance(params, TQParams):
        raise TypeError(f"params must be a TQParams, got {type(params).__name__}")
    if params.format != layout.format:
        raise ValueError("params.format must equal layout.format")
    key = np.asarray(key)
    if key.ndim != 3 or key.shape[1] != layout.num_kv_heads:
        raise ValueError(f"key must have shape [num_tokens, {layout.num_kv_heads}, {layout.head_dim}], got {key.shape}")
    value = np.asarray(value)
    if value.shape != key.shape:
        raise ValueError(f"value must have the shape of key {key.shape}, got {value.shape}")
    sm = np.asarray(slot_mapping)
    if sm.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must have shape ({key.shape[0]},), got {sm.shape}")
    cache = np.asarray(cache)
    written = (sm >= 0) & (sm < cache_rows(cache, layout).shape[0])
    # only the tokens that are written are compressed (their flags are the ones that count)
    slots, cflags = compress(key[written], value[written], params, return_flags=True)
    out = write_slots(cache, layout, slots, sm[written])
    flags = ErrorFlag.SLOT_OUT_OF_RANGE if np.any(sm >= cache_rows(cache, layout).shape[0]) else ErrorFlag(0)
    return (out, flags | cflags) if return_flags else out
