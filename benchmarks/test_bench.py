"""pytest-benchmark entries (GPU only): ``pytest benchmarks/test_bench.py --benchmark-only``.

Each case checks the output against the NumPy oracle before it is timed. The full table (every
preset and shape, SDPA baseline, CUDA-graph timing, JSON) comes from ``bench_decode.py``.
"""

import numpy as np
import pytest
import torch

from benchmarks.bench_decode import fill_cache, make_layout
from tqkern import reference as ref
from tqkern_torch.attention import paged_decode

pytestmark = [pytest.mark.benchmark,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (no CUDA device found)")]
PRESETS = [("tq4", "row"), ("turboquant_4bit_nc", "slot"), ("turboquant_k8v4", "slot"), ("fp16", "slot")]


@pytest.mark.parametrize("preset,arrangement", PRESETS)
def test_paged_decode_b32x4k(benchmark, preset, arrangement):
    b, L, hq, hkv, d = 32, 4096, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    layout, params = make_layout(preset, arrangement, hkv, d)
    nb = b * L // 16
    bt = torch.randperm(nb, device="cuda", generator=g).int().reshape(b, L // 16)
    sl = torch.full((b,), L, dtype=torch.int32, device="cuda")
    cache = fill_cache(layout, params, nb, g)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.float16, generator=g)
    out = paged_decode(q, cache, bt, sl, layout, params)
    exp = ref.paged_decode(q[:2].float().cpu().numpy(), cache.cpu().numpy(), bt[:2].cpu().numpy(),
                           sl[:2].cpu().numpy(), layout, params.params)
    assert np.abs(out[:2].float().cpu().numpy() - exp).max() < 4e-3 * 5.0

    def run():
        paged_decode(q, cache, bt, sl, layout, params, out=out, check_lengths=False)
        torch.cuda.synchronize()

    benchmark(run)


def test_sdpa_fp16_b32x4k(benchmark):
    b, L, hq, hkv, d = 32, 4096, 32, 8, 128
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hkv, L, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, hkv, L, d, device="cuda", dtype=torch.float16)

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize()

    benchmark(run)
