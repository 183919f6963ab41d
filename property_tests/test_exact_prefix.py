"""``replace_prefix`` (exact prefix tokens swapped in through the log-sum-exp): the NumPy oracle
against the attention oracle over the exact prefix (an independent path: whole softmaxes, no
correction), then the Triton kernel (interpreter or GPU) and the float32 torch path against the
oracle, with positions (some prefix tokens not in the cache, queries before some of them), a
sliding window and a soft-cap drawn."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqkern.ops.attention.reference import attention
from tqkern.ops.exact_prefix.reference import replace_prefix as oracle
from tqkern_torch.exact_prefix import replace_prefix
from tqkern_torch.testing import device_under_test, kernels_available

DEV = device_under_test()


@st.composite
def _case(draw):
    b = draw(st.integers(1, 2), label="b")
    hkv = draw(st.integers(1, 3), label="hkv")
    hq = hkv * draw(st.sampled_from([1, 2, 4]), label="group")
    n = draw(st.integers(1, 9), label="n")
    m = draw(st.integers(0, 6), label="others")  # cache positions after the prefix
    t = draw(st.integers(1, min(4, n + m)), label="t")  # queries: the last t positions
    d = draw(st.sampled_from([8, 16, 48, 64, 128]), label="d")
    window = draw(st.one_of(st.none(), st.integers(0, n + m)), label="window_left")
    cap = draw(st.one_of(st.none(), st.floats(2.0, 30.0)), label="logit_softcap")
    rng = np.random.default_rng(draw(st.integers(0, 2**16), label="seed"))
    scale = (1.0 + 2.0 * rng.random()) / np.sqrt(d)  # logits of a few units: the prefix matters
    r = lambda *s: rng.standard_normal(s)  # noqa: E731
    # the reconstruction: the exact vectors plus an error of a quantizer's size (2-5 bits' worth)
    err = draw(st.sampled_from([0.05, 0.2, 0.5]), label="reconstruction error")
    k_exact, v_exact = r(b, n, hkv, d), r(b, n, hkv, d)
    return dict(q=r(b, t, hq, d), k_hat=k_exact + err * r(b, n, hkv, d), v_hat=v_exact + err * r(b, n, hkv, d),
                k_exact=k_exact, v_exact=v_exact, k_other=r(b, m, hkv, d), v_other=r(b, m, hkv, d), scale=scale,
                window=window, cap=cap, t=t)


def _attend(c, k_pre, v_pre, bi, causal=True):
    """Attention of sequence ``bi``'s ``t`` queries over prefix + other keys (oracle): causal (the
    last t positions, with the window) or every query over every key."""
    k = np.concatenate([k_pre[bi], c["k_other"][bi]])
    v = np.concatenate([v_pre[bi], c["v_other"][bi]])
    return attention(c["q"][bi], k, v, scale=c["scale"], causal=causal, window_left=c["window"] if causal else None,
                     logit_softcap=c["cap"], return_lse=True)


@given(_case())
def test_oracle_equals_attention_over_the_exact_prefix(c):
    """Attention over [reconstructed prefix; other keys] corrected by the oracle equals attention
    over [exact prefix; other keys] (queries the last t positions, causal, window, soft-cap)."""
    b, t = c["q"].shape[0], c["t"]
    n, m = c["k_hat"].shape[1], c["k_other"].shape[1]
    for bi in range(b):
        out, lse = _attend(c, c["k_hat"], c["v_hat"], bi)
        want, lse_want = _attend(c, c["k_exact"], c["v_exact"], bi)
        q_pos = np.arange(n + m - t, n + m)[None]  # bottom-right: the queries are the last t positions
        got = oracle(out[None], lse[None], c["q"][bi: bi + 1].transpose(0, 2, 1, 3),
                     *(c[x][bi: bi + 1].transpose(0, 2, 1, 3) for x in ("k_hat", "v_hat", "k_exact", "v_exact")),
                     scale=c["scale"], q_pos=q_pos, window_left=c["window"], logit_softcap=c["cap"])[0]
        # float64 work, its rounding amplified by Z / Z' (the swap's cancellation where the prefix
        # holds most of the reconstructed softmax's weight)
        ratio = np.exp(lse - lse_want)[..., None]
        vmax = max(np.abs(out).max(), np.abs(c["v_exact"][bi]).max(), np.abs(c["v_hat"][bi]).max())
        err, tol = np.abs(got - want), 1e-12 * (1 + ratio) * vmax + 1e-13
        assert np.all(err <= tol), (err.max(), np.broadcast_to(tol, err.shape)[err > tol])


def _to(x, dtype):
    t = torch.from_numpy(np.ascontiguousarray(x)).to(dtype).to(DEV)
    return t, t.double().cpu().numpy()


@pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")
@settings(max_examples=max(80, settings.default.max_examples))  # (cheap: ~0.1 s an example interpreted)
@given(_case(), st.sampled_from(["float32", "float16"] + (["bfloat16"] if torch.cuda.is_available() else [])),
       st.sampled_from(["triton", "torch"]), st.sampled_from(["", "k", "q", "qw", "kq", "kqw"]), st.data())
def test_kernel_and_torch_path_equal_the_oracle(c, dtype, impl, positions, data):
    """Either implementation against the oracle on the values it was given (inputs rounded to the
    drawn dtype first), every row's prefix terms realistic: ``(out, lse)`` an attention over the
    reconstructed prefix and other keys, every query over every key. Paged positions drawn (``positions``: k_pos — prefix
    tokens dropped from the cache, negative, or after some queries —, q_pos, and with it a window),
    or none (every query after the prefix). Bound: float32 work, amplified by the normaliser ratio Z / Z' of the swap."""
    dt = getattr(torch, dtype)
    b, t, hq, d = c["q"].shape
    n = c["k_hat"].shape[1]
    outs, lses = zip(*(_attend(c, c["k_hat"], c["v_hat"], bi, causal=False) for bi in range(b)))
    out_t, out_np = _to(np.stack(outs), dt)
    lse_t, lse_np = _to(np.stack(lses), torch.float32)
    q_t, q_np = _to(c["q"].transpose(0, 2, 1, 3), dt)
    kv = [_to(c[x].transpose(0, 2, 1, 3), dt) for x in ("k_hat", "v_hat", "k_exact", "v_exact")]
    q_pos = k_pos = window = None
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="position seed"))
    if "k" in positions:  # prefix tokens dropped from the cache (negative) or after some queries
        k_pos = rng.integers(-2, n + 3, size=(b, n))
    if "q" in positions:
        q_pos = rng.integers(0, n + 4, size=(b, t))
    if "w" in positions:
        window = int(rng.integers(0, 4))
    want, lse_new = oracle(out_np, lse_np, q_np, *(x[1] for x in kv), scale=c["scale"], q_pos=q_pos, k_pos=k_pos,
                           window_left=window, logit_softcap=c["cap"], return_lse=True)
    got = replace_prefix(out_t, lse_t, q_t, *(x[0] for x in kv), scale=c["scale"],
                         q_pos=None if q_pos is None else torch.from_numpy(q_pos).to(DEV),
                         k_pos=None if k_pos is None else torch.from_numpy(k_pos).to(DEV),
                         window_left=window, logit_softcap=c["cap"], impl=impl)
    assert got.shape == out_t.shape and got.dtype == dt
    ratio = np.exp(lse_np - lse_new)  # Z / Z': how much the swap amplifies the float32 work's error
    scale_v = max(np.abs(out_np).max(), max(np.abs(x[1]).max() for x in kv[1::2]))
    eps = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dt]
    tol = 1e-5 * scale_v * (1 + ratio[..., None]) + eps * np.abs(want)
    err = np.abs(got.double().cpu().numpy() - want)
    assert np.all(err <= tol), (err.max(), np.broadcast_to(tol, err.shape)[err > tol][:4])
