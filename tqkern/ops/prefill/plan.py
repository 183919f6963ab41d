"""The prefill plan: every choice a ``prefill`` launch makes from the layout, the head counts, the
options and the device, as one typed, frozen value (:class:`PrefillPlan`) built by one pure
function (:func:`plan_prefill`).

A launch has two kernels: the q rotation with the block-table scan (the decode's
:func:`tqkern.ops.paged_decode.rotate._rotate_q_kernel`, here over ``num_tokens·Hq`` query rows)
and the prefill kernel (:mod:`.kernel`). The prefill grid is ``(num_tokens // BQ + num_seqs,
num_kv_heads)``: enough programs for every query tile of every sequence whatever the lengths
(a sequence of ``q_len`` tokens starting at ``qsl[s]`` needs ``ceil(q_len / BQ)`` tiles, at most
``qsl[s+1] // BQ − qsl[s] // BQ + 1``), so the host never reads ``query_start_loc``.

Tile sizes are first choices, **unmeasured** (no GPU run yet), picked by the offline sm_90
compile (``tests/test_prefill_sm90_compile.py``: fewest spills among 64/128 rows × 32/64 keys ×
4/8 warps, Triton 3.9): head_dim ≤ 128: ``BM = 128`` query rows (query positions × the GQA
group, padded to a power of two) by ``BN = 64`` keys, 8 warps, 2 stages; head_dim 256: 64 × 32,
8 warps, 1 stage. The interpreter takes 32 × 32 tiles (fewer, larger NumPy steps).

head_dim 32 takes 64 × 64 tiles. Triton 3.6 miscompiles both neighbours there (session 46,
H200): at 128 × 64, for 3-bit keys (turboquant_3bit_nc, turboquant_k3v4_nc), the key tile's shared
buffer gets a 128-byte swizzle, the value tile's a 64-byte one, and the P·V ``wgmma`` reads shared
memory far past the kernel's 22.5 KB (compute-sanitizer: "Invalid __shared__ read of size 1024
bytes" at offsets 0x1f000 / 0x22400), an illegal memory access on 11 of 12 fuzzed batches (one
stage: 9 of 12, four warps: 12 of 12); at 32 keys a step (128 × 32 or 64 × 32) every
compressed preset's output is wrong (max error ≈ max|output| against the oracle; raw fp16 right).
64 × 64 ran the 12 batches cleanly and matched the oracle for every preset tried, both kernels.
"""

from __future__ import annotations

import dataclasses
import functools

from tqkern.layouts import PagedLayout
from tqkern.ops.codecs import DT_BF16, Kind, layout_args
from tqkern.ops.common import halfword_aligned
from tqkern.ops.paged_decode.plan import DeviceCaps, RotatePlan, fast_path_plan, scan_split

__all__ = ["PrefillPlan", "plan_prefill"]


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """Everything one ``prefill`` launch runs, but the grid's size (:meth:`grid`).

    Attributes:
        layout: the cache's layout. num_q_heads: Hq. caps: the device.
        group: GQA group ``Hq // Hkv``; ``group_pad``: it rounded up to a power of two.
        block_q: query positions per program (``BQ``); ``block_m = block_q · group_pad`` rows.
        block_n: keys per step (``BN``).
        num_warps, num_stages: compile options of the prefill kernel.
        dot: ``"fp16"`` or ``"bf16"`` (raw bf16 caches): the dtype of the tensor-core products.
        window, softcap, sinks, lse: which options the kernel is compiled with.
        int8: Q·Kᵀ on int8 codes (``int8_prefill``; the keys through the float32 loader).
        rotate_rows, rotate_cols: the q rotation's rows and output columns per program.
        constexprs: the prefill kernel's constexprs (name, value pairs in a fixed order).
    """

    layout: PagedLayout
    num_q_heads: int
    caps: DeviceCaps
    group: int
    group_pad: int
    block_q: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    dot: str
    window: bool
    softcap: bool
    sinks: bool
    lse: bool
    int8: bool
    rotate_rows: int
    rotate_cols: int
    constexprs: tuple[tuple[str, object], ...]

    def grid(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The prefill kernel's grid for a batch of these sizes (programs past a sequence's last
        tile exit without work)."""
        return num_tokens // self.block_q + num_seqs, self.layout.num_kv_heads

    def rotate_plan(self, num_tokens: int, num_seqs: int, max_blocks: int) -> RotatePlan:
        """The q rotation with the block-table scan for a batch of these sizes."""
        n = num_tokens * self.num_q_heads
        programs = -(-n // self.rotate_rows)
        dp = layout_args(self.layout)["DP"]
        sb, scan_rows = scan_split(num_seqs * max_blocks, dp // self.rotate_cols)
        return RotatePlan(grid=(programs + scan_rows, dp // self.rotate_cols), programs=programs,
                          rows=self.rotate_rows, cols=self.rotate_cols, scan_block=sb,
                          rotate=bool(self.layout.format.key.rotated))

    def describe(self) -> str:
        """A readable one-line summary."""
        opts = [n for n in ("window", "softcap", "sinks", "lse", "int8") if getattr(self, n)]
        return (f"prefill D={self.layout.head_dim} Hq={self.num_q_heads} Hkv={self.layout.num_kv_heads} "
                f"group={self.group}: BQ={self.block_q} x GP={self.group_pad} = BM={self.block_m} rows, "
                f"BN={self.block_n}, {self.num_warps} warps, {self.num_stages} stages, dot {self.dot}"
                + (f", options {'/'.join(opts)}" if opts else ""))


def plan_prefill(layout: PagedLayout, num_q_heads: int, caps: DeviceCaps, *, window: bool = False,
                 softcap: bool = False, sinks: bool = False, lse: bool = False, int8: bool = False,
                 block_m: int | None = None,
                 block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None) -> PrefillPlan:
    """The plan of a prefill over ``layout`` with ``num_q_heads`` query heads on ``caps`` (pure;
    cached). ``window``/``softcap``/``sinks``/``lse``: compile the kernel with those options;
    ``int8``: the ``int8_prefill`` kernel (Q·Kᵀ on int8 codes).
    ``block_m`` (rows, a power of two ≥ 16), ``block_n`` (keys, a power of two ≥ 16) and the
    compile options override the defaults (module docstring)."""
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a tqkern.PagedLayout, got {type(layout).__name__}")
    if not isinstance(caps, DeviceCaps):
        raise TypeError(f"caps must be a DeviceCaps, got {type(caps).__name__}")
    hkv = layout.num_kv_heads
    if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads < 1 or num_q_heads % hkv:
        raise ValueError(f"num_q_heads must be a positive multiple of num_kv_heads = {hkv}, got {num_q_heads!r}")
    for name, v in (("block_m", block_m), ("block_n", block_n)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1)):
            raise ValueError(f"{name} must be None or a power of two >= 16, got {v!r}")
    return _plan(layout, num_q_heads, caps, bool(window), bool(softcap), bool(sinks), bool(lse), bool(int8), block_m,
                 block_n, num_warps, num_stages)


@functools.lru_cache(maxsize=256)
def _plan(layout, hq, caps, window, softcap, sinks, lse, int8, block_m, block_n, num_warps,
          num_stages) -> PrefillPlan:
    c = layout_args(layout)
    dp = c["DP"]
    g = hq // layout.num_kv_heads
    gp = 1 << max(0, (g - 1).bit_length())
    big = dp > 128
    if block_m is None:  # (dp 32: 64 x 64, the module docstring's miscompiles)
        block_m = 32 if caps.interpret else 64 if big or dp <= 32 else 128
    if block_n is None:
        block_n = 32 if caps.interpret or big else 64
    if num_warps is None:
        num_warps = 8
    if num_stages is None:
        num_stages = 1 if big else 2
    bq = max(1, block_m // gp)
    bm = max(16, bq * gp)  # (tl.dot needs 16 rows)
    raw_bf16 = any(s.KIND == Kind.RAW and s.PARAM_DTYPE == DT_BF16 for s in (c["K"], c["V"]))
    fast = fast_path_plan(layout)
    if 1 in (fast["K_FAST"], fast["V_FAST"]):
        # (the 16-bit-halves word read — turboquant_4bit_nc with one KV head — beside another
        # 4-bit side crashes Triton 3.6's TritonGPUOptimizeDotOperands pass: both take the loader)
        fast = dict(fast, K_FAST=0, V_FAST=0)
    if int8:
        fast = dict(fast, K_FAST=0)  # (the keys are reconstructed in float32 by the loader)
    consts = {k: v for k, v in c.items() if not k.startswith("PAD")}
    cx = dict(G=g, GP=gp, HQ=hq, BQ=bq, BM=bm, BN=block_n, BS=layout.block_size,
              K_FAST=fast["K_FAST"], V_FAST=fast["V_FAST"], USE_ASM=not caps.interpret,
              K_ALIGNED=halfword_aligned(layout, "key"), V_ALIGNED=halfword_aligned(layout, "value"),
              K_PAR_ALIGNED=fast["K_PAR_ALIGNED"], V_PAR_ALIGNED=fast["V_PAR_ALIGNED"],
              WINDOW=window, SOFTCAP=softcap, SINKS=sinks, LSE=lse, INT8=int8,
              ROTATE_BACK=bool(layout.format.value.rotated),
              DOT_PRECISION="ieee" if caps.interpret else "tf32x3", **consts)
    rotate_cols = min(64, dp) if layout.format.key.rotated else dp
    return PrefillPlan(layout=layout, num_q_heads=hq, caps=caps, group=g, group_pad=gp, block_q=bq, block_m=bm,
                       block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                       dot="bf16" if raw_bf16 else "fp16", window=window, softcap=softcap, sinks=sinks, lse=lse,
                       int8=int8,
                       rotate_rows=16, rotate_cols=rotate_cols, constexprs=tuple(cx.items()))
