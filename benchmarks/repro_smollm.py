"""Targeted check of the SmolLM2-like shape (D=64, Hq9/Hkv3) for every preset, launch-blocking."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
from benchmarks.bench_decode import make_layout, fill_cache
from benchmarks.shapes import DECODE_PRESETS
from tqkern_torch.attention import paged_decode

g = torch.Generator(device="cuda").manual_seed(0)
b, L, hq, hkv, d = 32, 4096, 9, 3, 64
q = torch.randn(b, hq, d, device="cuda", dtype=torch.float16, generator=g)
nb = b * L // 16
bt = torch.randperm(nb, device="cuda", generator=g).int().reshape(b, L // 16)
sl = torch.full((b,), L, dtype=torch.int32, device="cuda")
for preset, arr in DECODE_PRESETS:
    layout, params = make_layout(preset, arr, hkv, d)
    cache = fill_cache(layout, params, nb, g)
    torch.cuda.synchronize()
    print(preset, "store ok", flush=True)
    out = paged_decode(q, cache, bt, sl, layout, params)
    torch.cuda.synchronize()
    print(preset, "decode ok", bool(torch.isfinite(out).all()), flush=True)
