"""The benchmark shapes the sweeps accept by name (tqkern_torch/bench/shapes.py; no GPU needed)."""

import pytest

from tqkern_torch.bench.shapes import DECODE_SHAPES, decode_shape


def test_named_and_ad_hoc_decode_shapes():
    for shape in DECODE_SHAPES:
        assert decode_shape(shape.name) is shape
    s = decode_shape("B33x16K")  # the benchmark's heads and head_dim at another batch and length
    assert (s.name, s.batch, s.seq_len, s.num_q_heads, s.num_kv_heads, s.head_dim) == ("B33x16K", 33, 16384, 32, 8,
                                                                                        128)


@pytest.mark.parametrize("bad", ["B0x16K", "B32x0K", "B32x16", "b32x16K", "SmolLM2", ""])
def test_unknown_decode_shape_names_are_rejected(bad):
    with pytest.raises(ValueError, match=f"shape must be one of .* or B<batch>x<tokens>K, got '{bad}'"):
        decode_shape(bad)
