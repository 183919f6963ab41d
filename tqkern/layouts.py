"""Layout descriptors: what one compressed token of one KV head looks like, byte by byte.

Everything here is a frozen, slotted, keyword-only dataclass validated in ``__post_init__``.
Byte sizes and offsets are derived properties; kernels and oracles read them from here and
never write a size as a literal. The vocabulary is defined once in ``docs/layout.md``.

A *codec* describes how one vector (a key or a value of one token and one KV head, ``head_dim``
numbers) becomes bytes (:mod:`tqkern.vector_codecs`; its names are re-exported here). A
:class:`KVFormat` pairs a key codec with a value codec and fixes the bit order of packed codes. A :class:`PagedLayout` places the slots of a format in a paged cache,
either ``"slot"`` (vLLM: ``[num_blocks, block_size, num_kv_heads, slot_bytes]``) or ``"row"``
(turboquant-vllm: per token, every head's first field, then every head's second field, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from typing import Literal

from tqkern.vector_codecs import (_CODECS, FIELD_DTYPES, FP8, Codec, Field, LloydMax, Raw, Uniform, _bad,
                                  _check_choice, _check_int)

__all__ = [
    "LloydMax",
    "Uniform",
    "FP8",
    "Raw",
    "Codec",
    "Field",
    "FieldAddress",
    "KVFormat",
    "PagedLayout",
    "PRESETS",
    "is_format_name",
    "BIT_ORDERS",
    "ROTATIONS",
    "layout_to_dict",
    "layout_from_dict",
]

BIT_ORDERS = ("lsb", "nibble_high_even")
ROTATIONS = ("hadamard", "hadamard_signed", "haar")


@functools.lru_cache(maxsize=1024)
def _codec_fields(codec: Codec, head_dim: int) -> tuple[Field, ...]:
    """``codec.fields(head_dim)``, derived once per (frozen) codec and head_dim: every size of a
    format and layout (``slot_bytes``, ``row_bytes``, ``cache_shape``) sums them, and frontends read
    those at every call (building and validating the fields took ~2 µs a side)."""
    return codec.fields(head_dim)


@dataclass(frozen=True, slots=True, kw_only=True)
class KVFormat:
    """The bytes of one slot: one token's key and value for one KV head.

    A slot is ``[key fields | value fields | zero padding]``; fields follow each other without
    alignment, in the order the codec lists them, and the slot is padded with zero bytes to a
    multiple of ``slot_alignment``.

    Attributes:
        head_dim: D, even, 2..1024.
        key: codec of the key. value: codec of the value.
        bit_order: how packed codes sit in bytes. ``"lsb"``: one LSB-first bitstream, code j at
            bits [j·b, j·b + b) (as ``numpy.packbits(bitorder="little")``; for 4 bits the even index
            is the low nibble). ``"nibble_high_even"``: 4-bit codes only, two per byte, the even
            index in the high nibble (turboquant-vllm).
        rotation: kind of the orthogonal rotation Π shared by K and V when a codec is rotated:
            ``"hadamard"`` (Sylvester Hadamard/√D without signs, vLLM), ``"hadamard_signed"``
            (random ±1 signs applied before it), ``"haar"`` (seeded Haar-random orthogonal).
        slot_alignment: the slot size is padded to a multiple of this (vLLM pads to even).
    """

    head_dim: int
    key: Codec
    value: Codec
    bit_order: Literal["lsb", "nibble_high_even"] = "lsb"
    rotation: Literal["hadamard", "hadamard_signed", "haar"] = "hadamard_signed"
    slot_alignment: int = 2

    def __post_init__(self) -> None:
        _check_int("KVFormat.head_dim", self.head_dim, 2, 1024)
        if self.head_dim % 2:
            raise _bad("KVFormat.head_dim", "even", self.head_dim)
        for name in ("key", "value"):
            codec = getattr(self, name)
            if not isinstance(codec, _CODECS):
                raise TypeError(
                    f"KVFormat.{name} must be one of LloydMax, Uniform, FP8, Raw, "
                    f"got {type(codec).__name__}"
                )
        _check_choice("KVFormat.bit_order", self.bit_order, BIT_ORDERS)
        _check_choice("KVFormat.rotation", self.rotation, ROTATIONS)
        _check_int("KVFormat.slot_alignment", self.slot_alignment, 1, 256)
        if self.slot_alignment & (self.slot_alignment - 1):
            raise _bad("KVFormat.slot_alignment", "a power of two", self.slot_alignment)
        if self.bit_order == "nibble_high_even":
            for name in ("key", "value"):
                codec = getattr(self, name)
                if codec.packed and codec.bits != 4:
                    raise _bad(
                        f"KVFormat.{name}.bits",
                        "4 with bit_order='nibble_high_even'",
                        codec.bits,
                    )

    # -- derived sizes ---------------------------------------------------------------------
    @property
    def key_fields(self) -> tuple[Field, ...]:
        return _codec_fields(self.key, self.head_dim)

    @property
    def value_fields(self) -> tuple[Field, ...]:
        return _codec_fields(self.value, self.head_dim)

    @property
    def key_bytes(self) -> int:
        return sum(f.nbytes for f in self.key_fields)

    @property
    def value_bytes(self) -> int:
        return sum(f.nbytes for f in self.value_fields)

    @property
    def pad_bytes(self) -> int:
        return self.slot_bytes - self.key_bytes - self.value_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes per token per KV head, K and V together, padding included."""
        a = self.slot_alignment
        return (self.key_bytes + self.value_bytes + a - 1) // a * a

    @property
    def rotated(self) -> bool:
        """Whether any codec works in rotated space (so the format needs a rotation)."""
        return bool(self.key.rotated or self.value.rotated)

    @property
    def compression(self) -> float:
        """fp16 bytes (2·2·D) over ``slot_bytes``."""
        return 4 * self.head_dim / self.slot_bytes

    def slot_fields(self) -> tuple[tuple[str, Field, int], ...]:
        """``(qualified_name, field, byte_offset_in_slot)`` for every field, e.g. ``"key.norm"``."""
        out, offset = [], 0
        for side, fields in (("key", self.key_fields), ("value", self.value_fields)):
            for f in fields:
                out.append((f"{side}.{f.name}", f, offset))
                offset += f.nbytes
        return tuple(out)

    def field_offset(self, name: str) -> int:
        """Byte offset of ``name`` (``"key.codes"``, ``"value.scale"``, ...) inside a slot."""
        for qual, _, off in self.slot_fields():
            if qual == name:
                return off
        raise _bad("name", f"one of {[q for q, _, _ in self.slot_fields()]}", name)

    def replace(self, **changes) -> KVFormat:
        return dataclasses.replace(self, **changes)

    # -- presets ---------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, head_dim: int) -> KVFormat:
        """A named format. vLLM's ``turboquant_*`` cache dtypes (byte-exact, slot arrangement)
        and turboquant-vllm's ``tq4`` (byte-exact, use with ``arrangement="row"``); ``tqkern_*``
        are this library's own formats (which to use, by measured quality: ``docs/quality.md``).
        The layout is byte-exact; equal *codes* also
        need the peer's parameters: ``TQParams.vllm(fmt)`` for vLLM (``TQParams.default`` uses
        the exact codebook, not vLLM's numerical one), turboquant-vllm's Qᵀ and tables for
        ``tq4``. See ``docs/layout.md``.

        Also ``"kXvYh"`` (X, Y in 1..8): X-bit keys and Y-bit values, both Lloyd-Max codes of
        the Beta codebook with float16 norms and the stored norm correction, signed-Hadamard
        rotation, LSB bit order, 2-byte slot alignment — the family ``docs/quality.md`` builds
        per-layer allocations from (``k5v3h`` is ``tqkern_k5v3`` with float16 norms)."""
        if isinstance(name, str) and name in PRESETS:
            return cls(head_dim=head_dim, **PRESETS[name])
        bits = _FAMILY.fullmatch(name) if isinstance(name, str) else None
        if bits is None:
            raise _bad("name", f"one of {sorted(PRESETS)} or 'kXvYh' (X, Y in 1..8)", name)
        key, value = (LloydMax(bits=int(b), distribution="beta", norm_dtype="float16", norm_correction="stored")
                      for b in bits.groups())
        return cls(head_dim=head_dim, key=key, value=value, bit_order="lsb", rotation="hadamard_signed",
                   slot_alignment=2)


def _vllm(key: Codec, value: Codec) -> dict:
    return dict(key=key, value=value, bit_order="lsb", rotation="hadamard", slot_alignment=2)


def _vllm_mse_key(bits: int) -> LloydMax:
    return LloydMax(bits=bits, distribution="gaussian", norm_dtype="float16", norm_correction="decode")


_FAMILY = re.compile(r"k([1-8])v([1-8])h")


def is_format_name(name) -> bool:
    """Whether :meth:`KVFormat.preset` knows ``name``: a key of :data:`PRESETS` or ``"kXvYh"``."""
    return isinstance(name, str) and (name in PRESETS or _FAMILY.fullmatch(name) is not None)


PRESETS: dict[str, dict] = {
    "turboquant_k8v4": _vllm(FP8(), Uniform(bits=4)),
    "turboquant_4bit_nc": _vllm(_vllm_mse_key(4), Uniform(bits=4)),
    "turboquant_k3v4_nc": _vllm(_vllm_mse_key(3), Uniform(bits=4)),
    "turboquant_3bit_nc": _vllm(_vllm_mse_key(3), Uniform(bits=3)),
    "tq4": dict(
        key=LloydMax(bits=4, distribution="gaussian", norm_dtype="float32"),
        value=LloydMax(bits=4, distribution="gaussian", norm_dtype="float32"),
        bit_order="nibble_high_even",
        rotation="haar",
        slot_alignment=1,
    ),
    # tqkern's own: keys carry most of the error, so spend the bits there (measured by the tqkern
    # authors on SmolLM2-135M, one run: 4-bit keys alone cost about +6% perplexity, values +0.6%).
    "tqkern_k5v3": dict(
        key=LloydMax(bits=5, distribution="beta", norm_dtype="float32", norm_correction="stored"),
        value=LloydMax(bits=3, distribution="beta", norm_dtype="float32", norm_correction="stored"),
        rotation="hadamard_signed",
    ),
    "tqkern_k4v4": dict(
        key=LloydMax(bits=4, distribution="beta", norm_dtype="float32", norm_correction="stored"),
        value=LloydMax(bits=4, distribution="beta", norm_dtype="float32", norm_correction="stored"),
        rotation="hadamard_signed",
    ),
    "fp16": dict(key=Raw(dtype="float16"), value=Raw(dtype="float16"), rotation="hadamard"),
}


@dataclass(frozen=True, slots=True)
class FieldAddress:
    """Where a field of KV head ``h`` sits inside a token row:
    ``offset + h * head_stride`` .. ``+ nbytes``."""

    offset: int
    head_stride: int
    nbytes: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("offset", "head_stride", "nbytes"):
            _check_int(f"FieldAddress.{name}", getattr(self, name), 0, 1 << 30)
        _check_choice("FieldAddress.dtype", self.dtype, FIELD_DTYPES)


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedLayout:
    """A paged cache of a :class:`KVFormat`.

    The cache is one uint8 tensor. A token row holds ``num_kv_heads`` slots
    (``row_bytes = num_kv_heads * slot_bytes``); a block holds ``block_size`` rows; the physical
    slot index of token position ``p`` of a sequence is ``block_table[p // block_size] *
    block_size + p % block_size``.

    Attributes:
        format: the slot format.
        num_kv_heads: KV heads per token row.
        block_size: tokens per block, a power of two in [1, 1024].
        arrangement: ``"slot"``: each head's slot is contiguous (vLLM, cache shape
            ``[num_blocks, block_size, num_kv_heads, slot_bytes]``). ``"row"``: a row holds every
            head's first field, then every head's second field, and so on, then the padding
            (turboquant-vllm, cache shape ``[num_blocks, block_size, row_bytes]``).
    """

    format: KVFormat
    num_kv_heads: int
    block_size: int
    arrangement: Literal["slot", "row"] = "slot"
    key: str = dataclasses.field(init=False, repr=False, compare=False)
    """A canonical JSON string naming this layout (derived; the ``torch.library`` ops take it)."""

    def __post_init__(self) -> None:
        if not isinstance(self.format, KVFormat):
            raise TypeError(f"PagedLayout.format must be a KVFormat, got {type(self.format).__name__}")
        _check_int("PagedLayout.num_kv_heads", self.num_kv_heads, 1, 4096)
        _check_int("PagedLayout.block_size", self.block_size, 1, 1024)
        if self.block_size & (self.block_size - 1):
            raise _bad("PagedLayout.block_size", "a power of two", self.block_size)
        _check_choice("PagedLayout.arrangement", self.arrangement, ("slot", "row"))
        object.__setattr__(self, "key", json.dumps(layout_to_dict(self), sort_keys=True))

    @property
    def head_dim(self) -> int:
        return self.format.head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row (all KV heads)."""
        return self.num_kv_heads * self.format.slot_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.row_bytes

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.arrangement == "slot":
            return (num_blocks, self.block_size, self.num_kv_heads, self.format.slot_bytes)
        return (num_blocks, self.block_size, self.row_bytes)

    def field(self, name: str) -> FieldAddress:
        """Address of ``name`` (``"key.codes"``, ``"key.norm"``, ``"value.data"``, ...)."""
        fmt = self.format
        region = 0
        for qual, f, off in fmt.slot_fields():
            if qual == name:
                if self.arrangement == "slot":
                    return FieldAddress(off, fmt.slot_bytes, f.nbytes, f.dtype)
                return FieldAddress(region, f.nbytes, f.nbytes, f.dtype)
            region += self.num_kv_heads * f.nbytes
        raise _bad("name", f"one of {[q for q, _, _ in fmt.slot_fields()]}", name)

    def fields(self) -> dict[str, FieldAddress]:
        return {qual: self.field(qual) for qual, _, _ in self.format.slot_fields()}

    def pad_address(self) -> FieldAddress:
        """Where each head's padding bytes sit (zero-filled by ``store``)."""
        fmt = self.format
        if self.arrangement == "slot":
            return FieldAddress(fmt.key_bytes + fmt.value_bytes, fmt.slot_bytes, fmt.pad_bytes, "uint8")
        used = self.num_kv_heads * (fmt.key_bytes + fmt.value_bytes)
        return FieldAddress(used, fmt.pad_bytes, fmt.pad_bytes, "uint8")


def _codec_to_dict(codec: Codec) -> dict:
    return {"kind": codec.kind, **{f.name: getattr(codec, f.name) for f in dataclasses.fields(codec)}}


def _codec_from_dict(d: dict) -> Codec:
    d = dict(d)
    kind = d.pop("kind")
    cls = {c.kind: c for c in _CODECS}.get(kind)
    if cls is None:
        raise _bad("codec kind", f"one of {[c.kind for c in _CODECS]}", kind)
    return cls(**d)


def layout_to_dict(layout: PagedLayout) -> dict:
    """A JSON-able description of a layout (round-trips through :func:`layout_from_dict`)."""
    fmt = layout.format
    return {
        "format": {
            "head_dim": fmt.head_dim,
            "key": _codec_to_dict(fmt.key),
            "value": _codec_to_dict(fmt.value),
            "bit_order": fmt.bit_order,
            "rotation": fmt.rotation,
            "slot_alignment": fmt.slot_alignment,
        },
        "num_kv_heads": layout.num_kv_heads,
        "block_size": layout.block_size,
        "arrangement": layout.arrangement,
    }


def layout_from_dict(d: dict) -> PagedLayout:
    f = dict(d["format"])
    f["key"] = _codec_from_dict(f["key"])
    f["value"] = _codec_from_dict(f["value"])
    return PagedLayout(format=KVFormat(**f), num_kv_heads=d["num_kv_heads"], block_size=d["block_size"],
                       arrangement=d["arrangement"])
