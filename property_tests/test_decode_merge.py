"""The decode's merge kernels equal their oracle (:func:`tqkern.ops.paged_decode.reference.merge_partials`).

Every merge the launcher can run: the one-row merge (``"row"``), with the rotate-back in it or in a
launch of its own (``apart``, S70: by a product for a dense Π, by the Walsh–Hadamard transform for a
signed Sylvester one), the row-block merge (``"rows"``) and the per-group merge (``"heads"``), with
and without the transform, at head_dim 32–256 (96: a padded workspace), 1–600 splits, any column
chunks; empty splits (their partials NaN: never read), rows without keys, NaN query rows (the row
and its lse NaN), sink logits, the lse; the output and lse poisoned before the run.

Tolerance, per element, from float32 arithmetic (u = 2^-24): the merged row's numerator and
denominator are sums of ``NS`` weighted terms whose weights come from ``exp2`` (≤ 4 ulp on a GPU),
so ``|o − ô| ≤ ε·A`` with ``ε = (NS + 8)·u + 8·2u`` and ``A = Σ_j w_j·|acc_j| / L`` (the oracle's
merge of ``|acc|``); the rotate-back adds ``|Π| @ (ε·A) + (D + 2)·4u·(|Π| @ |o|)`` (a float32 or
tf32x3 dot of D terms, or the transform's log2 D butterfly levels); the lse moves by
``ε + 2u·(1 + |lse|)``. Both bounds doubled.
"""

import numpy as np
import pytest
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st

import tqkern
import tqkern_torch as tqt
from tqkern.ops.paged_decode.merge import _launch_merge
from tqkern.ops.paged_decode.reference import merge_partials
from tqkern.ops.paged_decode.side_plans import transform_fits
from tqkern.rotations import is_signed_sylvester
from tqkern_torch.testing import device_under_test, kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")

DEV = device_under_test()
U = 2.0 ** -24
# tq4: a dense Π; tqkern_k5v3: signed Sylvester (the transform at a power-of-two head_dim);
# turboquant_4bit_nc: values not rotated (no rotate-back)
PRESETS = ("tq4", "tqkern_k5v3", "turboquant_4bit_nc")


@st.composite
def merges(draw):
    impl = draw(st.sampled_from(["row", "apart", "rows", "heads"]), label="impl")
    apart, impl = impl == "apart", "row" if impl == "apart" else impl
    preset = draw(st.sampled_from(PRESETS[:2] if apart else PRESETS), label="preset")  # (apart: rotated values)
    d = draw(st.sampled_from([32, 64, 96, 128, 256]), label="head_dim")
    dp = max(16, 1 << (d - 1).bit_length())
    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, d), num_kv_heads=1, block_size=16)
    params = tqkern.TQParams.default(layout.format, seed=draw(st.integers(0, 3), label="seed"))
    rotated = bool(layout.format.value.rotated)
    # (the per-group merge unrolls its splits: few of them; the one-row merge up to past 512)
    ns = draw(st.integers(1, 40) if impl != "row" else st.one_of(st.integers(1, 40), st.integers(250, 600)),
              label="num_splits")
    fwht = impl != "row" or apart
    sylvester = is_signed_sylvester(params.rotation)
    fwht = fwht and sylvester and transform_fits(rotated, True, d) and draw(st.booleans(), label="fwht")
    chunks = draw(st.sampled_from([c for c in (1, 2, 4, 8) if dp // c >= 16]), label="chunks")
    s = draw(st.integers(1, 3), label="num_seqs")
    hq = draw(st.sampled_from([1, 2, 5, 8]), label="num_q_heads")
    return layout, params, impl, apart, fwht, ns, chunks, s, hq, draw(st.booleans(), label="sinks"), \
        draw(st.booleans(), label="lse"), draw(st.integers(0, 2**31 - 1), label="data_seed")


@given(merges())
def test_merge_kernels_match_the_oracle(case):
    layout, params, impl, apart, fwht, ns, chunks, s, hq, with_sinks, with_lse, seed = case
    d = layout.head_dim
    dp = max(16, 1 << (d - 1).bit_length())
    rows = s * hq
    rng = np.random.default_rng(seed)
    acc = rng.standard_normal((rows, ns, dp)).astype(np.float32)
    m = (rng.standard_normal((rows, ns)) * 4).astype(np.float32)
    l = rng.uniform(0.5, 3.0, (rows, ns)).astype(np.float32)
    empty = rng.random((rows, ns)) < 0.2  # splits without keys
    empty[rng.random(rows) < 0.2] = True  # rows without keys
    m[empty], l[empty], acc[empty] = -np.inf, 0.0, np.nan
    acc[..., d:] = np.nan  # pad columns: never read
    poison = np.where(rng.random(rows) < 0.2, np.nan, 0.0).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32) if with_sinks else None
    row_sinks = None if sinks is None else np.tile(sinks, s)
    rot = params.rotation if layout.format.value.rotated else None
    want, want_lse = merge_partials(acc[..., :d], m, l, rotation=rot, sinks=row_sinks)
    mag, _ = merge_partials(np.abs(acc[..., :d]), m, l, sinks=row_sinks)  # A = Σ w|acc| / L
    note(f"{impl} apart={apart} fwht={fwht} splits={ns} chunks={chunks} rows={rows} D={d}")
    event(f"{impl}{' apart' if apart else ''}{' transform' if fwht else ''}, {'≥ 250' if ns >= 250 else '< 41'} splits")

    dev = tqt.to_device(params, DEV)
    ws = torch.from_numpy(np.concatenate([acc.ravel(), np.stack([m, l], -1).ravel()])).to(DEV)
    out = torch.full((s, hq, d), float("nan"), dtype=torch.float32, device=DEV)
    lse = torch.full((s, hq), float("nan"), dtype=torch.float32, device=DEV) if with_lse else None
    _launch_merge(ws[: acc.size], ws[acc.size:], dev.rotation, out, layout, hq, ns, DEV.type == "cpu", chunks=chunks,
                  impl=impl, q_poison=torch.from_numpy(poison).to(DEV),
                  sinks=None if sinks is None else torch.from_numpy(sinks).to(DEV), lse=lse, fwht=fwht, apart=apart)

    eps = (ns + 8) * U + 16 * U
    tol = eps * mag
    if rot is not None:
        a = np.abs(np.asarray(rot, np.float64))
        tol = tol @ a.T + (d + 2) * 4 * U * (np.abs(merge_partials(acc[..., :d], m, l, sinks=row_sinks)[0]) @ a.T)
    got = out.cpu().numpy().reshape(rows, d)
    bad = np.isnan(poison)
    assert np.all(np.isnan(got[bad]))
    assert np.all(np.isfinite(got[~bad]))
    err = np.abs(got[~bad] - want[~bad])
    assert np.all(err <= 2 * tol[~bad]), float((err / np.maximum(tol[~bad], 1e-30)).max())
    if with_lse:
        got_lse = lse.cpu().numpy().ravel()
        assert np.all(np.isnan(got_lse[bad]))
        assert np.array_equal(np.isneginf(got_lse[~bad]), np.isneginf(want_lse[~bad]))
        fin = ~bad & np.isfinite(want_lse)
        assert np.all(np.abs(got_lse[fin] - want_lse[fin]) <= 2 * (eps + 2 * U * (1 + np.abs(want_lse[fin]))))
