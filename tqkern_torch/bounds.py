"""A bounds checker for Triton's CPU interpreter: :func:`interpreter_bounds_checked`.

tqkern's rule is that no index value, however wrong, makes a kernel read or write outside its
tensors. On a GPU a stray access shows up, if at all, as an illegal-address fault long after the
launch, and only when it leaves the allocator's segment. In the interpreter every load, store and
atomic is a NumPy gather or scatter over raw addresses, so each can be checked: inside
:func:`interpreter_bounds_checked`, every active lane (its mask set) of every ``tl.load``,
``tl.store`` and ``tl.atomic_*`` read-modify-write of a launch must fall, with all the bytes it
touches, inside the view of one of that launch's tensor arguments (its ``data_ptr`` over its
shape and strides, not its whole storage: a kernel writing past one view of a shared workspace
into the next is caught too). The first violation raises :class:`OutOfBounds` (the interpreter
reports it as an ``InterpreterError`` naming it), with the access kind, the tensor argument
nearest to the address and the program's grid index.

Tensor-descriptor (TMA) loads and stores are checked as the interpreter runs them: through the
same masked accesses, the box's part outside the descriptor's shape masked off (zero-filled, as
the hardware does), so a descriptor whose shape or strides overstate its tensor is caught. Not
checked: launches whose tensors are not on the CPU (the interpreter copies CUDA tensors to the
host first). The checker patches Triton's interpreter (Triton 3.6 to 3.9
internals, private API) for the duration of the ``with`` block; it is a test tool.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import numpy as np
import torch

__all__ = ["OutOfBounds", "interpreter_bounds_checked"]


class OutOfBounds(AssertionError):
    """An interpreted kernel touched memory outside its launch's tensor arguments."""


_state = threading.local()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``[first byte, one past the last byte)`` of a tensor view."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    lo = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)
    es = t.element_size()
    return t.data_ptr() + lo * es, t.data_ptr() + (hi + 1) * es


def _tensors(value, name: str):
    """``(name, tensor)`` of the tensors an argument holds (itself, a tuple's items, a descriptor's base)."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{name}[{i}]")
    elif isinstance(getattr(value, "base", None), torch.Tensor):
        yield f"{name}.base", value.base


def _check(kind: str, addrs: np.ndarray, mask, nbytes: int) -> None:
    ranges = getattr(_state, "ranges", None)
    if ranges is None:  # (not a checked launch: a tensor off the CPU, or outside the block)
        return
    a = np.asarray(addrs, dtype=np.uint64)
    if mask is not None:
        a = a[np.broadcast_to(np.asarray(mask, dtype=bool), a.shape)]
    a = a.ravel()
    if not a.size:
        return
    lo_a, hi_a = int(a.min()), int(a.max()) + nbytes
    if any(lo <= lo_a and hi_a <= hi for lo, hi, _ in ranges):  # (the usual case: one tensor holds them all)
        return
    ok = np.zeros(a.shape, dtype=bool)
    for lo, hi, _ in ranges:
        ok |= (a >= np.uint64(lo)) & (a + np.uint64(nbytes) <= np.uint64(hi))
    if ok.all():
        return
    first = int(a[~ok][0])
    name, off, size = min(((n, first - lo, hi - lo) for lo, hi, n in ranges), key=lambda x: abs(x[1]),
                          default=("(no tensor argument)", 0, 0))
    from triton.runtime import interpreter

    raise OutOfBounds(f"{kind} of {nbytes}-byte elements outside the launch's tensors: {int((~ok).sum())} "
                      f"lanes; the first at byte {off} of '{name}' ({size} bytes); program "
                      f"{interpreter.interpreter_builder.grid_idx}")


@contextlib.contextmanager
def interpreter_bounds_checked():
    """Within the block, every interpreted launch checks its memory accesses (module docstring).
    Re-entrant; restores the interpreter on exit."""
    from triton.runtime import interpreter as interp

    builder, executor = interp.InterpreterBuilder, interp.GridExecutor
    if getattr(builder, "_tqkern_bounds", False):  # already checked by an outer block
        yield
        return
    saved = (builder.create_masked_load, builder.create_masked_store, builder.create_atomic_rmw, executor.__call__)
    load0, store0, rmw0, call0 = saved

    def load(self, ptrs, mask, other, *rest, **kw):
        _check("load", ptrs.data, mask.data, np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize)
        return load0(self, ptrs, mask, other, *rest, **kw)

    def store(self, ptrs, value, mask, *rest, **kw):
        _check("store", ptrs.data, mask.data, value.data.dtype.itemsize)
        return store0(self, ptrs, value, mask, *rest, **kw)

    def rmw(self, op, ptr, val, mask, *rest, **kw):
        _check("atomic", ptr.data, mask.data, val.data.dtype.itemsize)
        return rmw0(self, op, ptr, val, mask, *rest, **kw)

    def call(self, *args, **kwargs):
        spec = inspect.getfullargspec(self.fn)
        named = dict(zip(spec.args, args))
        named.update((k, v) for k, v in kwargs.items() if k in spec.args or k in spec.kwonlyargs)
        found = [(n, t) for k, v in named.items() for n, t in _tensors(v, k)]
        outer = getattr(_state, "ranges", None)
        _state.ranges = ([(*_span(t), n) for n, t in found] if all(t.device.type == "cpu" for _, t in found)
                         else None)
        try:
            return call0(self, *args, **kwargs)
        finally:
            _state.ranges = outer

    builder.create_masked_load, builder.create_masked_store, builder.create_atomic_rmw = load, store, rmw
    executor.__call__ = call
    builder._tqkern_bounds = True
    try:
        yield
    finally:
        builder.create_masked_load, builder.create_masked_store, builder.create_atomic_rmw = saved[:3]
        executor.__call__ = saved[3]
        builder._tqkern_bounds = False
