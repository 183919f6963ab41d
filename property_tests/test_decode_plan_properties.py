"""The decode planner's invariants (``tqkern.ops.paged_decode.plan.plan_decode``; pure, no kernel
runs): for any layout, batch, GQA group, device, compiled-kernel residency and attention options
it returns a plan the kernels can run.

- The decode grid covers every work item once: the general kernel one program per (sequence, KV
  head, split); the per-warp warp-MMA kernel one warp per (sequence, KV head, query-head group,
  split), the last CTA's spare warps at most ``num_warps - 1``; a cooperative plan one CTA per
  (sequence, ``WS`` splits) with a warp per (KV head, split of the CTA).
- A CTA fits an SM: at most 1024 threads, and under a register cap at most 64K registers.
- The query heads are exactly the kernel's columns: ``G · KV heads · groups · tiles = Hq``, with
  ``G ≤ 8`` (the MMA's 8 columns) for the warp-MMA kernels.
- A two-step cooperative ring at 16 KV heads whose split count the planner chose launches more
  CTAs than half the SMs (else the per-warp kernel runs).
- The workspace holds every split's partials; a given split count is kept; the merge applies the
  options asked; the early launch only on sm_90.
- The same inputs give the same plan (the residency the planner asks is drawn as a fixed table).
"""

import dataclasses

from hypothesis import event, example, given, note, settings
from hypothesis import strategies as st

import tqkern
import tqkern.testing as T
from tqkern.layouts import PRESETS
from tqkern.ops.codecs import layout_consts
from tqkern.ops.paged_decode.plan import DecodeOptions, DeviceCaps, plan_decode, workspace_numel

_PRESETS = tuple(PRESETS) + ("k5v4h", "k5v3h", "k4v3h", "k4v2h", "k3v2h")  # (every preset, and kXvYh ones)


@st.composite
def layouts(draw):
    """A preset (or kXvYh) at a real head_dim, or any drawn format (``T.kv_formats``)."""
    heads = st.sampled_from([1, 1, 2, 2, 3, 4, 8, 16])  # (one and two KV heads: the WS plans)
    if draw(st.integers(0, 3), label="preset") > 0:  # (three in four: most drawn formats take the general kernel)
        fmt = tqkern.KVFormat.preset(draw(st.sampled_from(_PRESETS), label="name"),
                                     draw(st.sampled_from(T.HEAD_DIMS + (128, 128)), label="head_dim"))
        return tqkern.PagedLayout(format=fmt, num_kv_heads=draw(heads, label="num_kv_heads"),
                                  block_size=draw(st.sampled_from([16, 32, 64, 128]), label="block_size"),
                                  arrangement=draw(st.sampled_from(["slot", "row"]), label="arrangement"))
    return draw(T.paged_layouts(T.kv_formats(), num_kv_heads=heads))


@st.composite
def devices(draw):
    """An sm_90-class device of a drawn SM count, maybe without dynamic shared memory or with an
    sm_80/sm_89 capability and shared memory (the warp-MMA kernels need sm_80+), or the interpreter."""
    kind = draw(st.sampled_from(["sm90"] * 5 + ["no_dynamic_smem", "sm89", "sm80", "interpreter"]), label="device")
    if kind == "interpreter":
        return DeviceCaps.interpreter()
    caps = DeviceCaps.sm90(num_sms=draw(st.integers(8, 160), label="num_sms"))
    if kind == "no_dynamic_smem":
        return dataclasses.replace(caps, dynamic_smem=False)
    if kind == "sm89":
        return dataclasses.replace(caps, capability=(8, 9), smem_per_block_optin=101376, smem_per_sm=102400)
    if kind == "sm80":
        return dataclasses.replace(caps, capability=(8, 0), smem_per_block_optin=166912, smem_per_sm=167936)
    return caps


@st.composite
def residencies(draw):
    """What the planner learns of a compiled kernel: nothing, or CTAs per SM (1-4) drawn per
    (kernel, warps, register cap), fixed for the example."""
    if draw(st.booleans(), label="residency_unknown"):
        return None
    table = draw(st.fixed_dictionaries({}, optional={
        (k, w, r): st.integers(1, 4) for k in ("mma", "coop", "general") for w in (4, 8, 16) for r in (0, 128, 168)}),
        label="ctas")
    default = draw(st.integers(1, 4), label="ctas_default")
    return lambda kernel: table.get((kernel.kernel, kernel.num_warps, kernel.maxnreg), default)


@st.composite
def cases(draw):
    layout = draw(layouts(), label="layout")
    group = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24]), label="group")
    num_seqs = draw(st.one_of(st.integers(1, 4), st.integers(1, 512)), label="num_seqs")
    max_tokens = draw(st.one_of(st.integers(1, 4096), st.integers(1, 131072)), label="max_tokens")
    max_blocks = -(-max_tokens // layout.block_size)
    num_splits = draw(st.one_of(st.none(), st.integers(1, 1024)), label="num_splits")
    options = DecodeOptions(**{f.name: draw(st.booleans(), label=f.name) for f in dataclasses.fields(DecodeOptions)})
    return (layout, group, num_seqs, max_blocks, draw(devices()), num_splits, draw(residencies()), options,
            draw(st.booleans(), label="same_codebooks"))


def _plan(case):
    layout, group, s, max_blocks, caps, num_splits, occupancy, options, same = case
    return plan_decode(layout, s, group * layout.num_kv_heads, max_blocks, caps, same_codebooks=same,
                       num_splits=num_splits, occupancy=occupancy, options=options)


def _case(preset, hkv, group, s, tokens, num_splits=None):
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, 128), num_kv_heads=hkv, block_size=16)
    return layout, group, s, tokens // 16, DeviceCaps.sm90(), num_splits, None, DecodeOptions(), True


@settings(max_examples=max(300, settings().max_examples))  # (pure planning: a few ms an example)
@given(cases())
@example(_case("k5v4h", 2, 8, 32, 16384))  # shared-head CTAs: 4 warps per KV head (WS = 4)
@example(_case("k5v4h", 2, 7, 3, 5000, num_splits=6))  # ... a fixed split count not a multiple of WS
@example(_case("turboquant_4bit_nc", 1, 8, 1, 32768))  # one KV head's 4-warp CTAs (one_head_plan)
@example(_case("tq4", 16, 1, 1, 16384))  # a two-step ring at 16 KV heads on half the SMs: per-warp
@example(_case("turboquant_3bit_nc", 1, 16, 16, 32768))  # one KV head's CTAs under one an SM: per-warp
@example(_case("turboquant_4bit_nc", 1, 8, 1, 131072))  # ... at batch 1: 512 splits (fill_sms(long=True))
@example(_case("fp16", 1, 8, 1, 131072))  # the fp16 cache at batch 1: 256 splits (S70)
@example(_case("fp16", 2, 16, 1, 20000))  # ... 2 KV heads: 132 splits asked, 128 of 256 tokens kept
def test_decode_plans_are_runnable(case):
    layout, group, s, max_blocks, caps, num_splits, _, options, _ = case
    plan = _plan(case)
    note(plan.describe())
    event(f"{plan.decode.kernel} kernel" + (", capped" if plan.decode.maxnreg else "")
          + (", WS" if dict(plan.decode.constexprs).get("WS") else ""))
    d, hkv, hq, n = plan.decode, layout.num_kv_heads, group * layout.num_kv_heads, plan.num_splits
    cx = dict(d.constexprs)
    assert 1 <= n <= 1024 and (num_splits is None or n == num_splits)  # (the range a caller may fix)
    max_len = max_blocks * layout.block_size
    if num_splits is None and d.kernel == "general" and n > 64:  # fp16 caches' fill only (S70): at
        # head_dim 96-128, ~2 programs an SM, splits of whole BN tiles, none empty at max_len
        bn = cx["BN"]
        raw16 = all(getattr(side, "dtype", None) == "float16" for side in (layout.format.key, layout.format.value))
        assert raw16 and 96 <= layout.head_dim <= 128 and n <= 256, plan.describe()
        assert max_len >= bn * n and s * hkv * n < 2 * caps.num_sms + s * hkv, plan.describe()
        assert -(-(-(-max_len // n)) // bn) * bn * (n - 1) < max_len, plan.describe()
    elif num_splits is None and n > 128:  # the per-warp kernel's long fill only (S69): splits of >= 128
        # tokens, at head_dim 128, within one CTA an SM
        assert d.kernel == "mma" and layout.head_dim == 128 and n <= 512, plan.describe()
        assert max_len >= 128 * n and d.grid[0] <= caps.num_sms, plan.describe()
    assert plan.path == ("general" if d.kernel == "general" else "mma")
    assert d.num_warps * 32 <= 1024 and d.num_stages >= 1
    assert d.maxnreg in (0, 128, 168, 232)
    if d.maxnreg:
        assert d.maxnreg * 32 * d.num_warps <= 65536  # one CTA's registers fit an SM
    if caps.interpret:
        assert d.kernel == "general"
    if d.kernel == "general":
        assert d.grid == (s, hkv, n) and cx["NUM_SPLITS"] == n and cx["G"] == group
    else:
        assert caps.capability >= (8, 0)
        heads = hkv * cx["GS"]
        assert cx["G"] * heads * cx["QT"] == hq and 1 <= cx["G"] <= 8 and cx["HQ"] == hq and cx["HKV"] == heads
        if d.kernel == "mma":  # one warp per (sequence, KV head, group, split)
            assert not cx.get("COOP") and d.grid[0] * d.num_warps >= s * heads * n > (d.grid[0] - 1) * d.num_warps
        else:  # one CTA per (sequence, WS splits), a warp per (KV head, split)
            ws = cx.get("WS") or 1
            assert d.kernel == "coop" and cx["COOP"] >= 2 and caps.dynamic_smem
            assert n % ws == 0 and d.grid == (s * n // ws,) and d.num_warps == hkv * ws
            if num_splits is None and hkv == 16 and cx["SUB"] == 2:  # (a ring on at most half the SMs: per-warp)
                assert 2 * d.grid[0] > caps.num_sms
            if num_splits is None and hkv == 1 and ws == 4:  # one KV head's 4-warp CTAs: 1-2 an SM (S68)
                assert caps.num_sms <= d.grid[0] <= 2 * caps.num_sms
    m = plan.merge
    if m.rotate_apart:  # the rotate-back's own launch (S70): the one-row merge of many splits, 16 rows a program
        assert m.impl == "row" and m.rotate_back and n >= 256, plan.describe()
        assert m.back_grid[0] * 16 >= s * hq > (m.back_grid[0] - 1) * 16 and m.back_grid[1] >= 1, plan.describe()
    assert plan.workspace_numel == workspace_numel(s, hq, n, layout_consts(layout)["DP"])
    assert plan.merge.lse == options.lse and plan.merge.sinks == options.sinks
    assert all(isinstance(x, int) and x >= 1 for x in plan.merge.grid + plan.rotate.grid)
    assert not plan.pdl or (caps.capability >= (9, 0) and not caps.interpret)
    assert _plan(case) == plan  # pure
