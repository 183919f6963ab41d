"""GPU-only: the programmatic dependent launch of the decode and the merge (``DecodePlan.pdl``)
changes no output bit, eagerly and under CUDA-graph replay."""

import pytest
import torch

import tqkern
import tqkern_torch as tqt
import tqkern.ops.paged_decode.plan as plan_mod
import tqkern.ops.paged_decode.triton as launch_mod
from tqkern_torch.attention import paged_decode, plan_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("preset,kernel,hq,hkv", [("turboquant_4bit_nc", "coop", 32, 8), ("k5v4h", "coop", 32, 8),
                                                   ("turboquant_k8v4", "mma", 28, 4)])
def test_early_launch_changes_no_bit(preset, kernel, hq, hkv, monkeypatch):
    fmt = tqkern.KVFormat.preset(preset, 128)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=hkv, block_size=16, arrangement="slot")
    params = tqt.to_device(tqkern.TQParams.default(fmt), "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, mb = 4000, 256
    block_table = torch.randperm(mb, generator=g, device="cuda").to(torch.int32)[None]
    seq_lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    cache = torch.zeros(layout.cache_shape(mb), dtype=torch.uint8, device="cuda")
    slots = tqt.sequence_slot_ids(block_table, seq_lens, 16)[0, :n]
    k, v = (torch.randn(n, hkv, 128, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    tqt.store(cache, k, v, slots, layout, params)
    q = torch.randn(1, hq, 128, device="cuda", dtype=torch.float16, generator=g)

    def run():
        launch_mod._PREPARED.clear()
        plan = plan_decode(q, cache, block_table, layout, params)
        eager = paged_decode(q, cache, block_table, seq_lens, layout, params)
        out = torch.empty_like(q)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_decode(q, cache, block_table, seq_lens, layout, params, out=out, check_lengths=False)
        out.fill_(float("nan"))  # poisoned: the replay must write every element
        graph.replay()
        torch.cuda.synchronize()
        return plan, eager, out.clone()

    plan, eager, replayed = run()
    assert plan.pdl and plan.decode.kernel == kernel, plan.summary()
    monkeypatch.setattr(plan_mod, "use_pdl", lambda caps, decode: False)
    plain_plan, plain, plain_replayed = run()
    launch_mod._PREPARED.clear()
    assert not plain_plan.pdl and plain_plan.decode == plan.decode
    assert torch.equal(eager, plain) and torch.equal(replayed, plain_replayed) and torch.equal(eager, replayed)
