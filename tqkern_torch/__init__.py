"""tqkern_torch: the torch frontend of tqkern.

Validates torch tensors, allocates caches, launches the Triton kernels of ``tqkern`` and
registers them as ``torch.library`` ops (``torch.ops.tqkern.*``); also the ``tqkern`` command
line (:mod:`tqkern_torch.cli`). The layouts, parameters and NumPy oracles live in ``tqkern``.
No autograd.
"""

from tqkern_torch import library as _library  # noqa: F401  (registers torch.ops.tqkern.*)
from tqkern_torch._params import DeviceParams, to_device
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
    "check_errors",
    "read_errors",
    "TQKernError",
]
