"""Session 11 check (GPU): the CTA-cooperative kernel (COOP stages) against the per-warp kernel
at the same split count -- partials (acc, m, l) compared bit for bit -- and the public output
against the NumPy oracle, for every warp-MMA preset, block sizes 16/32/64, head_dim 128 (Hkv 8,
Hq 32) and 64 (Hkv 3, Hq 9), lengths 1..1000 with partial steps, shuffled blocks, a poisoned
(NaN-filled) unused block."""
import itertools
import sys

import numpy as np
import torch
import triton

import tqkern
import tqkern_torch as tqt
from benchmarks.bench_decode import q_rotated
from tqkern import reference as ref
from tqkern.ops.paged_decode.triton import _launch_merge, _workspace
from tqkern.ops.paged_decode.triton_mma import _launch_paged_decode_mma, coop_plan, mma_plan

PRESETS = (("tq4", "row"), ("turboquant_4bit_nc", "slot"), ("turboquant_k8v4", "slot"),
           ("turboquant_k3v4_nc", "slot"), ("turboquant_3bit_nc", "slot"), ("tqkern_k5v3", "slot"))


def case(preset, arr, hq, hkv, d, bs, g):
    fmt = tqkern.KVFormat.preset(preset, d)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=hkv, block_size=bs, arrangement=arr)
    params = tqt.to_device(tqkern.TQParams.default(fmt, seed=0), "cuda")
    lens = torch.tensor([1, 15, 16, 17, 77, 600, 1000, 999], dtype=torch.int32, device="cuda")
    mb = -(-1024 // bs)
    nb = len(lens) * mb + 1
    cache = torch.zeros(layout.cache_shape(nb), dtype=torch.uint8, device="cuda")
    n = nb * bs
    k = torch.randn(n, hkv, d, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(n, hkv, d, device="cuda", dtype=torch.float16, generator=g)
    tqt.store(cache, k, v, torch.arange(n, device="cuda"), layout, params)
    perm = torch.randperm(nb, device="cuda", generator=g).int()
    poison = int(perm[-1])
    cache[poison] = 0xFF  # never referenced by the table: NaN norms if it were read
    bt = perm[:-1].reshape(len(lens), mb).contiguous()
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.float16, generator=g)
    return layout, params, q, cache, bt, lens


def partials(layout, params, q, cache, bt, lens, plan, splits):
    s, hq, d = q.shape
    g = hq // layout.num_kv_heads
    acc, ml = _workspace(None, s, hq, splits, max(16, triton.next_power_of_2(d)), q.device)
    acc.fill_(float("nan"))
    ml.fill_(float("nan"))
    _launch_paged_decode_mma(q_rotated(q, layout, params), cache, bt, lens, layout, plan, params.key_centroids_f32, acc,
                             ml, group=g, num_splits=splits, sm_scale=d ** -0.5,
                             value_centroids_f32=params.value_centroids_f32)
    torch.cuda.synchronize()
    return acc, ml


def main():
    g = torch.Generator(device="cuda").manual_seed(11)
    bad = 0
    for (preset, arr), (hq, hkv, d), bs, stages in itertools.product(PRESETS, ((32, 8, 128), (9, 3, 64)), (16, 32, 64),
                                                                      (2, 3)):
        if bs == 64 and stages == 3:
            continue
        layout, params, q, cache, bt, lens = case(preset, arr, hq, hkv, d, bs, g)
        base = mma_plan(layout, hq // hkv)
        if base is None:
            print(f"{preset} d{d} bs{bs}: no warp-MMA plan", flush=True)
            continue
        plan = coop_plan(base, layout, stages)
        if plan is None:
            print(f"{preset} d{d} bs{bs} c{stages}: no cooperative plan", flush=True)
            continue
        for splits in (1, 3):
            try:
                a0, m0 = partials(layout, params, q, cache, bt, lens, base, splits)
                a1, m1 = partials(layout, params, q, cache, bt, lens, plan, splits)
            except Exception as e:  # noqa: BLE001
                print(f"{preset} d{d} bs{bs} c{stages} splits{splits}: ERROR {type(e).__name__}: {str(e)[:300]}",
                      flush=True)
                bad += 1
                continue
            same = torch.equal(a0.nan_to_num(7.0), a1.nan_to_num(7.0)) and torch.equal(m0.nan_to_num(7.0),
                                                                                    m1.nan_to_num(7.0))
            diff = float((a0.nan_to_num(0) - a1.nan_to_num(0)).abs().max())
            out = torch.full_like(q, float("nan"))
            _launch_merge(a1, m1, params.rotation, out, layout, hq // hkv, splits, False)
            exp = ref.paged_decode(q.float().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(),
                                   lens.cpu().numpy(), layout, params.params)
            err = float(np.abs(out.float().cpu().numpy() - exp).max())
            tol = 4e-3 * (float(np.abs(exp).max()) * 4 + 1e-6)
            ok = same and np.isfinite(err) and err <= tol
            bad += not ok
            print(f"{preset:20s} d{d} bs{bs} c{stages} splits{splits}: partials bit-identical {same} "
                  f"(max diff {diff:.1e}), oracle err {err:.2e} tol {tol:.1e} {'ok' if ok else 'FAIL'}", flush=True)
    print(f"{bad} failures", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
