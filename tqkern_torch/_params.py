"""TQParams on a torch device: the tables the kernels read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tqkern.ops.int8_prefill.reference import int8_image
from tqkern.ops.store.triton import rotation_parts, signed_key_offset
from tqkern.params import TQParams
from tqkern.rotations import is_signed_sylvester
from tqkern_torch._validate import check_device
from tqkern_torch.errors import error_word

__all__ = ["DeviceParams", "to_device"]


@dataclass(frozen=True, eq=False)
class DeviceParams:
    """A :class:`~tqkern.params.TQParams` as device tensors.

    Attributes:
        params: the NumPy parameters these tensors were made from.
        rotation: float32 ``[D, D]`` Π (identity when the format is not rotated).
        key_boundaries / value_boundaries: float32 ``[2**bits − 1]`` Lloyd-Max boundaries: the
            codebook's own (a caller's table from ``Codebook.from_centroids(..., boundaries=)``
            or the midpoints) rounded to float32, the precision the kernels compare in (a
            1-element placeholder for other codecs).
        key_centroids / value_centroids: float64 ``[2**bits]`` centroids (placeholder likewise).
        key_centroids_f32 / value_centroids_f32: the same in float32, for attention kernels.
        key_offset: float32 ``[num_kv_heads, D]`` μ, or ``None``.
        key_offset_signed: ``μ ⊙ sign(Π[:, 0])`` (float32, μ's shape), the warp store kernel's
            table for rotated keys (:func:`tqkern.ops.store.triton.signed_key_offset`), or
            ``None`` (the store then makes it per call).
        key_int8_table: float32 ``[2·2**bits + 1]`` for Lloyd-Max keys: the centroids, their int8
            image as floats and its scale (:func:`tqkern.ops.int8_prefill.reference.int8_image`),
            the table ``int8_prefill``'s kernels read; a 1-element placeholder for other key codecs.
        same_codebooks: the key and value codebooks are equal (both Lloyd-Max with the same
            centroids): the warp-MMA decode kernel then serves both from one table.
        signed_sylvester: the rotation is ``diag(s) · H / √D``
            (:func:`tqkern.rotations.is_signed_sylvester`): the store kernel then rotates with
            an exact ±1 matrix on the tensor cores (:mod:`tqkern.ops.store.plan`).
        rotation_parts: fp16 ``[2, D, D]``, ``16·Π`` as two fp16 parts
            (:func:`tqkern.ops.store.triton.rotation_parts`), the operands of the column-chunked
            store (:mod:`tqkern.ops.store.wide`), for rotated formats of head_dim above 128; or
            ``None`` (that store then makes them per call).
        symmetric_codebooks: every Lloyd-Max side's float32 boundaries are antisymmetric
            (``b == −b[::-1]``; the default codebooks are): the warp store kernel then searches
            half the table (:func:`tqkern.ops.fields.symmetric_codes`).
    """

    params: TQParams
    rotation: torch.Tensor
    key_boundaries: torch.Tensor
    value_boundaries: torch.Tensor
    key_centroids: torch.Tensor
    value_centroids: torch.Tensor
    key_centroids_f32: torch.Tensor
    value_centroids_f32: torch.Tensor
    key_offset: torch.Tensor | None
    same_codebooks: bool = False
    signed_sylvester: bool = False
    symmetric_codebooks: bool = False
    key_offset_signed: torch.Tensor | None = None
    key_int8_table: torch.Tensor | None = None
    rotation_parts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        """The tables' shapes and dtypes against ``params`` (shapes only: no device sync). The
        kernels index centroid tables by codes unmasked and read Π and μ by head_dim, so a table
        that does not match the format would be read past its end."""
        if not isinstance(self.params, TQParams):
            raise TypeError(f"DeviceParams.params must be a TQParams, got {type(self.params).__name__}")
        d = self.params.format.head_dim
        dev = self.rotation.device if isinstance(self.rotation, torch.Tensor) else None
        want = {"rotation": ((d, d), torch.float32)}
        for side in ("key", "value"):
            cb = getattr(self.params, f"{side}_codebook")
            n = 2**cb.bits if cb is not None else 1
            want[f"{side}_boundaries"] = ((max(n - 1, 1),), torch.float32)
            want[f"{side}_centroids"] = ((n,), torch.float64)
            want[f"{side}_centroids_f32"] = ((n,), torch.float32)
        if self.key_int8_table is not None:
            kcb = self.params.key_codebook
            want["key_int8_table"] = ((2 * 2**kcb.bits + 1 if kcb is not None else 1,), torch.float32)
        if self.rotation_parts is not None:
            want["rotation_parts"] = ((2, d, d), torch.float16)
        mu = self.params.key_offset
        if mu is not None:
            want["key_offset"] = (tuple(mu.shape), torch.float32)
            if self.key_offset_signed is not None:
                want["key_offset_signed"] = (tuple(mu.shape), torch.float32)
        else:
            for name in ("key_offset", "key_offset_signed"):
                if getattr(self, name) is not None:
                    raise ValueError(f"DeviceParams.{name} must be None when params.key_offset is None, got a tensor")
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"DeviceParams.{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != dev or not t.is_contiguous():
                raise ValueError(f"DeviceParams.{name} must be a contiguous {dtype} tensor of shape {shape} on "
                                 f"{dev}, got {t.dtype} {tuple(t.shape)} on {t.device}"
                                 f"{'' if t.is_contiguous() else ' (not contiguous)'}")

    @property
    def device(self) -> torch.device:
        return self.rotation.device

    def tables(self) -> dict:
        return {
            "rotation": self.rotation,
            "key_boundaries": self.key_boundaries,
            "value_boundaries": self.value_boundaries,
            "key_centroids": self.key_centroids,
            "value_centroids": self.value_centroids,
            "key_centroids_f32": self.key_centroids_f32,
            "value_centroids_f32": self.value_centroids_f32,
            "key_offset": self.key_offset,
            "key_offset_signed": self.key_offset_signed,
            "key_int8_table": self.key_int8_table,
            "rotation_parts": self.rotation_parts,
        }


def _int8_table(codebook) -> np.ndarray:
    """``DeviceParams.key_int8_table``'s values (float64; [0.0] without a codebook)."""
    if codebook is None:
        return np.zeros(1)
    c8, s_cb = int8_image(codebook.centroids)
    return np.concatenate([codebook.centroids, c8.astype(np.float64), [s_cb]])


def _antisymmetric(boundaries) -> bool:
    """``b == −b[::-1]`` in float32 (the precision the kernels compare in)."""
    b = np.asarray(boundaries, np.float32)
    return bool(np.array_equal(b, -b[::-1]))


def to_device(params: TQParams, device) -> DeviceParams:
    """Copy ``params`` to ``device`` (``"cuda"``, ``"cpu"``, a ``torch.device``)."""
    if isinstance(params, DeviceParams):
        params = params.params
    if not isinstance(params, TQParams):
        raise TypeError(f"params must be a TQParams or DeviceParams, got {type(params).__name__}")
    device = check_device(device)
    d = params.format.head_dim
    rot = params.rotation if params.rotation is not None else np.eye(d)
    t = {"rotation": torch.tensor(np.ascontiguousarray(rot, np.float32), device=device).contiguous()}
    for side in ("key", "value"):
        cb = getattr(params, f"{side}_codebook")
        b = cb.boundaries if cb is not None else np.zeros(1)
        c = cb.centroids if cb is not None else np.zeros(1)
        t[f"{side}_boundaries"] = torch.tensor(np.asarray(b, np.float32), device=device)
        t[f"{side}_centroids"] = torch.tensor(np.asarray(c, np.float64), device=device)
        t[f"{side}_centroids_f32"] = torch.tensor(np.asarray(c, np.float32), device=device)
    kcb, vcb = params.key_codebook, params.value_codebook
    t["key_int8_table"] = torch.tensor(np.asarray(_int8_table(kcb), np.float32), device=device)
    t["same_codebooks"] = bool(kcb is not None and vcb is not None
                               and np.array_equal(kcb.centroids, vcb.centroids))
    t["signed_sylvester"] = bool(params.rotation is not None and is_signed_sylvester(params.rotation))
    t["symmetric_codebooks"] = all(cb is None or _antisymmetric(cb.boundaries) for cb in (kcb, vcb))
    mu = params.key_offset
    t["key_offset"] = None if mu is None else torch.tensor(np.ascontiguousarray(mu, np.float32), device=device).contiguous()
    t["key_offset_signed"] = None if mu is None else signed_key_offset(t["key_offset"], t["rotation"])
    t["rotation_parts"] = rotation_parts(t["rotation"]) if params.format.rotated and d > 128 else None
    error_word(device)  # allocated now, so that no op allocates it later, e.g. under CUDA-graph capture
    return DeviceParams(params=params, **t)
