"""paged_decode's attention options (window_left, logit_softcap, sinks, return_lse): named edges
against the oracle, the plan they take, the NumPy fallback, torch.compile, opcheck, bad input.

Tolerances: the cases hold unit-scale q, K, V at head_dim 64, so logits move by at most
δ ≈ 2·2^-11·scale·Σ|q||k̂| < 0.05 and the outputs by (4e-3 + 2δ)·max|V̂| (the property tests'
bound, ``property_tests/test_paged_decode_options.py``), here 0.05 with max|V̂| < 0.5 after the
1/8 value scaling below; lse by δ plus float32 rounding: 0.05. Empty rows are exact.
"""

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.ops.paged_decode.plan import DecodeOptions, DeviceCaps, plan_decode
from tqkern_torch.attention import paged_decode
from tqkern_torch.library import layout_key
from tqkern_torch.testing import device_under_test, kernels_available

DEV = device_under_test()
needs_kernels = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")
BS, HKV, HQ, D = 16, 2, 4, 64
LENS = [37, 0, 16, 100]  # a partial page, an empty sequence, one exact page, several pages
MAX_BLOCKS = 8
OUT_TOL, LSE_TOL = 0.05, 0.05
# tq4: rotated values (row-block merge); turboquant_4bit_nc: plain values (per-group merge)
PRESETS = ["tq4", "turboquant_4bit_nc"]


class Case:
    def __init__(self, preset: str):
        fmt = tqkern.KVFormat.preset(preset, D)
        self.layout = tqkern.PagedLayout(format=fmt, num_kv_heads=HKV, block_size=BS)
        self.params = tqkern.TQParams.default(fmt, seed=5)
        self.dp = tqt.to_device(self.params, DEV)
        g = torch.Generator().manual_seed(1)
        n = len(LENS)
        perm = torch.randperm(n * MAX_BLOCKS, generator=g)  # shuffled physical blocks
        self.bt = perm.view(n, MAX_BLOCKS).to(torch.int32)
        self.sl = torch.tensor(LENS, dtype=torch.int32)
        self.cache = tqt.allocate_cache(self.layout, n * MAX_BLOCKS, DEV, fill=0xA5)
        slots = tqt.sequence_slot_ids(self.bt, self.sl, BS)
        slots = slots[slots >= 0]
        k = torch.randn(slots.shape[0], HKV, D, generator=g).half()
        v = (torch.randn(slots.shape[0], HKV, D, generator=g) / 8).half()
        tqt.store(self.cache, k.to(DEV), v.to(DEV), slots.to(DEV), self.layout, self.dp)
        self.q = torch.randn(n, HQ, D, generator=g).half()
        self.sinks = torch.tensor([0.5, -2.0, 3.0, 1.0], dtype=torch.float32)

    def run(self, **kw):
        s = kw.get("sinks")
        if isinstance(s, torch.Tensor) and s.device != DEV:  # (with its strides: a strided view stays one)
            kw["sinks"] = torch.empty_strided(s.shape, s.stride(), dtype=s.dtype, device=DEV).copy_(s)
        return paged_decode(self.q.to(DEV), self.cache, self.bt.to(DEV), self.sl.to(DEV), self.layout, self.dp, **kw)

    def oracle(self, **kw):
        if "sinks" in kw:
            kw["sinks"] = kw["sinks"].numpy()
        return ref.paged_decode(self.q.double().numpy(), self.cache.cpu().numpy(), self.bt.numpy(), self.sl.numpy(),
                                self.layout, self.params, return_lse=True, **kw)


@pytest.fixture(scope="module", params=PRESETS)
def case(request):
    return Case(request.param)


def _check(case, got, got_lse, **kw):
    want, want_lse = case.oracle(**kw)
    got, got_lse = got.float().cpu().numpy(), got_lse.cpu().numpy()
    assert np.all(np.isfinite(got))
    assert np.all(got[1] == 0), "the empty sequence gives zeros"
    assert np.abs(got - want).max() <= OUT_TOL
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    assert np.abs(got_lse[fin] - want_lse[fin]).max() <= LSE_TOL


# window_left against the lengths [37, 0, 16, 100]: 0 (only the query's own key), 15 (exactly
# the 16-token sequence: W + 1 = len), 36 (exactly the first), 99 (exactly the last), 100 and
# 10**9 (longer than every sequence: no key dropped), 20 (drops keys of two sequences)
@needs_kernels
@pytest.mark.parametrize("window", [0, 15, 20, 36, 99, 100, 10**9])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_window_edges(case, window, num_splits):
    out, lse = case.run(window_left=window, num_splits=num_splits, return_lse=True)
    _check(case, out, lse, window_left=window)


@needs_kernels
@pytest.mark.parametrize("window", [99, 10**9])
def test_a_window_covering_every_sequence_equals_no_window(case, window):
    """W + 1 ≥ every length: the window kernel walks the same tiles in the same splits, so where
    the call without a window takes the general kernel too (the interpreter; every call of a
    preset without a tensor-core kernel) the results are equal bit for bit; where it takes the
    tensor-core kernel (a GPU) both are held to the oracle's bound."""
    a, la = case.run(window_left=window, return_lse=True)
    b, lb = case.run(return_lse=True)
    plan = tqt.plan_decode(case.q.to(DEV), case.cache, case.bt.to(DEV), case.layout, case.dp, return_lse=True)
    if plan.path == "general":
        assert torch.equal(a, b) and torch.equal(la, lb)
    else:
        _check(case, a, la, window_left=window)
        _check(case, b, lb)


@needs_kernels
@pytest.mark.parametrize("num_splits", [None, 4])
def test_sinks_with_an_empty_sequence(case, num_splits):
    """The empty sequence's output is zero and its lse is the sink's logit."""
    out, lse = case.run(sinks=case.sinks, num_splits=num_splits, return_lse=True)
    _check(case, out, lse, sinks=case.sinks)
    assert np.allclose(lse[1].cpu().numpy(), case.sinks.numpy(), rtol=0, atol=1e-5)


@needs_kernels
def test_lse_of_an_empty_sequence_is_minus_inf(case):
    out, lse = case.run(return_lse=True)
    _check(case, out, lse)
    assert bool(torch.all(torch.isneginf(lse[1])))


@needs_kernels
@pytest.mark.parametrize("cap", [0.5, 3.0, 50.0])
def test_softcap(case, cap):
    out, lse = case.run(logit_softcap=cap, return_lse=True)
    _check(case, out, lse, logit_softcap=cap)


@needs_kernels
def test_every_option_at_once_and_a_nan_query_row(case):
    q = case.q.clone()
    q[2, 1, 5] = float("nan")
    kw = dict(window_left=20, logit_softcap=2.0, sinks=case.sinks)
    out, lse = paged_decode(q.to(DEV), case.cache, case.bt.to(DEV), case.sl.to(DEV), case.layout, case.dp,
                            return_lse=True, num_splits=2, sinks=case.sinks.to(DEV), window_left=20, logit_softcap=2.0)
    assert bool(torch.all(torch.isnan(out[2, 1]))) and bool(torch.isnan(lse[2, 1]))
    ok = torch.ones(len(LENS), HQ, dtype=torch.bool)
    ok[2, 1] = False
    want, want_lse = ref.paged_decode(q.double().numpy(), case.cache.cpu().numpy(), case.bt.numpy(), case.sl.numpy(),
                                      case.layout, case.params, return_lse=True,
                                      **dict(kw, sinks=case.sinks.numpy()))
    assert np.abs(out.float().cpu().numpy()[ok.numpy()] - want[ok.numpy()]).max() <= OUT_TOL
    assert np.abs(lse.cpu().numpy()[ok.numpy()] - want_lse[ok.numpy()]).max() <= LSE_TOL


@needs_kernels
def test_return_lse_with_no_sequences(case):
    out, lse = paged_decode(case.q[:0].to(DEV), case.cache, case.bt[:0].to(DEV), case.sl[:0].to(DEV), case.layout,
                            case.dp, return_lse=True)
    assert out.shape == (0, HQ, D) and lse.shape == (0, HQ) and lse.dtype == torch.float32


def test_numpy_fallback_passes_the_options(monkeypatch):
    """Without a GPU and without the interpreter, CPU tensors run the oracle with the options
    (on the float32 device copy of the parameters, and rounded to fp16: 1e-3 on outputs < 0.5;
    the options move the outputs by more than 1e-2)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    c = Case("tq4") if DEV.type == "cpu" else pytest.skip("the fallback runs CPU tensors")
    kw = dict(window_left=20, logit_softcap=2.0, sinks=c.sinks)
    out, lse = c.run(return_lse=True, **kw)
    want, want_lse = c.oracle(**kw)
    plain, _ = c.oracle()
    assert np.abs(out.numpy() - want).max() <= 1e-3 < np.abs(out.numpy() - plain).max() - 1e-2
    assert np.array_equal(np.isneginf(lse.numpy()), np.isneginf(want_lse))
    assert np.abs(lse.numpy() - want_lse)[np.isfinite(want_lse)].max() <= 1e-4


# -- the plan ---------------------------------------------------------------------------------------
MMA_LAYOUT = tqkern.PagedLayout(format=tqkern.KVFormat.preset("tq4", 128), num_kv_heads=8, block_size=16,
                                arrangement="row")


@pytest.mark.parametrize("opts", [
    DecodeOptions(), DecodeOptions(lse=True), DecodeOptions(sinks=True, lse=True), DecodeOptions(window=True),
    DecodeOptions(softcap=True), DecodeOptions(window=True, softcap=True, sinks=True, lse=True)])
def test_plan_keeps_the_warp_mma_kernel_with_every_option(opts):
    """Both decode kernels apply every option (the window and the soft-cap as constexprs, which a
    plain plan does not carry: its kernel is the one compiled before the options existed)."""
    plan = plan_decode(MMA_LAYOUT, 32, 32, 1024, DeviceCaps.sm90(), same_codebooks=True, options=opts)
    assert plan.path == "mma" and plan.options == opts
    assert (plan.merge.sinks, plan.merge.lse) == (opts.sinks, opts.lse)
    cx = dict(plan.decode.constexprs)
    assert cx.get("WINDOW", False) == opts.window and cx.get("SOFTCAP", False) == opts.softcap
    assert ("WINDOW" in cx) == opts.window and ("SOFTCAP" in cx) == opts.softcap
    plain = plan_decode(MMA_LAYOUT, 32, 32, 1024, DeviceCaps.sm90(), same_codebooks=True)
    assert {k: v for k, v in cx.items() if k not in ("WINDOW", "SOFTCAP")} == dict(plain.decode.constexprs)
    general = plan_decode(MMA_LAYOUT, 32, 32, 1024, DeviceCaps.sm90(), same_codebooks=True, options=opts,
                          path="general")
    assert general.decode.constexpr("WINDOW") == opts.window and general.decode.constexpr("SOFTCAP") == opts.softcap
    assert "options" in plan.describe()


def test_plan_rejects_bad_options():
    with pytest.raises(TypeError, match="options must be a DecodeOptions"):
        plan_decode(MMA_LAYOUT, 1, 32, 4, DeviceCaps.sm90(), same_codebooks=True, options={"window": True})
    with pytest.raises(TypeError, match="DecodeOptions.lse must be a bool, got int"):
        DecodeOptions(lse=1)


@needs_kernels
def test_frontend_plan_decode_reports_the_options():
    """The options ride on the plan the call would run without them (the warp-MMA kernel on a GPU)."""
    c = Case("tq4")
    plan = tqt.plan_decode(c.q.to(DEV), c.cache, c.bt.to(DEV), c.layout, c.dp, window_left=3, return_lse=True)
    plain = tqt.plan_decode(c.q.to(DEV), c.cache, c.bt.to(DEV), c.layout, c.dp)
    assert plan.options == DecodeOptions(window=True, lse=True) and plan.path == plain.path
    assert plan.path == ("mma" if DEV.type == "cuda" else "general")


# -- the op -----------------------------------------------------------------------------------------
@needs_kernels
def test_opcheck_paged_decode_with_options():
    c = Case("turboquant_4bit_nc")
    dp = c.dp
    out = torch.empty(len(LENS), HQ, D, dtype=torch.float16, device=DEV)
    lse = torch.empty(len(LENS), HQ, dtype=torch.float32, device=DEV)
    torch.library.opcheck(torch.ops.tqkern.paged_decode.default,
                          (c.q.to(DEV), c.cache, c.bt.to(DEV), c.sl.to(DEV), dp.rotation, dp.key_centroids,
                           dp.value_centroids, dp.key_centroids_f32, dp.value_centroids_f32, out, None,
                           layout_key(c.layout), 0.125, 2, dp.same_codebooks, 20, 2.0, c.sinks.to(DEV), lse,
                           dp.signed_sylvester))


def test_torch_compile_fullgraph_with_options():
    if DEV.type != "cpu":
        pytest.skip("compiled on CPU tensors (tests/test_compile.py)")
    c = Case("tq4")

    def fn(q, cache, bt, sl, sinks):
        return tqt.paged_decode(q, cache, bt, sl, c.layout, c.dp, window_left=20, logit_softcap=2.0, sinks=sinks,
                                return_lse=True)

    eager = fn(c.q, c.cache, c.bt, c.sl, c.sinks)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(c.q, c.cache, c.bt, c.sl, c.sinks)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


# -- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, err, msg", [
    (dict(window_left=-1), ValueError, r"window_left must be None or an int >= 0, got -1"),
    (dict(window_left=2.0), TypeError, r"window_left must be None or an int >= 0, got float"),
    (dict(window_left=True), TypeError, r"window_left must be None or an int >= 0, got bool"),
    (dict(logit_softcap=0.0), ValueError, r"logit_softcap must be finite and > 0, got 0.0"),
    (dict(logit_softcap=-1.0), ValueError, r"logit_softcap must be finite and > 0, got -1.0"),
    (dict(logit_softcap=float("inf")), ValueError, r"logit_softcap must be finite and > 0, got inf"),
    (dict(logit_softcap="2"), TypeError, r"logit_softcap must be a real number or None, got str"),
    (dict(sinks=[0.0] * HQ), TypeError, r"sinks must be a torch.Tensor, got list"),
    (dict(sinks=torch.zeros(HQ, dtype=torch.float16)), TypeError, r"sinks must be float32, got float16"),
    (dict(sinks=torch.zeros(HQ + 1)), ValueError, r"sinks must have shape \[4\], got \[5\]"),
    (dict(sinks=torch.zeros(2, HQ)[:, 0]), ValueError, r"sinks must have shape \[4\], got \[2\]"),
    (dict(sinks=torch.zeros(HQ, 2)[:, 0]), ValueError, r"sinks must be contiguous"),
    (dict(return_lse=1), TypeError, r"return_lse must be a bool, got int"),
    (dict(check_lengths="yes"), TypeError, r"check_lengths must be a bool, got str"),
    (dict(debug=0), TypeError, r"debug must be a bool, got int"),
])
def test_bad_options_are_rejected(kw, err, msg):
    c = Case("tq4")
    with pytest.raises(err, match=msg):
        c.run(**kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_sinks_on_another_device_are_rejected():
    c = Case("tq4")
    with pytest.raises(ValueError, match="sinks must be on"):
        paged_decode(c.q.to(DEV), c.cache, c.bt.to(DEV), c.sl.to(DEV), c.layout, c.dp, sinks=c.sinks.cpu())


@pytest.mark.parametrize("fits, fixed, want", [
    ({(128, 2)}, {}, (128, 2)),  # the measured default fits: kept
    ({(128, 1), (64, 2)}, {}, (128, 1)),  # one stage first
    ({(64, 2), (32, 2)}, {}, (64, 2)),  # then half the tokens
    ({(32, 2)}, {}, (32, 2)),
    (set(), {}, (32, 2)),  # none fits: the last (its launch raises the device's error)
    ({(64, 2)}, {"num_stages": 2}, (64, 2)),  # a fixed stage count stays
    ({(128, 1)}, {"block_n": 128}, (128, 1)),  # a fixed tile stays
    ({(64, 2)}, {"block_n": 128, "num_stages": 2}, (128, 2)),
])
def test_general_tiles_give_way_where_the_device_cannot_hold_them(fits, fixed, want):
    """A general-kernel tile whose shared memory the device cannot give a CTA (occupancy 0: on the
    H200, head_dim 256 row-arranged 3-bit keys at BN 128 with 2 stages needed 238 KB, before
    head_dim 256 took one stage by default) gives way to one stage, then to 64 and 32 tokens; tile
    options the caller fixed stay as given. (head_dim 128 here: its default tile is BN 128 with
    2 stages, every step of the fallback.)"""
    fmt = tqkern.KVFormat.preset("turboquant_k3v4_nc", 128)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=8, block_size=16, arrangement="row")
    asked = []

    def occupancy(kernel):
        tile = (kernel.constexpr("BN"), kernel.num_stages)
        asked.append(tile)
        return 2 if tile in fits else 0

    plan = plan_decode(layout, 8, 16, 512, DeviceCaps.sm90(), same_codebooks=False, occupancy=occupancy,
                       options=DecodeOptions(softcap=True), path="general", **fixed)
    assert plan.decode.kernel == "general"
    assert (plan.decode.constexpr("BN"), plan.decode.num_stages) == want
    assert asked[-1] == want and asked[0] == (fixed.get("block_n", 128), fixed.get("num_stages", 2))


# (preset, arrangement, head_dim 256's tile, head_dim 128's): 128 and 2 stages there for the word
# path, 1 stage for funnel-shifted words (4bit_nc and k3v4_nc's slot rows), 64 and 2 for the rest
@pytest.mark.parametrize("preset, arrangement, want, want128", [
    ("tq4", "row", (128, 1), (128, 2)), ("turboquant_4bit_nc", "slot", (128, 1), (128, 1)),
    ("turboquant_k3v4_nc", "slot", (64, 1), (128, 1)), ("k5v4h", "row", (64, 1), (128, 2)),
    ("turboquant_3bit_nc", "slot", (64, 1), (64, 2)), ("tqkern_k5v3", "row", (64, 1), (64, 2)),
    ("fp16", "slot", (64, 2), (128, 3))])
def test_general_tiles_at_head_dim_256(preset, arrangement, want, want128):
    """head_dim 256 (measured, H200, docs/performance.md): one stage (fp16 caches: two); BN 128
    only where keys and values both take the word path, else 64. head_dim 128 keeps its measured
    defaults (fp16 caches: BN 128 with 3 stages)."""
    fmt = tqkern.KVFormat.preset(preset, 256)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=8, block_size=16, arrangement=arrangement)
    plan = plan_decode(layout, 8, 16, 512, DeviceCaps.sm90(), same_codebooks=False,
                       options=DecodeOptions(softcap=True), path="general")
    assert (plan.decode.constexpr("BN"), plan.decode.num_stages) == want
    layout128 = tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, 128), num_kv_heads=8, block_size=16,
                                   arrangement=arrangement)
    plan = plan_decode(layout128, 8, 16, 512, DeviceCaps.sm90(), same_codebooks=False,
                       options=DecodeOptions(softcap=True), path="general")
    assert (plan.decode.constexpr("BN"), plan.decode.num_stages) == want128


@pytest.mark.parametrize("head_dim, dtype, fits, want", [
    (128, "float16", None, (128, 3)), (96, "float16", None, (128, 3)),
    (64, "float16", None, (64, 2)),  # (measured slower at head_dim 64)
    (128, "bfloat16", None, (64, 2)),  # (not timed: the old default)
    (128, "float16", {(128, 2), (64, 3)}, (128, 2)),  # fewer stages first,
    (128, "float16", {(128, 1), (64, 3)}, (128, 1)),
    (128, "float16", {(64, 3), (32, 3)}, (64, 3)),  # then half the tokens
])
def test_general_tiles_of_fp16_caches(head_dim, dtype, fits, want):
    """fp16 caches at head_dim 96-128 take BN 128 with 3 stages (measured, H200: docs/performance.md
    "The fp16 path"); where the device cannot hold a tile, 2 stages, then 1, then BN 64 and 32."""
    fmt = tqkern.KVFormat(head_dim=head_dim, key=tqkern.Raw(dtype=dtype), value=tqkern.Raw(dtype=dtype))
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=8, block_size=16, arrangement="slot")
    asked = []

    def occupancy(kernel):
        asked.append((kernel.constexpr("BN"), kernel.num_stages))
        return 1 if fits is None or asked[-1] in fits else 0

    plan = plan_decode(layout, 8, 32, 512, DeviceCaps.sm90(), same_codebooks=True, occupancy=occupancy)
    assert plan.decode.kernel == "general"
    assert (plan.decode.constexpr("BN"), plan.decode.num_stages) == want
    if fits is not None:
        order = [(128, 3), (128, 2), (128, 1), (64, 3), (32, 3)]
        assert asked[-1] == want and list(dict.fromkeys(asked)) == order[:order.index(want) + 1]  # (in order)


@pytest.mark.parametrize("preset, head_dim, want", [
    ("fp16", 256, 4), ("fp16", 128, 4),  # 256 CTAs in one round of 2 x 132
    ("turboquant_3bit_nc", 256, 9), ("turboquant_3bit_nc", 128, 9)])  # (splits of 910 tokens: no rounds)
def test_fp16_caches_split_in_whole_rounds(preset, head_dim, want):
    """fp16 caches take the whole-round split count at any split length (measured, H200, S53:
    Gemma-2-9B B8x8K 4 splits 136.0 µs against 152.4 at the plain rule's 9); other formats only
    for splits of >= 2048 tokens."""
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, head_dim), num_kv_heads=8, block_size=16,
                                arrangement="slot")
    plan = plan_decode(layout, 8, 16, 8192 // 16, DeviceCaps.sm90(), same_codebooks=True, occupancy=lambda k: 2,
                       path="general")
    assert plan.num_splits == want


@needs_kernels
def test_options_with_the_rotate_back_in_its_own_launch(monkeypatch):
    """The one-row merge that leaves the rotate-back to a launch of its own (S70; the planner's from
    256 splits with the transform, 512 with a product: here the rule is patched to take tq4's dense
    Π at 19 splits, which the interpreter runs in seconds) through the launcher must keep the merge's
    options: sinks, lse, a window, a soft-cap, a NaN query row, the empty sequence's zeros."""
    import tqkern.ops.paged_decode.side_plans as side_plans

    monkeypatch.setattr(side_plans, "rotate_apart", lambda rotate_back, ss, d, impl, n: rotate_back and impl == "row")
    c = Case("tq4")
    q = c.q.clone()
    q[3, 2, 7] = float("nan")
    plan = tqt.plan_decode(q.to(DEV), c.cache, c.bt.to(DEV), c.layout, c.dp, num_splits=19, return_lse=True)
    assert plan.merge.impl == "row" and plan.merge.rotate_apart and not plan.merge.fwht, plan.describe()
    kw = dict(window_left=20, logit_softcap=2.0, sinks=c.sinks)
    out, lse = paged_decode(q.to(DEV), c.cache, c.bt.to(DEV), c.sl.to(DEV), c.layout, c.dp, return_lse=True,
                            num_splits=19, **dict(kw, sinks=c.sinks.to(DEV)))
    assert bool(torch.all(torch.isnan(out[3, 2]))) and bool(torch.isnan(lse[3, 2]))
    ok = torch.ones(len(LENS), HQ, dtype=torch.bool)
    ok[3, 2] = False
    want, want_lse = ref.paged_decode(q.double().numpy(), c.cache.cpu().numpy(), c.bt.numpy(), c.sl.numpy(), c.layout,
                                      c.params, return_lse=True, **dict(kw, sinks=c.sinks.numpy()))
    got = out.float().cpu().numpy()
    assert np.all(np.isfinite(got[ok.numpy()])) and np.all(got[1] == 0)
    assert np.abs(got[ok.numpy()] - want[ok.numpy()]).max() <= OUT_TOL
    assert np.abs(lse.cpu().numpy()[ok.numpy()] - want_lse[ok.numpy()]).max() <= LSE_TOL
