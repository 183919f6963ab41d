"""The tiled prefill (:mod:`tqkern_torch.prefill_tiles`: keys gathered into a half-precision
workspace, a dense varlen kernel per call, log-sum-exp merges) equals the prefill oracle.

Same cases, error budget and poisoning as ``test_prefill_triton.py`` (its helpers). The workspace
budget is drawn down to one gather tile so that long prefixes split into many pieces merged by
log-sum-exp (sequences without queries, no prefix, prefix shorter than a piece); batches of equal
lengths (whose pieces go to the dense kernel as one batch) drawn; window, soft-cap, sinks and lse
drawn. The dense kernel is cuDNN's or FlashAttention-2 (drawn) on a GPU and
:func:`~tqkern_torch.prefill_tiles.attend_math` (the same contract in float32 torch ops) in the
interpreter, or on both the Triton kernel :func:`~tqkern_torch.prefill_tiles.attend_tiles` (drawn;
always with a soft-cap, which the others lack); the gather and combine kernels are the
Triton ones on both. The workspace rounds K and V to q's dtype once and the dense kernel rounds P
and the output to it: fp16 queries get the fused kernel's budget, bf16 ones three bf16 roundings
more (:class:`tqkern.testing.Rounding`, ``workspace=True``).
"""

import numpy as np
import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

import tqkern.testing as T
from property_tests.test_prefill_triton import DEV, ON_GPU, _compare, _draw_q, _fill_cache, prefill_cases, rounding
from tqkern import reference as ref
from tqkern.layouts import PRESETS
from tqkern.ops.decompress.gather import gather_config
from tqkern_torch.errors import error_word
from tqkern_torch.ops import _device_params
from tqkern_torch.prefill_tiles import attend_cudnn, attend_flash, attend_math, attend_tiles, tile_prefill
from tqkern_torch.testing import kernels_available, poisoned_like

pytestmark = [pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:All-NaN:RuntimeWarning",
                                         "ignore:overflow:RuntimeWarning")]


def _tiles(layout, params, batch, q, cache, *, budget_rows, window_left=None, sinks=None, return_lse=False,
           attend=None, fresh=False, int8=False, logit_softcap=None, gather_fwht=False):
    """``tile_prefill`` on ``DEV`` into a NaN-poisoned output (with ``fresh``: ``out=None``, what
    it returns; one dense call then returns its own output) with a workspace of ``budget_rows``
    prefix rows; NumPy (out, lse or None)."""
    h, d = layout.num_kv_heads, layout.head_dim
    out = poisoned_like(tuple(q.shape), q.dtype, DEV)
    lse = torch.full(tuple(q.shape[:2]), float("nan"), dtype=torch.float32, device=DEV) if return_lse else None
    cache_t, bt, sl, qsl = (torch.from_numpy(x).to(DEV) for x in (cache, batch.block_table, batch.seq_lens,
                                                                   batch.query_start_loc))
    res = tile_prefill(q, cache_t, bt, sl, qsl, layout, _device_params(params, layout, q.device),
                       q_lens=[int(x) for x in batch.q_lens], seq_lens=[int(x) for x in batch.seq_lens],
                       num_blocks=batch.num_blocks, errors=error_word(DEV), scale=float(d) ** -0.5,
                       out=None if fresh else out, lse=lse,
                       window_left=window_left, sinks=None if sinks is None else torch.from_numpy(sinks).to(DEV),
                       workspace_bytes=budget_rows * 2 * h * d * q.element_size(),
                       attend=attend, int8=int8, logit_softcap=logit_softcap,
                       gather=gather_config(triton.next_power_of_2(d))._replace(fwht=gather_fwht))
    assert res is out or fresh and res.shape == q.shape and res.dtype == q.dtype and res.is_contiguous()
    return res.float().cpu().numpy(), None if lse is None else lse.cpu().numpy().astype(np.float64)


@st.composite
def _equal_batch(draw, n: int, max_len: int):
    """``n`` sequences of one length and one ``q_len`` over shuffled blocks (and a spare one); some
    drawn ones a full prefill instead (``q_len = length``: no prefix piece, so the equal chunks
    around it have prefix pieces adjacent in their round but queries that are not)."""
    length = draw(st.integers(1, max_len))
    q_len = draw(st.integers(0, length))
    full = draw(st.lists(st.booleans(), min_size=n, max_size=n), label="full_prefills")
    per = -(-length // 16)
    blocks = np.random.default_rng(draw(st.integers(0, 2**16))).permutation(n * per + 1)[: n * per]
    return T.VarlenBatch(blocks.reshape(n, per).astype(np.int32), np.full(n, length, np.int32), n * per + 1, 16,
                         [length if f else q_len for f in full])


@pytest.mark.parametrize("preset", sorted(PRESETS))
@settings(max_examples=T.scale(4, 30))
@given(st.data())
def test_tiles_match_oracle(preset, data):
    """Every preset, both arrangements, GQA 1..4, mixed batches, shuffled blocks, poisoned
    queries, workspaces from one row up, a given or a fresh output: the oracle's rows (and lse)."""
    layout, params, group, batch, qdtype = data.draw(prefill_cases(presets=(preset,)), label="case")
    if data.draw(st.booleans(), label="equal_lengths"):  # pieces of equal shape share one dense call
        batch = data.draw(_equal_batch(len(batch.seq_lens), int(max(batch.seq_lens.max(), 1))), label="equal_batch")
    hq = layout.num_kv_heads * group
    window = data.draw(st.one_of(st.none(), st.integers(0, 40)), label="window_left")
    sinks = data.draw(st.one_of(st.none(), st.lists(st.floats(-3, 3), min_size=hq, max_size=hq)), label="sinks")
    sinks = None if sinks is None else np.asarray(sinks, np.float32)
    lse = data.draw(st.booleans(), label="return_lse")
    budget = data.draw(st.one_of(st.integers(1, 160), st.just(1 << 20)), label="budget_rows")
    cap = data.draw(st.one_of(st.none(), st.sampled_from([0.5, 5.0, 30.0])), label="logit_softcap")
    # the dense kernels: cuDNN has no window; a soft-cap always takes attend_tiles
    kernels = [attend_flash] + ([attend_cudnn] if window is None else []) if ON_GPU else [attend_math]
    kernels = kernels + [attend_tiles]
    attend = data.draw(st.sampled_from(kernels), label="attend")
    cache = _fill_cache(layout, params, batch, data)
    q, q64 = _draw_q(layout, group, batch, qdtype, data)
    fresh = data.draw(st.booleans(), label="out_none")
    fwht = data.draw(st.booleans(), label="gather_fwht")  # (takes effect for signed Sylvester rotations)
    got, got_lse = _tiles(layout, params, batch, q, cache, budget_rows=budget, window_left=window, sinks=sinks,
                          return_lse=lse, attend=attend, fresh=fresh, logit_softcap=cap, gather_fwht=fwht)
    res = ref.prefill(q64, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, layout, params,
                      window_left=window, logit_softcap=cap, sinks=sinks, return_lse=True)
    _compare(got, res[0], layout, params, batch, cache, q64, group, got_lse=got_lse, expect_lse=res[1],
             rnd=rounding(layout, q, workspace=True))


@pytest.mark.parametrize("preset,int8", [("tqkern_k5v3", False), ("turboquant_4bit_nc", False), ("tqkern_k4v4", True)])
def test_gather_transform_matches_oracle(preset, int8):
    """``GatherConfig.fwht`` with the default (signed Sylvester) rotation: the rotated sides leave
    the gather rotated back by the Walsh–Hadamard transform (keys too, but for ``int8_prefill``,
    whose keys stay in the codec's space), and the rows are the oracle's (the drawn test above
    meets this path only where it draws a signed Sylvester rotation)."""
    import tqkern

    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, 64), num_kv_heads=2, block_size=16)
    params = tqkern.TQParams.default(layout.format)
    assert _device_params(params, layout, torch.empty(0, device=DEV).device).signed_sylvester
    batch = T.VarlenBatch(np.array([[3, 0, 4], [1, 2, 5]], np.int32), np.array([40, 33], np.int32), 6, 16, [17, 33])
    rng = np.random.default_rng(11)
    cache = np.zeros(layout.cache_shape(batch.num_blocks), np.uint8)
    for s in range(2):
        n = int(batch.seq_lens[s])
        k, v = (rng.standard_normal((n, 2, 64)).astype(np.float16) for _ in range(2))
        cache = ref.store(cache, k, v, batch.slot_ids(s), layout, params)
    q64 = rng.standard_normal((batch.num_tokens, 4, 64)) * 0.3
    q = torch.from_numpy(q64).half().to(DEV)
    q64 = q.double().cpu().numpy()
    got, _ = _tiles(layout, params, batch, q, cache, budget_rows=24, int8=int8, gather_fwht=True)
    oracle = ref.int8_prefill if int8 else ref.prefill
    expect = oracle(q64, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, layout, params)
    if int8:
        from property_tests.test_int8_prefill_triton import _int8_bounds as bounds
    else:
        from property_tests.test_prefill_triton import _bounds as bounds
    rnd = rounding(layout, q, workspace=True)
    for s in range(2):  # _compare's budget (it notes through Hypothesis)
        a, b = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
        delta, vmax = bounds(layout, params, batch, cache, q64, s, 2, rnd)
        err = float(np.abs(got[a:b] - expect[a:b]).max())
        assert err <= rnd.atol(delta, vmax), f"seq {s}: error {err:.3g}"


@pytest.mark.parametrize("preset", ["tqkern_k5v3", "turboquant_4bit_nc", "tqkern_k4v4"])
def test_gather_transform_rows_are_the_rotated_back_reconstruction(preset):
    """What the dense kernel is handed with ``GatherConfig.fwht``: each key and value row equals the
    oracle's reconstruction rotated back (float64), up to one rounding to fp16 and float32 sums
    of D terms."""
    import tqkern

    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, 64), num_kv_heads=2, block_size=16)
    params = tqkern.TQParams.default(layout.format)
    rng = np.random.default_rng(3)
    n = 40
    k, v = (rng.standard_normal((n, 2, 64)).astype(np.float16) for _ in range(2))
    batch = T.VarlenBatch(np.array([[2, 0, 1]], np.int32), np.array([n], np.int32), 3, 16, [n])
    cache = ref.store(np.zeros(layout.cache_shape(3), np.uint8), k, v, batch.slot_ids(0), layout, params)
    seq = ref.gather_sequences(cache, layout, batch.block_table, batch.seq_lens)[0]
    expect = ref.decompress(seq, params, rotate_back=True)  # float64 [n, 2, 64] each
    seen = {}

    def attend(q, kk, vv, b, **kw):
        seen["kv"] = (kk.float().cpu().numpy(), vv.float().cpu().numpy())
        return torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)

    q = torch.zeros((n, 2, 64), dtype=torch.float16, device=DEV)
    _tiles(layout, params, batch, q, cache, budget_rows=1 << 20, attend=attend, gather_fwht=True)
    for name, got, x in zip(("key", "value"), seen["kv"], expect):
        tol = 2.0**-11 * np.abs(x) + 16 * 2.0**-24 * np.linalg.norm(x, axis=-1, keepdims=True)
        assert np.all(np.abs(got - x) <= tol), f"{name}: max error {np.abs(got - x).max():.3g}"


def test_device_lengths_that_disagree_stay_in_bounds():
    """Host lengths valid, device ``seq_lens`` / ``query_start_loc`` wrong (huge, negative): the
    runs are clamped and the gather masks, so the call finishes inside its tensors (rows are then
    whatever they are)."""
    import tqkern

    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset("tq4", 32), num_kv_heads=1, block_size=16)
    params = tqkern.TQParams.default(layout.format)
    cache = torch.zeros(layout.cache_shape(3), dtype=torch.uint8, device=DEV)
    bt = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=DEV)
    q = torch.zeros(30, 2, 32, dtype=torch.float16, device=DEV)
    for sl, qsl in (([1 << 30, 5], [0, 20, 30]), ([-7, 32], [0, 25, 30]), ([20, 10], [0, -5, 30])):
        out = tile_prefill(q, cache, bt, torch.tensor(sl, dtype=torch.int32, device=DEV),
                           torch.tensor(qsl, dtype=torch.int32, device=DEV), layout,
                           _device_params(params, layout, q.device), q_lens=[20, 10], seq_lens=[20, 12],
                           num_blocks=3, errors=error_word(DEV), scale=0.1, out=None, lse=None, window_left=None,
                           sinks=None, workspace_bytes=64 * 2 * 32 * 2, attend=attend_math if not ON_GPU else None)
        assert out.shape == q.shape


@st.composite
def _schedules(draw):
    """Host lengths of a batch (sometimes of equal sequences, whose pieces share dense calls), a
    workspace budget in rows, a window, sinks, whether ``lse`` and ``out`` are given."""
    n = draw(st.integers(1, 6), label="num_seqs")
    if draw(st.booleans(), label="equal"):
        length, q = draw(st.integers(1, 200)), draw(st.integers(0, 200))
        seq_lens = [length] * n
        q_lens = [length if draw(st.booleans()) else min(q, length) for _ in range(n)]
    else:
        seq_lens = draw(st.lists(st.integers(0, 200), min_size=n, max_size=n), label="seq_lens")
        q_lens = [draw(st.integers(0, s)) for s in seq_lens]
    budget = draw(st.one_of(st.integers(1, 300), st.just(1 << 20)), label="budget_rows")
    window = draw(st.one_of(st.none(), st.integers(0, 40)), label="window_left")
    sinks = draw(st.one_of(st.none(), st.lists(st.floats(-3, 3), min_size=2, max_size=2)), label="sinks")
    return seq_lens, q_lens, budget, window, sinks, draw(st.booleans(), label="lse"), draw(st.booleans(), label="fresh")


class _NoLaunch:
    """A kernel whose launches do nothing (the schedule test reads no workspace)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.skipif(ON_GPU, reason="host-side schedule (no kernel runs): the CPU run covers it")
@settings(max_examples=T.scale(60, 400))
@given(_schedules())
def test_merge_schedule_equals_the_direct_merge(case):
    """The tiled path's host side — the plan, the dense calls' groups, first pieces held until their
    next merge, float32 running results, sinks, the one-call route — with each dense call's rows
    and lse drawn at random: every query row's output and lse are the direct log-sum-exp merge of
    its pieces' partial results (and the sink), to the output dtype's rounding. The gather kernels
    are not launched."""
    from unittest import mock

    import tqkern
    import tqkern.ops.decompress.gather as gather
    import tqkern_torch.prefill_tiles as pt
    from tqkern.ops.prefill.tiles import plan_tiles

    seq_lens, q_lens, budget, window, sinks, with_lse, fresh = case
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset("fp16", 32), num_kv_heads=1, block_size=16)
    params = _device_params(tqkern.TQParams.default(layout.format), layout, torch.device("cpu"))
    t, hq = sum(q_lens), 2
    q = torch.zeros((t, hq, 32), dtype=torch.float16)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    calls = []

    def attend(qa, k, v, batch, *, causal, scale, window_left):
        a = (qa.data_ptr() - q.data_ptr()) // (q.stride(0) * q.element_size())
        g = torch.Generator().manual_seed(len(calls))
        o = torch.randn(qa.shape, generator=g).half()
        lp = torch.randn(qa.shape[:2], generator=g) * 4
        calls.append((a, o, lp))
        return o, lp

    blocks = max(1, -(-max(seq_lens) // 16))
    lse = torch.full((t, hq), float("nan")) if with_lse else None
    with mock.patch.object(gather, "_gather_kernel", _NoLaunch()), mock.patch.object(pt, "_runs_kernel", _NoLaunch()):
        out = tile_prefill(q, torch.zeros(layout.cache_shape(blocks), dtype=torch.uint8),
                           torch.zeros((len(seq_lens), blocks), dtype=torch.int32),
                           torch.tensor(seq_lens, dtype=torch.int32), torch.from_numpy(starts), layout, params,
                           q_lens=q_lens, seq_lens=seq_lens, num_blocks=blocks, errors=error_word(torch.device("cpu")),
                           scale=1.0,
                           out=None if fresh else torch.full_like(q, float("nan")), lse=lse, window_left=window,
                           sinks=None if sinks is None else torch.tensor(sinks, dtype=torch.float32),
                           workspace_bytes=budget * 2 * 32 * 2, attend=attend)
    plan = plan_tiles(q_lens, seq_lens, budget_rows=budget, window_left=window)
    assert len(calls) == sum(len(pt._groups(rnd, q_lens)) for rnd in plan.rounds)
    # the direct merge: every call's partial results of a row, and the sink, in float64
    parts = [[] for _ in range(t)]
    for a, o, lp in calls:
        for i in range(o.shape[0]):
            parts[a + i].append((o[i].double(), lp[i].double()))
    for row in range(t):
        ls = torch.stack([lp for _, lp in parts[row]])  # [pieces, hq]
        total = torch.cat([ls, torch.tensor(sinks, dtype=torch.float64)[None]]) if sinks is not None else ls
        want_lse = torch.logsumexp(total, dim=0)
        want = sum(torch.exp(lp - want_lse)[:, None] * o for o, lp in parts[row])
        seq = int(np.searchsorted(starts, row, side="right")) - 1
        assert len(parts[row]) == sum(pc.seq == seq for rnd in plan.rounds for pc in rnd)
        assert torch.allclose(out[row].double(), want, rtol=2.0**-10, atol=2.0**-10 * float(want.abs().max())), row
        if lse is not None:
            assert torch.allclose(lse[row].double(), want_lse, rtol=1e-5, atol=1e-5), row
