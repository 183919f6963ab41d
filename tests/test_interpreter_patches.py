"""The root conftest's faster interpreter (``_skip_nested_language_patches``): device functions
called within a launch (our helpers, ``tl.sum``) still run under the interpreted language, in
every program, and the launch still undoes its patches."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="Triton's interpreter only")


@triton.jit
def _twice_sum(x):
    return tl.sum(x * 2, axis=0)


@triton.jit
def _rows_kernel(x_ptr, out_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, N)
    tl.store(out_ptr + row, _twice_sum(tl.load(x_ptr + row * N + offs)) + tl.max(offs, axis=0))


def test_device_calls_within_a_launch():
    from triton.runtime import interpreter as interp

    if os.environ.get("TQKERN_FAST_INTERPRETER", "1") != "0":
        assert getattr(interp, "_tqkern_nested_patches_skipped", False)
    x = torch.arange(24, dtype=torch.float32).reshape(3, 8)
    out = torch.zeros(3)
    for _ in range(2):  # (a second launch: patched anew, skipped anew)
        _rows_kernel[(3,)](x, out, N=8)
        assert out.tolist() == (2 * x.sum(1) + 7).tolist()
    assert tl.core.is_builtin(tl.arange) and tl.core.is_builtin(tl.program_id)  # the launch's patches undone
