"""Compatibility: with the peers' rotation and codebook passed in as parameters, the store kernel
writes the bytes their formats specify (docs/layout.md), built here independently of tqkern's
oracle, and ``quantize`` reads back the oracle's fields.

vLLM ``turboquant_4bit_nc``: y = (k/‖k‖) @ H/√D (Sylvester, no signs); key code = number of
codebook midpoints ≤ y, LSB-first nibbles (even index low); fp16 ‖k‖; value: uniform 4-bit per
vector, scale = (max−min)/15, q = ⌊(v−min)/scale + 1/2⌋, LSB-first, then fp16 scale, fp16 min.
turboquant-vllm TQ4: y = (x/‖x‖) @ Qᵀ (Q Haar), codes of a ±3σ-truncated Gaussian codebook,
even index in the high nibble, fp32 norms, row arrangement ``[K codes | K norms | V codes | V
norms]``. Codes within EPS of a boundary (flagged by the oracle) may differ.
"""

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import Codebook, reference as ref
from tqkern_torch.testing import device_under_test, kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")
DEV = device_under_test()
D, H, N = 128, 2, 24

# The Gaussian 4-bit Lloyd-Max centroids (positive half, N(0,1); Max 1960); vLLM scales by 1/√D.
GAUSS4 = np.array([0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326])


def _sylvester(d):
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def _kv(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((N, H, D)).astype(np.float16), rng.standard_normal((N, H, D)).astype(np.float16))


def _store(layout, params, k, v):
    cache = tqt.allocate_cache(layout, N // layout.block_size, DEV)
    slots = torch.arange(N, device=DEV)
    tqt.store(cache, torch.from_numpy(k).to(DEV), torch.from_numpy(v).to(DEV), slots, layout, params)
    return cache.cpu().numpy()


def test_vllm_turboquant_4bit_nc_bytes():
    fmt = tqkern.KVFormat.preset("turboquant_4bit_nc", D)
    hadamard = _sylvester(D) / np.sqrt(D)
    cents = np.concatenate([-GAUSS4[::-1], GAUSS4]) / np.sqrt(D)
    params = tqkern.TQParams(format=fmt, rotation=hadamard, key_codebook=Codebook.from_centroids(cents, dim=D))
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=H, block_size=8)
    k, v = _kv(0)
    got = _store(layout, params, k, v).reshape(N, H, fmt.slot_bytes)

    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    norm = np.linalg.norm(k64, axis=-1)
    y = (k64 / norm[..., None]) @ hadamard
    mids = (cents[1:] + cents[:-1]) / 2
    kc = (y[..., None] >= mids).sum(-1).astype(np.uint8)
    lo, hi = v64.min(-1), v64.max(-1)
    scale = (hi - lo) / 15
    vq = np.clip(np.floor((v64 - lo[..., None]) / scale[..., None] + 0.5), 0, 15).astype(np.uint8)
    want = np.concatenate([
        kc[..., 0::2] | (kc[..., 1::2] << 4),
        norm.astype("<f2")[..., None].view(np.uint8),
        vq[..., 0::2] | (vq[..., 1::2] << 4),
        scale.astype("<f2")[..., None].view(np.uint8),
        lo.astype("<f2")[..., None].view(np.uint8),
    ], axis=-1)
    assert want.shape[-1] == fmt.slot_bytes == 134
    _, unsure = ref.compress(k, v, params, return_uncertain=True)
    assert not np.any((got != want) & ~unsure)
    assert unsure.mean() < 0.02


# vLLM's own float32 4-bit centroids at D = 128 (positive half, bit patterns; see test_codebooks).
VLLM4_D128 = [0x3C39FBAE, 0x3D0C8559, 0x3D6DD0E1, 0x3DAA99F2, 0x3DE3682B, 0x3E126F17, 0x3E3B36E7, 0x3E772CC4]


def test_vllm_params_store_writes_vllms_key_codes():
    # TQParams.vllm: the key codes vLLM's store writes, i.e. against the float32 midpoints of its
    # numerically solved float32 centroids.
    fmt = tqkern.KVFormat.preset("turboquant_4bit_nc", D)
    params = tqkern.TQParams.vllm(fmt)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=H, block_size=8)
    k, v = _kv(2)
    got = _store(layout, params, k, v).reshape(N, H, fmt.slot_bytes)
    half = np.array(VLLM4_D128, np.uint32).view(np.float32)
    c32 = np.concatenate([-half[::-1], half])
    mids = ((c32[:-1] + c32[1:]) / np.float32(2)).astype(np.float64)
    k64 = k.astype(np.float64)
    y = (k64 / (np.linalg.norm(k64, axis=-1, keepdims=True) + 1e-8)) @ (_sylvester(D) / np.sqrt(D))
    kc = (y[..., None] >= mids).sum(-1).astype(np.uint8)
    want = kc[..., 0::2] | (kc[..., 1::2] << 4)
    _, unsure = ref.compress(k, v, params, return_uncertain=True)
    assert not np.any((got[..., : D // 2] != want) & ~unsure[..., : D // 2])


def test_turboquant_vllm_tq4_row_bytes():
    fmt = tqkern.KVFormat.preset("tq4", D)
    rng = np.random.default_rng(7)
    q, r = np.linalg.qr(rng.standard_normal((D, D)))
    q = q * np.sign(np.diag(r))  # their Π; tqkern's convention y = x @ rotation, so pass Πᵀ
    # A ±3σ-truncated 4-bit codebook (a caller's own table: any ascending 16 values work).
    cents = np.concatenate([-GAUSS4[::-1], np.minimum(GAUSS4, 3.0)]) / np.sqrt(D) * 0.98
    cb = Codebook.from_centroids(cents, dim=D)
    params = tqkern.TQParams(format=fmt, rotation=q.T, key_codebook=cb, value_codebook=cb)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=H, block_size=8, arrangement="row")
    k, v = _kv(1)
    got = _store(layout, params, k, v).reshape(N, layout.row_bytes)

    mids = (cents[1:] + cents[:-1]) / 2
    rows = []
    parts = {}
    for name, x in (("k", k.astype(np.float64)), ("v", v.astype(np.float64))):
        n = np.linalg.norm(x, axis=-1)
        c = (((x / n[..., None]) @ q.T)[..., None] >= mids).sum(-1).astype(np.uint8)
        parts[name] = ((c[..., 0::2] << 4) | c[..., 1::2]).reshape(N, -1), n.astype("<f4").view(np.uint8).reshape(N, -1)
    rows = np.concatenate([parts["k"][0], parts["k"][1], parts["v"][0], parts["v"][1]], axis=-1)
    assert rows.shape[-1] == layout.row_bytes == H * (D + 8)
    # The oracle's uncertain bytes, mapped from slots into row positions.
    _, unsure = ref.compress(k, v, params, return_uncertain=True)
    unsure_rows = np.zeros_like(rows, dtype=bool)
    for qual, f, off in fmt.slot_fields():
        a = layout.field(qual)
        for h in range(H):
            unsure_rows[:, a.offset + h * a.head_stride: a.offset + h * a.head_stride + f.nbytes] = \
                unsure[:, h, off: off + f.nbytes]
    assert not np.any((got != rows) & ~unsure_rows)


def test_quantize_reads_back_the_oracle_fields():
    fmt = tqkern.KVFormat(head_dim=64, key=tqkern.LloydMax(bits=3, norm_correction="stored"),
                          value=tqkern.Uniform(bits=5, param_dtype="float32"))
    params = tqkern.TQParams.default(fmt, seed=2)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((6, 2, 64)).astype(np.float16)
    v = rng.standard_normal((6, 2, 64)).astype(np.float16)
    kq, vq = tqt.quantize(torch.from_numpy(k).to(DEV), torch.from_numpy(v).to(DEV), params)
    rk = ref.quantize(k.astype(np.float64), fmt.key, rotation=params.rotation, codebook=params.key_codebook)
    rv = ref.quantize(v.astype(np.float64), fmt.value)
    ok = ~rk.uncertain_codes
    assert np.array_equal(kq["codes"].cpu().numpy()[ok], rk.codes[ok])
    certain = ~rk.uncertain_params["norm"]
    assert np.array_equal(kq["norm"].cpu().numpy()[certain], rk.params["norm"][certain].astype(np.float32))
    assert np.array_equal(vq["codes"].cpu().numpy(), rv.codes)
    assert np.array_equal(vq["scale"].cpu().numpy(), rv.params["scale"].astype(np.float32))
    assert np.array_equal(vq["zero"].cpu().numpy(), rv.params["zero"].astype(np.float32))
