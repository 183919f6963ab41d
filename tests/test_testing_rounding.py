"""``tqkern.testing.Rounding``: the attention property tests' budget by the roundings of a route.

Expected values from the definitions: fp16 keeps 11 significant bits, bf16 8 (unit roundoffs
2^-11, 2^-8, checked against torch's own rounding), and the routes' roundings as the fused kernels
and the workspace path perform them.
"""

import pytest
import torch

from tqkern.layouts import KVFormat
from tqkern.testing import U_BF16, U_FP16, Rounding


@pytest.mark.parametrize("dtype, u", [(torch.float16, U_FP16), (torch.bfloat16, U_BF16)])
def test_unit_roundoffs_are_the_dtypes_worst_relative_rounding(dtype, u):
    x = torch.tensor(1 + u, dtype=torch.float64)  # halfway between 1 and the next value: ties to even, 1
    assert x.to(dtype).item() == 1.0
    assert torch.tensor(1 + 2 * u, dtype=torch.float64).to(dtype).item() == 1 + 2 * u  # the next value


@pytest.mark.parametrize("preset, q, workspace, dot_u, steps", [
    ("tq4", "float16", False, U_FP16, 0), ("tq4", "float16", True, U_FP16, 0),
    ("tq4", "bfloat16", False, U_FP16, 1),  # fp16 products; the output in bf16
    ("tq4", "bfloat16", True, U_BF16, 3),  # k̂, V̂, P and the output in bf16
    ("fp16", "bfloat16", True, U_BF16, 3),
])
def test_routes_roundings(preset, q, workspace, dot_u, steps):
    r = Rounding.of(KVFormat.preset(preset, 64), q, workspace=workspace)
    assert (r.dot_u, r.bf16_steps) == (dot_u, steps)


def test_raw_bf16_codec_rounds_products_and_probabilities_in_bf16():
    fmt = KVFormat.preset("fp16", 64)
    raw = fmt.key.__class__(dtype="bfloat16")
    bf = fmt.__class__(head_dim=64, key=raw, value=raw)
    assert Rounding.of(bf, "float16", workspace=False) == Rounding(U_BF16, 2)
    assert Rounding.of(bf, "bfloat16", workspace=False) == Rounding(U_BF16, 3)
    assert Rounding.of(bf, "float16", workspace=True) == Rounding(U_BF16, 0)


def test_atol_adds_each_bf16_rounding_to_the_fp16_budget():
    assert Rounding(U_FP16, 0).atol(0.01, 10.0) == pytest.approx((4e-3 + 0.02) * 10 + 1e-6)
    assert Rounding(U_BF16, 3).atol(0.0, 2.0) == pytest.approx((4e-3 + 3 * (2.0**-8 - 2.0**-11)) * 2 + 1e-6)


def test_unknown_query_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match=r"q_dtype must be 'float16' or 'bfloat16', got 'float32'"):
        Rounding.of(KVFormat.preset("tq4", 64), "float32", workspace=False)
