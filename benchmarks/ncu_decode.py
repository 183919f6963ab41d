"""One public ``paged_decode`` call on a full cache of a benchmark shape, for a profiler (Nsight
Compute) to attach to: a first call compiles and warms up, the second is the one to profile
(``ncu --launch-skip`` counts the q rotation, decode and merge launches of the first).

    ncu --clock-control none -k regex:paged_decode_mma --launch-skip 1 --launch-count 1 \\
        python benchmarks/ncu_decode.py --preset turboquant_4bit_nc --shape B32x16K
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._gpu import require_cuda  # noqa: E402
from benchmarks.bench_decode import BLOCK, fill_cache, make_layout  # noqa: E402
from benchmarks.shapes import DECODE_PRESETS, decode_shape  # noqa: E402
from tqkern_torch.attention import paged_decode  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tq4", choices=[p for p, _ in DECODE_PRESETS])
    ap.add_argument("--shape", default="B32x16K")
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args(argv)
    require_cuda(__file__)
    shape = decode_shape(args.shape)
    g = torch.Generator(device="cuda").manual_seed(0)
    layout, params = make_layout(args.preset, dict(DECODE_PRESETS)[args.preset], shape.num_kv_heads, shape.head_dim)
    b, n = shape.batch, shape.seq_len
    cache = fill_cache(layout, params, b * n // BLOCK, g)
    bt = torch.randperm(b * n // BLOCK, device="cuda", generator=g).int().reshape(b, n // BLOCK)
    sl = torch.full((b,), n, dtype=torch.int32, device="cuda")
    q = torch.randn(b, shape.num_q_heads, shape.head_dim, device="cuda", dtype=torch.float16, generator=g)
    for _ in range(args.calls):
        out = paged_decode(q, cache, bt, sl, layout, params)
    torch.cuda.synchronize()
    print(f"{args.preset} {shape.name}: out finite {bool(torch.isfinite(out).all())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
