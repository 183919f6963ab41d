"""store oracle: writes exactly the compressed slots at slot_mapping, in either arrangement,
and nothing else. The expected cache is built here byte by byte from the arrangement rules:
``"slot"``: a token row is the H slots one after the other; ``"row"``: for each field in slot
order, that field of head 0, head 1, ..., then every head's padding."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tqkern.errors import ErrorFlag
from tqkern.layouts import KVFormat, PagedLayout
from tqkern.ops.compress.reference import compress
from tqkern.ops.decompress.reference import gather_sequences, gather_slots
from tqkern.ops.store.reference import store
from tqkern.params import TQParams
from tqkern.testing import float_arrays, kv_formats, paged_batches, paged_layouts, scale, tq_params


def _my_row(slots_t: np.ndarray, layout: PagedLayout) -> np.ndarray:
    """One token row [row_bytes] from its slots [H, slot_bytes]."""
    fmt = layout.format
    if layout.arrangement == "slot":
        return slots_t.reshape(-1)
    parts = [slots_t[:, off: off + f.nbytes].reshape(-1) for _, f, off in fmt.slot_fields()]
    used = fmt.key_bytes + fmt.value_bytes
    parts.append(slots_t[:, used:].reshape(-1))  # every head's padding, last
    return np.concatenate(parts)


@st.composite
def store_cases(draw):
    layout = draw(paged_layouts(block_sizes=st.sampled_from([1, 2, 4, 16])), label="layout")
    fmt, h = layout.format, layout.num_kv_heads
    params = draw(tq_params(fmt, h), label="params")
    num_blocks = draw(st.integers(1, 4), label="num_blocks")
    num_slots = num_blocks * layout.block_size
    t = draw(st.integers(0, min(num_slots, scale(8, 64))), label="num_tokens")
    perm = np.random.default_rng(draw(st.integers(0, 2**16), label="perm_seed")).permutation(num_slots)
    sm = perm[:t].astype(draw(st.sampled_from([np.int32, np.int64]), label="sm_dtype"))
    skip = draw(st.lists(st.integers(0, max(t - 1, 0)), max_size=t), label="skipped") if t else []
    for i in skip:
        sm[i] = draw(st.sampled_from([-1, -2, -(2**31)]), label="negative")
    key = draw(float_arrays((t, h, fmt.head_dim)), label="key")
    value = draw(float_arrays((t, h, fmt.head_dim)), label="value")
    seed = draw(st.integers(0, 2**16), label="poison_seed")
    return layout, params, num_blocks, seed, key, value, sm


@given(case=store_cases())
def test_store_writes_exactly_the_compressed_slots(case, poison):
    layout, params, num_blocks, seed, key, value, sm = case
    cache = poison(layout.cache_shape(num_blocks), seed)
    before = cache.copy()
    new = store(cache, key, value, sm, layout, params)
    assert np.array_equal(cache, before)  # the input is not modified
    assert new.shape == cache.shape and new.dtype == np.uint8
    slots = compress(key, value, params)
    expected = before.reshape(-1, layout.row_bytes).copy()
    for t, s in enumerate(sm.tolist()):
        if s >= 0:
            expected[s] = _my_row(slots[t], layout)
    assert np.array_equal(new.reshape(-1, layout.row_bytes), expected)
    # ... and the gather oracle reads them back.
    valid = sm >= 0
    assert np.array_equal(gather_slots(new, layout, sm[valid]), slots[valid])


@pytest.mark.parametrize("arrangement", ["slot", "row"])
@given(data=st.data())
def test_field_addresses_of_both_arrangements(arrangement, data, poison):
    layout = data.draw(paged_layouts(kv_formats(head_dims=st.sampled_from([8, 64, 100])),
                                     block_sizes=st.just(2)), label="layout")
    layout = PagedLayout(format=layout.format, num_kv_heads=layout.num_kv_heads, block_size=2,
                         arrangement=arrangement)
    fmt, h = layout.format, layout.num_kv_heads
    params = data.draw(tq_params(fmt, h), label="params")
    key = data.draw(float_arrays((3, h, fmt.head_dim)), label="key")
    value = data.draw(float_arrays((3, h, fmt.head_dim)), label="value")
    cache = poison(layout.cache_shape(2), 1)
    new = store(cache, key, value, np.array([3, 0, 2]), layout, params).reshape(-1, layout.row_bytes)
    slots = compress(key, value, params)
    region = 0
    for name, f, off in fmt.slot_fields():
        a = layout.field(name)
        if arrangement == "slot":
            assert (a.offset, a.head_stride) == (off, fmt.slot_bytes)
        else:  # field f of head hh at H·(bytes of the fields before f) + hh·nbytes(f)
            assert (a.offset, a.head_stride) == (region, f.nbytes)
        for t, s in enumerate([3, 0, 2]):
            for hh in range(h):
                got = new[s, a.offset + hh * a.head_stride: a.offset + hh * a.head_stride + f.nbytes]
                assert np.array_equal(got, slots[t, hh, off: off + f.nbytes]), (name, t, hh)
        region += h * f.nbytes
    assert np.array_equal(new[1], cache.reshape(-1, layout.row_bytes)[1])  # slot 1 untouched


@given(data=st.data())
def test_store_then_gather_sequences(data, poison):
    layout = data.draw(paged_layouts(block_sizes=st.sampled_from([2, 4, 16])), label="layout")
    fmt, h = layout.format, layout.num_kv_heads
    params = data.draw(tq_params(fmt, h), label="params")
    batch = data.draw(paged_batches(layout.block_size, max_seqs=3, max_len=scale(20, 100)), label="batch")
    cache = poison(layout.cache_shape(batch.num_blocks), 7)
    seqs = []
    for s in range(len(batch.seq_lens)):
        n = int(batch.seq_lens[s])
        k = data.draw(float_arrays((n, h, fmt.head_dim)), label=f"key{s}")
        v = data.draw(float_arrays((n, h, fmt.head_dim)), label=f"value{s}")
        cache = store(cache, k, v, batch.slot_ids(s), layout, params)
        seqs.append(compress(k, v, params))
    got = gather_sequences(cache, layout, batch.block_table, batch.seq_lens)
    assert len(got) == len(seqs)
    for g, want in zip(got, seqs):
        assert np.array_equal(g, want)


# -- deterministic edges ----------------------------------------------------------------------

def _setup(poison, arrangement="row", num_blocks=2):
    fmt = KVFormat.preset("tq4", head_dim=64)
    layout = PagedLayout(format=fmt, num_kv_heads=2, block_size=4, arrangement=arrangement)
    params = TQParams.default(fmt, seed=0)
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((2, 3, 2, 64)).astype(np.float16)
    return layout, params, poison(layout.cache_shape(num_blocks), 3), kv[0], kv[1]


@pytest.mark.parametrize("arrangement", ["slot", "row"])
def test_all_negative_and_empty_mappings_change_nothing(arrangement, poison):
    layout, params, cache, k, v = _setup(poison, arrangement)
    assert np.array_equal(store(cache, k, v, np.array([-1, -1, -7]), layout, params), cache)
    empty = np.zeros((0, 2, 64), np.float16)
    assert np.array_equal(store(cache, empty, empty, np.zeros(0, np.int64), layout, params), cache)


def test_repeated_slot_later_token_wins(poison):
    layout, params, cache, k, v = _setup(poison)
    new = store(cache, k, v, np.array([5, 5, 1]), layout, params)
    slots = compress(k, v, params)
    assert np.array_equal(gather_slots(new, layout, [5, 1]), slots[[1, 2]])


def test_store_validates(poison):
    layout, params, cache, k, v = _setup(poison)
    # A slot past the cache is skipped and flagged, not an error (the policy every kernel follows).
    out, flags = store(cache, k, v, np.array([0, 8, 1]), layout, params, return_flags=True)
    assert flags == ErrorFlag.SLOT_OUT_OF_RANGE
    assert np.array_equal(out, store(cache, k, v, np.array([0, -1, 1]), layout, params))
    with pytest.raises(ValueError, match=r"^slot_mapping must have shape \(3,\)"):
        store(cache, k, v, np.array([0, 1]), layout, params)
    with pytest.raises(ValueError, match=r"^key must have shape \[num_tokens, 2, 64\]"):
        store(cache, k[:, :1], v[:, :1], np.array([0, 1, 2]), layout, params)
    with pytest.raises(ValueError, match=r"^value must have the shape of key \(3, 2, 64\), got \(2, 2, 64\)"):
        store(cache, k, v[:2], np.array([0, 1, 2]), layout, params)
    other = TQParams.default(KVFormat.preset("tqkern_k4v4", head_dim=64))
    with pytest.raises(ValueError, match=r"^params\.format must equal layout\.format"):
        store(cache, k, v, np.array([0, 1, 2]), layout, other)
    with pytest.raises(TypeError, match=r"^layout must be a PagedLayout"):
        store(cache, k, v, np.array([0, 1, 2]), layout.format, params)
    with pytest.raises(ValueError, match=r"^cache must have shape"):
        store(cache.reshape(2, 4, 2, -1), k, v, np.array([0, 1, 2]), layout, params)
