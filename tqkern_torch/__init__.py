"""tqkern_torch: the torch frontend of tqkern.

Validates torch tensors, allocates caches, launches the Triton kernels of ``tqkern`` and
registers them as ``torch.library`` ops (``torch.ops.tqkern.*``); reports what kernels skipped
(:mod:`tqkern_torch.errors`). The ``tqkern`` command line is :mod:`tqkern.cli`. The layouts, parameters and NumPy oracles live in ``tqkern``.
No autograd.

Importing this package registers every op: ``torch.ops.tqkern.store`` and ``.decompress``
(:mod:`tqkern_torch.library`), ``torch.ops.tqkern.paged_decode`` (:mod:`tqkern_torch.attention`) and
``torch.ops.tqkern.prefill`` and ``.int8_prefill`` (:mod:`tqkern_torch.prefill`).
"""

from tqkern_torch import library as _library  # noqa: F401  (registers tqkern::store, tqkern::decompress)
from tqkern_torch._params import DeviceParams, to_device
from tqkern_torch.attention import paged_decode, plan_decode  # (registers tqkern::paged_decode)
from tqkern_torch.dense import dense_attention, dense_decode, dense_layout, dense_store
from tqkern_torch.prefill import int8_prefill, prefill  # (registers tqkern::prefill, tqkern::int8_prefill)
from tqkern_torch.errors import TQKernError, check_errors, read_errors
from tqkern_torch.ops import (
    allocate_cache,
    compress,
    decompress,
    decompress_sequences,
    pack,
    quantize,
    rotate,
    sequence_slot_ids,
    store,
    unpack,
)

__all__ = [
    "DeviceParams",
    "to_device",
    "allocate_cache",
    "rotate",
    "pack",
    "unpack",
    "quantize",
    "store",
    "compress",
    "decompress",
    "decompress_sequences",
    "sequence_slot_ids",
    "paged_decode",
    "plan_decode",
    "int8_prefill",
    "prefill",
    "dense_layout",
    "dense_store",
    "dense_decode",
    "dense_attention",
    "check_errors",
    "read_errors",
    "TQKernError",
]
