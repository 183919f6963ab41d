"""GPU-only prefill checks: the fused kernel at head_dim 32 on long mixed batches, against the
oracle with the property tests' budget.

Session 46 found Triton 3.6 miscompiling the prefill kernel's sm_90 tiles at head_dim 32 (the
plan module's docstring, :mod:`tqkern.ops.prefill.plan`): 128 × 64 made 3-bit keys fault (a P·V
``wgmma`` reading shared memory past the allocation), 32-key steps gave wrong outputs for every
compressed codec. The interpreter runs neither compiled tile, so only a GPU run catches them:
these batches (long enough for many key tiles, a short sequence for ``int8_prefill``'s exact band)
faulted or failed before the plan's 64 × 64.
"""

import numpy as np
import pytest
import torch

import tqkern
import tqkern.testing as T
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.ops.int8_prefill.reference import int8_prefill as int8_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PRESETS = ["turboquant_3bit_nc", "turboquant_k3v4_nc", "turboquant_4bit_nc", "turboquant_k8v4", "tq4",
           "tqkern_k5v3", "tqkern_k4v4", "fp16"]


def check_fused(preset: str, fn: str, lens, q_lens, *, head_dim: int = 32, dtype=torch.float16,
                device: str = "cuda") -> None:
    """``fn`` (``prefill`` / ``int8_prefill``) on the fused kernel over a row-arranged cache of two KV
    heads (GQA 2, shuffled blocks, K/V stored by ``store``), queries in ``dtype``, equals its oracle
    within the property tests' per-sequence budget (``Rounding.atol``: ``(4e-3 + 2δ)·max|V̂|``, more for
    bf16 queries' output)."""
    from property_tests.test_int8_prefill_triton import _int8_bounds
    from property_tests.test_prefill_triton import _bounds, rounding, sequence_error

    hkv, group, bs = 2, 2, 16
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, head_dim), num_kv_heads=hkv, block_size=bs,
                                arrangement="row")
    params = tqkern.TQParams.default(layout.format, seed=7)
    per = max(-(-n // bs) for n in lens)
    rng = np.random.default_rng(1)
    table = rng.permutation(len(lens) * per).astype(np.int32).reshape(len(lens), per)
    batch = T.VarlenBatch(table, np.array(lens, np.int32), len(lens) * per, bs, q_lens)
    g = torch.Generator(device=device).manual_seed(1)
    cache = torch.zeros(layout.cache_shape(batch.num_blocks), dtype=torch.uint8, device=device)
    for s, n in enumerate(lens):
        k, v = (torch.randn(n, hkv, head_dim, device=device, generator=g).half() for _ in range(2))
        tqt.store(cache, k, v, torch.from_numpy(batch.slot_ids(s)).to(device), layout, params)
    q = torch.randn(batch.num_tokens, hkv * group, head_dim, device=device, generator=g).to(dtype)
    args = [torch.from_numpy(x).to(device) for x in (table, batch.seq_lens, batch.query_start_loc)]
    got = getattr(tqt, fn)(q, cache, *args, layout, params, check_inputs=False, max_query_len=1 << 20)
    got = got.float().cpu().numpy()
    q64, cache_np = q.double().cpu().numpy(), cache.cpu().numpy()
    oracle, bounds = (int8_oracle, _int8_bounds) if fn == "int8_prefill" else (ref.prefill, _bounds)
    expect = oracle(q64, cache_np, table, batch.seq_lens, batch.query_start_loc, layout, params)
    for s in range(len(lens)):
        err, tol, _, _ = sequence_error(got, expect, layout, params, batch, cache_np, q64, group, s, bounds,
                                        rounding(layout, q, workspace=False))
        assert err <= tol, f"{preset} {fn} seq {s} (len {lens[s]}, q_len {q_lens[s]}): error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("fn", ["prefill", "int8_prefill"])
@pytest.mark.parametrize("preset", PRESETS)
def test_head_dim_32_long_batches_match_the_oracle(preset, fn, dtype):
    check_fused(preset, fn, [248, 1616, 700, 2048], [248, 1616, 100, 8], dtype=dtype)
