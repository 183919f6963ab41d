"""The public API is pinned: names in ``__all__`` change only on purpose."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from importlib import metadata

import pytest

import tqkern
import tqkern.reference

TQKERN_ALL = [
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

REFERENCE_ALL = [
    "rotate",
    "quantize",
    "dequantize",
    "pack",
    "unpack",
    "compress",
    "decompress",
    "gather_slots",
    "gather_sequences",
    "store",
    "write_slots",
    "paged_decode",
    "prefill",
    "int8_prefill",
    "attention",
]

# Where each oracle is defined (and specified): tqkern/ops/<op>/reference.py.
ORACLE_HOME = {
    "rotate": "rotate", "quantize": "quantize", "dequantize": "quantize", "pack": "pack",
    "unpack": "pack", "compress": "compress", "decompress": "decompress",
    "gather_slots": "decompress", "gather_sequences": "decompress", "store": "store",
    "write_slots": "store", "paged_decode": "paged_decode", "prefill": "prefill",
    "int8_prefill": "int8_prefill", "attention": "attention",
}


def test_tqkern_all_is_pinned():
    assert tqkern.__all__ == TQKERN_ALL
    for name in TQKERN_ALL:
        assert hasattr(tqkern, name), name
    assert isinstance(tqkern.reference, types.ModuleType)


def test_reference_all_is_pinned():
    assert tqkern.reference.__all__ == REFERENCE_ALL
    assert set(ORACLE_HOME) == set(REFERENCE_ALL)
    for name in REFERENCE_ALL:
        fn = getattr(tqkern.reference, name)
        assert callable(fn), name
        home = importlib.import_module(f"tqkern.ops.{ORACLE_HOME[name]}.reference")
        assert fn is getattr(home, name), name
        assert fn.__doc__ and fn.__doc__.strip(), f"{name} has no docstring"


def test_star_import_gives_exactly_all():
    ns: dict = {}
    exec("from tqkern import *", ns)
    assert set(ns) - {"__builtins__"} == set(TQKERN_ALL)


def test_version_matches_installed_metadata():
    try:
        installed = metadata.version("tqkern")
    except metadata.PackageNotFoundError:
        pytest.skip("tqkern is not installed (run from a source tree)")
    assert tqkern.__version__ == installed


def test_tqkern_torch_all_exists():
    import tqkern_torch

    assert isinstance(tqkern_torch.__all__, list)
    for name in tqkern_torch.__all__:
        assert hasattr(tqkern_torch, name), name


def test_import_needs_no_torch_or_hypothesis():
    code = (
        "import sys, tqkern, tqkern.reference\n"
        "bad = sorted(m for m in ('torch', 'hypothesis') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_tqkern_torch_exports_paged_decode():
    import tqkern_torch
    import tqkern_torch.attention

    assert "paged_decode" in tqkern_torch.__all__
    assert tqkern_torch.paged_decode is tqkern_torch.attention.paged_decode


def test_tqkern_torch_exports_prefill():
    import tqkern_torch
    import tqkern_torch.prefill

    assert "prefill" in tqkern_torch.__all__
    # the function, not its module of the same name (importing the module must not rebind it)
    assert callable(tqkern_torch.prefill) and tqkern_torch.prefill.__module__ == "tqkern_torch.prefill"


def test_import_tqkern_torch_registers_every_op():
    # A fresh interpreter: nothing but `import tqkern_torch` may be needed before the ops resolve.
    code = (
        "import torch, tqkern_torch\n"
        "for name in ('store', 'decompress', 'paged_decode', 'prefill'):\n"
        "    op = getattr(torch.ops.tqkern, name)\n"
        "    assert isinstance(op, torch._ops.OpOverloadPacket), (name, type(op))\n"
        "from tqkern_torch import paged_decode, prefill\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
