"""Cheap repeated launches of one Triton kernel with fixed constexprs: :class:`KernelLauncher`.

``kernel[grid](*args, **constexprs)`` binds and specializes every argument on every call
(~40 constexprs for the decode kernels: tens of µs of host time per launch, measured on the H100
host, ``docs/performance.md`` "Host overhead"). A launcher does that work once per
*specialization* of its runtime arguments — what Triton compiles for: each tensor's dtype and
whether its address is 16-byte aligned, each int's width and whether it is 1 or a multiple of
16 — and afterwards calls the compiled kernel's launcher directly with the same argument list
Triton itself would pass. Any argument that could change what Triton compiles changes the key
(a miss goes through Triton's own path), so a direct launch never runs a kernel compiled for
other arguments. Under the interpreter every call goes through Triton.
"""

from __future__ import annotations

import os

import torch
from triton import knobs
from triton.runtime.driver import driver

__all__ = ["BoundedCache", "KernelLauncher", "current_stream"]

_I32 = 1 << 31


class BoundedCache(dict):
    """A dict of at most ``maxsize`` entries: :meth:`put` drops the oldest (insertion order) to
    make room. The launch caches (decode plans, store launchers) are these: shapes change as
    batches and block tables grow, so an unbounded one would grow for the life of a server."""

    def __init__(self, maxsize: int):
        super().__init__()
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize

    def put(self, key, value):
        """Store ``value`` under ``key`` (the oldest entry goes first when full); returns it."""
        if key not in self and len(self) >= self.maxsize:
            del self[next(iter(self))]
        self[key] = value
        return value


def _spec(a):
    """The part of one runtime argument that Triton's specialization looks at (conservative:
    a finer key only costs a lookup through Triton)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return bool, a
    if isinstance(a, int):
        return a == 1, a % 16 == 0, -_I32 <= a < _I32, 0 <= a < 2 * _I32
    if isinstance(a, float):
        return float
    return type(a), a  # (None, strings: part of the key as they are)


def current_stream():
    """The stream Triton's own launch would use (the current torch stream of the current device)."""
    return driver.active.get_current_stream(driver.active.get_current_device())


class KernelLauncher:
    """Launch ``fn`` (a ``@triton.jit`` function) on ``grid`` with fixed ``constexprs`` and
    launch ``options`` (``num_warps``, ``num_stages``, ``maxnreg``): call it with the runtime
    arguments only, in the kernel's order. ``prepare``: optional callable run once on each
    compiled kernel before its first launch (e.g. sizing dynamic shared memory). Compiled kernels
    are kept per specialization key in the launcher (its owner, a decode plan, holds it).

    A call whose non-tensor arguments equal the previous call's, whose tensors have the previous
    call's dtypes and are all 16-byte aligned (as the previous call's were) reuses the previous
    kernel without building the key (the same key would result); any other call builds it."""

    __slots__ = ("fn", "grid", "kwargs", "prepare", "_slots", "_defaults", "_tail", "_compiled", "_direct", "_last")

    def __init__(self, fn, grid, constexprs: dict, prepare=None, **options):
        grid = tuple(int(x) for x in grid)
        if not 1 <= len(grid) <= 3 or min(grid) < 1:
            raise ValueError(f"grid must be 1 to 3 positive ints, got {grid}")
        self.fn, self.grid, self.prepare = fn, grid + (1,) * (3 - len(grid)), prepare
        self.kwargs = dict(constexprs, **options)
        # The full argument list Triton's own launch passes: runtime arguments where the
        # signature has them, the constexprs (given or defaulted) elsewhere.
        slots, defaults = [], []
        params = getattr(fn, "params", None)
        names = getattr(fn, "arg_names", None)
        if params is not None and names is not None:
            for p in params:
                if p.name in constexprs:
                    slots.append(None)
                    defaults.append(constexprs[p.name])
                elif p.is_constexpr:
                    slots.append(None)
                    defaults.append(p.default)
                else:
                    slots.append(len([s for s in slots if s is not None]))
                    defaults.append(None)
        self._slots, self._defaults = tuple(slots), tuple(defaults)
        # runtime parameters first, constexprs after (every kernel here): the full list is the
        # call's arguments followed by this tail
        n_rt = sum(s is not None for s in slots)
        self._tail = tuple(defaults[n_rt:]) if all(s == i for i, s in enumerate(slots[:n_rt])) and \
            all(s is None for s in slots[n_rt:]) else None
        self._compiled: dict = {}
        self._direct = params is not None and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        self._last = None  # (tensor positions, their dtypes, other positions, their values, kernel)

    def __call__(self, *args) -> None:
        self.launch(current_stream(), *args) if self._direct else self.fn[self.grid](*args, **self.kwargs)

    def launch(self, stream, *args) -> None:
        """:meth:`__call__` on ``stream`` (a raw CUDA stream handle, e.g. the current one once for
        several launches)."""
        if not self._direct:
            self.fn[self.grid](*args, **self.kwargs)
            return
        kernel = self._reuse(args)
        if kernel is None:
            kernel = self.compiled(*args)
            tpos = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            opos = tuple(i for i in range(len(args)) if i not in tpos)
            aligned = all(args[i].data_ptr() % 16 == 0 for i in tpos)
            self._last = (tpos, tuple(args[i].dtype for i in tpos), opos, tuple(args[i] for i in opos),
                          kernel) if aligned else None
        if self._tail is not None:
            full = args + self._tail
        else:
            full = [d if s is None else args[s] for s, d in zip(self._slots, self._defaults)]
        g = self.grid
        meta = None if knobs.runtime.launch_enter_hook is None else kernel.launch_metadata(g, stream, *full)
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, meta,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *full)

    def _reuse(self, args):
        """The previous call's kernel if ``args`` would give its key (see the class), else ``None``."""
        last = self._last
        if last is None or len(args) != len(last[1]) + len(last[3]):
            return None
        tpos, dtypes, opos, others, kernel = last
        bits = 0
        for i in tpos:
            a = args[i]
            if type(a) is not torch.Tensor:
                return None
            bits |= a.data_ptr()
        if bits & 15 or tuple([args[i].dtype for i in tpos]) != dtypes:
            return None
        vals = tuple([args[i] for i in opos])
        if vals != others or tuple(map(type, vals)) != tuple(map(type, others)):
            return None
        return kernel

    def compiled(self, *args):
        """The compiled kernel this launcher runs for ``args`` (compiling it if needed), e.g. for
        its registers and shared memory."""
        key = tuple(_spec(a) for a in args)
        kernel = self._compiled.get(key)
        if kernel is None:
            kernel = self.fn.warmup(*args, grid=self.grid, **self.kwargs)
            if self.prepare is not None:
                self.prepare(kernel)  # (before the binary loads)
            self._compiled[key] = kernel
        kernel._init_handles()  # (loads the binary once: the launcher and ``function``)
        return kernel
