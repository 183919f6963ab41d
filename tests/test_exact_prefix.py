"""tqkern_torch.exact_prefix.replace_prefix against attention computed in float64 NumPy over the
K/V with the exact prefix in place: GQA, causal query positions that see part of the prefix,
a prefix that takes most of the attention (an attention sink), low-precision outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tqkern_torch.exact_prefix import replace_prefix


def _attend(q, k, v, scale, q_pos, window_left=None, softcap=None):
    """float64 attention: q [B, Hq, T, D], k/v [B, Hkv, L, D]; key j attended iff j <= q_pos[b, t]
    (and q_pos[b, t] − j <= window_left); logits capped as softcap·tanh(s/softcap).
    Returns (out [B, T, Hq, D], lse [B, T, Hq])."""
    b, hq, t, d = q.shape
    rep = hq // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = scale * np.einsum("bhtd,bhld->bhtl", q, k)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    j, qp = np.arange(k.shape[2])[None, None, None, :], q_pos[:, None, :, None]
    s = np.where((j <= qp) & (qp - j <= (np.inf if window_left is None else window_left)), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    z = p.sum(axis=-1, keepdims=True)
    out = np.einsum("bhtl,bhld->bhtd", p / z, v)
    return out.transpose(0, 2, 1, 3), (np.log(z) + m)[..., 0].transpose(0, 2, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,t,n", [(4, 2, 1, 1), (6, 2, 5, 3), (3, 3, 7, 4), (8, 1, 3, 16)])
def test_replace_prefix_equals_attention_over_the_exact_prefix(hq, hkv, t, n, dtype):
    rng = np.random.default_rng(hq * 100 + t * 10 + n)
    b, d, length = 2, 16, 24
    scale = d ** -0.5
    q = rng.standard_normal((b, hq, t, d))
    k = rng.standard_normal((b, hkv, length, d))
    v = rng.standard_normal((b, hkv, length, d))
    k[:, :, 0] *= 3.0  # an attention sink at position 0 of the exact keys
    q[..., :] += 2.0 * k[:, :1, :1, :].mean(axis=1, keepdims=True) / 3.0
    k_hat, v_hat = k.copy(), v.copy()
    k_hat[:, :, :n] += 0.3 * rng.standard_normal((b, hkv, n, d))  # the prefix's reconstruction error
    v_hat[:, :, :n] += 0.3 * rng.standard_normal((b, hkv, n, d))
    q_pos = np.stack([np.arange(length - t, length), np.arange(t) + min(1, length - t)])  # row 1 sees part of it
    out_hat, lse_hat = _attend(q, k_hat, v_hat, scale, q_pos)
    want, _ = _attend(q, k, v, scale, q_pos)
    T = lambda x, dt=torch.float32: torch.from_numpy(np.ascontiguousarray(x)).to(dt)  # noqa: E731
    got = replace_prefix(T(out_hat, dtype), T(lse_hat), T(q), T(k_hat[:, :, :n]), T(v_hat[:, :, :n]),
                         T(k[:, :, :n]), T(v[:, :, :n]), scale=scale, q_pos=torch.from_numpy(q_pos))
    assert got.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    np.testing.assert_allclose(got.double().numpy(), want, atol=tol * np.abs(v).max(), rtol=0)
    # the correction is not the identity: the prefix mattered
    assert np.abs(out_hat - want).max() > 0.05 * np.abs(v).max()


def test_replace_prefix_without_positions_and_empty_prefix():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 2, 1, 8)), rng.standard_normal((1, 1, 5, 8)), rng.standard_normal((1, 1, 5, 8))
    k_hat = k.copy()
    k_hat[:, :, :2] += 0.5
    pos = np.array([[4]])
    out_hat, lse = _attend(q, k_hat, v, 0.5, pos)
    want, _ = _attend(q, k, v, 0.5, pos)
    T = lambda x: torch.from_numpy(np.ascontiguousarray(x))  # noqa: E731
    got = replace_prefix(T(out_hat), T(lse), T(q), T(k_hat[:, :, :2]), T(v[:, :, :2]), T(k[:, :, :2]),
                         T(v[:, :, :2]), scale=0.5)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-6, rtol=0)  # float32 inside
    empty = T(k[:, :, :0])
    assert replace_prefix(T(out_hat), T(lse), T(q), empty, empty, empty, empty, scale=0.5) is not None


def test_replace_prefix_paged_positions_window_and_softcap():
    """Prefix token j at cache position k_pos[b, j] (negative: not in the cache, e.g. dropped as
    older than a sliding window), queries under a window of 5 keys and soft-capped logits (what
    a TQStaticCacheLayer's decode step passes): against float64 attention over the cache with
    those positions exact; queries that see all, part or none of the prefix."""
    rng = np.random.default_rng(5)
    b, hq, hkv, t, d, length, n, cap, wl = 2, 4, 2, 3, 16, 12, 3, 2.0, 4
    q = rng.standard_normal((b, hq, t, d))
    k, v = rng.standard_normal((b, hkv, length, d)), rng.standard_normal((b, hkv, length, d))
    k_pos = np.array([[0, 1, 2], [-1, 0, 1]])  # row 1: prefix token 0 is not in the cache
    q_pos = np.array([[3, 6, 11], [0, 4, 5]])
    k_hat, v_hat = k.copy(), v.copy()
    k_ex, v_ex = rng.standard_normal((b, hkv, n, d)), rng.standard_normal((b, hkv, n, d))  # at k_pos (if ≥ 0)
    k_pre, v_pre = k_ex + 0.5 * rng.standard_normal(k_ex.shape), v_ex + 0.5 * rng.standard_normal(v_ex.shape)
    for row in range(b):
        for j, p in enumerate(k_pos[row]):
            if p >= 0:
                k_hat[row, :, p], v_hat[row, :, p] = k_pre[row, :, j], v_pre[row, :, j]
                k[row, :, p], v[row, :, p] = k_ex[row, :, j], v_ex[row, :, j]
    out_hat, lse_hat = _attend(q, k_hat, v_hat, 0.3, q_pos, wl, cap)
    want, _ = _attend(q, k, v, 0.3, q_pos, wl, cap)
    T = lambda x: torch.from_numpy(np.ascontiguousarray(x)).float()  # noqa: E731
    got = replace_prefix(T(out_hat), T(lse_hat), T(q), T(k_pre), T(v_pre), T(k_ex), T(v_ex), scale=0.3,
                         q_pos=torch.from_numpy(q_pos), k_pos=torch.from_numpy(k_pos), window_left=wl,
                         logit_softcap=cap)
    np.testing.assert_allclose(got.double().numpy(), want, atol=1e-5, rtol=0)
    changed = np.abs(out_hat - want).max(axis=(2, 3))  # [B, T]: the queries that see a prefix token
    assert (changed[:, [0, 2]] > 1e-2).tolist() == [[True, False], [True, True]] and changed[0, 2] == 0
    with pytest.raises(ValueError, match="window_left must be an int >= 0, with q_pos"):
        replace_prefix(T(out_hat), T(lse_hat), T(q), T(k_pre), T(v_pre), T(k_ex), T(v_ex), scale=0.3, window_left=4)
    with pytest.raises(ValueError, match="logit_softcap must be > 0"):
        replace_prefix(T(out_hat), T(lse_hat), T(q), T(k_pre), T(v_pre), T(k_ex), T(v_ex), scale=0.3,
                       logit_softcap=0.0)
    with pytest.raises(ValueError, match="impl must be 'auto', 'triton' or 'torch', got 'cuda'"):
        replace_prefix(T(out_hat), T(lse_hat), T(q), T(k_pre), T(v_pre), T(k_ex), T(v_ex), scale=0.3, impl="cuda")


@pytest.mark.parametrize("arg,shape,match", [
    ("out", (1, 1, 2, 7), "out must have shape"), ("lse", (1, 2, 1), "lse must have shape"),
    ("k_hat", (1, 1, 3, 8), "k_hat must have shape"), ("v_exact", (1, 1, 2, 4), "v_exact must have shape"),
    ("q_pos", (1, 2), "q_pos must have shape"), ("k_pos", (1, 3), "k_pos must have shape"),
])
def test_replace_prefix_rejects_bad_shapes(arg, shape, match):
    args = dict(out=torch.zeros(1, 1, 2, 8), lse=torch.zeros(1, 1, 2), q=torch.zeros(1, 2, 1, 8),
                k_hat=torch.zeros(1, 1, 2, 8), v_hat=torch.zeros(1, 1, 2, 8), k_exact=torch.zeros(1, 1, 2, 8),
                v_exact=torch.zeros(1, 1, 2, 8), q_pos=torch.zeros(1, 1, dtype=torch.long),
                k_pos=torch.zeros(1, 2, dtype=torch.long))
    args[arg] = torch.zeros(shape, dtype=args[arg].dtype)
    with pytest.raises(ValueError, match=match):
        replace_prefix(**args, scale=1.0)


def test_exact_prefix_state_rejects_bad_input():
    from tqkern_torch.exact_prefix import ExactPrefix

    for bad in (0, -2, 1.0, True):
        with pytest.raises(ValueError, match="exact_prefix must be an int >= 1"):
            ExactPrefix(bad)
    kv = torch.zeros(2, 1, 6, 8)
    with pytest.raises(ValueError, match=r"starts must have shape \[2\]"):
        ExactPrefix(2).capture(kv, kv, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="needs at least 2 real tokens in every row of the first chunk, got 1"):
        ExactPrefix(2).capture(kv, kv, torch.tensor([0, 5]))
    state = ExactPrefix(2)
    state.capture(kv, kv, torch.tensor([0, 4]))
    assert state.pos.tolist() == [[0, 1], [4, 5]] and state.k.dtype == torch.float16


def test_replace_prefix_rejects_heads_that_do_not_divide():
    z = torch.zeros
    with pytest.raises(ValueError, match="q's 3 heads must be a multiple of k_exact's 2 KV heads"):
        replace_prefix(z(1, 1, 3, 8), z(1, 1, 3), z(1, 3, 1, 8), z(1, 2, 1, 8), z(1, 2, 1, 8), z(1, 2, 1, 8),
                       z(1, 2, 1, 8), scale=1.0)


def test_first_chunk_mask_must_pad_on_the_left():
    pytest.importorskip("transformers")
    from tqkern_torch.transformers import _first_chunk_padding

    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
    assert _first_chunk_padding(None, 4) is None
    assert _first_chunk_padding(mask, 4).tolist() == [0, 0]
    mask[1, :, :, 0] = False  # row 1: one token of left padding
    assert _first_chunk_padding(mask, 4).tolist() == [0, 1]
    mask[0, :, :, 2] = False  # row 0: a hole, not left padding
    with pytest.raises(ValueError, match="pad rows on the left only"):
        _first_chunk_padding(mask, 4)
