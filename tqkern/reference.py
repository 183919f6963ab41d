"""Every NumPy oracle of tqkern in one namespace: ``tqkern.reference.compress(...)`` and so on.

Each function is defined, and specified in its docstring, in ``tqkern/ops/<op>/reference.py``;
this module only re-exports them. They compute in float64 on NumPy arrays and never need torch.

- :func:`rotate`: ``x @ Π`` (or ``x @ Πᵀ``).
- :func:`quantize` / :func:`dequantize`: one codec, per vector.
- :func:`pack` / :func:`unpack`: integer codes ↔ bytes in a bit order.
- :func:`compress` / :func:`decompress`: K/V ↔ whole slots of a :class:`~tqkern.KVFormat`.
- :func:`gather_slots` / :func:`gather_sequences`: read slots out of a paged cache.
- :func:`store` / :func:`write_slots`: write slots into a paged cache through ``slot_mapping``.
- :func:`paged_decode`, :func:`prefill`, :func:`int8_prefill`: attention over a paged cache.
- :func:`attention`: dense attention (GQA, causal, additive mask).
"""

from tqkern.ops.attention.reference import attention
from tqkern.ops.compress.reference import compress
from tqkern.ops.decompress.reference import decompress, gather_sequences, gather_slots
from tqkern.ops.int8_prefill.reference import int8_prefill
from tqkern.ops.pack.reference import pack, unpack
from tqkern.ops.paged_decode.reference import paged_decode
from tqkern.ops.prefill.reference import prefill
from tqkern.ops.quantize.reference import dequantize, quantize
from tqkern.ops.rotate.reference import rotate
from tqkern.ops.store.reference import store, write_slots

__all__ = [
    "rotate",
    "quantize",
    "dequantize",
    "pack",
    "unpack",
    "compress",
    "decompress",
    "gather_slots",
    "gather_sequences",
    "store",
    "write_slots",
    "paged_decode",
    "prefill",
    "int8_prefill",
    "attention",
]
