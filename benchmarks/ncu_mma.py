"""One launch of the warp-MMA decode kernel at B32x16K (Hq32/Hkv8/D128) for Nsight Compute.

    ncu --clock-control none -k regex:_paged_decode_mma --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight ... python benchmarks/ncu_mma.py tq4
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._gpu import require_cuda  # noqa: E402
from benchmarks.bench_decode import BLOCK, fill_cache, make_layout  # noqa: E402
from benchmarks.shapes import DECODE_PRESETS  # noqa: E402
from tqkern_torch.attention import paged_decode  # noqa: E402

preset = sys.argv[1] if len(sys.argv) > 1 else "tq4"
b, L, hq, hkv, d = 32, 16384, 32, 8, 128
require_cuda(__file__)
g = torch.Generator(device="cuda").manual_seed(0)
layout, params = make_layout(preset, dict(DECODE_PRESETS)[preset], hkv, d)
nb = b * L // BLOCK
cache = fill_cache(layout, params, nb, g)
bt = torch.randperm(nb, device="cuda", generator=g).int().reshape(b, L // BLOCK)
sl = torch.full((b,), L, dtype=torch.int32, device="cuda")
q = torch.randn(b, hq, d, device="cuda", dtype=torch.float16, generator=g)
for _ in range(2):
    paged_decode(q, cache, bt, sl, layout, params, check_lengths=False)
torch.cuda.synchronize()
