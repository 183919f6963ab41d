"""Repro for a 'misaligned address' seen once per run on D=64, Hq9/Hkv3 (run under compute-sanitizer)."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
from benchmarks._gpu import require_cuda
from benchmarks.bench_decode import make_layout, fill_cache
from tqkern_torch.attention import paged_decode

require_cuda(__file__)
g = torch.Generator(device="cuda").manual_seed(1)
for preset, arr in (("tq4", "row"), ("turboquant_4bit_nc", "slot")):
    for trial in range(3):
        layout, params = make_layout(preset, arr, 3, 64)
        lens = torch.tensor([1, 77, 600, 1000], dtype=torch.int32, device="cuda")
        bt = torch.randperm(256, device="cuda", generator=g).int().reshape(4, 64)
        cache = fill_cache(layout, params, 256, g)
        torch.cuda.synchronize()
        print(preset, trial, "store ok", flush=True)
        q = torch.randn(4, 9, 64, device="cuda", dtype=torch.float16, generator=g)
        out = paged_decode(q, cache, bt, lens, layout, params)
        torch.cuda.synchronize()
        print(preset, trial, "decode ok", flush=True)
