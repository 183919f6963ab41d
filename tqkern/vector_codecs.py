"""Codec descriptors: how one vector (a key or a value of one token and one KV head, ``head_dim``
numbers) becomes bytes (:class:`LloydMax`, :class:`Uniform`, :class:`FP8`, :class:`Raw`), and the
:class:`Field` list each gives. Frozen, slotted dataclasses validated in ``__post_init__``;
:mod:`tqkern.layouts` pairs them into formats and places them in a paged cache (and re-exports
every name here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Union

__all__ = ["LloydMax", "Uniform", "FP8", "Raw", "Codec", "Field", "FIELD_NAMES", "FIELD_DTYPES"]

_FLOAT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
FIELD_NAMES = ("codes", "norm", "data", "scale", "zero")
FIELD_DTYPES = ("codes", "uint8", "float8_e4m3fn", "float16", "bfloat16", "float32")


def _bad(field: str, expected: str, actual: object) -> ValueError:
    return ValueError(f"{field} must be {expected}, got {actual!r}")


def _check_int(field: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise _bad(field, f"in [{lo}, {hi}]", value)


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise _bad(field, f"one of {choices}", value)


@dataclass(frozen=True, slots=True)
class Field:
    """One named field of a codec's bytes.

    Attributes:
        name: ``"codes"``, ``"norm"``, ``"data"``, ``"scale"`` or ``"zero"``.
        nbytes: size of the field for one vector.
        dtype: how the bytes are read: ``"codes"`` (packed integer codes, see ``bit_order``),
            ``"uint8"`` (one byte per element), ``"float8_e4m3fn"``, ``"float16"``,
            ``"bfloat16"`` or ``"float32"`` (little-endian).
    """

    name: str
    nbytes: int
    dtype: str

    def __post_init__(self) -> None:
        _check_choice("Field.name", self.name, FIELD_NAMES)
        _check_int("Field.nbytes", self.nbytes, 1, 1 << 20)
        _check_choice("Field.dtype", self.dtype, FIELD_DTYPES)


def _packed_bytes(head_dim: int, bits: int) -> int:
    # Codes form one bitstream of head_dim * bits bits; a partial last byte is padded with zero
    # bits (so 3-bit codes need no head_dim % 8 == 0).
    return (head_dim * bits + 7) // 8


@dataclass(frozen=True, slots=True, kw_only=True)
class LloydMax:
    """TurboQuant_mse: store ``‖x‖``, rotate the unit vector, quantize each coordinate with the
    Lloyd-Max codebook of the rotated coordinate's distribution.

    Attributes:
        bits: bits per coordinate, 1..8.
        distribution: ``"beta"`` (exact density of a rotated unit vector's coordinate,
            ∝ (1 − t²)^((d − 3)/2)) or ``"gaussian"`` (N(0, 1/d), what vLLM and turboquant-vllm use).
        norm_dtype: ``"float16"`` or ``"float32"`` for the stored norm field.
        norm_correction: ``"none"`` (norm field = ‖x‖, reconstruction ‖x‖·c[idx]);
            ``"decode"`` (norm field = ‖x‖, reconstruction ‖x‖·c[idx]/‖c[idx]‖, the divisor
            computed at decode: vLLM's ``_nc`` meaning); ``"stored"`` (norm field =
            ‖x‖/‖c[idx]‖, reconstruction field·c[idx]: the correction is free at decode).
    """

    bits: int
    distribution: Literal["beta", "gaussian"] = "beta"
    norm_dtype: Literal["float16", "float32"] = "float32"
    norm_correction: Literal["none", "decode", "stored"] = "none"

    kind: ClassVar[str] = "lloyd_max"

    def __post_init__(self) -> None:
        _check_int("LloydMax.bits", self.bits, 1, 8)
        _check_choice("LloydMax.distribution", self.distribution, ("beta", "gaussian"))
        _check_choice("LloydMax.norm_dtype", self.norm_dtype, ("float16", "float32"))
        _check_choice("LloydMax.norm_correction", self.norm_correction, ("none", "decode", "stored"))

    @property
    def rotated(self) -> bool:
        return True

    @property
    def packed(self) -> bool:
        return True

    def fields(self, head_dim: int) -> tuple[Field, ...]:
        return (
            Field("codes", _packed_bytes(head_dim, self.bits), "codes"),
            Field("norm", _FLOAT_BYTES[self.norm_dtype], self.norm_dtype),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Uniform:
    """Uniform asymmetric quantization per vector: ``scale = (max − min)/(2^bits − 1)`` (floored at
    1e-8), ``q = floor((x − min)/scale + 0.5)`` clamped to ``[0, 2^bits − 1]``; dequantized
    ``q·scale + zero`` with ``zero = min``.

    Attributes:
        bits: 2..8.
        param_dtype: dtype of the stored scale and zero, ``"float16"`` (vLLM) or ``"float32"``
            (for bf16 models whose values exceed the fp16 range; fp16 saturates at ±65504).
        rotated: quantize the rotated vector instead of the raw one (vLLM: raw).
    """

    bits: int
    param_dtype: Literal["float16", "float32"] = "float16"
    rotated: bool = False

    kind: ClassVar[str] = "uniform"

    def __post_init__(self) -> None:
        _check_int("Uniform.bits", self.bits, 2, 8)
        _check_choice("Uniform.param_dtype", self.param_dtype, ("float16", "float32"))
        if not isinstance(self.rotated, bool):
            raise TypeError(f"Uniform.rotated must be a bool, got {type(self.rotated).__name__}")

    @property
    def packed(self) -> bool:
        return True

    def fields(self, head_dim: int) -> tuple[Field, ...]:
        nb = _FLOAT_BYTES[self.param_dtype]
        return (
            Field("data", _packed_bytes(head_dim, self.bits), "codes"),
            Field("scale", nb, self.param_dtype),
            Field("zero", nb, self.param_dtype),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class FP8:
    """FP8 E4M3 (``float8_e4m3fn``: bias 7, max 448, no infinities), one byte per element,
    no scale. Rounding to nearest even, saturating at ±448 (vLLM's plain cast; NaN stays NaN).

    Attributes:
        rotated: cast the rotated vector instead of the raw one (vLLM: raw).
    """

    rotated: bool = False

    kind: ClassVar[str] = "fp8"
    bits: ClassVar[int] = 8

    def __post_init__(self) -> None:
        if not isinstance(self.rotated, bool):
            raise TypeError(f"FP8.rotated must be a bool, got {type(self.rotated).__name__}")

    @property
    def packed(self) -> bool:
        return False

    def fields(self, head_dim: int) -> tuple[Field, ...]:
        return (Field("data", head_dim, "float8_e4m3fn"),)


@dataclass(frozen=True, slots=True, kw_only=True)
class Raw:
    """Uncompressed fp16 or bf16 (boundary layers, and the baseline), never rotated."""

    dtype: Literal["float16", "bfloat16"] = "float16"

    kind: ClassVar[str] = "raw"
    bits: ClassVar[int] = 16

    def __post_init__(self) -> None:
        _check_choice("Raw.dtype", self.dtype, ("float16", "bfloat16"))

    @property
    def rotated(self) -> bool:
        return False

    @property
    def packed(self) -> bool:
        return False

    def fields(self, head_dim: int) -> tuple[Field, ...]:
        return (Field("data", 2 * head_dim, self.dtype),)


Codec = Union[LloydMax, Uniform, FP8, Raw]
_CODECS = (LloydMax, Uniform, FP8, Raw)
