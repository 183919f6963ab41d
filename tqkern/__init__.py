"""tqkern: TurboQuant KV-cache compression.

Layout descriptors say what every byte of a compressed cache means (:class:`KVFormat`,
:class:`PagedLayout`); :class:`TQParams` holds the numbers a format needs besides its bytes
(rotation, Lloyd-Max codebooks, key offset); :mod:`tqkern.reference` holds the NumPy oracles
that specify every op. None of this imports torch: the torch frontend is ``tqkern_torch``.

See ``docs/layout.md`` for the byte layouts and ``docs/algorithms.md`` for the maths.
"""

from tqkern import reference
from tqkern.codebooks import Codebook, lloyd_max
from tqkern.layouts import (
    FP8,
    PRESETS,
    Field,
    FieldAddress,
    KVFormat,
    LloydMax,
    PagedLayout,
    Raw,
    Uniform,
)
from tqkern.params import TQParams
from tqkern.rotations import haar, hadamard

__version__ = "0.1.0"

__all__ = [
    "KVFormat",
    "PagedLayout",
    "LloydMax",
    "Uniform",
    "FP8",
    "Raw",
    "Field",
    "FieldAddress",
    "PRESETS",
    "Codebook",
    "lloyd_max",
    "TQParams",
    "hadamard",
    "haar",
    "reference",
    "__version__",
]
