"""The benchmark shapes the sweeps accept by name (tqkern_torch/bench/shapes.py; no GPU needed)."""

import pytest

from tqkern_torch.bench.shapes import DECODE_SHAPES, ShapeHeadsError, decode_shape


def test_named_and_ad_hoc_decode_shapes():
    for shape in DECODE_SHAPES:
        assert decode_shape(shape.name) is shape
    s = decode_shape("B33x16K")  # the benchmark's heads and head_dim at another batch and length
    assert (s.name, s.batch, s.seq_len, s.num_q_heads, s.num_kv_heads, s.head_dim) == ("B33x16K", 33, 16384, 32, 8,
                                                                                        128)
    s = decode_shape("B16x32K_Hq32_Hkv2_D128")  # a model's heads and head_dim (Llama-3-405B on 4 GPUs)
    assert (s.batch, s.seq_len, s.num_q_heads, s.num_kv_heads, s.head_dim, s.options) == (16, 32768, 32, 2, 128, {})
    assert decode_shape("B1x8K_Hq16_Hkv16_D96").num_kv_heads == 16


@pytest.mark.parametrize("bad", ["B0x16K", "B32x0K", "B32x16", "b32x16K", "SmolLM2", "", "B1x4K_Hq32_Hkv8",
                                 "B1x4K_Hq32_Hkv8_D", "B1x4K_D128"])
def test_unknown_decode_shape_names_are_rejected(bad):
    with pytest.raises(ValueError, match=r"shape must be one of .* or B<batch>x<tokens>K\[_Hq<q>_Hkv<k>_D<d>\], "
                                         f"got '{bad}'"):
        decode_shape(bad)


@pytest.mark.parametrize("bad,what", [("B1x4K_Hq30_Hkv8_D128", "Hq 30, Hkv 8"), ("B1x4K_Hq32_Hkv0_D128", "Hkv 0"),
                                      ("B1x4K_Hq0_Hkv8_D128", "Hq 0"), ("B1x4K_Hq32_Hkv8_D127", "D 127"),
                                      ("B1x4K_Hq32_Hkv8_D0", "D 0")])
def test_ad_hoc_decode_shape_heads_are_checked(bad, what):
    with pytest.raises(ShapeHeadsError, match=f"shape '{bad}': Hq must be .*{what}"):
        decode_shape(bad)
