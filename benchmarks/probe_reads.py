"""What the decode's order of reads costs the memory system (a GPU timing probe, not a test).

For each decode shape and preset, against SDPA fp16 in the same run:

* ``blocks``: every cache block read once by a plain kernel (one program per block, coalesced
  16-byte loads, summed), in the shuffled block table's order and in storage order: what DRAM
  delivers for these bytes when nothing else happens;
* the warp-MMA kernel alone and the public ``paged_decode``, with the shuffled block table and
  with a sorted one (sequence ``s`` holds blocks ``s·n ..``). (The kernel's loads-only timing
  probe, ``PROBE = 1``, was removed: docs/performance.md.)

    python benchmarks/probe_reads.py --out $OUT [--shapes B32x16K] [--presets tq4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._gpu import require_cuda  # noqa: E402
from benchmarks.bench_decode import BLOCK, baseline_runs, bench, preset_caches  # noqa: E402
from benchmarks.sweep_mma import launch, resident_for  # noqa: E402
from tqkern.ops.paged_decode.mma_plans import mma_plan, num_splits_mma  # noqa: E402
from tqkern_torch.attention import paged_decode  # noqa: E402


@triton.jit
def _read_blocks(words_ptr, order_ptr, out_ptr, WORDS: tl.constexpr, CHUNK: tl.constexpr):
    """Program ``i``: the sum of the int32 words of block ``order[i]`` (``WORDS`` words)."""
    pid = tl.program_id(0)
    base = words_ptr + tl.load(order_ptr + pid).to(tl.int64) * WORDS
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.int32)
    for k in tl.static_range(0, WORDS, CHUNK):
        acc += tl.load(base + k + offs, mask=k + offs < WORDS, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_blocks(cache, order, block_bytes):
    words = cache.view(-1).view(torch.int32)  # rows of 134-byte slots: the whole cache as words
    out = torch.empty(order.numel(), dtype=torch.int32, device=cache.device)
    _read_blocks[(order.numel(),)](words, order, out, WORDS=block_bytes // 4, CHUNK=1024, num_warps=4)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", nargs="*", default=["B32x16K", "B8x64K"])
    ap.add_argument("--presets", nargs="*", default=["tq4", "turboquant_4bit_nc"])
    args = ap.parse_args(argv)
    require_cuda(__file__)
    res = dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__, time=time.strftime("%F %T"), rows=[])
    g = torch.Generator(device="cuda").manual_seed(5)
    for shape, q, sdpa, bt, sl in baseline_runs(args.shapes, g, res["rows"]):
        b, L, hq, hkv, d = shape.batch, shape.seq_len, shape.num_q_heads, shape.num_kv_heads, shape.head_dim
        sorted_bt = torch.arange(bt.numel(), device="cuda", dtype=torch.int32).reshape(bt.shape)
        for preset, layout, params, cache in preset_caches(shape, args.presets, g):
            nbytes = b * L * layout.row_bytes
            block_bytes = BLOCK * layout.row_bytes
            out = torch.empty_like(q)

            def row(variant, order, us):
                res["rows"].append(dict(shape=shape.name, variant=preset, probe=variant, order=order, us=us,
                                        gbps=nbytes / us / 1e3, ratio=sdpa / us))
                print(f"{shape.name} {preset:20s} {variant:12s} {order:8s} {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s "
                      f"{sdpa / us:.2f}x SDPA", flush=True)

            for order, table in (("shuffled", bt), ("sorted", sorted_bt)):
                flat = table.flatten().contiguous()
                got = read_blocks(cache, flat, block_bytes).long()
                want = cache.view(-1).view(torch.int32).view(-1, block_bytes // 4)[flat.long()].long().sum(1)
                assert torch.equal(got & 0xFFFFFFFF, want & 0xFFFFFFFF), "block read sums differ"
                row("blocks", order, bench(lambda: read_blocks(cache, flat, block_bytes)))
                row("public", order, bench(lambda: paged_decode(q, cache, table, sl, layout, params, out=out,
                                                                check_lengths=False)))
                g_ = hq // hkv
                if mma_plan(layout, g_) is None:
                    continue
                ns = num_splits_mma(b, hkv, L, resident_for(q, cache, table, sl, layout, params, mma_plan(layout, g_)))
                fn = launch(q, cache, table, sl, layout, params, out, prefetch=0, hint=1, warps=4, num_splits=ns,
                            parts="kernel")
                row("kernel", order, bench(fn))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_reads.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
