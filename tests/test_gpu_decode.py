"""GPU-only decode checks: CUDA-graph capture and replay, 64K contexts, caches above 2 GiB."""

import dataclasses

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.testing import Rounding
from tqkern.ops.paged_decode.triton import decode_path
from tqkern_torch.attention import paged_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _fill(layout, params, num_blocks, seq_lens, block_table, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.randint(0, 256, layout.cache_shape(num_blocks), dtype=torch.uint8, device="cuda", generator=g)
    h, d, bs = layout.num_kv_heads, layout.head_dim, layout.block_size
    for s, n in enumerate(seq_lens.tolist()):
        slots = tqt.sequence_slot_ids(block_table[s: s + 1], seq_lens[s: s + 1], bs)[0, :n]
        k = torch.randn(n, h, d, device="cuda", dtype=torch.float16, generator=g)
        v = torch.randn(n, h, d, device="cuda", dtype=torch.float16, generator=g)
        tqt.store(cache, k, v, slots, layout, params)
    return cache


def _vmax(cache, block_table, seq_lens, layout, params) -> float:
    _, v = tqt.decompress_sequences(cache, block_table, seq_lens, layout, params, rotate_back=True)
    return float(v.abs().max())


def _dense_reference(q, cache, block_table, seq_lens, layout, params):
    """float32 attention over decompress(..., rotate_back=True), on the GPU (for long contexts)."""
    k, v = tqt.decompress_sequences(cache, block_table, seq_lens, layout, params, rotate_back=True)
    outs = []
    g = q.shape[1] // layout.num_kv_heads
    for s, n in enumerate(seq_lens.tolist()):
        ks = k[s, :n].repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, n, D]
        vs = v[s, :n].repeat_interleave(g, dim=1).transpose(0, 1)
        qs = q[s].float()[:, None, :]
        w = torch.softmax((qs @ ks.transpose(1, 2)) / layout.head_dim**0.5, dim=-1)
        outs.append((w @ vs)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("preset,arrangement,path,heads", [
    ("fp16", "slot", "general", 2), ("tq4", "row", "mma", 2), ("tqkern_k5v3", "slot", "mma", 2),
    ("turboquant_4bit_nc", "slot", "mma", 2),  # 268-byte rows: shifted word reads
    ("turboquant_3bit_nc", "slot", "mma", 2),  # 3-bit uniform values
    ("tq4", "row", "mma", 8), ("turboquant_4bit_nc", "slot", "mma", 8)])  # cooperative stages
def test_cuda_graph_replay_with_new_lengths_and_tables(preset, arrangement, path, heads):
    fmt = tqkern.KVFormat.preset(preset, 128)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=heads, block_size=16, arrangement=arrangement)
    params = tqt.to_device(tqkern.TQParams.default(fmt), "cuda")
    assert decode_path(layout, 4, same_codebooks=params.same_codebooks) == path
    num_blocks, max_blocks, s = 64, 16, 3
    perm = torch.randperm(num_blocks, device="cuda")[: s * max_blocks].reshape(s, max_blocks).int()
    bt = perm.clone()
    sl = torch.tensor([5, 100, 256], dtype=torch.int32, device="cuda")
    cache = _fill(layout, params, num_blocks, torch.tensor([256] * s, dtype=torch.int32, device="cuda"), bt)
    q = torch.randn(s, 4 * heads, 128, device="cuda", dtype=torch.float16)
    out = torch.full_like(q, float("nan"))
    ws = torch.empty(1 << 20, dtype=torch.float32, device="cuda")
    paged_decode(q, cache, bt, sl, layout, params, out=out, workspace=ws, num_splits=3)  # warm up / compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(q, cache, bt, sl, layout, params, out=out, workspace=ws, num_splits=3)
    for lens, table in (([1, 17, 200], perm), ([256, 3, 64], perm.flip(0))):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        bt.copy_(table)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expect = ref.paged_decode(q.float().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(),
                                  sl.cpu().numpy(), layout, params.params)
        vmax = _vmax(cache, bt, sl, layout, params)
        assert torch.isfinite(out).all()
        assert np.abs(out.float().cpu().numpy() - expect).max() <= 4e-3 * vmax


@pytest.mark.parametrize("preset,arrangement,heads", [("tq4", "row", 2), ("turboquant_4bit_nc", "slot", 2),
                                                     ("tq4", "row", 8)])  # 8 heads: cooperative stages
def test_64k_context(preset, arrangement, heads):
    fmt = tqkern.KVFormat.preset(preset, 128)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=heads, block_size=16, arrangement=arrangement)
    params = tqt.to_device(tqkern.TQParams.default(fmt), "cuda")
    n = 65536
    nb = n // 16
    bt = torch.randperm(nb, device="cuda").int()[None]
    sl = torch.tensor([n], dtype=torch.int32, device="cuda")
    cache = _fill(layout, params, nb, sl, bt)
    q = torch.randn(1, 4 * heads, 128, device="cuda", dtype=torch.float16)
    out = paged_decode(q, cache, bt, sl, layout, params)
    expect = _dense_reference(q, cache, bt, sl, layout, params)
    assert (out.float() - expect).abs().max() <= 4e-3 * _vmax(cache, bt, sl, layout, params)


_COOP_CASES = [(p, a, b, 128, 8) for b in (16, 32) for p, a in (
    ("tq4", "row"), ("turboquant_4bit_nc", "slot"), ("turboquant_k8v4", "slot"), ("turboquant_k3v4_nc", "slot"),
    ("turboquant_3bit_nc", "slot"), ("tqkern_k5v3", "slot"), ("k4v3h", "slot"), ("k4v2h", "slot"),
    ("k3v2h", "slot"), ("k5v4h", "slot"))]
# head_dim 256 (Gemma-2-9B's 8 KV heads): 32-byte 4-bit key chunks, 12-byte 3-bit and 8-byte 2-bit value chunks
_COOP_CASES += [(p, "slot", 16, 256, 8) for p in ("turboquant_4bit_nc", "turboquant_3bit_nc", "k3v2h",
                                                   "turboquant_k3v4_nc", "turboquant_k8v4")]
# 16 KV heads: CTAs of 512 threads fill the 256-entry table (S27: they left it empty); head_dim 96 (Phi-3)
_COOP_CASES += [(p, "slot", 16, d, 16) for p, d in (("turboquant_4bit_nc", 128), ("turboquant_3bit_nc", 128),
                                                     ("k3v2h", 128), ("turboquant_4bit_nc", 96),
                                                     ("turboquant_k3v4_nc", 96), ("k4v3h", 96))]
# ... Lloyd-Max values whose 4 stages do not fit one CTA there: 2 stages of two steps
_COOP_CASES += [("tq4", "row", 16, 96, 16), ("k5v4h", "slot", 16, 96, 16), ("tqkern_k5v3", "slot", 16, 128, 16),
                ("k5v4h", "slot", 16, 128, 16)]


@pytest.mark.parametrize("preset,arrangement,block_size,head_dim,heads", _COOP_CASES)
def test_cooperative_stages_match_the_per_warp_kernel_bit_for_bit(preset, arrangement, block_size, head_dim, heads):
    """The cooperative stages only change where a head-warp reads its words (shared memory
    instead of global memory): every partial (acc, max, sum) equals the per-warp kernel's bit for
    bit, with 1 and 3 splits, lengths ending mid-step and mid-block, shuffled blocks, random bytes
    in the unused slots, every stage count, with the 32 KB pair table and (4-bit keys) the
    PRMT-addressed 64 KB one (its stages split around it as planned, and all above it), values
    read after the update (the plan's) or with the keys, at the plan's steps per update and (one
    ring) at the per-warp kernel's."""
    import triton

    from tqkern.ops.paged_decode.coop_variants import two_cta_plan
    from tqkern.ops.paged_decode.mma_plans import coop_plan, coop_smem_bytes, mma_plan, per_warp_plan, table256_plan
    from tqkern.ops.paged_decode.triton import _workspace, device_caps, launch_mma_plan

    fmt = tqkern.KVFormat.preset(preset, head_dim)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=heads, block_size=block_size, arrangement=arrangement)
    params = tqt.to_device(tqkern.TQParams.default(fmt), "cuda")
    plan = mma_plan(layout, 32 // heads)
    assert plan.COOP in (2, 3, 4) and device_caps(torch.device("cuda")).smem_per_block_optin >= coop_smem_bytes(plan)
    sl = torch.tensor([1, 15, 16, 17, 77, 600, 999, 1000], dtype=torch.int32, device="cuda")
    max_blocks = -(-1000 // block_size)
    num_blocks = len(sl) * max_blocks + 5
    bt = torch.randperm(num_blocks, device="cuda")[: len(sl) * max_blocks].reshape(len(sl), max_blocks).int()
    cache = _fill(layout, params, num_blocks, sl, bt, seed=block_size)
    q = torch.randn(len(sl), 32, head_dim, device="cuda", dtype=torch.float16)
    q_rot = ((q.float() @ params.rotation) if fmt.key.rotated else q.float()).contiguous()
    groups = []  # (per-warp reference, cooperative variants that must equal it bit for bit)
    for sub in sorted({per_warp_plan(plan).SUB, plan.SUB}):
        ref_plan = dataclasses.replace(per_warp_plan(plan), SUB=sub)
        variants = []
        for n in (2, 3, 4) if sub == plan.SUB else (3,):  # (the other step count: one ring)
            p = coop_plan(ref_plan, layout, n)
            if p is None:  # more stages than one CTA's shared memory holds
                continue
            variants.append(dataclasses.replace(p, LUT_AT=None, NLOW=None))  # the 32 KB table
            if n == plan.COOP and sub == plan.SUB:  # the values read with the keys (LATE_V = 0)
                variants.append(dataclasses.replace(variants[-1], LATE_V=0))
            t256 = table256_plan(p) if sub == plan.SUB else None
            if t256:
                variants.append(t256)
                low = dataclasses.replace(t256, NLOW=0)  # every stage above the table
                if t256.NLOW and coop_smem_bytes(low) <= 232448:
                    variants.append(low)
        groups.append((ref_plan, variants))
    # (the PRMT-addressed 64 KB table: 4-bit keys' pairs alone; at head_dim 256 it and a stage ring of
    # 8 heads' rows do not fit one CTA's shared memory)
    if heads == 8:
        assert any(p.LUT_AT for _, vs in groups for p in vs) == (plan.K_BITS == 4 and plan.K_AT == 0 and head_dim < 256)
    assert any(p == plan for _, vs in groups for p in vs)  # the launcher's own plan is among them
    two = two_cta_plan(plan, layout)  # 5-bit keys at 8 KV heads: the launcher's two-CTA plan too
    assert two is None or any(p == two for _, vs in groups for p in vs)
    for splits in (1, 3):
        for ref_plan, variants in groups:
            got = []
            for p in [ref_plan] + variants:
                acc, ml = _workspace(None, len(sl), 32, splits, max(16, triton.next_power_of_2(head_dim)), q.device)
                acc.fill_(float("nan"))
                ml.fill_(float("nan"))
                tables = {"key_centroids_f32": params.key_centroids_f32,
                          "value_centroids_f32": params.value_centroids_f32}
                launch_mma_plan(q_rot, cache, bt, sl, layout, p, tables, acc, ml, num_splits=splits,
                                sm_scale=head_dim ** -0.5)
                got.append(((p.SUB, (p.COOP or 0), (p.LUT_AT or 0), p.NLOW, p.LATE_V),
                            acc.nan_to_num(7.0), ml.nan_to_num(7.0)))
            assert len(got) >= 2
            for variant, acc, ml in got[1:]:
                assert torch.equal(acc, got[0][1]) and torch.equal(ml, got[0][2]), (splits, variant)


_SHARED_CASES = [(p, h, g, b) for p, h, g, b in (
    ("turboquant_4bit_nc", 1, 8, 16), ("turboquant_4bit_nc", 1, 16, 32), ("turboquant_4bit_nc", 2, 8, 16),
    ("tq4", 1, 8, 16), ("tq4", 2, 16, 16), ("k5v4h", 1, 8, 32), ("k5v4h", 2, 8, 16), ("tqkern_k5v3", 1, 8, 16),
    ("turboquant_3bit_nc", 1, 8, 16), ("turboquant_k3v4_nc", 2, 4, 16), ("turboquant_k8v4", 1, 8, 16),
    ("k4v2h", 1, 8, 16))]


@pytest.mark.parametrize("preset,heads,group,block_size", _SHARED_CASES)
def test_shared_head_plans_match_oracle(monkeypatch, preset, heads, group, block_size):
    """One or two KV heads (Llama-3-70B on 8 or 4 GPUs): the shared-head plan (CTAs of 8 warps,
    each a split taking its steps of every stage) through ``paged_decode`` at 1 and 2 CTA splits and
    the planner's own count, against the NumPy oracle, with lengths that end mid-step, mid-stage and
    before the CTA's last warp has a step (1, 15, 17, 77), shuffled blocks, poisoned outputs (every
    case takes the plan here; by default the planner takes it for 5-bit keys at two KV heads); then
    the ring's other depths and tables give the same partials bit for bit (only where a warp reads
    changes)."""
    import triton

    import tqkern.ops.paged_decode.plan as plan_mod
    import tqkern.ops.paged_decode.triton as launch_mod
    from tqkern.ops.launch import BoundedCache
    from tqkern.ops.paged_decode.coop_variants import shared_head_plan
    from tqkern.ops.paged_decode.mma_plans import coop_plan, coop_smem_bytes, mma_plan, table256_plan
    from tqkern.ops.paged_decode.triton import _workspace, launch_mma_plan

    fmt = tqkern.KVFormat.preset(preset, 128)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=heads, block_size=block_size, arrangement="slot")
    default = plan_mod.shared_heads(mma_plan(layout, group), layout)
    assert (default is not None) == (heads == 2 and preset in ("k5v4h", "tqkern_k5v3") and group <= 8)  # (D128)
    monkeypatch.setattr(plan_mod, "shared_heads", lambda p, lay: shared_head_plan(p, lay, 8 // lay.num_kv_heads))
    monkeypatch.setattr(launch_mod, "_PREPARED", BoundedCache(64))
    params = tqkern.TQParams.default(fmt)
    p = tqt.to_device(params, "cuda")
    plan = shared_head_plan(mma_plan(layout, group), layout, 8 // heads)
    assert plan is not None and plan.WS == 8 // heads
    sl = torch.tensor([1, 15, 16, 17, 77, 300, 513, 1000], dtype=torch.int32, device="cuda")
    max_blocks = -(-1000 // block_size)
    num_blocks = len(sl) * max_blocks + 3
    g = torch.Generator(device="cuda").manual_seed(5)
    bt = torch.randperm(num_blocks, device="cuda", generator=g)[: len(sl) * max_blocks].reshape(len(sl), -1).int()
    cache = _fill(layout, p, num_blocks, sl, bt, seed=heads + group)
    q = torch.randn(len(sl), heads * group, 128, device="cuda", dtype=torch.float16, generator=g)
    expect = ref.paged_decode(q.double().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(), sl.cpu().numpy(),
                              layout, params)
    vmax = _vmax(cache, bt, sl, layout, p)
    for splits in (plan.WS, 2 * plan.WS, None):
        dp = tqt.plan_decode(q, cache, bt, layout, p, num_splits=splits)
        if splits is not None:  # (the planner's own count: FP8 keys' short splits may take the per-warp kernel)
            assert dp.decode.kernel == "coop" and dp.decode.constexpr("WS") == plan.WS, dp.describe()
        out = torch.full_like(q, float("nan"))
        paged_decode(q, cache, bt, sl, layout, p, out=out, num_splits=splits)
        assert torch.isfinite(out).all()
        assert np.abs(out.float().cpu().numpy() - expect).max() <= 4e-3 * vmax, splits
    q_rot = ((q.float() @ p.rotation) if fmt.key.rotated else q.float()).contiguous()
    variants = [plan] + [v for n in (2, 3, 4) if n != plan.COOP
                         for v in [coop_plan(dataclasses.replace(plan, LUT_AT=None, NLOW=None), layout, n)]
                         if v is not None and coop_smem_bytes(v) <= 232448]
    if plan.LUT_AT:
        variants.append(dataclasses.replace(plan, LUT_AT=None, NLOW=None))
    elif plan.K_BITS == 4 and not plan.K_AT:
        variants += [t for t in [table256_plan(plan)] if t is not None]
    assert len(variants) >= 2
    got = []
    for v in variants:
        acc, ml = _workspace(None, len(sl), q.shape[1], 2 * plan.WS, max(16, triton.next_power_of_2(128)), q.device)
        acc.fill_(float("nan"))
        ml.fill_(float("nan"))
        tables = {"key_centroids_f32": p.key_centroids_f32, "value_centroids_f32": p.value_centroids_f32}
        launch_mma_plan(q_rot, cache, bt, sl, layout, v, tables, acc, ml, num_splits=2 * plan.WS,
                        sm_scale=128 ** -0.5)
        got.append((v, acc.nan_to_num(7.0), ml.nan_to_num(7.0)))
    for v, acc, ml in got[1:]:
        assert torch.equal(acc, got[0][1]) and torch.equal(ml, got[0][2]), (v.COOP, v.LUT_AT, v.NLOW)


@pytest.mark.parametrize("preset", ["k5v4h", "tqkern_k5v3"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_two_cta_plan_and_transform_merge_match_dense_attention(preset, dtype):
    """The launcher's own plan at a shape that takes two CTAs per SM (160 sequences of up to 1024
    tokens, 8 KV heads, one split) and rotates back by the Walsh–Hadamard transform in the merge,
    with fp16 and bf16 queries (the merge then writes bf16): against float32 attention over the
    decompressed K/V; lengths from 1 to 1024, shuffled blocks, the output poisoned first."""
    fmt = tqkern.KVFormat.preset(preset, 128)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=8, block_size=16, arrangement="slot")
    params = tqt.to_device(tqkern.TQParams.default(fmt), "cuda")
    s, n = 160, 1024
    g = torch.Generator(device="cuda").manual_seed(11)
    sl = torch.randint(1, n + 1, (s,), device="cuda", generator=g, dtype=torch.int32)
    sl[0], sl[1] = n, 1
    nb = s * (n // 16)
    bt = torch.randperm(nb + 7, device="cuda", generator=g)[:nb].reshape(s, n // 16).int()
    cache = _fill(layout, params, nb + 7, sl, bt, seed=3)
    q = torch.randn(s, 32, 128, device="cuda", dtype=getattr(torch, dtype), generator=g)
    plan = tqt.plan_decode(q, cache, bt, layout, params)
    assert plan.decode.kernel == "coop" and plan.decode.constexpr("COOP") == 2 and plan.num_splits == 1
    assert plan.merge.fwht
    out = torch.full_like(q, float("nan"))
    paged_decode(q, cache, bt, sl, layout, params, out=out)
    expect = _dense_reference(q, cache, bt, sl, layout, params)
    assert torch.isfinite(out).all()
    assert (out.float() - expect).abs().max() <= 4e-3 * _vmax(cache, bt, sl, layout, params)


def test_cache_above_2gib_uses_64bit_offsets():
    fmt = tqkern.KVFormat.preset("tq4", 128)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=8, block_size=16, arrangement="row")
    params = tqt.to_device(tqkern.TQParams.default(fmt), "cuda")
    num_blocks = (2**31 // layout.block_bytes) + 4096  # > 2 GiB
    cache = torch.randint(0, 256, layout.cache_shape(num_blocks), dtype=torch.uint8, device="cuda")
    assert cache.numel() > 2**31
    # The sequence's blocks sit at the very end of the cache.
    bt = torch.arange(num_blocks - 64, num_blocks, device="cuda").int().flip(0)[None]
    sl = torch.tensor([64 * 16], dtype=torch.int32, device="cuda")
    slots = tqt.sequence_slot_ids(bt, sl, 16)[0]
    k = torch.randn(1024, 8, 128, device="cuda", dtype=torch.float16)
    v = torch.randn(1024, 8, 128, device="cuda", dtype=torch.float16)
    tqt.store(cache, k, v, slots, layout, params)
    got_k, got_v = tqt.decompress(cache, slots, layout, params, rotate_back=True)
    assert (got_k - k.float()).norm() / k.float().norm() < 0.15
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.float16)
    out = paged_decode(q, cache, bt, sl, layout, params)
    expect = _dense_reference(q, cache, bt, sl, layout, params)
    assert (out.float() - expect).abs().max() <= 4e-3 * _vmax(cache, bt, sl, layout, params)


_K5 = tqkern.LloydMax(bits=5, norm_dtype="float16")
_FAMILY = tqkern.KVFormat.preset


@pytest.mark.parametrize("fmt,heads,block_size,expect", [
    # rows of 2 mod 4 bytes (odd tokens' rows 2 bytes off a word): SmolLM2's vLLM formats
    (tqkern.KVFormat.preset("turboquant_4bit_nc", 64), 3, 16, dict(K_FUN=True, V_FUN=True)),
    (tqkern.KVFormat.preset("turboquant_4bit_nc", 64), 3, 2, dict(K_FUN=True, V_FUN=True)),
    (tqkern.KVFormat.preset("turboquant_k3v4_nc", 64), 3, 32, dict(K_BITS=3, V_FUN=True)),
    (tqkern.KVFormat.preset("turboquant_3bit_nc", 64), 3, 16, dict(K_BITS=3, V_BITS=3)),
    (tqkern.KVFormat.preset("turboquant_3bit_nc", 128), 1, 4, dict(K_BITS=3, V_BITS=3)),
    # 4-bit keys misaligned against their 16-byte chunks (rows of 268 bytes): shifted, not joined
    (tqkern.KVFormat.preset("turboquant_4bit_nc", 128), 2, 16, dict(K_FUN=True, K_MERGE=False)),
    # Lloyd-Max values: two 16-token steps per iteration (lengths end in either of them), also
    # with blocks shorter than a step
    (tqkern.KVFormat.preset("tq4", 128), 2, 16, dict(SUB=2, V_UNIFORM=False)),
    (tqkern.KVFormat.preset("tq4", 64), 3, 4, dict(SUB=2, V_UNIFORM=False)),
    # 5-bit keys with 3-bit Lloyd-Max values (own codebook) and with 3-/4-bit uniform values
    (tqkern.KVFormat.preset("tqkern_k5v3", 128), 2, 16, dict(K_BITS=5, V_BITS=3, V_UNIFORM=False, SUB=2)),
    (tqkern.KVFormat.preset("tqkern_k5v3", 64), 3, 16, dict(K_BITS=5, V_BITS=3)),
    (tqkern.KVFormat(head_dim=64, key=_K5, value=tqkern.Uniform(bits=3), slot_alignment=2), 3, 16,
     dict(K_BITS=5, V_BITS=3, V_UNIFORM=True)),
    (tqkern.KVFormat(head_dim=128, key=_K5, value=tqkern.Uniform(bits=4), slot_alignment=2), 1, 16,
     dict(K_BITS=5, V_BITS=4, V_UNIFORM=True, SUB=1)),
    # Lloyd-Max values of their own codebook below the keys' table entries (K_AT): docs/quality.md's
    # per-layer formats (2- and 3-bit values next to 4- and 3-bit keys, 4-bit values next to 5-bit keys)
    (_FAMILY("k4v3h", 128), 2, 16, dict(K_BITS=4, V_BITS=3, K_AT=64)),
    (_FAMILY("k4v3h", 64), 3, 16, dict(K_BITS=4, V_BITS=3, K_AT=64)),
    (_FAMILY("k4v2h", 128), 2, 16, dict(K_BITS=4, V_BITS=2, K_AT=64)),
    (_FAMILY("k4v2h", 64), 3, 16, dict(K_BITS=4, V_BITS=2, K_AT=64)),
    (_FAMILY("k3v2h", 128), 2, 16, dict(K_BITS=3, V_BITS=2, K_AT=64)),
    (_FAMILY("k3v2h", 64), 3, 16, dict(K_BITS=3, V_BITS=2, K_AT=64)),
    (_FAMILY("k3v3h", 64), 3, 16, dict(K_BITS=3, V_BITS=3, K_AT=64)),
    (_FAMILY("k5v4h", 128), 2, 16, dict(K_BITS=5, V_BITS=4, K_AT=256)),
    (_FAMILY("k5v4h", 64), 3, 16, dict(K_BITS=5, V_BITS=4, K_AT=256)),
    (_FAMILY("k5v2h", 64), 3, 16, dict(K_BITS=5, V_BITS=2, K_AT=64)),
    # head_dim 96 (Phi-3): 12-byte key chunks (shifted where not aligned), 6-byte value chunks
    # (shifted; the last word two M tiles); 4 KV heads: cooperative stages
    (_FAMILY("turboquant_4bit_nc", 96), 2, 16, dict(D=96, K_FUN=True, V_FUN=True, V_UNIFORM=True)),
    (_FAMILY("turboquant_4bit_nc", 96), 4, 16, dict(D=96, K_FUN=True, V_FUN=True, COOP=2)),
    (_FAMILY("tq4", 96), 2, 16, dict(D=96, V_FUN=True, V_UNIFORM=False)),
    (_FAMILY("tq4", 96), 4, 16, dict(D=96, V_FUN=True, V_UNIFORM=False, COOP=4)),
    (_FAMILY("turboquant_k8v4", 96), 2, 16, dict(D=96, K_FP8=True)),
    (_FAMILY("turboquant_k3v4_nc", 96), 3, 16, dict(D=96, K_BITS=3, V_FUN=True)),
    (_FAMILY("k4v2h", 96), 2, 16, dict(D=96, K_BITS=4, V_BITS=2)),
    (_FAMILY("k5v4h", 96), 2, 16, dict(D=96, K_BITS=5, V_BITS=4, V_FUN=True)),
    # 3-bit values at head_dim 96: 36-bit chunks, every other lane's starting at bit 4 of a byte
    (_FAMILY("turboquant_3bit_nc", 96), 2, 16, dict(D=96, K_BITS=3, V_BITS=3, V_UNIFORM=True)),
    (_FAMILY("turboquant_3bit_nc", 96), 4, 16, dict(D=96, K_BITS=3, V_BITS=3, COOP=2)),
    (_FAMILY("k4v3h", 96), 2, 16, dict(D=96, K_BITS=4, V_BITS=3, V_UNIFORM=False)),
    (_FAMILY("tqkern_k5v3", 96), 3, 16, dict(D=96, K_BITS=5, V_BITS=3)),
    # Phi-3-mini on 2 GPUs (16 KV heads): cooperative CTAs of 512 threads (the table's fill)
    (_FAMILY("turboquant_4bit_nc", 96), 16, 16, dict(D=96, COOP=2)),
    (_FAMILY("turboquant_3bit_nc", 96), 16, 16, dict(D=96, V_BITS=3, COOP=2)),
    (_FAMILY("turboquant_k3v4_nc", 128), 16, 16, dict(K_BITS=3, COOP=2)),
], ids=lambda x: x if isinstance(x, int) else None)
def test_warp_mma_read_schemes_match_oracle(fmt, heads, block_size, expect):
    """Each read scheme of the warp-MMA kernel (shifted words, 3-bit values, 5-bit keys) on a
    layout that is sure to take it, against the NumPy oracle: shuffled blocks, random poison in
    every unused byte, lengths that end mid-block and mid-step, 3 query heads per KV head."""
    _mma_matches_oracle(fmt, heads, block_size, 3, expect)


_D256_PRESETS = ["turboquant_k8v4", "turboquant_k3v4_nc", "tq4", "turboquant_4bit_nc", "turboquant_3bit_nc",
                 "tqkern_k5v3", "k4v3h", "k4v2h", "k5v4h"]


@pytest.mark.parametrize("preset,group,dtype", [(p, g, "float16") for p in _D256_PRESETS for g in (1, 2, 4)]
                         + [(p, 2, "bfloat16") for p in _D256_PRESETS])
def test_warp_mma_head_dim_256_matches_oracle(preset, group, dtype):
    """head_dim 256 at the KV heads of Gemma-7B (16, GQA 1), Gemma-2-9B (8, GQA 2) and Gemma-3-1B
    (1, GQA 4): every key and value read scheme (32-byte 4-bit key chunks joined, aligned or
    shifted, 40-byte 5-bit ones, 12-byte 3-bit and 8-byte 2-bit value chunks; per-warp and
    cooperative), with fp16 and bf16 queries."""
    heads = {1: 16, 2: 8, 4: 1}[group]
    _mma_matches_oracle(tqkern.KVFormat.preset(preset, 256), heads, 16, group, dict(D=256),
                        dtype=getattr(torch, dtype))


@pytest.mark.parametrize("preset,heads,group,gs,qt", [
    ("tq4", 1, 16, 1, 2), ("turboquant_4bit_nc", 1, 16, 1, 2), ("turboquant_k8v4", 2, 16, 1, 2),
    ("turboquant_3bit_nc", 2, 12, 1, 2), ("turboquant_k3v4_nc", 1, 32, 2, 2), ("tqkern_k5v3", 1, 24, 2, 2),
    ("tq4", 2, 9, 3, 1), ("turboquant_4bit_nc", 1, 40, 4, 2),
    # four and eight KV heads: two column tiles under cooperative stages
    ("tq4", 4, 16, 1, 2), ("turboquant_4bit_nc", 8, 16, 1, 2), ("turboquant_3bit_nc", 8, 16, 1, 2)])
def test_warp_mma_gqa_groups_above_8_match_oracle(preset, heads, group, gs, qt):
    """GQA groups above the MMA's 8 query heads (Llama-3-405B on 8 GPUs: 16 per KV head; the
    short-row prefill path: G·T) run as ``GS`` warps per KV head with ``QT`` query column tiles
    each (two MMAs per decoded fragment), or single tiles for odd groups."""
    _mma_matches_oracle(tqkern.KVFormat.preset(preset, 128), heads, 16, group, dict(GS=gs, QT=qt))


@pytest.mark.parametrize("preset,heads,group,expect", [
    ("tq4", 3, 1, dict(COOP=None)), ("tq4", 3, 3, dict(COOP=None)), ("turboquant_4bit_nc", 4, 2, dict(COOP=2)),
    ("k4v3h", 3, 2, dict(K_AT=64))])
def test_warp_mma_head_dim_96_aligned_key_chunks_match_oracle(preset, heads, group, expect):
    """head_dim 96 rows whose 12-byte 4-bit key chunks sit at aligned offsets (``arrangement="row"``,
    e.g. tq4 with 3 KV heads: 312-byte rows): three single-word loads per chunk, neither shifted nor
    joined (session 28: such layouts failed to compile; the GPU fuzz test found it)."""
    _mma_matches_oracle(tqkern.KVFormat.preset(preset, 96), heads, 16, group,
                        dict(D=96, K_BITS=4, K_FUN=False, K_MERGE=False, **expect), arrangement="row")


def _mma_matches_oracle(fmt, heads, block_size, group, expect, dtype=torch.float16, arrangement="slot"):
    from tqkern.ops.paged_decode.mma_plans import mma_plan

    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=heads, block_size=block_size, arrangement=arrangement)
    plan = mma_plan(layout, group)
    assert plan is not None and {k: getattr(plan, k) for k in expect} == expect
    params = tqkern.TQParams.default(fmt)
    p = tqt.to_device(params, "cuda")
    assert decode_path(layout, group, same_codebooks=p.same_codebooks) == "mma"
    seq_lens = torch.tensor([1, 37, 300, 513], dtype=torch.int32, device="cuda")
    max_blocks = -(-600 // block_size)
    num_blocks = 4 * max_blocks + 3
    g = torch.Generator(device="cuda").manual_seed(7)
    bt = torch.randperm(num_blocks, device="cuda", generator=g)[: 4 * max_blocks].reshape(4, max_blocks).int()
    cache = _fill(layout, p, num_blocks, seq_lens, bt, seed=block_size + heads)
    q = torch.randn(4, heads * group, fmt.head_dim, device="cuda", dtype=dtype, generator=g)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, cache, bt, seq_lens, layout, p, out=out, num_splits=3)
    expect_out = ref.paged_decode(q.double().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(),
                                  seq_lens.cpu().numpy(), layout, params)
    vmax = _vmax(cache, bt, seq_lens, layout, p)
    assert torch.isfinite(out).all()
    assert np.abs(out.float().cpu().numpy() - expect_out).max() <= 4e-3 * vmax


@pytest.mark.parametrize("path", ["auto", "general"])
@pytest.mark.parametrize("arrangement", ["slot", "row"])
@pytest.mark.parametrize("preset", ["fp16"] + _D256_PRESETS)
def test_head_dim_256_with_gemma2_options_matches_oracle(preset, arrangement, path):
    """Gemma-2-9B's decode (head_dim 256, 8 KV heads, GQA 2, logit soft-cap 50, a 200-token window
    as on its local layers) on the plan's kernel (``"auto"``: the warp-MMA kernel where it takes the
    layout, which applies both options since session 49) and on the general kernel: every preset and
    arrangement compiles into a tile the device holds (session 49: row-arranged turboquant_k3v4_nc
    asked 238 KB of shared memory at BN 128 with 2 stages and failed to load) and matches the
    oracle with the options. Tolerance ``(4e-3 + 2δ)·max|V̂|`` (δ: the fp16 dot's logit error
    bound, ``property_tests/test_paged_decode_options.py``)."""
    from tqkern.ops.paged_decode.triton import _launch_paged_decode

    fmt = tqkern.KVFormat.preset(preset, 256)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=8, block_size=16, arrangement=arrangement)
    params = tqkern.TQParams.default(fmt)
    p = tqt.to_device(params, "cuda")
    seq_lens = torch.tensor([1, 37, 300, 513], dtype=torch.int32, device="cuda")
    max_blocks = -(-600 // 16)
    g = torch.Generator(device="cuda").manual_seed(11)
    bt = torch.randperm(4 * max_blocks + 3, device="cuda", generator=g)[: 4 * max_blocks].reshape(4, max_blocks).int()
    cache = _fill(layout, p, 4 * max_blocks + 3, seq_lens, bt, seed=3)
    q = torch.randn(4, 16, 256, device="cuda", dtype=torch.float16, generator=g)
    opts = dict(logit_softcap=50.0, window_left=200)
    if path == "auto":
        plan = tqt.plan_decode(q, cache, bt, layout, p, **opts)
        plain = tqt.plan_decode(q, cache, bt, layout, p)
        assert plan.path == plain.path and plan.path == ("general" if preset == "fp16" else "mma")
        out = paged_decode(q, cache, bt, seq_lens, layout, p, **opts)
    else:
        q_rot = q.float() @ p.rotation if fmt.key.rotated else q.float()
        tables = {"rotation": p.rotation, "key_centroids_f32": p.key_centroids_f32,
                  "value_centroids_f32": p.value_centroids_f32}
        out = torch.full_like(q_rot, float("nan"))
        _launch_paged_decode(out, q_rot.contiguous(), cache, bt, seq_lens, layout, tables, sm_scale=256**-0.5,
                             same_codebooks=p.same_codebooks, path="general", **opts)
    q64, cache_np, bt_np, sl_np = q.double().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(), seq_lens.cpu().numpy()
    want = ref.paged_decode(q64, cache_np, bt_np, sl_np, layout, params, **opts)
    got = out.float().cpu().numpy()
    assert np.all(np.isfinite(got))
    q_k = q64 @ params.rotation if fmt.key.rotated else q64
    rnd = Rounding.of(fmt, "float16", workspace=False)
    for s, slots in enumerate(ref.gather_sequences(cache_np, layout, bt_np, sl_np)):
        lo = max(0, int(sl_np[s]) - 1 - opts["window_left"])
        khat, _ = ref.decompress(slots, params)
        _, vhat = ref.decompress(slots, params, rotate_back=True)
        delta = rnd.logit_bound(q_k[s], khat[lo:], 2) + 50.0 * 2.0**-21
        tol = rnd.atol(delta, float(np.abs(vhat[lo:]).max()))
        err = float(np.abs(got[s] - want[s]).max())
        assert err <= tol, f"seq {s}: error {err:.3g} > {tol:.3g} (δ {delta:.3g})"
