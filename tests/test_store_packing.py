"""The store kernel's word packer (``tqkern.ops.common._store_words``: codes of 3, 5, 6 or 7 bits
packed 32 at a time into int32 words, written as 16-bit or byte stores) gives the oracle's bytes:
every such width, head dims whose padded width is 32 to 128 (fields shorter than the padding, and
of an odd byte count), fields at even and at odd byte offsets."""

import numpy as np
import pytest
import torch

from tqkern import KVFormat, PagedLayout, TQParams
from tqkern import reference as ref
from tqkern.layouts import LloydMax, Uniform
from tqkern.ops.common import halfword_aligned
from tqkern_torch.testing import device_under_test, kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")

CASES = [(bits, bits, d, nd, h, arr) for bits in (3, 5, 6, 7) for d, nd, h, arr in
         ((32, "float16", 1, "slot"), (40, "float32", 3, "row"), (96, "float16", 2, "row"), (128, "float32", 2, "slot"))]
CASES += [(3, 6, 40, "float16", 2, "slot"), (5, 6, 40, "float16", 3, "row")]  # even fields at odd offsets


def _layout(kbits, vbits, d, norm_dtype, heads, arrangement):
    fmt = KVFormat(head_dim=d, key=LloydMax(bits=kbits, norm_dtype=norm_dtype), value=Uniform(bits=vbits))
    return PagedLayout(format=fmt, num_kv_heads=heads, block_size=16, arrangement=arrangement)


@pytest.mark.parametrize("kbits, vbits, d, norm_dtype, heads, arrangement", CASES)
def test_word_packing_equals_oracle(kbits, vbits, d, norm_dtype, heads, arrangement):
    import tqkern_torch as tqt

    dev = device_under_test()
    layout = _layout(kbits, vbits, d, norm_dtype, heads, arrangement)
    fmt = layout.format
    params = TQParams.default(fmt)
    rng = np.random.default_rng(kbits * 1000 + vbits * 100 + d)
    n = 20
    k, v = (rng.standard_normal((n, heads, d)).astype(np.float16) for _ in range(2))
    slots = rng.permutation(32)[:n].astype(np.int64)
    blank = np.zeros(layout.cache_shape(2), np.uint8)
    cache = torch.from_numpy(blank.copy()).to(dev)
    tqt.store(cache, torch.from_numpy(k).to(dev), torch.from_numpy(v).to(dev), torch.from_numpy(slots).to(dev),
              layout, params)
    expect = ref.store(blank, k.astype(np.float64), v.astype(np.float64), slots, layout, params)
    _, unsure = ref.compress(k.astype(np.float64), v.astype(np.float64), params, return_uncertain=True)
    got, want = ref.gather_slots(cache.cpu().numpy(), layout, slots), ref.gather_slots(expect, layout, slots)
    bad = (got != want) & ~unsure
    assert not bad.any(), f"{int(bad.sum())} certain bytes differ (key field aligned: " \
                          f"{halfword_aligned(layout, 'key')}, value: {halfword_aligned(layout, 'value')})"


def test_cases_cover_both_alignments_and_odd_fields():
    """(field at an even offset, even byte count): all four combinations occur among the cases."""
    seen = set()
    for kbits, vbits, d, nd, h, arr in CASES:
        layout = _layout(kbits, vbits, d, nd, h, arr)
        for side, bits in (("key", kbits), ("value", vbits)):
            seen.add((halfword_aligned(layout, side), d * bits % 16 == 0))
    assert seen == {(True, True), (False, True), (False, False), (True, False)}
