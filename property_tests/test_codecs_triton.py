"""A value codec added through the registry (``docs/codecs.md``): 2-bit uniform values, end to end.

The store kernel's bytes equal the oracle's, decompress equals the oracle's decompress, and the
general decode kernel equals the oracle's attention, each by the same checks (and tolerances,
stated there) as the store/decompress and decode property tests, here with the value codec pinned
to ``Uniform(bits=2)`` (any key codec, any parameter dtype, rotated or not, both arrangements).
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tqkern
import tqkern.testing as T
from property_tests import test_paged_decode_triton as decode_tests
from property_tests import test_store_triton as store_tests
from tqkern.ops.codecs import Kind, side_consts
from tqkern_torch.testing import kernels_available

pytestmark = [pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:All-NaN:RuntimeWarning")]


@st.composite
def uniform2_formats(draw, *, raw: bool = True):
    fmt = draw(T.kv_formats(raw=raw), label="drawn_format")
    value = tqkern.Uniform(bits=2, param_dtype=draw(st.sampled_from(["float16", "float32"]), label="v_param_dtype"),
                           rotated=draw(st.booleans(), label="v_rotated"))
    return fmt.replace(value=value, bit_order="lsb")  # nibble order is for 4-bit codes only


@st.composite
def store_cases(draw):
    layout = draw(T.paged_layouts(uniform2_formats()), label="layout")
    assert side_consts(layout, "value").KIND == Kind.UNIFORM and side_consts(layout, "value").BITS == 2
    params = draw(T.tq_params(layout.format, layout.num_kv_heads), label="params")
    num_blocks = draw(st.integers(1, T.scale(3, 12)), label="num_blocks")
    capacity = num_blocks * layout.block_size
    n = draw(st.integers(1, min(capacity, T.scale(40, 600))), label="num_tokens")
    slots = np.random.default_rng(draw(st.integers(0, 2**16), label="slot_seed")).permutation(capacity)[:n]
    k, v = draw(T.kv_arrays(n, layout.num_kv_heads, layout.head_dim, dtype=np.float32), label="kv")
    misaligned = draw(st.sampled_from([0, 1, 2]), label="key_offset_elements")  # GPU: > 0 takes the tile kernel
    return layout, params, num_blocks, slots.astype(np.int64), torch.float16, k, v, misaligned


@given(store_cases(), st.booleans())
def test_uniform2_store_bytes_equal_oracle(case, small_tile):
    store_tests.test_store_bytes_equal_oracle.hypothesis.inner_test(case, small_tile)


@given(store_cases(), st.booleans(), store_tests.DECOMPRESS_TILES)
def test_uniform2_decompress_equals_oracle(case, rotate_back, tiles):
    store_tests.test_decompress_equals_oracle.hypothesis.inner_test(case, rotate_back, tiles)


@st.composite
def decode_cases(draw):
    fmts = uniform2_formats().filter(lambda f: "bfloat16" not in (getattr(f.key, "dtype", ""),))
    layout = draw(T.paged_layouts(fmts, num_kv_heads=st.integers(1, 3)), label="layout")
    params = draw(T.tq_params(layout.format, layout.num_kv_heads), label="params")
    group = draw(st.sampled_from([1, 2, 4]), label="gqa_group")
    batch = draw(T.paged_batches(layout.block_size, max_seqs=T.scale(3, 8), max_len=T.scale(80, 3000)),
                 label="batch")
    num_splits = draw(st.one_of(st.none(), st.integers(1, 3)), label="num_splits")
    return layout, params, group, batch, torch.float16, num_splits


@given(decode_cases(), st.data())
def test_uniform2_paged_decode_matches_oracle(case, data):
    decode_tests._check_against_oracle(*case, data)
