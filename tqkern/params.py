"""The numeric parameters of a format: rotation, codebooks and the optional key offset."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from tqkern.codebooks import Codebook, lloyd_max, lloyd_max_vllm
from tqkern.layouts import KVFormat, LloydMax, PagedLayout, layout_from_dict, layout_to_dict
from tqkern.rotations import _check_seed, rotation_for

__all__ = ["TQParams", "load_params", "orthogonality_tolerance", "save_params"]


def orthogonality_tolerance(d: int) -> float:
    """The largest ``max |ΠΠᵀ − I|`` that :class:`TQParams` accepts for a ``[d, d]`` rotation:
    ``max(1e-6, d · 2^-24)``.

    A float32 orthogonal matrix is what torch callers have, and one made in float32 by Householder
    QR (turboquant-vllm's Haar Π) loses orthogonality by a multiple of the float32 unit roundoff
    u = 2^-24 that grows with d (each of the d reflections adds O(u); Higham, *Accuracy and
    Stability of Numerical Algorithms*, §19.3). Measured with torch's float32 QR: 4e-7 (7u) at
    d = 16, 8.9e-7 at d = 256 and 1.01e-6 (17u) at d = 512, seed 42. The bound d·u (3.1e-5 at
    d = 512, 6.1e-5 at d = 1024) leaves room for that; the 1e-6 floor (17u) covers small d. A
    matrix within the bound scales norms by at most ~d·u, far below any codebook's resolution,
    while a wrong or transposed-wrong matrix is off by O(1).
    """
    return max(1e-6, d * 2.0**-24)


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.array(a, dtype=np.float64, copy=True, order="C")  # kernels index row-major
    a.setflags(write=False)
    return a


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TQParams:
    """Everything besides the bytes that decoding a :class:`KVFormat` needs.

    Attributes:
        format: the format these parameters belong to.
        rotation: float64 ``[D, D]`` orthogonal Π (``y = x @ Π``), shared by K and V; ``None``
            when no codec of the format is rotated.
        key_codebook / value_codebook: the Lloyd-Max codebook of a ``LloydMax`` codec, else
            ``None``.
        key_offset: float64 ``[num_kv_heads, D]`` per-head key offset μ (values exactly
            representable in float32; float32 subnormals are stored as zeros of their sign: with
            them the GPU kernels' codes differed from the oracle's, session 73), subtracted from every key before it
            is compressed, or ``None``. Attention is unchanged: q·(k − μ) = q·k − q·μ and softmax ignores the
            per-query constant.

    Build with :meth:`default` (tqkern's exact codebooks), :meth:`vllm` (vLLM's numerically
    solved codebooks, for codes byte-exact with vLLM) or pass your own matrices. The rotation
    convention is ``y = x @ Π``: a peer that writes ``y = x @ Qᵀ`` (turboquant-vllm) enters as
    ``rotation=Q.T``. A transposed matrix is just as orthogonal, so it cannot be detected here
    and silently gives wrong codes (``docs/layout.md`` shows each peer's import). Construction
    checks shapes, orthogonality (to :func:`orthogonality_tolerance`, which admits float32
    matrices) and that codebook bit widths match the codecs.
    """

    format: KVFormat
    rotation: np.ndarray | None
    key_codebook: Codebook | None = None
    value_codebook: Codebook | None = None
    key_offset: np.ndarray | None = None

    def __post_init__(self) -> None:
        fmt = self.format
        if not isinstance(fmt, KVFormat):
            raise TypeError(f"TQParams.format must be a KVFormat, got {type(fmt).__name__}")
        d = fmt.head_dim
        if fmt.rotated and self.rotation is None:
            raise ValueError("TQParams.rotation must be a [D, D] matrix for a rotated format, got None")
        if self.rotation is not None:  # (a format without rotation may carry one: rotate() uses it)
            rot = np.asarray(self.rotation)
            if rot.shape != (d, d):
                raise ValueError(f"TQParams.rotation must have shape ({d}, {d}), got {rot.shape}")
            err = np.max(np.abs(rot.astype(np.float64) @ rot.T.astype(np.float64) - np.eye(d)))
            tol = orthogonality_tolerance(d)
            if not err <= tol:
                raise ValueError(f"TQParams.rotation must be orthogonal (max |ΠΠᵀ − I| ≤ {tol:.3g} at D = {d}), "
                                 f"got {err:.3g}")
            object.__setattr__(self, "rotation", _readonly(rot))
        for side in ("key", "value"):
            codec = getattr(fmt, side)
            cb = getattr(self, f"{side}_codebook")
            if isinstance(codec, LloydMax):
                if not isinstance(cb, Codebook):
                    raise TypeError(f"TQParams.{side}_codebook must be a Codebook, got {type(cb).__name__}")
                if cb.bits != codec.bits:
                    raise ValueError(f"TQParams.{side}_codebook.bits must be {codec.bits}, got {cb.bits}")
            elif cb is not None:
                raise ValueError(f"TQParams.{side}_codebook must be None for a {codec.kind} codec, got a Codebook")
        if self.key_offset is not None:
            mu = np.asarray(self.key_offset)
            if mu.ndim != 2 or mu.shape[1] != d:
                raise ValueError(f"TQParams.key_offset must have shape [num_kv_heads, {d}], got {mu.shape}")
            if not np.all(np.isfinite(mu)):
                raise ValueError("TQParams.key_offset must be finite")
            with np.errstate(over="ignore"):
                mu32 = mu.astype(np.float32)
            if not np.all(np.isfinite(mu32)):
                raise ValueError(f"TQParams.key_offset must lie within float32's range (|μ| ≤ 3.4e38), "
                                 f"got max |μ| = {float(np.max(np.abs(mu))):.3g}")
            tiny = np.abs(mu32) < np.finfo(np.float32).tiny
            mu32 = np.where(tiny, np.copysign(np.float32(0.0), mu32), mu32).astype(np.float32)
            object.__setattr__(self, "key_offset", _readonly(mu32))

    @classmethod
    def default(cls, format: KVFormat, *, seed: int = 0, key_offset=None) -> TQParams:
        """The format's own rotation (``format.rotation`` with ``seed``) and Lloyd-Max codebooks
        (``lloyd_max(bits, head_dim, codec.distribution)``, the exact optimum).

        For vLLM's presets this is vLLM's rotation but not exactly its codebook: vLLM solves
        numerically, and its centroids differ from the exact ones by up to ~7e-4 relative, so a
        few key codes per thousand differ from vLLM's. Use :meth:`vllm` for vLLM's bytes."""
        if not isinstance(format, KVFormat):
            raise TypeError(f"format must be a KVFormat (KVFormat.preset(name, head_dim)), got {type(format).__name__}")
        _check_seed(seed)
        d = format.head_dim
        rot = rotation_for(format.rotation, d, seed) if format.rotated else None
        cbs = {}
        for side in ("key", "value"):
            codec = getattr(format, side)
            cbs[f"{side}_codebook"] = (
                lloyd_max(codec.bits, d, codec.distribution) if isinstance(codec, LloydMax) else None
            )
        return cls(format=format, rotation=rot, key_offset=key_offset, **cbs)

    @classmethod
    def vllm(cls, format: KVFormat, *, key_offset=None) -> TQParams:
        """vLLM's parameters for ``format``: the unsigned Sylvester Hadamard / √D (vLLM's Π, symmetric,
        so its ``x @ Π`` and ``x @ Πᵀ`` agree) and, for every Lloyd-Max codec,
        :func:`~tqkern.codebooks.lloyd_max_vllm` (vLLM's float32 centroids and float32 midpoints,
        bit for bit). With a ``turboquant_*`` preset the codes then match vLLM's store except where
        a rotated coordinate lies within float32 rounding of a boundary.

        Args:
            format: a format whose rotated codecs use ``rotation="hadamard"`` and whose Lloyd-Max
                codecs use ``distribution="gaussian"`` (vLLM's ``turboquant_*`` presets). vLLM
                only has power-of-two D; for other D the rotation is tqkern's block Hadamard.
            key_offset: as in :meth:`default`.

        Raises:
            ValueError: ``format`` rotates with anything but the unsigned Hadamard, or a Lloyd-Max
                codec is not Gaussian.
        """
        if not isinstance(format, KVFormat):
            raise TypeError(f"format must be a KVFormat, got {type(format).__name__}")
        if format.rotated and format.rotation != "hadamard":
            raise ValueError(f"format.rotation must be 'hadamard' (vLLM's unsigned Hadamard) for TQParams.vllm, "
                             f"got {format.rotation!r}")
        d = format.head_dim
        cbs = {}
        for side in ("key", "value"):
            codec = getattr(format, side)
            if isinstance(codec, LloydMax) and codec.distribution != "gaussian":
                raise ValueError(f"format.{side}.distribution must be 'gaussian' (vLLM solves N(0, 1/D)) for "
                                 f"TQParams.vllm, got {codec.distribution!r}")
            cbs[f"{side}_codebook"] = lloyd_max_vllm(codec.bits, d) if isinstance(codec, LloydMax) else None
        rot = rotation_for("hadamard", d, 0) if format.rotated else None
        return cls(format=format, rotation=rot, key_offset=key_offset, **cbs)

    def with_key_offset(self, key_offset) -> TQParams:
        return TQParams(format=self.format, rotation=self.rotation, key_codebook=self.key_codebook,
                        value_codebook=self.value_codebook, key_offset=key_offset)


_SAVE_VERSION = 1


def save_params(path: Union[str, os.PathLike], params: Sequence[TQParams]) -> None:
    """Write a sequence of :class:`TQParams` (e.g. one per decoder layer) to ``path`` as one
    NumPy ``.npz`` file: each entry's format (the JSON of ``layout_to_dict(...)["format"]``),
    rotation, codebooks (centroids, boundaries, dim, distribution, distortion) and key offset μ,
    every array exactly as held. :func:`load_params` reads it back equal, field by field."""
    params = list(params)
    for i, p in enumerate(params):
        if not isinstance(p, TQParams):
            raise TypeError(f"params[{i}] must be a TQParams, got {type(p).__name__}")
    meta = []
    arrays = {}
    for i, p in enumerate(params):
        fmt = layout_to_dict(PagedLayout(format=p.format, num_kv_heads=1, block_size=16))["format"]
        entry = {"format": fmt, "codebooks": {}}
        if p.rotation is not None:
            arrays[f"rotation_{i}"] = p.rotation
        if p.key_offset is not None:
            arrays[f"key_offset_{i}"] = p.key_offset
        for side in ("key", "value"):
            cb = getattr(p, f"{side}_codebook")
            if cb is not None:
                arrays[f"{side}_centroids_{i}"] = cb.centroids
                arrays[f"{side}_boundaries_{i}"] = cb.boundaries
                entry["codebooks"][side] = {"dim": cb.dim, "distribution": cb.distribution,
                                            "distortion": cb.distortion}
        meta.append(entry)
    header = json.dumps({"tqkern_params": _SAVE_VERSION, "entries": meta})
    with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a bare name
        np.savez(f, header=np.array(header), **arrays)


def load_params(path: Union[str, os.PathLike]) -> tuple[TQParams, ...]:
    """The :class:`TQParams` that :func:`save_params` wrote to ``path`` (validated again on
    construction). Raises ``ValueError`` for a file that :func:`save_params` did not write."""
    with np.load(path, allow_pickle=False) as z:
        if "header" not in z.files:
            raise ValueError(f"path must be a file written by tqkern.params.save_params, got {str(path)!r} "
                             f"(no header)")
        header = json.loads(str(z["header"]))
        if header.get("tqkern_params") != _SAVE_VERSION:
            raise ValueError(f"path must hold tqkern params version {_SAVE_VERSION}, got "
                             f"{header.get('tqkern_params')!r}")
        out = []
        for i, entry in enumerate(header["entries"]):
            fmt = layout_from_dict({"format": entry["format"], "num_kv_heads": 1, "block_size": 16,
                                    "arrangement": "slot"}).format
            cbs = {}
            for side in ("key", "value"):
                info = entry["codebooks"].get(side)
                cb = None
                if info is not None:
                    cb = Codebook.from_centroids(z[f"{side}_centroids_{i}"], dim=info["dim"],
                                                 distribution=info["distribution"],
                                                 boundaries=z[f"{side}_boundaries_{i}"])
                    cb = dataclasses.replace(cb, distortion=float(info["distortion"]))
                cbs[f"{side}_codebook"] = cb
            rot = z[f"rotation_{i}"] if f"rotation_{i}" in z.files else None
            mu = z[f"key_offset_{i}"] if f"key_offset_{i}" in z.files else None
            out.append(TQParams(format=fmt, rotation=rot, key_offset=mu, **cbs))
    return tuple(out)
