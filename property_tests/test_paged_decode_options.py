"""The Triton paged_decode kernels with the attention options equal the oracle on the same cache.

``window_left``, ``logit_softcap``, ``sinks`` and ``return_lse`` (spec:
:mod:`tqkern.ops.paged_decode.reference`), alone and together, for every codec kind on either
side; windows shorter than, equal to and longer than the sequences; empty sequences, with and
without sinks. The output tolerance is that of ``test_paged_decode_triton.py`` over the keys the
window leaves: ``(4e-3 + 2·δ)·max|V̂|``, δ = 2u·scale·max Σ_d |q_d|·|k̂_d| the largest logit error
of the fp16 (bf16) dot; the soft-cap's tanh has slope ≤ 1 (it never enlarges δ) and, computed in
float32, adds at most ``c·2^-21`` (a few float32 roundings of a value ≤ c). The lse moves by at
most the largest logit error, plus float32 rounding of the max and of a sum over at most ~100
tile and split steps: ``δ + 2^-21·c + 1e-5·(1 + |lse|)``. Empty rows: zero output, lse exactly
−inf (the sink's logit with sinks, to the same tolerance). Non-finite query rows: NaN output and
NaN lse.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import tqkern
import tqkern.testing as T
import tqkern_torch as tqt
from property_tests.test_paged_decode_triton import mma_path_cases
from tqkern import reference as ref
from tqkern.ops.paged_decode.plan import DecodeOptions
from tqkern.ops.paged_decode.triton import decode_path
from tqkern_torch.attention import paged_decode
from tqkern_torch.testing import device_under_test, kernels_available, poisoned_like, store_for_tests, to_torch_kv

pytestmark = [pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:All-NaN:RuntimeWarning")]

DEV = device_under_test()
ON_GPU = DEV.type == "cuda"
KINDS = ("lloyd_max", "uniform", "fp8", "raw")


def _kind(codec) -> str:
    return {tqkern.LloydMax: "lloyd_max", tqkern.Uniform: "uniform", tqkern.FP8: "fp8", tqkern.Raw: "raw"}[type(codec)]


def _codecs(kind: str | None):
    """Codecs of one kind (``None``: any); raw bf16 only on a GPU (the interpreter cannot multiply bf16)."""
    raw = st.builds(tqkern.Raw, dtype=st.sampled_from(["float16", "bfloat16"] if ON_GPU else ["float16"]))
    by_kind = {"lloyd_max": T.lloyd_max_codecs(), "uniform": T.uniform_codecs(),
               "fp8": st.builds(tqkern.FP8, rotated=st.booleans()), "raw": raw}
    return by_kind[kind] if kind else st.one_of(list(by_kind.values()))


@st.composite
def _formats(draw, kind: str):
    """A format with a ``kind`` codec on a drawn side and any codec on the other."""
    side = draw(st.sampled_from(["key", "value"]), label="side_of_kind")
    key = draw(_codecs(kind if side == "key" else None), label="key")
    value = draw(_codecs(kind if side == "value" else None), label="value")
    packed4 = all((not c.packed) or c.bits == 4 for c in (key, value))
    return tqkern.KVFormat(
        head_dim=draw(st.one_of(st.sampled_from(T.HEAD_DIMS), st.integers(1, 64).map(lambda n: 2 * n)),
                      label="head_dim"),
        key=key, value=value,
        bit_order=draw(st.sampled_from(["lsb", "nibble_high_even"] if packed4 else ["lsb"]), label="bit_order"),
        rotation=draw(st.sampled_from(["hadamard", "hadamard_signed", "haar"]), label="rotation"),
        slot_alignment=draw(st.sampled_from([1, 2, 4, 16]), label="slot_alignment"))


@st.composite
def option_cases(draw, kind: str):
    """A layout with a ``kind`` codec on one side, a batch (some sequences emptied), and a
    non-empty set of options with their values."""
    layout = draw(T.paged_layouts(_formats(kind), num_kv_heads=st.integers(1, 3)), label="layout")
    params = draw(T.tq_params(layout.format, layout.num_kv_heads), label="params")
    group = draw(st.sampled_from([1, 2, 3, 4, 8]), label="gqa_group")
    batch = draw(T.paged_batches(layout.block_size, max_seqs=T.scale(3, 8), max_len=T.scale(80, 3000)),
                 label="batch")
    empty = draw(st.lists(st.integers(0, len(batch.seq_lens) - 1), max_size=2), label="emptied_seqs")
    for s in empty:  # (its blocks stay in the table: padding, never read)
        batch.seq_lens[s] = 0
    which = draw(st.sets(st.sampled_from(["window", "softcap", "sinks", "lse"]), min_size=1), label="options")
    opts = {}
    if "window" in which:
        n0 = int(batch.seq_lens[0])  # shorter than, equal to (W + 1 = n) or longer than the first sequence
        opts["window_left"] = draw(st.one_of(st.integers(0, 3), st.sampled_from([max(0, n0 - 2), max(0, n0 - 1), n0]),
                                             st.integers(0, max(1, int(batch.seq_lens.max())) + 5)),
                                   label="window_left")
    if "softcap" in which:
        opts["logit_softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0]) | st.floats(0.25, 60.0), label="logit_softcap")
    if "sinks" in which:
        hq = layout.num_kv_heads * group
        opts["sinks"] = np.array(draw(st.lists(st.floats(-8.0, 8.0, width=32), min_size=hq, max_size=hq),
                                      label="sinks"), np.float32)
    # 16 / 17 / 40: the one-row merge (from 16 splits, 17 with the rotate-back; 40: partial split tiles)
    num_splits = draw(st.one_of(st.none(), st.integers(1, 5), st.sampled_from([16, 17, 40])), label="num_splits")
    return layout, params, group, batch, num_splits, opts, "lse" in which


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=T.scale(8, settings.default.max_examples))  # CI: 8 (slowest interpreted)
@given(st.data())
def test_options_match_oracle(kind, data):
    _check_options_against_oracle(*data.draw(option_cases(kind), label="case"), data)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the warp-MMA kernel is inline PTX: GPU only")
@given(mma_path_cases(), st.data())
def test_options_on_the_mma_kernel(case, data):
    """The warp-MMA kernel applies the window and the soft-cap itself (constexprs ``WINDOW``,
    ``SOFTCAP``); sinks and the lse are the merge's. Every option, alone or together, on the
    layouts that take that kernel."""
    layout, params, group, batch, qdtype, num_splits = case  # qdtype: float16 or (GPU) bfloat16
    assert decode_path(layout, group, same_codebooks=tqt.to_device(params, DEV).same_codebooks) == "mma"
    hq = layout.num_kv_heads * group
    opts = {}
    n0 = int(batch.seq_lens[0])
    if data.draw(st.booleans(), label="with_window"):
        opts["window_left"] = data.draw(st.one_of(st.integers(0, 20), st.sampled_from([max(0, n0 - 1), n0]),
                                                  st.integers(0, max(1, int(batch.seq_lens.max())) + 5)),
                                        label="window_left")
    if data.draw(st.booleans(), label="with_softcap"):
        opts["logit_softcap"] = data.draw(st.sampled_from([0.5, 2.0, 30.0, 50.0]), label="logit_softcap")
    if data.draw(st.booleans(), label="with_sinks"):
        opts["sinks"] = np.array(data.draw(st.lists(st.floats(-8.0, 8.0, width=32), min_size=hq, max_size=hq),
                                           label="sinks"), np.float32)
    options = DecodeOptions(window="window_left" in opts, softcap="logit_softcap" in opts, sinks="sinks" in opts,
                            lse=True)
    plan = tqt.plan_decode(torch.zeros(len(batch.seq_lens), hq, layout.head_dim, dtype=torch.float16, device=DEV),
                           tqt.allocate_cache(layout, batch.num_blocks, DEV),
                           torch.from_numpy(batch.block_table).to(DEV), layout, params,
                           num_splits=num_splits, window_left=opts.get("window_left"),
                           logit_softcap=opts.get("logit_softcap"),
                           sinks=None if "sinks" not in opts else torch.from_numpy(opts["sinks"]).to(DEV),
                           return_lse=True)
    assert plan.path == "mma" and plan.options == options
    assert dict(plan.decode.constexprs).get("WINDOW", False) == options.window
    assert dict(plan.decode.constexprs).get("SOFTCAP", False) == options.softcap
    _check_options_against_oracle(layout, params, group, batch, num_splits, opts, True, data, qdtype)


def _check_options_against_oracle(layout, params, group, batch, num_splits, opts, return_lse, data,
                                  qdtype=torch.float16):
    h, d = layout.num_kv_heads, layout.head_dim
    cache = poisoned_like(layout.cache_shape(batch.num_blocks), torch.uint8, DEV, seed=batch.num_blocks)
    for s in range(len(batch.seq_lens)):
        if batch.seq_lens[s] == 0:
            continue
        k, v = data.draw(T.kv_arrays(int(batch.seq_lens[s]), h, d, dtype=np.float32), label=f"kv{s}")
        store_for_tests(cache, k, v, batch.slot_ids(s), layout, params, qdtype)  # (the oracle off the GPU)
    num_seqs = len(batch.seq_lens)
    q_np = data.draw(T.float_arrays((num_seqs, h * group, d), dtype=np.float32), label="q")
    nonfinite = data.draw(st.lists(st.tuples(st.integers(0, num_seqs - 1), st.integers(0, h * group - 1),
                                             st.integers(0, d - 1), st.sampled_from([np.nan, np.inf])),
                                   max_size=1), label="non_finite_q")
    for s_, hq_, d_, x in nonfinite:
        q_np[s_, hq_, d_] = x
    q, q64 = to_torch_kv(q_np, qdtype, DEV)
    bad = ~np.all(np.isfinite(q64), axis=-1)  # [S, Hq]
    out = poisoned_like(tuple(q.shape), qdtype, DEV)
    kw = dict(opts)
    if "sinks" in kw:
        kw["sinks"] = torch.from_numpy(opts["sinks"]).to(DEV)
    res = paged_decode(q, cache, torch.from_numpy(batch.block_table).to(DEV), torch.from_numpy(batch.seq_lens).to(DEV),
                       layout, params, out=out, num_splits=num_splits, return_lse=return_lse, **kw)
    cache_np = cache.cpu().numpy()
    expect, expect_lse = ref.paged_decode(q64, cache_np, batch.block_table, batch.seq_lens, layout, params,
                                          return_lse=True, **opts)
    if return_lse:
        assert isinstance(res, tuple) and res[0] is out
        lse = res[1]
        assert lse.dtype == torch.float32 and tuple(lse.shape) == (num_seqs, h * group)
        lse = lse.cpu().numpy().astype(np.float64)
        assert np.all(np.isnan(lse[bad])), "a query row with NaN/inf must give a NaN lse"
    else:
        assert res is out
    got = out.float().cpu().numpy()
    assert np.all(np.isnan(got[bad])), "a query row with NaN/inf must give a NaN output row"
    assert np.all(np.isfinite(got[~bad])), "output has NaN/inf (unwritten or overflow)"

    fmt = layout.format
    rnd = T.Rounding.of(fmt, str(qdtype).removeprefix("torch."), workspace=False)  # (dot_u 2^-8 for a raw bf16 side)
    cap = opts.get("logit_softcap")
    cap_err = 0.0 if cap is None else cap * 2.0**-21
    q_ok = np.where(bad[..., None], 0.0, q64)
    q_k = q_ok @ params.rotation if fmt.key.rotated else q_ok
    for s, slots in enumerate(ref.gather_sequences(cache_np, layout, batch.block_table, batch.seq_lens)):
        n = int(batch.seq_lens[s])
        lo = 0 if "window_left" not in opts else max(0, n - 1 - opts["window_left"])  # the visible keys lo .. n − 1
        khat, _ = ref.decompress(slots, params)
        _, vhat = ref.decompress(slots, params, rotate_back=True)
        khat, vhat = khat[lo:], vhat[lo:]
        vmax = float(np.abs(vhat).max()) if vhat.size else 0.0
        delta = rnd.logit_bound(q_k[s], khat, group) + cap_err
        good = ~bad[s]
        if n == 0:
            assert np.all(got[s][good] == 0), "an empty sequence gives a zero output"
        err = float(np.abs(got[s][good] - expect[s][good]).max()) if good.any() else 0.0
        tol = rnd.atol(delta, vmax)
        note(f"seq {s}: len {n}, visible {n - lo}, max err {err:.3g}, tol {tol:.3g}, δ {delta:.3g}")
        assert err <= tol, f"seq {s}: error {err:.3g} > tolerance {tol:.3g} (max|V| {vmax:.3g}, δ {delta:.3g})"
        if not return_lse:
            continue
        want, have = expect_lse[s][good], lse[s][good]
        empty = np.isneginf(want)
        assert np.array_equal(np.isneginf(have), empty), f"seq {s}: lse −inf exactly where the oracle's is"
        lerr = np.abs(have[~empty] - want[~empty])
        ltol = delta + 1e-5 * (1 + np.abs(want[~empty]))
        note(f"seq {s}: lse max err {float(lerr.max()) if lerr.size else 0.0:.3g}")
        assert np.all(lerr <= ltol), f"seq {s}: lse error {lerr.max():.3g} > tolerance {ltol.max():.3g}"
