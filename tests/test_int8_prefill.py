"""``tqkern_torch.int8_prefill``: named edge cases against its oracle
(``tqkern.ops.int8_prefill.reference``), the NumPy fallback, a bad argument, and the plan. Its op
registration (opcheck, ``torch.compile(fullgraph=True)``) is tested beside ``prefill``'s in
``tests/test_prefill.py``; the property tests are ``property_tests/test_int8_prefill_triton.py``."""

import numpy as np
import pytest
import torch

import tqkern_torch as tqt
from tests.test_prefill import DEV, HQ, D, _qsl, case, needs_kernels  # noqa: F401  (case: the fixture)
from tqkern.ops.int8_prefill.reference import int8_prefill as oracle
from tqkern.ops.paged_decode.plan import DeviceCaps
from tqkern.ops.prefill.plan import plan_prefill


def _args(case, q_lens, seed=0):
    layout, params, cache, bt, sl = case
    qsl = _qsl(q_lens)
    q = torch.from_numpy(np.random.default_rng(seed).standard_normal((int(qsl[-1]), HQ, D))).half()
    return layout, params, cache, bt, sl, qsl, q


@needs_kernels
@pytest.mark.parametrize("q_lens", [[33, 32, 17, 0], [1, 1, 1, 0], [0, 0, 0, 0], [16, 8, 2, 0]],
                         ids=["whole", "decode", "empty", "chunks"])
def test_edges_match_oracle(case, q_lens):
    """Whole sequences, decode rows, an empty batch and chunks on cached prefixes; the kernel's
    codes equal the oracle's away from float ties, so the outputs agree to the P·V rounding."""
    layout, params, cache, bt, sl, qsl, q = _args(case, q_lens)
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, sl, qsl)]
    out, lse = tqt.int8_prefill(q.to(DEV), *t, layout, tqt.to_device(params, DEV), return_lse=True)
    eo, el = oracle(q.double().numpy(), cache, bt, sl, qsl, layout, params, return_lse=True)
    got = out.float().cpu().numpy()
    assert got.shape == eo.shape and np.all(np.isfinite(got))
    if got.size:
        assert np.abs(got - eo).max() <= 4e-3 * max(1.0, float(np.abs(eo).max()))
        assert np.abs(lse.cpu().numpy() - el).max() <= 2e-3


def test_numpy_fallback_equals_oracle(case, monkeypatch):
    """Without a GPU and without the interpreter, CPU tensors run the int8 oracle."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    layout, params, cache, bt, sl, qsl, q = _args(case, [4, 1, 17, 0], seed=3)
    t = [torch.from_numpy(x) for x in (cache, bt, sl, qsl)]
    out = tqt.int8_prefill(q, *t, layout, params, logit_softcap=5.0)
    exp = oracle(q.double().numpy(), cache, bt, sl, qsl, layout, params, logit_softcap=5.0)
    # (the frontend's parameters hold Π in float32: the oracle's float64 result within an fp16 ulp,
    # but for a code that Π's float32 rounding moves across a half)
    assert np.allclose(out.numpy(), exp, rtol=2**-10, atol=4e-3 * float(np.abs(exp).max()))


def test_int8_prefill_checks_its_arguments_like_prefill(case):
    layout, params, cache, bt, sl, qsl, q = _args(case, [1, 1, 1, 0])
    t = [torch.from_numpy(x) for x in (cache, bt, sl, qsl)]
    with pytest.raises(TypeError, match="q must be float16 or bfloat16, got float32"):
        tqt.int8_prefill(q.float(), *t, layout, params)
    with pytest.raises(ValueError, match="query_start_loc"):
        tqt.int8_prefill(q, *t[:3], torch.tensor([0, 1, 2, 9, 3], dtype=torch.int32), layout, params)


def test_int8_plan_reads_keys_through_the_float32_loader():
    """The int8 kernel reconstructs keys in float32 (the loader), so its plan drops the keys'
    4-bit word path; values keep theirs."""
    import tqkern

    fmt = tqkern.KVFormat.preset("turboquant_4bit_nc", 128)
    lay = tqkern.PagedLayout(format=fmt, num_kv_heads=8, block_size=16)
    base = dict(plan_prefill(lay, 32, DeviceCaps.sm90()).constexprs)
    i8 = plan_prefill(lay, 32, DeviceCaps.sm90(), int8=True)
    cx = dict(i8.constexprs)
    assert i8.int8 and cx["INT8"] and not base["INT8"] and "int8" in i8.describe()
    assert base["K_FAST"] > 0 and cx["K_FAST"] == 0 and cx["V_FAST"] == base["V_FAST"]
