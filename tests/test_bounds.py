"""The interpreter's bounds checker (:mod:`tqkern_torch.bounds`) catches what it must and nothing else."""

from __future__ import annotations

import pytest
import torch

from tqkern_torch._validate import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="the checker patches Triton's interpreter (TRITON_INTERPRET=1)")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from tqkern_torch.bounds import interpreter_bounds_checked  # noqa: E402


@triton.jit
def _copy(x, y, n, LOAD_EXTRA: tl.constexpr, STORE_EXTRA: tl.constexpr):
    i = tl.arange(0, 16)
    v = tl.load(x + i, mask=i < n + LOAD_EXTRA, other=0.0)
    tl.store(y + i, v, mask=i < n + STORE_EXTRA)


@triton.jit
def _count(c, n, EXTRA: tl.constexpr):
    i = tl.arange(0, 16)
    tl.atomic_add(c + i, 1, mask=i < n + EXTRA)


def _views():
    """A 10-element view at the start of a 32-element buffer (the rest of the buffer is another
    tensor's memory as far as the kernel knows) and a 10-element output."""
    buf = torch.arange(32, dtype=torch.float32)
    return buf, buf[:10], torch.zeros(10)


def test_in_bounds_and_masked_off_lanes_pass():
    buf, x, y = _views()
    with interpreter_bounds_checked():
        _copy[(1,)](x, y, 10, LOAD_EXTRA=0, STORE_EXTRA=0)  # lanes 10..15 are masked off: not accesses
    assert torch.equal(y, buf[:10])


@pytest.mark.parametrize("load_extra,store_extra,what", [(1, 0, "load"), (0, 1, "store")])
def test_one_element_past_a_view_is_caught(load_extra, store_extra, what):
    """One lane past a view raises, although it stays inside the buffer the view belongs to."""
    _, x, y = _views()
    with interpreter_bounds_checked(), pytest.raises(Exception, match=f"{what} of 4-byte elements outside") as err:
        _copy[(1,)](x, y, 10, LOAD_EXTRA=load_extra, STORE_EXTRA=store_extra)
    assert ("'x'" if what == "load" else "'y'") in str(err.value), str(err.value)
    assert "byte 40" in str(err.value), str(err.value)


def test_atomics_are_checked():
    c = torch.zeros(20, dtype=torch.int32)[:12]
    with interpreter_bounds_checked():
        _count[(1,)](c, 12, EXTRA=0)
        with pytest.raises(Exception, match="atomic of 4-byte elements outside"):
            _count[(1,)](c, 12, EXTRA=1)


@pytest.mark.bounds_unchecked
def test_the_interpreter_is_restored_after_the_block():
    _, x, y = _views()
    with interpreter_bounds_checked():
        with interpreter_bounds_checked():  # re-entrant
            pass
        with pytest.raises(Exception, match="outside"):  # the inner exit left the outer check on
            _copy[(1,)](x, y, 10, LOAD_EXTRA=1, STORE_EXTRA=0)
    _copy[(1,)](x, y, 10, LOAD_EXTRA=1, STORE_EXTRA=0)  # unchecked again: reads the buffer's 11th float
    assert float(y[9]) == 9.0
