"""The documented way to import each peer's parameters (``docs/layout.md``, *Importing a peer's
parameters*) gives the peer's codes, and the documented remaining differences hold.

The code blocks are taken from the page itself and run, so the page cannot drift from the API.
The peers' formulas are written here from their descriptions (PRIOR_ART.md):

- vLLM: y = (k / (‖k‖ + 1e-8)) @ H (H the unsigned Sylvester Hadamard / √D, symmetric); code =
  number of float32 midpoints of vLLM's float32 centroids ≤ y.
- turboquant-vllm: Q from float32 QR of a seeded float32 Gaussian (torch), columns multiplied by
  sign(diag R); y = (x / (‖x‖ + 1e-10)) @ Qᵀ in float32; code = ``torch.bucketize(y, table)``
  (boundaries < y) against its float32 boundary table (the float64 midpoints rounded to float32);
  norm = torch's float32 ‖x‖.
"""

import pathlib
import re

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.codebooks import lloyd_max

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "layout.md"

# vLLM's float32 4-bit centroids at D = 128 (positive half, bit patterns): see test_codebooks.
VLLM4_D128 = [0x3C39FBAE, 0x3D0C8559, 0x3D6DD0E1, 0x3DAA99F2, 0x3DE3682B, 0x3E126F17, 0x3E3B36E7, 0x3E772CC4]


def _doc_block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"docs/layout.md must hold one python block containing {marker!r}"
    return found[0]


def _run_doc(marker: str, **names):
    ns = dict(names)
    exec(compile(_doc_block(marker), str(DOC), "exec"), ns)  # noqa: S102 - our own documentation
    return ns["params"]


def _sylvester(d):
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def _oracle_codes(params, x, side="key"):
    q = ref.quantize(x.astype(np.float64), getattr(params.format, side), rotation=params.rotation,
                     codebook=getattr(params, f"{side}_codebook"))
    return q.codes, q.uncertain_codes, q.params["norm"]


def test_vllm_doc_import_gives_vllms_codes():
    params = _run_doc('KVFormat.preset("turboquant_4bit_nc"')
    d = 128
    x = np.random.default_rng(11).standard_normal((4000, d)).astype(np.float16).astype(np.float64)
    half = np.array(VLLM4_D128, np.uint32).view(np.float32)
    c32 = np.concatenate([-half[::-1], half])
    mids = ((c32[:-1] + c32[1:]) / np.float32(2)).astype(np.float64)
    y = (x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-8)) @ (_sylvester(d) / np.sqrt(d))
    want = (y[..., None] >= mids).sum(-1)
    got, unsure, _ = _oracle_codes(params, x)
    assert not np.any((got != want) & ~unsure)
    # The exact codebook (TQParams.default) does not give vLLM's codes: ~4 in 10,000 differ, some
    # of them well away from float32 rounding of a boundary.
    dflt, unsure_d, _ = _oracle_codes(tqkern.TQParams.default(params.format), x)
    assert np.sum(dflt != want) > 100 and np.sum((dflt != want) & ~unsure_d) > 10


def _peer_tq4(d, seed=42):
    """turboquant-vllm's rotation and codebook tables, made its way (float32)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float32))
    s = torch.sign(torch.diag(r))
    s[s == 0] = 1.0
    q = q * s.unsqueeze(0)
    c64 = lloyd_max(4, d, "gaussian").centroids  # any float64 solve; the peer rounds it as below
    return q, torch.tensor(c64, dtype=torch.float32), torch.tensor((c64[:-1] + c64[1:]) / 2, dtype=torch.float32)


def _peer_quantize(x32, q, bounds):
    norms = torch.norm(x32, dim=-1, keepdim=True)
    y = (x32 / (norms + 1e-10)) @ q.T
    return torch.bucketize(y, bounds).numpy(), norms[..., 0].numpy()


@pytest.mark.parametrize("d", [128, 512])
def test_tq4_doc_import_gives_the_peers_codes(d):
    q, cents, bounds = _peer_tq4(d)
    names = dict(Q=q.numpy(), centroids=cents.numpy(), boundaries=bounds.numpy())
    params = _run_doc('KVFormat.preset("tq4"', **names)
    x = np.random.default_rng(3).standard_normal((300, d)).astype(np.float16)
    want, _ = _peer_quantize(torch.from_numpy(x).float(), q, bounds)
    got, unsure, _ = _oracle_codes(params, x)
    assert np.mean(unsure) < 0.02
    assert not np.any((got != want) & ~unsure)
    # The same matrix passed untransposed is accepted (it is orthogonal) and gives garbage.
    wrong = tqkern.TQParams(format=params.format, rotation=names["Q"], key_codebook=params.key_codebook,
                            value_codebook=params.value_codebook)
    bad, _, _ = _oracle_codes(wrong, x)
    assert np.mean(bad != want) > 0.5


def test_tq4_norms_are_correctly_rounded_not_the_peers_float32_reduction():
    # Documented: tqkern stores the correctly rounded fp32 ‖x‖ (oracle and store kernel alike); the
    # peer's float32 torch norm differs from it in about 1 in 4 vectors, by an ulp or two.
    d = 128
    q, cents, bounds = _peer_tq4(d)
    fmt = tqkern.KVFormat.preset("tq4", d)
    cb = tqkern.Codebook.from_centroids(cents.numpy(), dim=d)  # the table does not matter here
    params = tqkern.TQParams(format=fmt, rotation=q.numpy().T, key_codebook=cb, value_codebook=cb)
    x = np.random.default_rng(4).standard_normal((400, 2, d)).astype(np.float16)
    exact = np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=-1)).astype(np.float32)
    _, _, oracle = _oracle_codes(params, x)
    assert np.array_equal(oracle, exact.astype(np.float64))
    kq, vq = tqt.quantize(torch.from_numpy(x), torch.from_numpy(x), params)  # the active CPU path
    assert np.array_equal(kq["norm"].numpy(), exact) and np.array_equal(vq["norm"].numpy(), exact)
    _, peer = _peer_quantize(torch.from_numpy(x).float(), q, bounds)
    peer, exact = peer.reshape(-1).astype(np.float64), exact.reshape(-1)
    ulps = np.abs(peer - exact) / np.spacing(exact)
    assert 0.1 < np.mean(ulps > 0) < 0.5
    assert np.max(ulps) <= 3
