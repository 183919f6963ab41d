"""The device-side error word: what kernels skipped, reported when the caller asks.

Every ``tqkern`` op ORs :class:`tqkern.errors.ErrorFlag` bits into one int32 word on the device
of its tensors instead of failing or synchronising (a bad slot writes nothing, a bad block reads
nothing outside the cache, a non-finite key or value is stored as zeros, ...). Reading the word
is a device synchronisation, so nothing on the default path reads it: call :func:`check_errors`
where the caller synchronises anyway (after a step, after a prefill, in a test), or pass
``debug=True`` to an op to check right after it.

The words live in one process-wide registry, like CUDA's own sticky error state: one word per
device, allocated on first use (:func:`tqkern_torch.to_device` allocates it too, so that a CUDA
graph captured later never allocates). It is the only state the frontend keeps.
"""

from __future__ import annotations

import threading

import torch

from tqkern.errors import ErrorFlag, describe
from tqkern_torch._validate import check_device, check_flag

__all__ = ["TQKernError", "check_errors", "error_word", "read_errors"]


class TQKernError(RuntimeError):
    """Raised by :func:`check_errors` when a kernel skipped or changed something.

    Attributes:
        flags: the :class:`~tqkern.errors.ErrorFlag` bits that were set.
        device: the device whose word held them.
    """

    def __init__(self, flags: ErrorFlag, device: torch.device):
        self.flags = ErrorFlag(flags)
        self.device = device
        super().__init__(f"tqkern kernels on {device} reported:\n{describe(int(flags))}")


class _Words:
    """One int32 ``[1]`` tensor per device (zero: nothing to report)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._words: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        word = self._words.get(device)
        if word is None:
            with self._lock:
                word = self._words.get(device)
                if word is None:
                    word = torch.zeros(1, dtype=torch.int32, device=device)
                    self._words[device] = word
        return word

    def items(self):
        return list(self._words.items())


_WORDS = _Words()


def _canonical(device) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def error_word(device) -> torch.Tensor:
    """The int32 ``[1]`` error word of ``device`` (allocated on first use); kernels OR into it."""
    return _WORDS.get(_canonical(device))


def read_errors(device=None, *, clear: bool = True) -> ErrorFlag:
    """The bits set on ``device`` (``None``: every device used so far), then, with ``clear``,
    zero them. Synchronises with those devices."""
    clear = check_flag(clear, "clear")
    if device is None:
        words = _WORDS.items()
    else:
        d = _canonical(check_device(device))
        words = [(d, _WORDS.get(d))]
    flags = ErrorFlag(0)
    for _, word in words:
        flags |= ErrorFlag(int(word.item()))
        if clear:
            word.zero_()
    return flags


def check_errors(device=None, *, clear: bool = True) -> None:
    """Raise :class:`TQKernError` if any kernel on ``device`` (``None``: on any device used so
    far) set a bit of its error word since the last check; ``clear`` zeroes the words first.
    Synchronises with those devices: call it where the caller synchronises anyway."""
    devices = [d for d, _ in _WORDS.items()] if device is None else [_canonical(check_device(device))]
    found = [(d, bits) for d in devices if (bits := read_errors(d, clear=clear))]
    if found:
        total = ErrorFlag(0)
        for _, bits in found:
            total |= bits
        raise TQKernError(total, found[0][0])
