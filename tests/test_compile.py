"""The public torch functions trace under ``torch.compile(fullgraph=True)`` with their default
arguments, on CPU tensors, and give exactly the eager result.

``fullgraph=True`` makes any graph break an error, so a pass proves the whole call (argument
checks, parameter lookup, the ``torch.ops.tqkern`` op) is one graph. Backends: ``aot_eager``
(always; it traces through AOTAutograd and functionalization like inductor, without generating
code) and inductor, the default backend, where a C++ compiler is found (inductor compiles CPU
graphs to C++). The ops themselves run the Triton kernels in the interpreter under
``TRITON_INTERPRET=1`` and the NumPy oracle otherwise; both are covered by running the suite
in each mode.

Not covered: ``compress`` builds a ``PagedLayout`` inside the call, which dynamo cannot trace,
and ``decompress_sequences`` checks ``seq_lens`` on the host for CPU tensors (a data-dependent
branch).
"""

from __future__ import annotations

import os
import shutil

import pytest

torch = pytest.importorskip("torch")

import tqkern  # noqa: E402
import tqkern_torch as tqt  # noqa: E402

NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 64, 16, 8
SEQ_LENS = [20, 33]
BLOCK_TABLE = [[5, 2, 0], [1, 7, 3]]  # physical blocks; entries past a sequence are unused
PRESETS = [("tq4", "row"), ("turboquant_4bit_nc", "slot")]


def _have_cxx() -> bool:
    return bool(os.environ.get("CXX")) or any(shutil.which(c) for c in ("g++", "c++", "clang++"))


BACKENDS = [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(not _have_cxx(), reason="inductor needs a C++ compiler on CPU")),
]


class Case:
    """A small paged cache with two sequences stored in it (eagerly), on CPU."""

    def __init__(self, preset: str, arrangement: str):
        fmt = tqkern.KVFormat.preset(preset, head_dim=HEAD_DIM)
        self.layout = tqkern.PagedLayout(format=fmt, num_kv_heads=NUM_KV_HEADS, block_size=BLOCK_SIZE,
                                         arrangement=arrangement)
        self.params = tqt.to_device(tqkern.TQParams.default(fmt), "cpu")
        g = torch.Generator().manual_seed(0)
        self.seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
        self.block_table = torch.tensor(BLOCK_TABLE, dtype=torch.int32)
        slots = tqt.sequence_slot_ids(self.block_table, self.seq_lens, BLOCK_SIZE)
        self.slot_mapping = slots[slots >= 0]
        n = self.slot_mapping.shape[0]
        self.key = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).half()
        self.value = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).half()
        self.q = torch.randn(len(SEQ_LENS), NUM_Q_HEADS, HEAD_DIM, generator=g).half()
        self.cache = self.fresh_cache()
        tqt.store(self.cache, self.key, self.value, self.slot_mapping, self.layout, self.params)

    def fresh_cache(self) -> torch.Tensor:
        return tqt.allocate_cache(self.layout, NUM_BLOCKS, "cpu", fill=0xA5)


@pytest.fixture(scope="module", params=PRESETS, ids=[p for p, _ in PRESETS])
def case(request):
    return Case(*request.param)


def _compiled(fn, backend):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_compiles(case, backend):
    def fn(cache, key, value, slot_mapping):
        return tqt.store(cache, key, value, slot_mapping, case.layout, case.params)

    eager = case.fresh_cache()
    fn(eager, case.key, case.value, case.slot_mapping)
    compiled = case.fresh_cache()
    ret = _compiled(fn, backend)(compiled, case.key, case.value, case.slot_mapping)
    assert torch.equal(compiled, eager)  # written in place, byte for byte
    assert torch.equal(ret, eager)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decompress_compiles(case, backend):
    def fn(cache, slot_ids):
        return tqt.decompress(cache, slot_ids, case.layout, case.params)

    ids = torch.cat([case.slot_mapping, torch.tensor([-1])])  # a negative id reads zeros
    k_e, v_e = fn(case.cache, ids)
    k_c, v_c = _compiled(fn, backend)(case.cache, ids)
    assert torch.equal(k_c, k_e)
    assert torch.equal(v_c, v_e)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_decode_compiles(case, backend):
    def fn(q, cache, block_table, seq_lens):
        return tqt.paged_decode(q, cache, block_table, seq_lens, case.layout, case.params)

    eager = fn(case.q, case.cache, case.block_table, case.seq_lens)
    compiled = _compiled(fn, backend)(case.q, case.cache, case.block_table, case.seq_lens)
    assert compiled.dtype == eager.dtype and compiled.shape == eager.shape
    assert torch.equal(compiled, eager)
