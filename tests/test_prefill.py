"""``tqkern_torch.prefill``: named edge cases against the oracle, the op registration (opcheck,
``torch.compile(fullgraph=True)``), the NumPy fallback, bad indices, every bad argument, and the
plan."""

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.errors import ErrorFlag
from tqkern.ops.paged_decode.plan import DeviceCaps, fast_path_plan
from tqkern.ops.prefill.plan import plan_prefill
from tqkern_torch.library import layout_key
from tqkern_torch.testing import device_under_test, kernels_available

DEV = device_under_test()
needs_kernels = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")
H, HQ, D, BS = 2, 4, 64, 16
# physical blocks shuffled across sequences; entries past a sequence's length are never read
BLOCK_TABLE = [[5, 2, 0], [1, 7, 3], [4, 6, 6], [6, 6, 6]]
SEQ_LENS = [33, 32, 17, 0]  # partial last page, exact page boundary, one token past a page, empty


@pytest.fixture(scope="module", params=[("tq4", "row"), ("turboquant_4bit_nc", "slot")], ids=["tq4", "tq4nc"])
def case(request):
    preset, arrangement = request.param
    fmt = tqkern.KVFormat.preset(preset, D)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=H, block_size=BS, arrangement=arrangement)
    params = tqkern.TQParams.default(fmt, seed=5)
    rng = np.random.default_rng(1)
    cache = rng.integers(0, 256, layout.cache_shape(8), dtype=np.uint8)
    bt, sl = np.array(BLOCK_TABLE, np.int32), np.array(SEQ_LENS, np.int32)
    for s, n in enumerate(SEQ_LENS):
        pos = np.arange(n)
        slots = bt[s, pos // BS].astype(np.int64) * BS + pos % BS
        cache = ref.store(cache, rng.standard_normal((n, H, D)), rng.standard_normal((n, H, D)), slots, layout, params)
    return layout, params, cache, bt, sl


def _qsl(q_lens):
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


def _call(case, q_lens, seed=0, **kw):
    layout, params, cache, bt, sl = case
    qsl = _qsl(q_lens)
    q = torch.from_numpy(np.random.default_rng(seed).standard_normal((int(qsl[-1]), HQ, D))).half()
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, sl, qsl)]
    res = tqt.prefill(q.to(DEV), *t, layout, tqt.to_device(params, DEV), **kw)
    exp = ref.prefill(q.double().numpy(), cache, bt, sl, qsl, layout, params, **{k: v for k, v in kw.items() if
                                                                                 k not in ("sinks", "max_query_len")},
                      **({"sinks": kw["sinks"].cpu().numpy()} if "sinks" in kw else {}))
    return res, exp


def _close(got, exp):
    got = got.float().cpu().numpy()
    assert np.all(np.isfinite(got))
    if got.size:
        assert np.abs(got - exp).max() <= 4e-3 * max(1.0, float(np.abs(exp).max()))


KERNEL = 1 << 20  # a max_query_len above every q_len: the prefill kernel


@needs_kernels
@pytest.mark.parametrize("max_query_len", [None, KERNEL], ids=["auto", "kernel"])
@pytest.mark.parametrize("q_lens", [[33, 32, 17, 0], [1, 1, 1, 0], [5, 0, 17, 0], [0, 0, 0, 0], [16, 8, 2, 0],
                                    [8, 1, 3, 0], [8, 8, 8, 0]],
                         ids=["q_len=seq_len", "q_len=1", "mixed", "no new tokens", "chunks", "speculative",
                              "speculative=8"])
def test_edges_match_oracle(case, q_lens, max_query_len):
    """Both paths (``max_query_len`` None: the short-row path where every q_len ≤ 8)."""
    got, exp = _call(case, q_lens, max_query_len=max_query_len)
    assert got.shape == exp.shape
    _close(got, exp)


@needs_kernels
@pytest.mark.parametrize("seq_lens", [[3, 1, 2, 0], [33, 32, 17, 0]], ids=["prefix shorter than T", "prefix"])
def test_short_rows_options_match_oracle(case, seq_lens):
    """Short rows with soft-cap, sinks and lse, T = 3: sinks counted once, rows with no prefix key."""
    layout, params, cache, bt, _ = case
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float32, device=DEV)
    got, exp = _call((layout, params, cache, bt, np.array(seq_lens, np.int32)), [3, 1, 2, 0], logit_softcap=3.0,
                     sinks=sinks, return_lse=True, max_query_len=3)
    _close(got[0], exp[0])
    assert np.abs(got[1].cpu().numpy() - exp[1]).max() < 2e-2


@needs_kernels
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # (the interpreter on masked lanes: 0/0 norms)
def test_short_rows_flag_bad_blocks_and_lengths(case):
    """``check_inputs=False`` on the short-row path: a bad block id among a sequence's newest keys
    reads zeros inside the cache and sets BLOCK_OUT_OF_RANGE; a length past the table is clamped
    and sets SEQ_LEN_OUT_OF_RANGE; the other sequences are unchanged."""
    layout, params, cache, bt, sl = case
    bad = bt.copy()
    bad[0, 2] = 1000  # the block of sequence 0's newest key (position 32)
    qsl = _qsl([3, 2, 1, 0])
    q = torch.randn(6, HQ, D, dtype=torch.float16, device=DEV)
    tqt.read_errors(DEV)
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bad, sl, qsl)]
    out = tqt.prefill(q, *t, layout, params, check_inputs=False, max_query_len=3).float().cpu().numpy()
    assert tqt.read_errors(DEV) == ErrorFlag.BLOCK_OUT_OF_RANGE
    exp = ref.prefill(q.double().cpu().numpy(), cache, bt, sl, qsl, layout, params)
    assert np.abs(out[3:] - exp[3:]).max() <= 4e-3 * float(np.abs(exp).max())
    long = sl.copy()
    long[2] = 49
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, long, qsl)]
    tqt.prefill(q, *t, layout, params, check_inputs=False, max_query_len=3)
    assert tqt.read_errors(DEV) & ErrorFlag.SEQ_LEN_OUT_OF_RANGE


@needs_kernels
def test_options_and_lse_match_oracle(case):
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float32, device=DEV)
    (out, lse), (eo, el) = _call(case, [9, 3, 17, 0], window_left=7, logit_softcap=3.0, sinks=sinks,
                                 return_lse=True)
    _close(out, eo)
    assert lse.dtype == torch.float32 and lse.shape == el.shape
    assert np.abs(lse.cpu().numpy() - el).max() < 2e-2


@needs_kernels
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:All-NaN:RuntimeWarning")  # (the inf row)
def test_empty_batch_and_non_finite_query_row(case):
    layout, params, cache, bt, sl = case
    q = torch.zeros(0, HQ, D, dtype=torch.float16, device=DEV)
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt[:0], sl[:0], _qsl([]))]
    assert tqt.prefill(q, *t, layout, params).shape == (0, HQ, D)
    q = torch.randn(4, HQ, D, dtype=torch.float16, device=DEV)
    q[2, 1, 5] = float("inf")
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, sl, _qsl([4, 0, 0, 0]))]
    out = tqt.prefill(q, *t, layout, params).float().cpu()
    assert torch.isnan(out[2, 1]).all()
    mask = torch.ones(4, HQ, dtype=torch.bool)
    mask[2, 1] = False
    assert torch.isfinite(out[mask]).all()


@needs_kernels
def test_bad_block_ids_are_clamped_and_flagged(case):
    """``check_inputs=False``: a block id past the cache reads inside it and sets the error bit;
    the other sequences are unchanged."""
    layout, params, cache, bt, sl = case
    bad = bt.copy()
    bad[1, 0] = 1000
    qsl = _qsl([3, 2, 1, 0])
    q = torch.randn(6, HQ, D, dtype=torch.float16, device=DEV)
    tqt.read_errors(DEV)
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bad, sl, qsl)]
    out = tqt.prefill(q, *t, layout, params, check_inputs=False).float().cpu().numpy()
    assert tqt.read_errors(DEV) & ErrorFlag.BLOCK_OUT_OF_RANGE
    exp = ref.prefill(q.double().cpu().numpy(), cache, bt, sl, qsl, layout, params)
    keep = np.r_[0:3, 5:6]
    assert np.abs(out[keep] - exp[keep]).max() <= 4e-3 * float(np.abs(exp).max())


@needs_kernels
@pytest.mark.parametrize("qsl", [[0, 5, 3, 6, 6], [2, 9, 40, 70, 6], [0, -4, 6, 6, 99], [0, 0, 0, 0, 6]],
                         ids=["decreasing", "past num_tokens", "negative", "q_len above seq_len"])
def test_bad_query_start_loc_stays_inside_q_and_out(case, qsl):
    """``check_inputs=False``: whatever ``query_start_loc`` holds, the kernels write only rows of
    ``out`` (a view inside a NaN-poisoned buffer whose guard rows must stay NaN)."""
    layout, params, cache, bt, sl = case
    q = torch.randn(6, HQ, D, dtype=torch.float16, device=DEV)
    buf = torch.full((10, HQ, D), float("nan"), dtype=torch.float16, device=DEV)
    out = buf[2:8]
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, np.minimum(sl, 16))]
    for bound in (None, 3):  # (the prefill kernel; the short-row path)
        tqt.prefill(q, *t, torch.tensor(qsl, dtype=torch.int32, device=DEV), layout, params, out=out,
                    check_inputs=False, max_query_len=bound)
        assert torch.isnan(buf[:2].float()).all() and torch.isnan(buf[8:].float()).all()


def test_numpy_fallback_equals_oracle(case, monkeypatch):
    """Without a GPU and without the interpreter, CPU tensors run the NumPy oracle."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    layout, params, cache, bt, sl = case
    qsl = _qsl([4, 1, 17, 0])
    q = torch.randn(22, HQ, D).half()
    t = [torch.from_numpy(x) for x in (cache, bt, sl, qsl)]
    out, lse = tqt.prefill(q, *t, layout, params, window_left=5, return_lse=True)
    eo, el = ref.prefill(q.double().numpy(), cache, bt, sl, qsl, layout, params, window_left=5, return_lse=True)
    # (the frontend's parameters hold Π in float32: the oracle's float64 result within an fp16 ulp)
    assert np.allclose(out.numpy(), eo, rtol=2**-10, atol=2**-14)
    assert np.allclose(lse.numpy(), el, rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("op", ["prefill", "int8_prefill"])
def test_opcheck_prefill(case, op):
    layout, params, cache, bt, sl = case
    dp = tqt.to_device(params, DEV)
    qsl = torch.from_numpy(_qsl([3, 1, 2, 0])).to(DEV)
    q = torch.randn(6, HQ, D, device=DEV).half()
    out = torch.empty_like(q)
    lse = torch.empty(6, HQ, device=DEV)
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, sl)]
    torch.library.opcheck(getattr(torch.ops.tqkern, op).default,
                          (q, *t, qsl, dp.rotation, dp.key_centroids, dp.value_centroids, dp.key_centroids_f32,
                           dp.value_centroids_f32, None, out, lse, layout_key(layout), 0.125, -1, 0.0))


@needs_kernels
def test_opcheck_short_rows_ops(case):
    """The short-row path's two ops (prep; tail + merge) pass torch's op checks."""
    layout, params, cache, bt, sl = case
    qsl = torch.from_numpy(_qsl([3, 1, 2, 0])).to(DEV)
    q = torch.randn(6, HQ, D, device=DEV).half()
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, sl)]
    key = layout_key(layout)
    torch.library.opcheck(torch.ops.tqkern.short_rows_prep.default, (q, qsl, t[2], t[1], cache.shape[0], key, 3))
    q1, prefix, slots = torch.ops.tqkern.short_rows_prep(q, qsl, t[2], t[1], cache.shape[0], key, 3)
    o1, l1 = tqt.paged_decode(q1, t[0], t[1], prefix, layout, params, return_lse=True)
    k, v = tqt.decompress(t[0], slots.view(-1), layout, params, rotate_back=True)
    out, lse = torch.empty_like(q), torch.empty(6, HQ, device=DEV)
    torch.library.opcheck(torch.ops.tqkern.short_rows_merge.default,
                          (q1, o1, l1, k, v, qsl, t[2], bt.shape[1], out, lse, key, 3, 0.125, 0.0))


@pytest.mark.parametrize("op, bound", [("prefill", KERNEL), ("prefill", 5), ("int8_prefill", None)],
                         ids=["prefill", "prefill-short-rows", "int8_prefill"])
def test_prefill_compiles_fullgraph(case, op, bound):
    """One graph (aot_eager), the eager result exactly (the interpreter or the NumPy fallback),
    on the path ``max_query_len`` selects."""
    layout, params, cache, bt, sl = case
    if bound == 5 and not kernels_available():
        pytest.skip("the short-row path runs paged_decode: needs CUDA or TRITON_INTERPRET=1")
    dp = tqt.to_device(params, DEV)
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, sl, _qsl([5, 1, 2, 0]))]
    q = torch.randn(8, HQ, D, device=DEV).half()

    def fn(q, cache, bt, sl, qsl, check=True):
        return getattr(tqt, op)(q, cache, bt, sl, qsl, layout, dp, return_lse=True, max_query_len=bound,
                                check_inputs=check)

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, *t)
    want = fn(q, *t, check=False)  # unchecked eager: the traced path (a checked call may take the tiled one)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_prefill_rejects_bad_arguments(case):
    layout, params, cache, bt, sl = case
    qsl = _qsl([3, 1, 2, 0])
    c, b, s, l_ = (torch.from_numpy(x) for x in (cache, bt, sl, qsl))
    q = torch.randn(6, HQ, D).half()
    bad = [
        (TypeError, "q must be float16 or bfloat16, got float32", dict(q=q.float())),
        (ValueError, "q must have shape [num_tokens, num_q_heads, 64]", dict(q=q[..., :32])),
        (ValueError, "num_q_heads) must be a positive multiple of num_kv_heads = 2, got 3", dict(q=q[:, :3])),
        (TypeError, "block_table must be int32, got int64", dict(block_table=b.long())),
        (ValueError, "seq_lens must have shape [4], got [3]", dict(seq_lens=s[:3])),
        (ValueError, "query_start_loc must have shape [5], got [4]", dict(query_start_loc=l_[:4])),
        (TypeError, "query_start_loc must be int32, got int64", dict(query_start_loc=l_.long())),
        (ValueError, "query_start_loc[0] must be 0, got 1", dict(query_start_loc=torch.tensor([1, 3, 4, 6, 6],
                                                                                               dtype=torch.int32))),
        (ValueError, "query_start_loc must be non-decreasing", dict(query_start_loc=torch.tensor(
            [0, 4, 3, 6, 6], dtype=torch.int32))),
        (ValueError, "query_start_loc[-1] must be num_tokens = 6 (q.shape[0]), got 5",
         dict(query_start_loc=torch.tensor([0, 3, 4, 5, 5], dtype=torch.int32))),
        (ValueError, "query_start_loc[4] - query_start_loc[3] (q_len) must be <= seq_lens[3] = 0, got 1",
         dict(query_start_loc=torch.tensor([0, 3, 4, 5, 6], dtype=torch.int32))),
        (ValueError, "seq_lens must be in [0, max_blocks * block_size = 48]",
         dict(seq_lens=torch.tensor([49, 32, 17, 0], dtype=torch.int32))),
        (ValueError, "block_table entries in use must be in [0, num_blocks = 8)",
         dict(block_table=torch.tensor([[5, 2, 9], [1, 7, 3], [4, 6, 6], [6, 6, 6]], dtype=torch.int32))),
        (ValueError, "out must have shape [6, 4, 64], got [6, 4, 32]", dict(out=torch.empty(6, 4, 32).half())),
        (TypeError, "out must be float16, got bfloat16", dict(out=torch.empty(6, 4, 64).bfloat16())),
        (ValueError, "sinks must have shape [4], got [2]", dict(sinks=torch.zeros(2))),
        (TypeError, "sinks must be float32, got float64", dict(sinks=torch.zeros(4, dtype=torch.float64))),
        (ValueError, "sinks must be finite", dict(sinks=torch.tensor([0.0, float("nan"), 0.0, 0.0]))),
        (ValueError, "window_left must be None or an int >= 0, got -1", dict(window_left=-1)),
        (ValueError, "logit_softcap must be finite and > 0, got 0.0", dict(logit_softcap=0.0)),
        (ValueError, "scale must be finite, got inf", dict(scale=float("inf"))),
        (TypeError, "return_lse must be a bool, got int", dict(return_lse=1)),
        (TypeError, "check_inputs must be a bool, got str", dict(check_inputs="no")),
        (TypeError, "debug must be a bool, got int", dict(debug=1)),
        (TypeError, "layout must be a PagedLayout, got str", dict(layout="tq4")),
        (ValueError, "max_query_len must be None or an int >= 0, got -1", dict(max_query_len=-1)),
        (ValueError, "max_query_len must be None or an int >= 0, got True", dict(max_query_len=True)),
        (ValueError, "max_query_len must be >= every q_len, got 2 < q_len 3 of sequence 0", dict(max_query_len=2)),
        (ValueError, "cache must have shape", dict(cache=torch.zeros(8, 3, dtype=torch.uint8))),
    ]
    for exc, msg, change in bad:
        args = dict(q=q, cache=c, block_table=b, seq_lens=s, query_start_loc=l_, layout=layout, params=params)
        kw = {k: change.pop(k) for k in list(change) if k not in args}
        args.update(change)
        with pytest.raises(exc) as info:
            tqt.prefill(*args.values(), **kw)
        assert msg in str(info.value), f"{msg!r} not in {str(info.value)!r}"


def test_plan_is_pure_typed_and_checked():
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset("tq4", 128), num_kv_heads=8, block_size=16)
    a = plan_prefill(layout, 32, DeviceCaps.sm90())
    assert a == plan_prefill(layout, 32, DeviceCaps.sm90()) and hash(a) == hash(a)
    assert (a.group, a.group_pad, a.block_q, a.block_m, a.block_n) == (4, 4, 32, 128, 64)
    assert a.grid(100, 3) == (100 // 32 + 3, 8)
    g3 = plan_prefill(layout, 24, DeviceCaps.interpreter(), lse=True)
    assert (g3.group, g3.group_pad, g3.block_q, g3.block_m, g3.lse) == (3, 4, 8, 32, True)
    assert "BQ=32 x GP=4 = BM=128" in a.describe()
    with pytest.raises(ValueError, match="num_q_heads must be a positive multiple of num_kv_heads = 8, got 12"):
        plan_prefill(layout, 12, DeviceCaps.sm90())
    with pytest.raises(ValueError, match="block_n must be None or a power of two >= 16, got 24"):
        plan_prefill(layout, 32, DeviceCaps.sm90(), block_n=24)
    with pytest.raises(TypeError, match="caps must be a DeviceCaps, got str"):
        plan_prefill(layout, 32, "sm90")


@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_k3v4_nc", "tq4"])
@pytest.mark.parametrize("int8", [False, True])
def test_plan_keeps_head_dim_32_off_the_miscompiled_tiles(preset, int8):
    """At head_dim 32 Triton 3.6 miscompiles the 128 x 64 tiles for 3-bit keys (a P·V ``wgmma``
    reading shared memory past the allocation: an illegal memory access on the GPU) and 32-key
    steps for every compressed codec (wrong outputs); the plan module's docstring. head_dim 32
    takes 64 x 64, every codec; 64 keeps 128 x 64."""
    for d, tiles in ((32, (64, 64)), (64, (128, 64))):
        layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, d), num_kv_heads=2, block_size=16)
        plan = plan_prefill(layout, 8, DeviceCaps.sm90(), int8=int8)
        assert (plan.block_m, plan.block_n) == tiles
        assert (dict(plan.constexprs)["BM"], dict(plan.constexprs)["BN"]) == tiles


@pytest.mark.parametrize("hkv, word_reads", [(1, (0, 0)), (2, (2, 2)), (8, (2, 2))])
def test_plan_avoids_the_16_bit_word_read(hkv, word_reads):
    """turboquant_4bit_nc with one KV head would read its 4-bit words as 16-bit halves (read plan
    1), which crashes Triton 3.6's compiler beside another 4-bit side: the plan reads both sides
    through the field loader there and keeps the word path elsewhere."""
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset("turboquant_4bit_nc", 128), num_kv_heads=hkv,
                                block_size=16, arrangement="slot")
    assert tuple(fast_path_plan(layout)[k] for k in ("K_FAST", "V_FAST")) == ((1, 1) if hkv == 1 else word_reads)
    cx = dict(plan_prefill(layout, 4 * hkv, DeviceCaps.sm90()).constexprs)
    assert (cx["K_FAST"], cx["V_FAST"]) == word_reads
