"""The tiled prefill's plan (:func:`tqkern.ops.prefill.tiles.plan_tiles`): every key a query may see
is in exactly one piece, masks are right for every query of a piece, rounds pack within the
budget; and the frontend's routing and host-length checks."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tqkern.ops.prefill.tiles import PIECE_ALIGN, plan_tiles


@st.composite
def lengths(draw):
    n = draw(st.integers(1, 6))
    seq = draw(st.lists(st.integers(0, 3000), min_size=n, max_size=n))
    q = [draw(st.integers(0, s)) for s in seq]
    return q, seq


@given(lengths(), st.integers(1, 5000), st.one_of(st.none(), st.integers(0, 500)))
def test_pieces_cover_each_visible_key_once(ls, budget, window):
    q_lens, seq_lens = ls
    plan = plan_tiles(q_lens, seq_lens, budget_rows=budget, window_left=window)
    seen = {s: [] for s in range(len(q_lens))}
    for r, rnd in enumerate(plan.rounds):
        row = 0
        assert rnd, "no empty round"
        for pc in rnd:
            assert pc.length > 0 and pc.row == row
            row += pc.length
            q, n = q_lens[pc.seq], seq_lens[pc.seq]
            p = n - q
            assert pc.first == (r == 0)
            if pc.causal:  # bottom-right over [start, n): ends at the sequence's end
                assert pc.start + pc.length == n
                assert window is not None or pc.start == p  # square without a window
            else:  # unmasked: every key at or before the first query's position
                assert pc.start + pc.length <= p and window is None
            seen[pc.seq] += list(range(pc.start, pc.start + pc.length))
        if r > 0:
            assert row <= max(budget, PIECE_ALIGN * len(rnd))
    for s, (q, n) in enumerate(zip(q_lens, seq_lens)):
        lo = 0 if window is None else max(0, n - q - window)
        assert sorted(seen[s]) == (list(range(lo, n)) if q else []), f"sequence {s}"
        mine = [pc for rnd in plan.rounds for pc in rnd if pc.seq == s]
        if mine:
            assert [pc.last for pc in mine] == [False] * (len(mine) - 1) + [True]
    assert plan.workspace_rows == max((sum(pc.length for pc in r) for r in plan.rounds), default=0)


def test_whole_prefix_in_one_round_when_it_fits():
    plan = plan_tiles([1024, 1024], [17408, 9216], budget_rows=1 << 20)
    assert len(plan.rounds) == 2 and plan.piece_rows == 16384
    assert [(pc.start, pc.length) for pc in plan.rounds[1]] == [(0, 16384), (0, 8192)]
    plan = plan_tiles([16384], [16384], budget_rows=64)
    assert len(plan.rounds) == 1 and plan.workspace_rows == 16384  # no prefix: the new tokens alone


@pytest.mark.parametrize("kw, match", [
    (dict(q_lens=[3], seq_lens=[2], budget_rows=64), r"q_lens\[0\] must be <= seq_lens\[0\] = 2, got 3"),
    (dict(q_lens=[1], seq_lens=[1, 2], budget_rows=64), "one entry per sequence, got 1 and 2"),
    (dict(q_lens=[-1], seq_lens=[2], budget_rows=64), r"q_lens must be >= 0, got \[-1\]"),
    (dict(q_lens=[1], seq_lens=[2], budget_rows=0), "budget_rows must be an int >= 1, got 0"),
    (dict(q_lens=[1], seq_lens=[2], budget_rows=64, window_left=-2), "window_left must be None or an int >= 0"),
])
def test_plan_rejects_bad_lengths(kw, match):
    with pytest.raises(ValueError, match=match):
        plan_tiles(**kw)


def test_host_lengths_are_checked():
    """``query_start_loc_cpu`` / ``seq_lens_cpu``: both or neither, host tensors, a valid batch."""
    import tqkern
    import tqkern_torch as tqt

    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset("tq4", 64), num_kv_heads=1, block_size=16)
    params = tqkern.TQParams.default(layout.format)
    cache = torch.zeros(layout.cache_shape(2), dtype=torch.uint8)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    sl = torch.tensor([20], dtype=torch.int32)
    qsl = torch.tensor([0, 12], dtype=torch.int32)
    q = torch.zeros(12, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="must be given together, got only query_start_loc_cpu"):
        tqt.prefill(q, cache, bt, sl, qsl, layout, params, query_start_loc_cpu=qsl)
    with pytest.raises(ValueError, match=r"seq_lens_cpu must be in \[0, max_blocks \* block_size = 32\], "
                                         r"got range \[40, 40\]"):
        tqt.prefill(q, cache, bt, sl, qsl, layout, params, query_start_loc_cpu=qsl,
                    seq_lens_cpu=torch.tensor([40]), check_inputs=False)
    with pytest.raises(ValueError, match=r"query_start_loc_cpu\[-1\] must be num_tokens = 12 \(q.shape\[0\]\), "
                                         r"got 11"):
        tqt.prefill(q, cache, bt, sl, qsl, layout, params, query_start_loc_cpu=torch.tensor([0, 11]),
                    seq_lens_cpu=sl, check_inputs=False)
    with pytest.raises(ValueError, match=r"seq_lens_cpu must have shape \[1\], got \[2\]"):
        tqt.prefill(q, cache, bt, sl, qsl, layout, params, query_start_loc_cpu=qsl, seq_lens_cpu=torch.tensor([1, 2]))


def test_equal_pieces_share_a_dense_call():
    """Consecutive sequences with equal (q_len, piece length, mask, last) go to one dense call; a
    sequence without queries between them does not split the run, other lengths do."""
    from tqkern_torch.prefill_tiles import _groups

    q_lens, seq_lens = [4, 0, 4, 4, 3], [10, 7, 10, 12, 10]
    plan = plan_tiles(q_lens, seq_lens, budget_rows=1 << 20)
    assert [[pc.seq for pc in g] for g in _groups(plan.rounds[0], q_lens)] == [[0, 2, 3], [4]]
    assert [[pc.seq for pc in g] for g in _groups(plan.rounds[1], q_lens)] == [[0, 2], [3], [4]]
    # a sequence with queries but no piece in this round (no prefix) sits between equal pieces:
    # their queries are not adjacent, so they take separate calls (one call overwrote its rows)
    q_lens, seq_lens = [9, 32, 9], [64, 32, 64]
    plan = plan_tiles(q_lens, seq_lens, budget_rows=1 << 20)
    assert [[pc.seq for pc in g] for g in _groups(plan.rounds[1], q_lens)] == [[0], [2]]


@pytest.mark.parametrize("int8", [False, True])
def test_batch_equals_its_sequences_one_at_a_time(int8, monkeypatch):
    """A full prefill between two chunks of equal shape (found on the H200 by the int8 tiles'
    property test, session 44): the chunks' prefix pieces used to share one dense call whose query
    rows spanned the full prefill's, and its merge overwrote them. Each sequence's rows equal
    those of a call holding that sequence alone."""
    import tqkern_torch.prefill_tiles as pt
    from tqkern_torch.errors import error_word
    from tqkern_torch.ops import _device_params

    q_lens, seq_lens = [12, 20, 12], [30, 20, 30]
    layout, params, cache, bt, sl, qsl, q, _ = _tq4_batch(q_lens, seq_lens, 3, monkeypatch)
    p = _device_params(params, layout, q.device)

    def run(rows, lens, block_table, seq_dev, starts):
        return pt.tile_prefill(rows, cache, block_table, seq_dev, starts, layout, p, q_lens=lens,
                               seq_lens=[int(x) for x in seq_dev], num_blocks=bt.numel(), errors=error_word(q.device),
                               scale=0.125, out=None, lse=None, window_left=None, sinks=None, int8=int8,
                               attend=None if int8 else pt.attend_math)

    whole = run(q, q_lens, bt, sl, qsl)
    for s in range(3):
        a, b = int(qsl[s]), int(qsl[s + 1])
        alone = run(q[a:b], [q_lens[s]], bt[s:s + 1], sl[s:s + 1], torch.tensor([0, b - a], dtype=torch.int32))
        torch.testing.assert_close(whole[a:b], alone, atol=2e-3, rtol=0, msg=lambda m: f"sequence {s}: {m}")


def test_int8_prefill_takes_the_host_lengths():
    """``int8_prefill`` has ``prefill``'s arguments: the host lengths are checked, and the call
    gives what it gives without them."""
    import tqkern
    import tqkern_torch as tqt
    from tqkern import reference as ref

    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset("tq4", 64), num_kv_heads=1, block_size=16)
    params = tqkern.TQParams.default(layout.format)
    rng = torch.Generator().manual_seed(0)
    k, v = (torch.randn(20, 1, 64, generator=rng).half() for _ in range(2))
    cache = torch.from_numpy(ref.store(np.zeros(layout.cache_shape(2), np.uint8), k.numpy(), v.numpy(),
                                       np.arange(20), layout, params))
    bt, sl, qsl = (torch.tensor(x, dtype=torch.int32) for x in ([[0, 1]], [20], [0, 12]))
    q = torch.randn(12, 2, 64, generator=rng).half()
    want = tqt.int8_prefill(q, cache, bt, sl, qsl, layout, params)
    got = tqt.int8_prefill(q, cache, bt, sl, qsl, layout, params, query_start_loc_cpu=qsl, seq_lens_cpu=sl)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="must be given together, got only seq_lens_cpu"):
        tqt.int8_prefill(q, cache, bt, sl, qsl, layout, params, seq_lens_cpu=sl)


def _tq4_batch(q_lens, seq_lens, seed, monkeypatch):
    """A tq4 head_dim-64 cache of ``len(seq_lens)`` sequences (two 16-slot blocks each, keys from
    the oracle's store), its table, lengths and queries, and a list that counts the tiled path's
    merges (``_combine`` wrapped); skips without the interpreter."""
    import tqkern
    import tqkern_torch.prefill_tiles as pt
    from tqkern import reference as ref
    from tqkern_torch._validate import use_triton

    if not use_triton(torch.device("cpu")):
        pytest.skip("needs TRITON_INTERPRET=1 on a CPU")
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset("tq4", 64), num_kv_heads=1, block_size=16)
    params = tqkern.TQParams.default(layout.format)
    rng = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    k, v = (torch.randn(n * 32, 1, 64, generator=rng).half() for _ in range(2))
    cache = torch.from_numpy(ref.store(np.zeros(layout.cache_shape(2 * n), np.uint8), k.numpy(), v.numpy(),
                                       np.arange(n * 32), layout, params))
    bt = torch.arange(2 * n, dtype=torch.int32).reshape(n, 2)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    q = torch.randn(sum(q_lens), 2, 64, generator=rng).half()
    merged = []
    real_combine = pt._combine
    monkeypatch.setattr(pt, "_combine", lambda *a: merged.append(1) or real_combine(*a))
    return layout, params, cache, bt, sl, qsl, q, merged


@pytest.mark.parametrize("q_lens, seq_lens, sinks, one_call", [([16, 0, 16], [16, 5, 16], False, True),
                                                                ([16, 16], [16, 20], False, False),
                                                                ([16, 16], [16, 16], True, False)])
def test_one_dense_call_returns_its_output(q_lens, seq_lens, sinks, one_call, monkeypatch):
    """With ``out=None``, a call that is one dense call (full prefills of equal length, no
    sinks) returns the dense call's own output (no merge, no copy) and fills ``lse``; a prefix
    piece or sinks take the merge. Either way the rows equal those written into a given ``out``."""
    import tqkern_torch.prefill_tiles as pt
    from tqkern_torch.errors import error_word
    from tqkern_torch.ops import _device_params

    layout, params, cache, bt, sl, qsl, q, merged = _tq4_batch(q_lens, seq_lens, 1, monkeypatch)
    kw = dict(layout=layout, p=_device_params(params, layout, q.device), q_lens=q_lens, seq_lens=seq_lens,
              num_blocks=bt.numel(), errors=error_word(q.device), scale=0.125, window_left=None,
              sinks=torch.zeros(2) if sinks else None, attend=pt.attend_math)
    given = torch.full_like(q, float("nan"))
    lse_given, lse_fresh = torch.empty(q.shape[:2]), torch.full(q.shape[:2], float("nan"))
    assert pt.tile_prefill(q, cache, bt, sl, qsl, out=given, lse=lse_given, **kw) is given
    merged.clear()
    fresh = pt.tile_prefill(q, cache, bt, sl, qsl, out=None, lse=lse_fresh, **kw)
    assert bool(merged) != one_call and fresh.is_contiguous()
    assert torch.equal(fresh, given) and torch.equal(lse_fresh, lse_given)


@pytest.mark.parametrize("q_lens, seq_lens, merges", [([16, 16], [32, 32], 1), ([16, 0, 16], [32, 5, 20], 2),
                                                       ([16, 16], [16, 32], 2), ([16, 16, 16], [16, 32, 32], 2)])
def test_first_pieces_are_held_not_copied(q_lens, seq_lens, merges, monkeypatch):
    """A sequence's first piece (its new tokens) is merged straight from the dense call's output
    by its next piece's merge: two-piece sequences take one merge per dense call of their
    prefix, not a copy first and a merge after; the rows equal the oracle's."""
    import tqkern.testing as T
    import tqkern_torch.prefill_tiles as pt
    from property_tests.test_prefill_triton import _bounds, rounding, sequence_error
    from tqkern import reference as ref
    from tqkern_torch.errors import error_word
    from tqkern_torch.ops import _device_params

    layout, params, cache, bt, sl, qsl, q, merged = _tq4_batch(q_lens, seq_lens, 4, monkeypatch)
    kw = dict(layout=layout, p=_device_params(params, layout, q.device), q_lens=q_lens, seq_lens=seq_lens,
              num_blocks=bt.numel(), errors=error_word(q.device), scale=0.125, window_left=None, sinks=None,
              attend=pt.attend_math)
    got = pt.tile_prefill(q, cache, bt, sl, qsl, out=torch.full_like(q, float("nan")), lse=None, **kw)
    assert len(merged) == merges
    batch = T.VarlenBatch(bt.numpy(), sl.numpy(), bt.numel(), 16, q_lens)
    q64, cache_np = q.double().numpy(), cache.numpy()
    expect = ref.prefill(q64, cache_np, bt.numpy(), sl.numpy(), qsl.numpy(), layout, params, scale=0.125)
    for s in range(len(q_lens)):
        if q_lens[s]:
            err, tol, _, _ = sequence_error(got.float().numpy(), expect, layout, params, batch, cache_np, q64, 2, s,
                                            _bounds, rounding(layout, q, workspace=True))
            assert err <= tol, (s, err, tol)


def test_held_rows_from_different_calls_move_to_float32_first():
    """Where a merge's sequences were held in different dense outputs (no plan makes this today:
    the fall-back), their rows are copied into the float32 running result first, then merged from
    it."""
    import tqkern_torch.prefill_tiles as pt
    from tqkern.ops.prefill.tiles import Piece
    from tqkern_torch._validate import use_triton

    if not use_triton(torch.device("cpu")):
        pytest.skip("needs TRITON_INTERPRET=1 on a CPU")
    g = torch.Generator().manual_seed(5)
    q = torch.zeros(6, 2, 16, dtype=torch.float16)
    lse_acc = torch.zeros(6, 2)
    run = pt._Running(q, lse_acc, [0, 2, 6])
    o1, o2 = (torch.randn(n, 2, 16, generator=g).half() for n in (2, 4))
    l1, l2 = torch.randn(2, 2, generator=g), torch.randn(4, 2, generator=g)
    pieces = [Piece(seq=s, start=0, length=4, row=0, causal=False, first=True, last=False) for s in (0, 1)]
    run.hold(pieces[:1], o1, l1, 0)
    run.hold(pieces[1:], o2, l2, 2)
    rows, rows_lse = run.source(pieces, 0, 6)
    assert rows.dtype == torch.float32 and not run.held
    assert torch.equal(rows, torch.cat([o1, o2]).float()) and torch.allclose(rows_lse, torch.cat([l1, l2]))
    run.hold(pieces, o2, l2, 0)  # both in one output: its rows, no copy
    rows, _ = run.source(pieces, 0, 4)
    assert rows.data_ptr() == o2.data_ptr()


def _guarded_attend(q, k, v, batch, **kw):
    """``attend_math`` as FlashAttention-style kernels treat a row whose scores are all −inf or
    NaN: output zeros, lse −inf (no NaN left to propagate)."""
    import tqkern_torch.prefill_tiles as pt

    o, lse = pt.attend_math(q, k, v, batch, **kw)
    bad = ~torch.isfinite(lse)
    return o.masked_fill(bad[..., None], 0.0), lse.masked_fill(bad, float("-inf"))


@pytest.mark.parametrize("dense", ["math", "guarded"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("given_out", [False, True])
def test_non_finite_query_row_gets_nan_output_and_lse_on_every_route(value, given_out, dense, monkeypatch):
    """A query row holding one ±inf or NaN element gets a NaN output row and a NaN ``lse`` whether
    the call is one dense call (its output returned as is) or merged, whatever the dense kernel
    gave that row: with one +inf element the scores are ±inf and the lse +inf (the one-call route
    returned that, found on an H200 by the tiled property test); a guarded kernel gives zeros and
    −inf."""
    import tqkern_torch.prefill_tiles as pt
    from tqkern_torch.errors import error_word
    from tqkern_torch.ops import _device_params

    layout, params, cache, bt, sl, qsl, q, merged = _tq4_batch([16], [16], 3, monkeypatch)
    q[3, 1, 5] = value
    kw = dict(layout=layout, p=_device_params(params, layout, q.device), q_lens=[16], seq_lens=[16],
              num_blocks=bt.numel(), errors=error_word(q.device), scale=0.125, window_left=None, sinks=None,
              attend=pt.attend_math if dense == "math" else _guarded_attend)
    lse = torch.zeros(q.shape[:2])
    out = pt.tile_prefill(q, cache, bt, sl, qsl, out=torch.zeros_like(q) if given_out else None, lse=lse, **kw)
    assert bool(merged) == given_out
    bad = torch.zeros(q.shape[:2], dtype=torch.bool)
    bad[3, 1] = True
    assert torch.isnan(out[bad]).all() and torch.isnan(lse[bad]).all()
    assert torch.isfinite(out[~bad]).all() and torch.isfinite(lse[~bad]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_poison_rows_kernel_writes_exactly_the_non_finite_rows(dtype):
    """The one-call route's check over many programs of 1024 lse rows (and the sub-chunks a
    program writes): rows with a NaN or ±inf lse, wherever they fall (first and last row, a
    program's last row, rows past a partial last program), become NaN in the output and the lse;
    every other byte is untouched, including the output's padding columns and a strided lse.
    Runs where the kernels run: the interpreter on a CPU (fp16 only), else the GPU."""
    import triton

    import tqkern_torch.prefill_tiles as pt
    from tqkern_torch.testing import device_under_test, kernels_available

    dev = device_under_test()
    if not kernels_available():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    if dev.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter has no bf16")
    t, hq, d = 700, 4, 24  # 2800 rows: three programs, the last partial
    g = torch.Generator().manual_seed(5)
    base = torch.randn((t, hq, 32), generator=g).to(device=dev, dtype=dtype)
    o = base[:, :, :d]  # row stride 128, 24 columns of 32
    lse_full = torch.randn((t, 2 * hq), generator=g).to(dev)
    lse = lse_full[:, ::2]  # strided
    rows = [0, 15, 16, 1023, 1024, 1500, 2047, 2799]
    values = [float("nan"), float("inf"), -float("inf")]
    for i, r in enumerate(rows):
        lse[r // hq, r % hq] = values[i % 3]
    base_before, lse_before = base.clone(), lse_full.clone()
    pt._poison_rows_kernel[(triton.cdiv(t * hq, pt._POISON_ROWS),)](
        o, lse, t * hq, o.stride(0), o.stride(1), lse.stride(0), lse.stride(1), HQ=hq, D=d, DP=32,
        BR=pt._POISON_ROWS, SUB=pt._COMBINE_ROWS)
    bad = torch.zeros((t, hq), dtype=torch.bool, device=dev)
    for r in rows:
        bad[r // hq, r % hq] = True
    assert torch.isnan(o[bad]).all() and torch.isnan(lse[bad]).all()
    assert torch.equal(o[~bad], base_before[:, :, :d][~bad]) and torch.equal(lse[~bad], lse_before[:, ::2][~bad])
    assert torch.equal(lse_full[:, 1::2], lse_before[:, 1::2])
    assert torch.equal(base[..., d:], base_before[..., d:])  # the padding columns: not written


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("q_lens, seq_lens, one_call", [([16], [16], True), ([16, 0], [16, 5], True),
                                                        ([16, 4], [16, 20], False)])
def test_frontend_batch_of_long_rows_runs_whole(int8, q_lens, seq_lens, one_call, monkeypatch):
    """``prefill`` / ``int8_prefill`` with host lengths and no ``out``: a batch without short rows
    (q_len 1..8) runs whole on the tiled path, so a full prefill is one dense call whose output is
    returned without a merge or copy (``int8_prefill`` used to split every batch and copy it); a
    batch holding a short row still splits. Rows equal those written into a given ``out``."""
    import importlib

    import tqkern_torch as tqt

    layout, params, cache, bt, sl, qsl, q, merged = _tq4_batch(q_lens, seq_lens, 2, monkeypatch)
    frontend = importlib.import_module("tqkern_torch.prefill")  # (the package's `prefill` is the function)
    monkeypatch.setattr(frontend, "tiles_supported", lambda *a, **k: True)  # the tiled path in the interpreter
    f = tqt.int8_prefill if int8 else tqt.prefill
    host = dict(query_start_loc_cpu=qsl, seq_lens_cpu=sl)
    given = torch.full_like(q, float("nan"))
    assert f(q, cache, bt, sl, qsl, layout, params, out=given, **host) is given
    merged.clear()
    fresh = f(q, cache, bt, sl, qsl, layout, params, **host)
    assert (not merged) == one_call
    assert torch.equal(fresh, given)


def test_gather_grid_runs_heads_fastest_and_names_its_limits():
    """The gather's grid: KV heads on the first axis (neighbouring programs share a token row),
    then position tiles, then runs; CUDA's 65,535 limit on the other two axes is named."""
    from tqkern.ops.decompress.gather import gather_config

    gc = gather_config(128)
    per = gc.BT * gc.TILES
    assert gc.grid(per + 1, 3, 8) == (8, 2, 3)
    assert gc.grid(65535 * per, 65535, 8) == (8, 65535, 65535)
    with pytest.raises(ValueError, match="at most 65535 position tiles and runs, got 65536 tiles"):
        gc.grid(65535 * per + 1, 1, 8)
    with pytest.raises(ValueError, match="got 1 tiles .* and 65536 runs"):
        gc.grid(1, 65536, 8)


def test_gather_config_fits_long_runs_by_more_tiles_per_program():
    """A run longer than 65,535 programs' positions (one KV head at head_dim 64 fills the default
    workspace with 2^20 rows) takes more tiles per program instead of a failed grid."""
    from tqkern.ops.decompress.gather import gather_config
    from tqkern_torch.prefill_tiles import WORKSPACE_BYTES

    gc = gather_config(64)
    per = gc.BT * gc.TILES
    assert gc.fitting(65535 * per) is gc
    rows = WORKSPACE_BYTES // (2 * 1 * 64 * 2)  # K + V rows of one fp16 KV head at head_dim 64
    wide = gc.fitting(rows)
    assert wide.TILES == 2 * gc.TILES and wide._replace(TILES=gc.TILES) == gc
    assert wide.grid(rows, 1, 1) == (1, -(-rows // (2 * per)), 1)
    assert gc.fitting(65535 * 4 * per).TILES == 4 * gc.TILES


def _one_sequence(preset: str, tokens: int, order: list[int], seq_len: int, q_len: int, hq: int, seed: int):
    """A one-KV-head D64 cache of ``tokens`` stored tokens in the blocks of ``order`` (the block
    table row), ``q_len`` new queries of ``hq`` heads ending sequence 0 at ``seq_len``, and
    :func:`tile_prefill`'s keyword arguments (dense attention by ``attend_math``); skips off the
    interpreter."""
    import tqkern
    import tqkern_torch.prefill_tiles as pt
    from tqkern import reference as ref
    from tqkern_torch._validate import use_triton
    from tqkern_torch.errors import error_word
    from tqkern_torch.ops import _device_params

    if not use_triton(torch.device("cpu")):
        pytest.skip("needs TRITON_INTERPRET=1 on a CPU")
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, 64), num_kv_heads=1, block_size=16)
    params = tqkern.TQParams.default(layout.format)
    rng = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(tokens, 1, 64, generator=rng).half() for _ in range(2))
    cache = torch.from_numpy(ref.store(np.zeros(layout.cache_shape(len(order)), np.uint8), k.numpy(), v.numpy(),
                                       np.arange(tokens), layout, params))
    bt, sl, qsl = (torch.tensor(x, dtype=torch.int32) for x in ([order], [seq_len], [0, q_len]))
    q = torch.randn(q_len, hq, 64, generator=rng).half()
    kw = dict(layout=layout, p=_device_params(params, layout, q.device), q_lens=[q_len], seq_lens=[seq_len],
              num_blocks=len(order), errors=error_word(q.device), scale=0.125, window_left=None, sinks=None,
              attend=pt.attend_math, out=None, lse=None)
    return (q, cache, bt, sl, qsl), kw


def test_tile_prefill_runs_long_runs_with_more_tiles_per_program(monkeypatch):
    """The wiring of ``GatherConfig.fitting``: with the grid's axis limit lowered to 2 programs,
    the 60-position prefix run and the 40-position causal run (16-position tiles) take 2 tiles a
    program, and the rows equal the default call's."""
    import tqkern.ops.decompress.gather as gather
    import tqkern_torch.prefill_tiles as pt

    args, kw = _one_sequence("turboquant_4bit_nc", 112, [3, 0, 6, 1, 5, 2, 4], 100, 40, 2, seed=2)
    want = pt.tile_prefill(*args, **kw)
    tiles = []
    real = gather.GatherConfig.grid
    monkeypatch.setattr(gather, "GRID_AXIS_MAX", 2)
    monkeypatch.setattr(gather.GatherConfig, "grid", lambda self, *a: tiles.append(self.TILES) or real(self, *a))
    got = pt.tile_prefill(*args, **kw)
    assert tiles == [2, 2] and torch.equal(got, want)


def test_gather_config_rotates_back_in_the_gather():
    """``gather_config``'s default: the Walsh–Hadamard rotate-back on, 16 positions a program."""
    from tqkern.ops.decompress.gather import GatherConfig, gather_config

    assert gather_config(128) == GatherConfig(16, 1, 1, True)
    assert gather_config(256) == GatherConfig(16, 1, 2, True)


@pytest.mark.parametrize("preset,int8,products", [("turboquant_4bit_nc", False, 0), ("tqkern_k5v3", False, 0),
                                                   ("tq4", False, 4), ("tqkern_k5v3", True, 0), ("tq4", True, 2)])
def test_tile_prefill_default_gather_rotates_signed_sylvester_sides_back(monkeypatch, preset, int8, products):
    """The wiring of the default gather config: a signed Sylvester preset's rotated sides leave the
    gather rotated back (no product by ``Πᵀ`` after it), tq4's dense rotation takes one product a
    rotated side and round (a prefix round and a causal round here), ``int8_prefill``'s keys none
    (they stay in the codec's space)."""
    import tqkern_torch.prefill_tiles as pt

    args, kw = _one_sequence(preset, 32, [1, 0], 32, 16, 1, seed=5)
    calls = []
    real = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k_: calls.append(1) or real(*a, **k_))
    out = pt.tile_prefill(*args, int8=int8, **kw)
    assert len(calls) == products and torch.isfinite(out).all()
