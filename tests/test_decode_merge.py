"""The decode launcher's merge of split partials (every kernel and column-chunk count, with and
without the rotate-back, sinks, lse and poisoned rows) and the q rotation, against NumPy; the
rules that plan them; and the workspace they write (its size and alignment). Run in Triton's interpreter on CPU (TRITON_INTERPRET=1) or on a GPU."""

import numpy as np

import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern.ops.paged_decode.merge import _launch_merge, merge_chunks
from tqkern.ops.paged_decode.reference import merge_partials
from tqkern.ops.paged_decode.rotate import rotate_q
from tqkern.ops.paged_decode.triton import workspace_numel
from tqkern_torch.testing import device_under_test, kernels_available

DEV = device_under_test()
needs_kernels = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")
INTERP = DEV.type == "cpu"


def _layout(preset, d, heads, arrangement="slot"):
    return tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, d), num_kv_heads=heads, block_size=16,
                              arrangement=arrangement)


def test_merge_chunks_rule():
    assert merge_chunks(256, 132, 128) == 1
    assert merge_chunks(64, 132, 128) == 4
    assert merge_chunks(1, 132, 128) == 8  # at most DP / 16
    assert merge_chunks(1, 132, 16) == 1


def test_row_merge_chunks_rule():
    """The row-block merge's chunks: uncapped without the rotate-back; with it at most 2 for
    DP <= 128 and 8 for DP = 256 (each chunk re-merges every column)."""
    from tqkern.ops.paged_decode.side_plans import row_merge_chunks
    assert row_merge_chunks(64, 132, 128, False) == 4
    assert row_merge_chunks(64, 132, 128, True) == 2
    assert row_merge_chunks(8, 132, 256, True) == 8  # Gemma-2-9B B8x8K: 128 rows
    assert row_merge_chunks(8, 132, 256, False) == 16
    assert row_merge_chunks(256, 132, 256, True) == 1


def test_merge_impl_and_one_row_chunks_rule():
    """The one-row merge from 16 splits (17 with the rotate-back); its chunks fill two programs per
    SM (at most DP/16) without the rotate-back, one per SM (at most DP/32) with it; the planned
    split block is a tile of at most 4096 float32."""
    from tqkern.ops.paged_decode.plan import DeviceCaps, DecodeOptions
    from tqkern.ops.paged_decode.side_plans import _merge_plan, merge_impl, row_chunks, row_split_block
    assert [merge_impl(False, n) for n in (8, 15, 16, 128)] == ["heads", "heads", "row", "row"]
    assert [merge_impl(True, n) for n in (8, 16, 17, 128)] == ["rows", "rows", "row", "row"]
    assert row_chunks(32, 132, 128, False) == 8 and row_chunks(256, 132, 128, False) == 2
    assert row_chunks(32, 132, 128, True) == 4 and row_chunks(256, 132, 128, True) == 1
    assert row_chunks(16, 132, 256, True) == 8 and row_chunks(128, 132, 256, True) == 2
    assert row_split_block(128, 128, 1, True) == 32 and row_split_block(8, 128, 8, False) == 8
    assert row_split_block(256, 128, 8, False) == 256 and row_split_block(17, 128, 8, False) == 32
    assert row_split_block(40, 256, 4, True) == 16  # [16, 256]: 4096 floats
    m = _merge_plan(_layout("tq4", 128, 8), 1, 32, 128, DeviceCaps.sm90(), DecodeOptions())
    assert (m.impl, m.grid, m.chunks, m.unroll, m.rotate_back) == ("row", (32, 4), 4, 32, True)
    m = _merge_plan(_layout("turboquant_4bit_nc", 128, 4), 1, 28, 128, DeviceCaps.sm90(), DecodeOptions())
    assert (m.impl, m.grid, m.chunks, m.unroll) == ("row", (28, 8), 8, 128)


def test_merge_transform_rule_and_plan():
    """The planned merge rotates back by the Walsh–Hadamard transform only where it was measured to
    win: a rotated value codec with a signed Sylvester Π, the row-block merge, head_dim 128 (not the
    one-row merge of many splits, not head_dim 64 or 256); the plan keeps the product's chunk rules,
    ``describe`` names it and the launch's constexprs follow; the launcher refuses the transform
    where it cannot apply."""
    from tqkern.ops.paged_decode.plan import DeviceCaps, DecodeOptions, plan_decode
    from tqkern.ops.paged_decode.side_plans import _merge_plan, merge_transform
    assert merge_transform(True, True, 128, "rows")
    assert not any(merge_transform(True, True, d, "rows") for d in (16, 64, 96, 256))
    assert not merge_transform(True, True, 128, "row") and not merge_transform(True, True, 128, "heads")
    assert not merge_transform(False, True, 128, "rows") and not merge_transform(True, False, 128, "rows")
    caps, opts = DeviceCaps.sm90(), DecodeOptions()
    k5v3 = "tqkern_k5v3"
    for preset, d, ss, s, ns, want in ((k5v3, 128, True, 32, 8, True), (k5v3, 128, True, 1, 128, False),
                                       (k5v3, 64, True, 32, 8, False), (k5v3, 256, True, 32, 8, False),
                                       (k5v3, 96, True, 32, 8, False), (k5v3, 128, False, 32, 8, False),
                                       ("tq4", 128, False, 32, 8, False),
                                       ("turboquant_4bit_nc", 128, True, 32, 8, False)):
        m = _merge_plan(_layout(preset, d, 8), s, 32, ns, caps, opts, signed_sylvester=ss)
        p = _merge_plan(_layout(preset, d, 8), s, 32, ns, caps, opts)
        assert m.fwht == want and (m.impl, m.grid, m.chunks, m.unroll) == (p.impl, p.grid, p.chunks, p.unroll)
        assert m.constexprs(d) == dict(FWHT=want, LOG2D=7 if want else 0)
    plan = plan_decode(_layout("tqkern_k5v3", 128, 8), 32, 32, 64, caps, same_codebooks=False, signed_sylvester=True)
    assert plan.merge.fwht and "rotate back by Walsh-Hadamard" in plan.describe()
    plan = plan_decode(_layout("tq4", 128, 8), 32, 32, 64, caps, same_codebooks=True)
    assert not plan.merge.fwht and "rotate back by" not in plan.describe() and "rotate back" in plan.describe()
    ws = torch.zeros(workspace_numel(1, 8, 2, 128), device=DEV)
    for preset, d in (("tqkern_k5v3", 96), ("turboquant_4bit_nc", 128)):
        layout = _layout(preset, d, 2)
        params = tqt.to_device(tqkern.TQParams.default(layout.format), DEV)
        with pytest.raises(ValueError, match=f"fwht needs a rotated value codec at a power-of-two head_dim >= 16, "
                                             f"got head_dim {d}"):
            _launch_merge(ws[:2048], ws[2048:], params.rotation, torch.zeros(1, 8, d, device=DEV), layout, 4, 2,
                          INTERP, fwht=True)
    layout = _layout("tqkern_k5v3", 128, 2)
    params = tqt.to_device(tqkern.TQParams.default(layout.format), DEV)
    with pytest.raises(ValueError, match="fwht applies to the 'rows' and 'heads' merges, not 'row'"):
        _launch_merge(ws[:2048], ws[2048:], params.rotation, torch.zeros(1, 8, 128, device=DEV), layout, 4, 2, INTERP,
                      impl="row", fwht=True)


def test_rotate_cols_rule():
    """The q rotation's output columns per program: 32 at DP >= 256, 64 below, all when nothing
    rotates (the plan's grid follows)."""
    from tqkern.ops.paged_decode.side_plans import _rotate_plan, rotate_cols
    assert [rotate_cols(dp) for dp in (64, 128, 256)] == [64, 64, 32]
    r = _rotate_plan(_layout("tq4", 256, 8, "slot"), 8, 16, 512)
    assert (r.cols, r.grid[1], r.programs) == (32, 8, 8)
    assert _rotate_plan(_layout("tq4", 96, 8, "slot"), 8, 16, 512).cols == 64
    assert _rotate_plan(_layout("fp16", 256, 8, "slot"), 8, 16, 512).cols == 256
    for bad in (96, 8, 0, 128.0, True, "128"):
        with pytest.raises(ValueError, match=rf"dp must be a power of two >= 16 \(head_dim padded\), got {bad!r}"):
            rotate_cols(bad)


@needs_kernels
@pytest.mark.parametrize("preset", ["tq4", "turboquant_4bit_nc"])  # values rotated back / not
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("impl,rows,unroll", [("heads", 16, None), ("rows", 16, 8), ("rows", 32, 2), ("rows", 16, None),
                                              ("row", 16, None), (None, 16, None)])
def test_merge_matches_numpy(preset, chunks, impl, rows, unroll):
    """out = Σ_i exp2(m_i − m)·acc_i / Σ_i exp2(m_i − m)·l_i (@ Πᵀ when values are rotated), with
    empty splits (m = −inf, l = 0) ignored, a row without any tokens gives 0; the output is
    poisoned first, and so are the partials of the empty splits (NaN: a merge must not read them
    into the sum). The three merge kernels: per GQA group, per block of query rows (24 rows: a
    partial block of 16 or 32; 5 splits: a partial unroll of 2 or 8, or all 5 at once: the
    default without the rotate-back) and per query row; and the launcher's default choice."""
    _merge_matches_numpy(preset, 128, chunks, impl, rows, unroll)


@needs_kernels
def test_merge_head_dim_256_in_8_chunks():
    """head_dim 256 with the rotate-back in 8 column chunks of 32 (the row merge's D256 rule): each
    chunk merges all 256 columns and rotates into its 32."""
    _merge_matches_numpy("tq4", 256, 8, "rows", 16, 8)


@needs_kernels
@pytest.mark.parametrize("preset", ["tq4", "turboquant_4bit_nc"])
@pytest.mark.parametrize("d,chunks", [(128, 1), (128, 4), (96, 2), (256, 2)])
def test_one_row_merge_many_splits(preset, d, chunks):
    """The one-row merge at batch 1's split counts: 40 splits read 32 (DP 128, rotate-back), 8
    (DP 256) or more at a time, so the last load is partial; head_dim 96 pads the workspace to
    DP 128 (pad columns poisoned: never read); one sequence, so each query row is one program."""
    _merge_matches_numpy(preset, d, chunks, "row", 16, None, s=1, ns=40)


@needs_kernels
@pytest.mark.parametrize("preset,chunks", [("tq4", 1), ("turboquant_4bit_nc", 4)])
def test_one_row_merge_of_512_splits(preset, chunks):
    """The one-row merge at the per-warp kernel's longest batch-1 plans (512 splits, S69): all
    maxima in one [512] load, then 16-32 splits a load, an empty split and a row without tokens."""
    _merge_matches_numpy(preset, 128, chunks, "row", 16, None, s=1, ns=512)


@needs_kernels
@pytest.mark.parametrize("preset,d,chunks,fwht,s,ns", [
    ("tq4", 128, 8, False, 3, 40), ("tq4", 96, 4, False, 3, 40), ("tq4", 256, 2, False, 1, 20),
    ("tqkern_k5v3", 128, 8, True, 3, 40), ("tqkern_k5v3", 64, 4, True, 1, 17), ("tqkern_k5v3", 128, 1, False, 2, 20),
    ("tq4", 128, 8, False, 1, 512)])
def test_one_row_merge_with_the_rotate_back_apart(preset, d, chunks, fwht, s, ns):
    """``apart`` (the planner's from 256 splits with the transform, 512 with a product, S70): the
    one-row merge writes each merged row unrotated over its split 0's partial (each chunk its own
    columns), then 16-row programs rotate the rows back into ``out`` by the product (64 columns a
    program) or the transform (all columns): 24 rows (a partial second block), head_dim 96's pad
    columns poisoned in the workspace (never read), an empty split, a row without tokens."""
    _merge_matches_numpy(preset, d, chunks, "row", 16, None, s=s, ns=ns, fwht=fwht, apart=True)


def test_rotate_apart_rule():
    """The rotate-back leaves the one-row merge from 256 splits with the transform (a signed
    Sylvester Π at a power-of-two head_dim), from 512 with a product; never for another merge or
    unrotated values. The plan gives the merge the unrotated chunk rule and the launch its grid."""
    from tqkern.ops.paged_decode.plan import DecodeOptions, DeviceCaps, plan_decode
    from tqkern.ops.paged_decode.side_plans import _merge_plan, rotate_apart
    assert [rotate_apart(True, True, 128, "row", n) for n in (128, 255, 256, 1024)] == [False, False, True, True]
    assert [rotate_apart(True, False, 128, "row", n) for n in (256, 511, 512)] == [False, False, True]
    assert rotate_apart(True, True, 96, "row", 256) is False and rotate_apart(True, True, 96, "row", 512) is True
    assert rotate_apart(True, True, 128, "rows", 512) is False and rotate_apart(False, False, 128, "row", 512) is False
    caps, opts = DeviceCaps.sm90(), DecodeOptions()
    m = _merge_plan(_layout("tq4", 128, 1), 1, 8, 512, caps, opts)
    assert (m.grid, m.chunks, m.unroll, m.rotate_back, m.fwht, m.back_grid) == ((8, 8), 8, 256, True, False, (1, 2))
    m = _merge_plan(_layout("tqkern_k5v3", 128, 2), 1, 32, 264, caps, opts, signed_sylvester=True)
    assert (m.grid, m.chunks, m.fwht, m.back_grid, m.rotate_apart) == ((32, 8), 8, True, (2, 1), True)
    m = _merge_plan(_layout("tq4", 128, 1), 1, 16, 256, caps, opts)
    assert (m.chunks, m.back_grid, m.rotate_apart) == (4, (), False)
    plan = plan_decode(_layout("k5v4h", 128, 1), 1, 16, 2048, caps, same_codebooks=True, signed_sylvester=True)
    assert plan.num_splits == 256 and plan.merge.rotate_apart, plan.describe()
    assert "rotate back by Walsh-Hadamard in a launch of its own, grid (1, 1)" in plan.describe()


@needs_kernels
@pytest.mark.parametrize("impl,chunks", [("rows", 1), ("rows", 2), ("heads", 1), ("heads", 2)])
@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_merge_rotate_back_by_the_transform(impl, chunks, d):
    """A signed Sylvester rotation's rotate-back by the Walsh–Hadamard transform
    (``out = Π[:, 0] ⊙ H·o``) on the row-block and group merges equals ``o @ Πᵀ``: every chunk
    transforms all columns and stores its own (an empty split, a row without tokens)."""
    _merge_matches_numpy("tqkern_k5v3", d, chunks, impl, 16, None, s=3, ns=5, fwht=True)


@needs_kernels
@pytest.mark.parametrize("impl,chunks", [("row", 1), ("row", 4), ("rows", 2), ("heads", 2), ("apart", 8)])
@pytest.mark.parametrize("preset", ["tq4", "tqkern_k5v3"])
def test_merge_sinks_lse_and_poison(impl, chunks, preset):
    """The merge's own options on each kernel: sink logits σ join each row's denominator
    (``2^(σ·log2 e − m)``, no value), ``lse`` gets ``(m + log2 l)·ln 2`` of the row (−inf for a row
    without keys), a poisoned query row comes out NaN in every column and in its lse; the
    rotate-back by the product (tq4; tqkern_k5v3 on the one-row merge) and by the transform
    (tqkern_k5v3's signed Sylvester Π on the others, and in the one-row merge's own launch:
    ``"apart"``)."""
    apart, impl = impl == "apart", "row" if impl == "apart" else impl
    layout = _layout(preset, 128, 2)
    params = tqt.to_device(tqkern.TQParams.default(layout.format, seed=3), DEV)
    s, hq, ns, dp, g = 2, 8, 20, 128, 4
    rng = np.random.default_rng(1)
    acc = rng.standard_normal((s, hq, ns, dp)).astype(np.float32)
    m = (rng.standard_normal((s, hq, ns)) * 4).astype(np.float32)
    l = rng.uniform(0.5, 3.0, (s, hq, ns)).astype(np.float32)
    m[1, 2], l[1, 2] = -np.inf, 0.0  # a row without keys: its sink alone
    sinks = rng.standard_normal(hq).astype(np.float32)
    poison = np.zeros(s * hq, np.float32)
    poison[5] = np.nan
    ws = torch.from_numpy(np.concatenate([acc.ravel(), np.stack([m, l], -1).ravel()])).to(DEV)
    out = torch.full((s, hq, dp), float("nan"), device=DEV)
    lse = torch.full((s, hq), float("nan"), device=DEV)
    _launch_merge(ws[:acc.size], ws[acc.size:], params.rotation, out, layout, g, ns, INTERP, chunks=chunks,
                  impl=impl, q_poison=torch.from_numpy(poison).to(DEV), sinks=torch.from_numpy(sinks).to(DEV),
                  lse=lse, fwht=params.signed_sylvester and (impl != "row" or apart), apart=apart)
    o, want_lse = merge_partials(acc.reshape(s * hq, ns, dp), m.reshape(s * hq, ns), l.reshape(s * hq, ns),
                                 rotation=params.params.rotation, sinks=np.tile(sinks, s))
    got, got_lse = out.cpu().numpy().reshape(s * hq, dp), lse.cpu().numpy().ravel()
    assert np.all(np.isnan(got[5])) and np.isnan(got_lse[5])
    keep = np.arange(s * hq) != 5
    np.testing.assert_allclose(got[keep], o.reshape(s * hq, dp)[keep], rtol=1e-4, atol=1e-4 * np.abs(o).max())
    np.testing.assert_allclose(got_lse[keep], want_lse.ravel()[keep], rtol=1e-5, atol=1e-5)
    assert np.all(got[hq + 2] == 0)  # no keys: the sink takes all the weight, no value


def _merge_matches_numpy(preset, d, chunks, impl, rows, unroll, s=3, ns=5, fwht=False, apart=False):
    layout = _layout(preset, d, 2)
    dp = max(16, 1 << (d - 1).bit_length())
    params = tqt.to_device(tqkern.TQParams.default(layout.format, seed=3), DEV)
    assert params.signed_sylvester or not fwht
    hq, g = 8, 4
    rng = np.random.default_rng(0)
    acc = rng.standard_normal((s, hq, ns, dp)).astype(np.float32)
    m = (rng.standard_normal((s, hq, ns)) * 4).astype(np.float32)
    l = rng.uniform(0.5, 3.0, (s, hq, ns)).astype(np.float32)
    m[0, :, 1] = -np.inf  # an empty split
    l[0, :, 1] = 0.0
    m[s - 1, 3, :] = -np.inf  # a row with no tokens (sequence length 0): output 0
    l[s - 1, 3, :] = 0.0
    acc_used = acc[..., :d].copy()
    acc[0, :, 1] = np.nan  # what an empty split left in the workspace does not matter
    acc[s - 1, 3, :] = np.nan
    acc[..., d:] = np.nan  # nor what the pad columns hold
    ws = np.concatenate([acc.ravel(), np.stack([m, l], -1).ravel()])
    assert ws.size == workspace_numel(s, hq, ns, dp)
    ws_t = torch.from_numpy(ws).to(DEV)
    out = torch.full((s, hq, d), float("nan"), dtype=torch.float32, device=DEV)
    n_acc = acc.size
    _launch_merge(ws_t[:n_acc], ws_t[n_acc:], params.rotation, out, layout, g, ns, INTERP, chunks=chunks,
                  impl=impl, rows=rows, unroll=unroll, fwht=fwht, apart=apart)
    rot = params.params.rotation if layout.format.value.rotated else None
    o, _ = merge_partials(acc_used.reshape(s * hq, ns, d), m.reshape(s * hq, ns), l.reshape(s * hq, ns), rotation=rot)
    o = o.reshape(s, hq, d)
    assert np.all(o[s - 1, 3] == 0)
    got = out.cpu().numpy()
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, o, rtol=1e-4, atol=1e-4 * np.abs(o).max())


def test_merge_and_rotation_options_rejected():
    """Unknown merge kernels and row blocks that are not powers of two ≥ 16 (tl.arange) raise
    before any launch."""
    layout = _layout("tq4", 128, 2)
    params = tqt.to_device(tqkern.TQParams.default(layout.format), DEV)
    ws = torch.zeros(workspace_numel(1, 8, 2, 128), device=DEV)
    out = torch.zeros(1, 8, 128, device=DEV)
    acc, ml = ws[: 8 * 2 * 128], ws[8 * 2 * 128:]
    with pytest.raises(ValueError, match="impl must be 'rows', 'row', 'heads' or None, got 'cols'"):
        _launch_merge(acc, ml, params.rotation, out, layout, 4, 2, INTERP, impl="cols")
    with pytest.raises(ValueError, match="rows must be a power of two >= 16, got 24"):
        _launch_merge(acc, ml, params.rotation, out, layout, 4, 2, INTERP, rows=24)
    with pytest.raises(ValueError, match="apart applies to the 'row' merge of a rotated value codec, got impl 'rows' "
                                         r"\(value codec rotated: True\)"):
        _launch_merge(acc, ml, params.rotation, out, layout, 4, 2, INTERP, impl="rows", apart=True)
    plain = _layout("turboquant_4bit_nc", 128, 2)
    with pytest.raises(ValueError, match=r"got impl 'row' \(value codec rotated: False\)"):
        _launch_merge(acc, ml, params.rotation, out, plain, 4, 2, INTERP, impl="row", apart=True)
    with pytest.raises(ValueError, match="rows must be a power of two >= 16, got 8"):
        rotate_q(torch.zeros(1, 8, 128, device=DEV), params.rotation, True, INTERP, rows=8)
    with pytest.raises(ValueError, match="cols must be a power of two >= 16, got 48"):
        rotate_q(torch.zeros(1, 8, 128, device=DEV), params.rotation, True, INTERP, cols=48)


@needs_kernels
@pytest.mark.parametrize("d", [64, 142, 256])
@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("cols", [16, 64, 256])
def test_rotate_q_matches_numpy(d, rotate, cols):
    """float32(q) @ Π (programs of 16 rows × ``cols`` output columns, 64 per dot; head_dim 142
    pads to 256, and ``cols`` above the padded head_dim means all of it) or the plain cast, for a
    q whose head dimension is strided."""
    fmt = tqkern.KVFormat(head_dim=d, key=tqkern.LloydMax(bits=4), value=tqkern.LloydMax(bits=4), rotation="haar")
    params = tqt.to_device(tqkern.TQParams.default(fmt, seed=1), DEV)
    q_full = torch.randn(3, 10, d, device=DEV).half()
    q = q_full[:, ::2]  # [3, 5, d], head stride 2·d
    got = rotate_q(q, params.rotation, rotate, INTERP, cols=cols).cpu().numpy()
    q64 = q.double().cpu().numpy()
    expect = q64 @ params.params.rotation if rotate else q64
    assert got.shape == (3, 5, d) and got.dtype == np.float32
    np.testing.assert_allclose(got, expect, rtol=0, atol=1e-5 * np.abs(expect).max())


@needs_kernels
@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_rotate_q_by_the_transform_matches_numpy(d):
    """A signed Sylvester Π (the default rotation of the Hadamard presets): ``q @ Π`` as the
    Walsh–Hadamard transform of ``q ⊙ Π[:, 0]``, every column a program, to float32 rounding of
    the float64 product (the transform adds exactly what the product sums, in another order)."""
    fmt = tqkern.KVFormat.preset("turboquant_4bit_nc", d)
    params = tqt.to_device(tqkern.TQParams.default(fmt, seed=3), DEV)
    assert params.signed_sylvester
    q = torch.randn(3, 10, d, device=DEV).half()[:, ::2]
    got = rotate_q(q, params.rotation, True, INTERP, signed_sylvester=True).cpu().numpy()
    expect = q.double().cpu().numpy() @ params.params.rotation
    assert got.shape == (3, 5, d) and got.dtype == np.float32
    bound = 4 * np.log2(d) * 2.0**-24 * np.abs(q.double().cpu().numpy()).sum(-1).max()
    np.testing.assert_allclose(got, expect, rtol=0, atol=bound)
    # a dense rotation named signed Sylvester by mistake would be rotated wrongly: the flag is the
    # caller's promise (DeviceParams.signed_sylvester); without it the product runs
    assert np.allclose(rotate_q(q, params.rotation, True, INTERP).cpu().numpy(), expect, atol=1e-4)


def test_q_transform_rule():
    """The decode's q rotation takes the transform for a rotated key codec with a signed Sylvester
    Π at a power-of-two head_dim ≥ 16 (every column a program), else the 64- or 32-column product
    (or the cast); the plan says which."""
    from tqkern.ops.paged_decode.plan import DeviceCaps, plan_decode
    from tqkern.ops.paged_decode.side_plans import _rotate_plan, q_transform

    assert q_transform(True, True, 128) and q_transform(True, True, 16)
    assert not q_transform(True, True, 96) and not q_transform(True, True, 8)
    assert not q_transform(False, True, 128) and not q_transform(True, False, 128)
    r = _rotate_plan(_layout("turboquant_4bit_nc", 256, 8), 8, 16, 512, signed_sylvester=True)
    assert (r.fwht, r.cols, r.grid[1]) == (True, 256, 1)
    r = _rotate_plan(_layout("turboquant_4bit_nc", 256, 8), 8, 16, 512)
    assert (r.fwht, r.cols, r.grid[1]) == (False, 32, 8)
    assert not _rotate_plan(_layout("turboquant_k8v4", 128, 8), 8, 16, 512, signed_sylvester=True).fwht
    plan = plan_decode(_layout("turboquant_4bit_nc", 128, 8), 8, 32, 64, DeviceCaps.sm90(), same_codebooks=True,
                       signed_sylvester=True)
    assert plan.rotate.fwht and "rotate      Walsh-Hadamard, grid" in plan.describe()
    with pytest.raises(TypeError, match="signed_sylvester must be a bool, got int"):
        plan_decode(_layout("tq4", 128, 8), 8, 32, 64, DeviceCaps.sm90(), same_codebooks=True, signed_sylvester=1)


def test_workspace_needs_its_size_and_a_16_byte_aligned_start():
    """paged_decode's ``workspace``: a ValueError before any launch when it holds too few elements,
    or starts past a 16-byte boundary (the warp-MMA kernel stores its partials 16 bytes at a time)."""
    from tqkern.ops.paged_decode.triton import _workspace

    layout = _layout("turboquant_4bit_nc", 64, 2)
    params = tqt.to_device(tqkern.TQParams.default(layout.format, seed=0), DEV)
    q = torch.zeros(3, 4, 64, dtype=torch.float16, device=DEV)
    cache = torch.zeros(layout.cache_shape(8), dtype=torch.uint8, device=DEV)
    bt = torch.zeros(3, 5, dtype=torch.int32, device=DEV)
    sl = torch.zeros(3, dtype=torch.int32, device=DEV)
    need = workspace_numel(3, 4, 2, 64)
    ws = torch.zeros(need + 4, dtype=torch.float32, device=DEV)
    for off in (1, 2, 3):
        with pytest.raises(ValueError, match=f"workspace must start at a 16-byte aligned address, got one {4 * off} "):
            tqt.paged_decode(q, cache, bt, sl, layout, params, workspace=ws[off:], num_splits=2)
        with pytest.raises(ValueError, match="workspace must start at a 16-byte aligned address"):
            _workspace(ws[off:], 3, 4, 2, 64, DEV)
    with pytest.raises(ValueError, match=rf"workspace must have at least workspace_numel\(3, 4, num_splits=2, 64\) = "
                                         rf"{need} float32 elements, got {need - 1}"):
        tqt.paged_decode(q, cache, bt, sl, layout, params, workspace=ws[4:need + 3], num_splits=2)
    acc, ml = _workspace(ws[4:], 3, 4, 2, 64, DEV)  # an aligned view is taken as it is
    assert acc.data_ptr() == ws[4:].data_ptr() and acc.numel() == 3 * 4 * 2 * 64


def test_merge_oracle_hand_values_and_bad_shapes():
    """``merge_partials`` on values worked by hand: two splits with maxima 1 and 3 (base 2) weigh
    1/4 and 1; an empty split (NaN partial) is never read; a sink of natural-log σ joins the
    denominator; a row without keys or sink is zeros with lse −inf. Shapes are checked."""
    acc = np.array([[[4.0, 8.0], [2.0, 2.0], [np.nan, np.nan]], [[np.nan, np.nan]] * 3])
    m = np.array([[1.0, 3.0, -np.inf], [-np.inf] * 3])
    l = np.array([[2.0, 1.0, 0.0], [0.0] * 3])
    o, lse = merge_partials(acc, m, l)
    # M = 3, w = (1/4, 1), L = 2/4 + 1 = 1.5, o = (1 + 2, 2 + 2) / 1.5, lse = (3 + log2 1.5)·ln 2
    np.testing.assert_allclose(o, [[2.0, 8 / 3], [0.0, 0.0]], rtol=1e-15)
    np.testing.assert_allclose(lse[0], (3 + np.log2(1.5)) * np.log(2), rtol=1e-15)
    assert lse[1] == -np.inf
    o, lse = merge_partials(acc, m, l, sinks=[3 * np.log(2), 0.0])  # σ·log2 e = 3: + 2^0 in L
    np.testing.assert_allclose(o[0], np.array([3.0, 4.0]) / 2.5, rtol=1e-15)
    np.testing.assert_allclose(lse, [(3 + np.log2(2.5)) * np.log(2), 0.0], rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(merge_partials(acc, m, l, rotation=np.array([[0.0, 1.0], [1.0, 0.0]]))[0][0],
                               [8 / 3, 2.0], rtol=1e-15)
    with pytest.raises(ValueError, match=r"acc must be \[R, NS, D\] and m, l \[R, NS\], got \(2, 3, 2\), \(2, 2\)"):
        merge_partials(acc, m[:, :2], l)
    with pytest.raises(ValueError, match=r"sinks must be \[R\] = \[2\], got \(3,\)"):
        merge_partials(acc, m, l, sinks=[0.0, 0.0, 0.0])
