"""tqkern.ops.launch.KernelLauncher: the argument list and specialization key of a direct launch,
checked against a stand-in for a Triton kernel (no GPU needed)."""


import pytest
import torch

import tqkern.ops.launch as launch


class _Param:
    def __init__(self, name, constexpr=False, default=None):
        self.name, self.is_constexpr, self.default = name, constexpr, default


class _Compiled:
    """Records launches like a compiled Triton kernel's launcher would see them."""

    def __init__(self, log):
        self.log, self.function, self.packed_metadata, self.inits = log, "fn", ("meta",), 0

    def _init_handles(self):
        self.inits += 1

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *args):
        self.log.append(("direct", (g0, g1, g2), stream, args))


class _Fn:
    """A @triton.jit stand-in: ``kern(x_ptr, n, BLOCK: constexpr, FLAG: constexpr = 7, y_ptr)``."""

    def __init__(self):
        self.params = [_Param("x_ptr"), _Param("n"), _Param("BLOCK", True), _Param("FLAG", True, 7), _Param("y_ptr")]
        self.arg_names = [p.name for p in self.params]
        self.log, self.compiles = [], []

    def warmup(self, *args, grid, **kwargs):
        self.compiles.append((args, kwargs))
        return _Compiled(self.log)

    def __getitem__(self, grid):
        return lambda *a, **k: self.log.append(("triton", grid, a, k))


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(launch, "current_stream", lambda: "stream")
    fn = _Fn()
    lk = launch.KernelLauncher(fn, (4, 2), {"BLOCK": 64}, num_warps=4)
    lk._direct = True  # (the interpreter otherwise takes Triton's own path)
    return fn, lk


def test_direct_launch_passes_triton_s_full_argument_list(direct):
    fn, lk = direct
    x, y = torch.zeros(8), torch.zeros(8)
    lk(x, 5, y)
    lk(x, 5, y)
    assert len(fn.compiles) == 1 and fn.compiles[0][1] == {"BLOCK": 64, "num_warps": 4}
    assert [e[:3] for e in fn.log] == [("direct", (4, 2, 1), "stream")] * 2
    assert fn.log[0][3] == (x, 5, 64, 7, y)  # runtime args in place, constexprs (given and default) between


def test_a_different_specialization_compiles_again(direct):
    """Whatever Triton would specialize on changes the key: an int equal to 1 or a multiple of 16,
    a tensor's dtype or 16-byte alignment; other values reuse the compiled kernel."""
    fn, lk = direct
    x = torch.zeros(64)
    for args in [(x, 5, x), (x, 7, x), (x, 1, x), (x, 32, x), (x, 48, x), (x.half(), 5, x), (x[1:], 5, x),
                 (x, 2 ** 40, x)]:
        lk(*args)
    assert len(fn.compiles) == 6  # 5/7 share; 32/48 share; 1, fp16, misaligned and int64 each compile


def test_a_repeated_call_reuses_the_kernel_only_where_its_key_would_match(direct):
    """The reuse path (same non-tensor values and types, same dtypes, every tensor aligned)
    launches the new tensors; any other call goes through the key."""
    fn, lk = direct
    x, y, x2, y2 = torch.zeros(64), torch.zeros(64), torch.zeros(64), torch.zeros(64)
    lk(x, 5, y)
    lk(x2, 5, y2)
    assert len(fn.compiles) == 1 and fn.log[-1][3] == (x2, 5, 64, 7, y2)
    for args in [(x, True, y), (x, 1.0, y), (x, 1, y), (x[4:], 1, y), (x, 1, y.double())]:
        lk(*args)
        assert fn.log[-1][3][0] is args[0] and fn.log[-1][3][1] is args[1] and fn.log[-1][3][4] is args[2]
    # True, 1.0 and 1 are different keys (bool, float, int equal to 1); x[4:] is 16-byte aligned
    # (reused, same key); a float64 y is another key
    assert len(fn.compiles) == 5
    lk(x[1:], 1, y)  # misaligned: the key (compiles), and no reuse recorded for it
    lk(x[1:], 1, y)
    assert len(fn.compiles) == 6 and lk._last is None


def test_runtime_arguments_first_pass_the_constexprs_as_one_tail(monkeypatch):
    monkeypatch.setattr(launch, "current_stream", lambda: "stream")
    fn = _Fn()
    fn.params = [_Param("x_ptr"), _Param("n"), _Param("y_ptr"), _Param("BLOCK", True), _Param("FLAG", True, 7)]
    fn.arg_names = [p.name for p in fn.params]
    lk = launch.KernelLauncher(fn, (2,), {"BLOCK": 32})
    lk._direct = True
    x = torch.zeros(8)
    lk(x, 3, x)
    lk.launch("other", x, 4, x)
    assert [e[2:] for e in fn.log] == [("stream", (x, 3, x, 32, 7)), ("other", (x, 4, x, 32, 7))]


def test_interpreter_goes_through_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fn = _Fn()
    lk = launch.KernelLauncher(fn, (3,), {"BLOCK": 16}, num_warps=2)
    lk(torch.zeros(2), 3, torch.zeros(2))
    assert fn.log[0][0] == "triton" and fn.log[0][1] == (3, 1, 1) and fn.log[0][3] == {"BLOCK": 16, "num_warps": 2}
    assert not fn.compiles


def test_bad_grid():
    for bad in ((), (0,), (1, 2, 3, 4)):
        with pytest.raises(ValueError, match="grid must be 1 to 3 positive ints"):
            launch.KernelLauncher(_Fn(), bad, {})


def test_prepare_runs_once_per_compiled_kernel(direct):
    fn, _ = direct
    seen = []
    lk = launch.KernelLauncher(fn, (1,), {"BLOCK": 8}, prepare=seen.append)
    lk._direct = True
    x = torch.zeros(4)
    lk(x, 3, x)
    lk(x, 3, x)
    assert len(seen) == 1 and isinstance(seen[0], _Compiled) and seen[0].inits == 1  # (the second call reused it)
    assert isinstance(lk.compiled(x, 3, x), _Compiled) and len(fn.compiles) == 1


def test_bounded_cache_drops_the_oldest_entry():
    from tqkern.ops.launch import BoundedCache

    c = BoundedCache(2)
    assert c.put("a", 1) == 1 and c.put("b", 2) == 2
    c.put("a", 3)  # an existing key: replaced in place, nothing dropped
    assert dict(c) == {"a": 3, "b": 2}
    c.put("c", 4)
    assert dict(c) == {"b": 2, "c": 4}
    with pytest.raises(ValueError, match="maxsize must be >= 1, got 0"):
        BoundedCache(0)
