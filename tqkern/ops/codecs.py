"""The codec registry: every codec of :mod:`tqkern.layouts` as the kernels see it.

One table, :data:`CODECS`, maps each codec class to its kind id (:class:`Kind`) and to the function
that derives the rest of its kernel constants. :func:`side_consts` turns one side (key or value)
of a :class:`~tqkern.layouts.PagedLayout` into a :class:`SideConsts`, the one constexpr argument
(``K`` or ``V``) that the store, decompress and general decode kernels take for that side;
:func:`layout_args` gives a kernel all of a layout's constexprs (cached per layout), and
:func:`layout_consts` the same flattened to ``K_*`` / ``V_*`` names (plans and the warp-MMA
launcher read those). Kernels compare ``K.KIND`` with the ``KIND_*`` constexprs below, never
with an integer literal. The codec table of every preset and how to add a codec: ``docs/codecs.md``.

A side's fields are addressed by position: ``A`` is the codec's first field (codes or data),
``B`` its second (norm or scale; ``A`` again when it has none), ``C`` its third (zero; ``A``
again when it has none), in the order ``Codec.fields`` lists them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Callable, NamedTuple

import triton
import triton.language as tl

from tqkern.layouts import FP8, Codec, LloydMax, PagedLayout, Raw, Uniform

__all__ = ["Kind", "CodecSpec", "CODECS", "SideConsts", "codec_spec", "codec_kind", "side_consts",
           "layout_args", "layout_consts", "KIND_LLOYD_MAX", "KIND_UNIFORM", "KIND_FP8", "KIND_RAW",
           "NC_NONE", "NC_DECODE", "NC_STORED", "DT_F16", "DT_F32", "DT_BF16"]


class Kind(enum.IntEnum):
    """Kind id of a codec: how a kernel decodes one side's fields."""

    LLOYD_MAX = 0  # packed codes → codebook centroid, times the norm field
    UNIFORM = 1  # packed codes q → q·scale + zero
    FP8 = 2  # one float8_e4m3fn byte per element
    RAW = 3  # one fp16 / bf16 per element


# The names kernels compare with (``if K.KIND == KIND_UNIFORM:``).
KIND_LLOYD_MAX = tl.constexpr(int(Kind.LLOYD_MAX))
KIND_UNIFORM = tl.constexpr(int(Kind.UNIFORM))
KIND_FP8 = tl.constexpr(int(Kind.FP8))
KIND_RAW = tl.constexpr(int(Kind.RAW))
# NORM_CORRECTION: Lloyd-Max's ``norm_correction`` ("none", "decode", "stored").
NC_NONE, NC_DECODE, NC_STORED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# PARAM_DTYPE: dtype of the per-token float fields (norm, scale, zero) or of raw elements.
DT_F16, DT_F32, DT_BF16 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_DT = {"float16": 0, "float32": 1, "bfloat16": 2}
_NC = {"none": 0, "decode": 1, "stored": 2}


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """One row of the registry.

    Attributes:
        kind: the codec's kind id.
        params: ``codec -> (param_dtype, norm_correction)``, the dtype name of its per-token
            float fields (or of its raw elements) and its Lloyd-Max norm correction (``"none"``
            for every other kind).
    """

    kind: Kind
    params: Callable[[Codec], tuple[str, str]]


CODECS: dict[type, CodecSpec] = {
    LloydMax: CodecSpec(Kind.LLOYD_MAX, lambda c: (c.norm_dtype, c.norm_correction)),
    Uniform: CodecSpec(Kind.UNIFORM, lambda c: (c.param_dtype, "none")),
    FP8: CodecSpec(Kind.FP8, lambda c: ("float32", "none")),
    Raw: CodecSpec(Kind.RAW, lambda c: (c.dtype, "none")),
}


def codec_spec(codec: Codec) -> CodecSpec:
    """The registry row of ``codec`` (``TypeError`` for an object that is not a registered codec)."""
    spec = CODECS.get(type(codec))
    if spec is None:
        raise TypeError(f"codec must be one of {[c.__name__ for c in CODECS]}, got {type(codec).__name__}")
    return spec


def codec_kind(codec: Codec) -> Kind:
    """The kind id of ``codec``."""
    return codec_spec(codec).kind


class SideConsts(NamedTuple):
    """Constexprs of one side (key or value) of a layout: a kernel's ``K`` or ``V`` argument."""

    KIND: int
    BITS: int
    ROTATED: bool
    NORM_CORRECTION: int
    PARAM_DTYPE: int  # norm / scale / zero / raw element dtype
    A_OFF: int  # codes or data field
    A_STRIDE: int
    A_BYTES: int
    B_OFF: int  # norm or scale field
    B_STRIDE: int
    C_OFF: int  # zero field
    C_STRIDE: int

    def kwargs(self, prefix: str) -> dict:
        """The fields as ``{prefix}_{NAME}`` keys (``K_A_OFF``, ...)."""
        return {f"{prefix}_{k}": v for k, v in self._asdict().items()}


def side_consts(layout: PagedLayout, side: str) -> SideConsts:
    """The constexprs of ``side`` (``"key"`` or ``"value"``) of ``layout`` (cached per layout)."""
    if side not in ("key", "value"):
        raise ValueError(f"side must be 'key' or 'value', got {side!r}")
    return _side_consts(layout, side)


@functools.lru_cache(maxsize=512)
def _side_consts(layout: PagedLayout, side: str) -> SideConsts:
    codec = getattr(layout.format, side)
    spec = codec_spec(codec)
    addr = [layout.field(f"{side}.{f.name}") for f in codec.fields(layout.head_dim)]
    a = addr[0]
    b = addr[1] if len(addr) > 1 else a
    c = addr[2] if len(addr) > 2 else a
    dtype, nc = spec.params(codec)
    return SideConsts(KIND=int(spec.kind), BITS=codec.bits, ROTATED=bool(codec.rotated), NORM_CORRECTION=_NC[nc],
                      PARAM_DTYPE=_DT[dtype], A_OFF=a.offset, A_STRIDE=a.head_stride, A_BYTES=a.nbytes,
                      B_OFF=b.offset, B_STRIDE=b.head_stride, C_OFF=c.offset, C_STRIDE=c.head_stride)


def layout_args(layout: PagedLayout) -> dict:
    """A layout's constexprs as kernel arguments (a fresh dict; computed once per layout):
    ``D``, ``DP``, ``ROW_BYTES``, ``NIBBLE``, the padding's ``PAD_*`` and the sides ``K`` and ``V``
    (:class:`SideConsts`)."""
    return dict(_layout_args(layout))


def layout_consts(layout: PagedLayout) -> dict:
    """:func:`layout_args` with ``K`` and ``V`` flattened to ``K_KIND``, ``K_BITS``, ... ``V_C_STRIDE``
    (a fresh dict; computed once per layout: deriving it takes ~90 µs of host time)."""
    return dict(_layout_consts(layout))


@functools.lru_cache(maxsize=256)
def _layout_args(layout: PagedLayout) -> tuple:
    fmt = layout.format
    pad = layout.pad_address()
    d = fmt.head_dim
    return tuple(dict(
        D=d,
        DP=max(16, triton.next_power_of_2(d)),  # tl.dot needs K >= 16 on GPUs
        ROW_BYTES=layout.row_bytes,
        NIBBLE=fmt.bit_order == "nibble_high_even",
        PAD_OFF=pad.offset,
        PAD_STRIDE=pad.head_stride,
        PAD_BYTES=pad.nbytes,
        PADP=max(2, triton.next_power_of_2(max(1, pad.nbytes))),
        K=side_consts(layout, "key"),
        V=side_consts(layout, "value"),
    ).items())


@functools.lru_cache(maxsize=256)
def _layout_consts(layout: PagedLayout) -> tuple:
    args = dict(_layout_args(layout))
    k, v = args.pop("K"), args.pop("V")
    return tuple({**args, **k.kwargs("K"), **v.kwargs("V")}.items())
