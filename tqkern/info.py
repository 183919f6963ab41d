"""The report of ``tqkern info``: the preset formats at a head_dim (bytes, fields, codecs) and a
demo through the NumPy oracles (random K/V compressed and decompressed with every preset, the
relative reconstruction error), and the environment (versions, CUDA device). NumPy and
``tqkern`` only; torch is reported where it imports, never needed."""

from __future__ import annotations

import sys
from importlib import metadata

import numpy as np

import tqkern
from tqkern.layouts import FP8, PRESETS, KVFormat, LloydMax, Raw, Uniform
from tqkern.ops.compress.reference import codec_inputs
from tqkern.params import TQParams
from tqkern.reference import compress, decompress

__all__ = ["describe_codec", "info_report", "render_info"]

_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def describe_codec(codec) -> str:
    """A short human-readable name of a codec, e.g. ``"lloyd-max 4b gaussian, norm fp16, nc decode"``."""
    if isinstance(codec, LloydMax):
        return (f"lloyd-max {codec.bits}b {codec.distribution}, norm {_SHORT[codec.norm_dtype]}, "
                f"nc {codec.norm_correction}")
    if isinstance(codec, Uniform):
        rot = ", rotated" if codec.rotated else ""
        return f"uniform {codec.bits}b, scale/zero {_SHORT[codec.param_dtype]}{rot}"
    if isinstance(codec, FP8):
        return "fp8 e4m3" + (", rotated" if codec.rotated else "")
    if isinstance(codec, Raw):
        return _SHORT[codec.dtype]
    raise TypeError(f"codec must be LloydMax, Uniform, FP8 or Raw, got {type(codec).__name__}")


def _import_torch():
    """``torch``, or ``None`` where importing it fails (not installed, or broken)."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - ImportError, or e.g. OSError from a broken CUDA build
        return None
    return torch


def _environment() -> dict:
    """Versions of Python, tqkern, NumPy, Triton and torch, and the name of CUDA device 0.

    A distribution that is not installed is ``None``. torch is ``None`` (and so is ``cuda``) where
    ``import torch`` fails, installed or not: ``info`` only reports it, never needs it.
    """
    env = {"python": sys.version.split()[0]}
    for dist in ("tqkern", "numpy", "triton"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = None
    env["tqkern"] = env["tqkern"] or tqkern.__version__
    torch = _import_torch()
    env["torch"] = None if torch is None else str(torch.__version__)
    try:
        env["cuda"] = torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a broken driver must not break `tqkern info`
        env["cuda"] = None
    return env


def _format_row(name: str, fmt: KVFormat) -> dict:
    packed = any(c.packed for c in (fmt.key, fmt.value))
    return {
        "preset": name,
        "slot_bytes": fmt.slot_bytes,
        "key_bytes": fmt.key_bytes,
        "value_bytes": fmt.value_bytes,
        "pad_bytes": fmt.pad_bytes,
        "compression": fmt.compression,
        "bit_order": fmt.bit_order if packed else None,
        "rotation": fmt.rotation if fmt.rotated else None,
        "key": describe_codec(fmt.key),
        "value": describe_codec(fmt.value),
        "fields": [{"name": q, "offset": off, "nbytes": f.nbytes, "dtype": f.dtype}
                   for q, f, off in fmt.slot_fields()],
    }


def _rel_error(approx: np.ndarray, exact: np.ndarray) -> float:
    den = float(np.linalg.norm(exact))
    return float(np.linalg.norm(approx - exact)) / den if den > 0 else float("nan")


def info_report(head_dim: int = 128, *, num_tokens: int = 256, num_kv_heads: int = 2,
                seed: int = 0) -> dict:
    """Everything ``tqkern info`` prints, as a JSON-serialisable dict.

    The demo draws key and value ``[num_tokens, num_kv_heads, head_dim]`` i.i.d. N(0, 1) from
    ``numpy.random.default_rng(seed)``, rounds them to fp16, compresses them with every preset
    (``TQParams.default(format, seed=seed)``, no key offset) and decompresses with
    ``rotate_back=True``. Each error is ``‖x̂ − x‖ / ‖x‖`` (Frobenius norm over all tokens and
    heads), x being what the codec was given: the key minus its offset μ (μ = 0 here) and the value.

    Raises:
        ValueError: if no preset can be built at ``head_dim`` (e.g. an odd head_dim).
    """
    formats = {name: KVFormat.preset(name, head_dim) for name in PRESETS}
    rng = np.random.default_rng(seed)
    shape = (num_tokens, num_kv_heads, head_dim)
    key = rng.standard_normal(shape).astype(np.float16)
    value = rng.standard_normal(shape).astype(np.float16)
    errors = {}
    for name, fmt in formats.items():
        params = TQParams.default(fmt, seed=seed)
        k_in, v_in = codec_inputs(key, value, params)
        k_hat, v_hat = decompress(compress(key, value, params), params, rotate_back=True)
        errors[name] = {"key": _rel_error(k_hat, k_in), "value": _rel_error(v_hat, v_in)}
    return {
        "environment": _environment(),
        "head_dim": head_dim,
        "fp16_bytes": 4 * head_dim,
        "formats": [_format_row(name, fmt) for name, fmt in formats.items()],
        "demo": {"num_tokens": num_tokens, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                 "dtype": "float16", "distribution": "normal(0, 1)", "seed": seed,
                 "errors": errors},
    }


def render_info(report: dict) -> str:
    """The text form of :func:`info_report` (ASCII only)."""
    env = report["environment"]
    versions = " | ".join(f"{k} {env[k] or 'not installed'}" for k in ("tqkern", "numpy", "triton"))
    versions += f" | torch {env['torch'] or 'not available'}"
    lines = [f"{versions} | CUDA: {env['cuda'] or 'none'}", ""]
    d = report["head_dim"]
    lines.append(f"KV formats at head_dim={d}: bytes per token per KV head, K and V together, padding "
                 f"included (fp16 K+V: {report['fp16_bytes']} B)")
    rows = [(r["preset"], str(r["slot_bytes"]), f"{r['compression']:.2f}x", r["bit_order"] or "-",
             r["rotation"] or "-", r["key"], r["value"]) for r in report["formats"]]
    titles = ("preset", "bytes", "vs fp16", "bit order", "rotation", "key", "value")
    widths = [max(len(x) for x in col) for col in zip(titles, *rows)]
    right = (False, True, True, False, False, False, False)

    def fmt_row(cells) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    lines += [fmt_row(titles), "-" * len(fmt_row(titles))]
    lines += [fmt_row(r) for r in rows]
    lines.append("nc = norm correction: none; decode (x_hat = n * c/|c|, divisor computed at decode); "
                 "stored (gain n/|c| stored at write)")
    demo = report["demo"]
    lines += [
        "",
        f"Demo: random K/V, {demo['num_tokens']} tokens x {demo['num_kv_heads']} KV heads x {d}, "
        f"fp16 N(0, 1), seed {demo['seed']}, through the NumPy oracles (compress, decompress).",
        "Relative error |x_hat - x| / |x| over all tokens and heads, in original coordinates:",
    ]
    head = f"{'preset':<20}{'K error':>9}{'V error':>9}"
    lines += [head, "-" * len(head)]
    for name, e in demo["errors"].items():
        lines.append(f"{name:<20}{e['key']:>9.4f}{e['value']:>9.4f}")
    return "\n".join(lines)
