"""A caller's own boundary table (``Codebook.from_centroids(..., boundaries=)``) decides the codes
on every path: the NumPy oracle, the store kernel, and the torch CPU fallback (the oracle run by
``tqkern::store`` when no kernel can run), which used to rebuild midpoint boundaries.

The table here is float32 and sits 70% (keys) / 30% (values) of the way between neighbouring
centroids, far from the midpoints, so a code differs from the midpoint code exactly where the
rotated coordinate lies between the midpoint and the caller's boundary. Float32 values are kept
exactly on the torch paths (which round boundaries to float32), so all paths see one table.
"""

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
import tqkern_torch.library as library
from tqkern import Codebook, reference as ref
from tqkern_torch._validate import interpreting

D, H, N = 64, 2, 12


def _custom(cb, frac):
    c = cb.centroids
    b = (c[:-1] + frac * (c[1:] - c[:-1])).astype(np.float32)
    return Codebook.from_centroids(c, dim=cb.dim, boundaries=b)


def _setup():
    fmt = tqkern.KVFormat.preset("tqkern_k4v4", D)
    mid = tqkern.TQParams.default(fmt, seed=1)
    kcb = _custom(mid.key_codebook, 0.7)
    vcb = _custom(mid.value_codebook, 0.3)
    own = tqkern.TQParams(format=fmt, rotation=mid.rotation, key_codebook=kcb, value_codebook=vcb)
    rng = np.random.default_rng(5)
    k = rng.standard_normal((N, H, D)).astype(np.float16)
    v = rng.standard_normal((N, H, D)).astype(np.float16)
    return fmt, mid, own, k, v


def _oracle_codes(params, x, side):
    codec = getattr(params.format, side)
    q = ref.quantize(x.astype(np.float64), codec, rotation=params.rotation,
                     codebook=getattr(params, f"{side}_codebook"))
    return q.codes, q.uncertain_codes


def test_oracle_codes_follow_the_callers_boundaries():
    fmt, mid, own, k, v = _setup()
    for side, x, frac in (("key", k, 0.7), ("value", v, 0.3)):
        got, _ = _oracle_codes(own, x, side)
        ref_mid, _ = _oracle_codes(mid, x, side)
        y = (x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=-1, keepdims=True)) @ mid.rotation
        c = getattr(mid, f"{side}_codebook").centroids
        # Between the midpoint below centroid i+1 and the caller's boundary, the midpoint code is
        # i + 1 and the caller's is i (frac > 1/2), or the reverse (frac < 1/2).
        i = ref_mid.astype(int)
        lower = np.clip(i - 1, 0, c.size - 2)
        b_own = getattr(own, f"{side}_codebook").boundaries
        if frac > 0.5:
            moved = (i > 0) & (y < b_own[lower])
            want = np.where(moved, i - 1, i)
        else:
            upper = np.clip(i, 0, c.size - 2)
            moved = (i < c.size - 1) & (y >= b_own[upper])
            want = np.where(moved, i + 1, i)
        assert moved.sum() > 50
        assert np.array_equal(got, want.astype(np.uint8))


def _assert_codes_match(params, k, v, *, exact):
    kq, vq = tqt.quantize(torch.from_numpy(k), torch.from_numpy(v), params)
    for side, x, got in (("key", k, kq), ("value", v, vq)):
        want, unsure = _oracle_codes(params, x, side)
        got = got["codes"].numpy()
        if exact:
            assert np.array_equal(got, want)
        else:
            assert not np.any((got != want) & ~unsure)
    return kq, vq


def test_active_cpu_path_uses_the_callers_boundaries():
    # The store kernel under TRITON_INTERPRET=1, otherwise the oracle fallback.
    fmt, mid, own, k, v = _setup()
    kq, vq = _assert_codes_match(own, k, v, exact=False)
    kmid, _ = _oracle_codes(mid, k, "key")
    assert np.mean(kq["codes"].numpy() != kmid) > 0.05


def test_cpu_fallback_uses_the_callers_boundaries(monkeypatch):
    # The fallback path of tqkern::store, forced even where the interpreter would run the kernel.
    monkeypatch.setattr(library, "use_triton", lambda device: False)
    fmt, mid, own, k, v = _setup()
    # The fallback runs the oracle on the device tables: float32 rotation, float32 boundaries.
    rot32 = own.rotation.astype(np.float32)
    own32 = tqkern.TQParams(format=fmt, rotation=rot32, key_codebook=own.key_codebook,
                            value_codebook=own.value_codebook)
    _assert_codes_match(own32, k, v, exact=True)
    slots = tqt.compress(torch.from_numpy(k), torch.from_numpy(v), own32).numpy()
    assert np.array_equal(slots, ref.compress(k, v, own32))


def test_host_params_round_trip_the_device_boundaries():
    fmt, _, own, _, _ = _setup()
    dp = tqt.to_device(own, "cpu")
    lay = tqkern.PagedLayout(format=fmt, num_kv_heads=H, block_size=4)
    hp = library._host_params(lay, dp.rotation, dp.key_centroids, dp.value_centroids, None,
                              dp.key_boundaries, dp.value_boundaries)
    assert hp.key_codebook == own.key_codebook and hp.value_codebook == own.value_codebook
    # float64 midpoints reach the device (and so the fallback) rounded to float32.
    mid = tqkern.TQParams.default(fmt, seed=1)
    dm = tqt.to_device(mid, "cpu")
    assert dm.key_boundaries.dtype == torch.float32
    hm = library._host_params(lay, dm.rotation, dm.key_centroids, dm.value_centroids, None,
                              dm.key_boundaries, dm.value_boundaries)
    assert np.array_equal(hm.key_codebook.boundaries, mid.key_codebook.boundaries.astype(np.float32))


@pytest.mark.skipif(not interpreting(), reason="the kernel path on CPU needs TRITON_INTERPRET=1")
def test_kernel_and_fallback_agree_with_callers_boundaries(monkeypatch):
    fmt, _, own, k, v = _setup()
    kt, vt = torch.from_numpy(k), torch.from_numpy(v)
    kernel = tqt.compress(kt, vt, own).numpy()
    monkeypatch.setattr(library, "use_triton", lambda device: False)
    fallback = tqt.compress(kt, vt, own).numpy()
    _, unsure = ref.compress(k, v, own, return_uncertain=True)
    assert not np.any((kernel != fallback) & ~unsure)
