"""``tqkern.testing.Rounding``: the attention property tests' budget by the roundings of a route.

Expected values from the definitions: fp16 keeps 11 significant bits, bf16 8 (unit roundoffs
2^-11, 2^-8, checked against torch's own rounding), and the routes' roundings as the fused kernels
and the workspace path perform them.
"""

import numpy as np
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


def test_logit_bound_is_the_largest_pair_over_rows_heads_and_keys():
    """δ = 2u/√D · max Σ|q||k̂| by hand: D = 4 (√D = 2), u = 2^-11. Keys [1,1,1,1] and [0,0,3,0]
    of one KV head, read by both query heads (group 2); a query row past the first 64 holds the
    largest pair (|q|·[0,0,3,0] = 3·5 = 15), so the chunked scan must reach it."""
    rnd = Rounding(dot_u=2.0**-11, bf16_steps=0)
    khat = np.array([[[1.0, 1.0, 1.0, 1.0]], [[0.0, 0.0, 3.0, 0.0]]])  # [n = 2, Hkv = 1, D = 4]
    q = np.zeros((70, 2, 4))
    q[3, 0] = [1.0, -1.0, 0.0, 2.0]  # pairs 4 and 0
    q[66, 1] = [0.0, 0.0, -5.0, 0.0]  # pairs 5 and 15
    assert rnd.logit_bound(q, khat, 2) == 2 * 2.0**-11 / 2 * 15
    assert rnd.logit_bound(q[3], khat, 2) == 2 * 2.0**-11 / 2 * 4  # one row [Hq, D]
    assert rnd.logit_bound(q, khat[:0], 2) == 0.0 and rnd.logit_bound(q[:0], khat, 2) == 0.0


@pytest.mark.parametrize("q_shape, k_shape, group", [((2, 4), (3, 1, 4), 1), ((2, 4), (3, 1, 5), 2),
                                                     ((4,), (3, 1, 4), 1), ((2, 4), (3, 4), 2),
                                                     ((2, 4), (3, 1, 4), 0)])
def test_logit_bound_rejects_mismatched_shapes(q_shape, k_shape, group):
    with pytest.raises(ValueError, match="group must be|q must be"):
        Rounding(dot_u=U_FP16, bf16_steps=0).logit_bound(np.zeros(q_shape), np.zeros(k_shape), group)
