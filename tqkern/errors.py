"""What a kernel skipped or changed instead of failing: the bits of the error flag.

Kernels never read or write outside their tensors, whatever an index holds, and never stop to
report: a bad index is skipped (or clamped), a non-finite input is stored as zeros, a float too
large for its field is saturated, and the kernel ORs the matching bit into a small device-side
word. The torch frontend reads that word only when asked (``tqkern_torch.check_errors()``), so
the default path needs no device synchronisation. The NumPy oracles compute the same bits
(``return_flags=True``), and ``docs/layout.md`` states the policy in full.

This module needs neither torch nor Triton.
"""

from __future__ import annotations

import enum

__all__ = ["ErrorFlag", "describe"]


class ErrorFlag(enum.IntFlag):
    """Bits of the error flag (an int32 word; several may be set at once).

    Attributes:
        SLOT_OUT_OF_RANGE: ``store``: a ``slot_mapping`` entry ≥ ``num_blocks·block_size`` (the
            token was not written); ``decompress``: a slot id ≥ that bound (its rows read zeros).
        BLOCK_OUT_OF_RANGE: ``paged_decode``: a ``block_table`` entry in use lies outside
            ``[0, num_blocks)``; that sequence's output is unspecified (it reads only memory
            inside the cache).
        SEQ_LEN_OUT_OF_RANGE: ``paged_decode``: a ``seq_lens`` entry outside
            ``[0, max_blocks·block_size]``; it was clamped into that range.
        NONFINITE_INPUT: ``store``/``compress``: a key or value vector holding a NaN or ±inf; it was
            stored as the zero vector.
        SATURATED: ``store``/``compress``: a stored float (a norm, a uniform scale or zero point, an
            FP8 or fp16 element) exceeded its dtype's largest finite value; it was stored as that
            value with the input's sign.
    """

    SLOT_OUT_OF_RANGE = 1
    BLOCK_OUT_OF_RANGE = 2
    SEQ_LEN_OUT_OF_RANGE = 4
    NONFINITE_INPUT = 8
    SATURATED = 16


_WHAT = {
    ErrorFlag.SLOT_OUT_OF_RANGE: "a slot index was >= num_blocks * block_size (that token was skipped)",
    ErrorFlag.BLOCK_OUT_OF_RANGE: "a block_table entry in use was outside [0, num_blocks) (that sequence's "
                                  "output is unspecified)",
    ErrorFlag.SEQ_LEN_OUT_OF_RANGE: "a seq_lens entry was outside [0, max_blocks * block_size] (clamped)",
    ErrorFlag.NONFINITE_INPUT: "a key or value vector held NaN or inf (stored as the zero vector)",
    ErrorFlag.SATURATED: "a stored float exceeded its dtype's range (saturated to the largest finite value)",
}


def describe(bits: int) -> str:
    """One line per set bit of ``bits``, e.g. for an exception message; ``""`` when none is set."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int, got {type(bits).__name__}")
    unknown = bits & ~sum(ErrorFlag)
    lines = [f"{flag.name}: {text}" for flag, text in _WHAT.items() if bits & flag]
    if unknown:
        lines.append(f"unknown bits {unknown:#x}")
    return "\n".join(lines)
