"""The attention oracle's options, each checked through an independent path:

- ``window_left``: equals attention over the sliced keys (slicing, not masking);
- ``sinks``: equals an extra key of score σ_h (an additive mask on a zero key) whose value is 0;
- ``logit_softcap``: equals a softmax written out by hand for two keys, and tends to no cap;
- ``lse``: two partial results over disjoint keys merge into the whole, and it equals the log of
  the normaliser written out by hand.
"""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tqkern.ops.attention.reference import attention


@st.composite
def qkv(draw, max_tq=5, max_tk=9):
    tq = draw(st.integers(1, max_tq), label="tq")
    tk = draw(st.integers(0, max_tk), label="tk")
    hkv = draw(st.sampled_from([1, 2]), label="hkv")
    hq = hkv * draw(st.sampled_from([1, 2, 3]), label="group")
    d = draw(st.sampled_from([2, 4, 8]), label="d")
    rng = np.random.default_rng(draw(st.integers(0, 2**16), label="seed"))
    scale = 1.0 + 2 * rng.random()  # scores of a few units: the options matter
    return (rng.standard_normal((tq, hq, d)), rng.standard_normal((tk, hkv, d)), rng.standard_normal((tk, hkv, d)),
            scale)


@given(qkv(), st.integers(0, 6), st.booleans())
def test_window_equals_attention_over_the_sliced_keys(case, window, causal):
    q, k, v, scale = case
    tq, tk = q.shape[0], k.shape[0]
    got = attention(q, k, v, scale=scale, causal=causal, window_left=window)
    for i in range(tq):
        p = tk - tq + i
        lo = max(0, p - window)
        hi = min(tk, p + 1) if causal else tk
        if hi <= lo:
            assert np.all(got[i] == 0)
            continue
        want = attention(q[i: i + 1], k[lo:hi], v[lo:hi], scale=scale)
        np.testing.assert_allclose(got[i: i + 1], want, rtol=1e-12, atol=1e-12)


@given(qkv(), st.booleans(), st.data())
def test_sinks_equal_a_zero_value_key(case, causal, data):
    q, k, v, scale = case
    hq, d = q.shape[1], q.shape[2]
    assume(not causal or k.shape[0] >= q.shape[0])  # (a causal row before the first key cannot see key 0)
    sinks = np.array(data.draw(st.lists(st.floats(-4, 4), min_size=hq, max_size=hq), label="sinks"))
    out, lse = attention(q, k, v, scale=scale, causal=causal, sinks=sinks, return_lse=True)
    # The sink as key 0 (every row sees it, causal or not): a zero key scores 0, the mask adds σ_h.
    k0 = np.concatenate([np.zeros((1, k.shape[1], d)), k])
    v0 = np.concatenate([np.zeros((1, v.shape[1], d)), v])
    mask = np.zeros((hq, q.shape[0], k0.shape[0]))
    mask[:, :, 0] = sinks[:, None]
    want, want_lse = attention(q, k0, v0, scale=scale, causal=causal, mask=mask, return_lse=True)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


@given(st.floats(0.5, 20), st.integers(0, 2**16))
def test_softcap_by_hand(cap, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((1, 1, 4)) * 3, rng.standard_normal((2, 1, 4)), rng.standard_normal((2, 1, 4))
    a = [0.5 * float(q[0, 0] @ k[j, 0]) for j in range(2)]
    c = [cap * np.tanh(x / cap) for x in a]
    w0 = 1.0 / (1.0 + np.exp(c[1] - c[0]))
    want = w0 * v[0, 0] + (1 - w0) * v[1, 0]
    got = attention(q, k, v, scale=0.5, logit_softcap=cap)
    np.testing.assert_allclose(got[0, 0], want, rtol=1e-12, atol=1e-12)


@given(qkv())
def test_a_huge_softcap_is_no_cap(case):
    q, k, v, scale = case
    np.testing.assert_allclose(attention(q, k, v, scale=scale, logit_softcap=1e7), attention(q, k, v, scale=scale),
                               rtol=1e-9, atol=1e-9)


@given(qkv(), st.data())
def test_lse_merges_two_partials(case, data):
    q, k, v, scale = case
    tk = k.shape[0]
    t = data.draw(st.integers(0, tk), label="split")
    sinks = np.linspace(-1, 1, q.shape[1])
    o1, l1 = attention(q, k[:t], v[:t], scale=scale, sinks=sinks, return_lse=True)  # the sinks once
    o2, l2 = attention(q, k[t:], v[t:], scale=scale, return_lse=True)
    big = np.logaddexp(l1, l2)
    merged = np.exp(l1 - big)[..., None] * o1 + np.exp(np.where(l2 == -np.inf, -np.inf, l2 - big))[..., None] * o2
    out, lse = attention(q, k, v, scale=scale, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(merged, out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(big, lse, rtol=1e-12, atol=1e-12)
    # by hand: log(Σ_j exp(scale·q·k_j) + exp(σ_h)) with query head h on KV head h // group
    group = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        for h in range(q.shape[1]):
            terms = [scale * float(q[i, h] @ k[j, h // group]) for j in range(tk)] + [sinks[h]]
            assert lse[i, h] == pytest.approx(np.log(np.sum(np.exp(terms))), rel=1e-12, abs=1e-12)


def test_lse_of_a_row_without_keys():
    q, k = np.ones((2, 2, 4)), np.zeros((0, 1, 4))
    out, lse = attention(q, k, k, return_lse=True)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    out, lse = attention(q, k, k, sinks=np.array([0.5, -1.0]), return_lse=True)
    assert np.all(out == 0) and np.array_equal(lse, np.array([[0.5, -1.0]] * 2))


@pytest.mark.parametrize("kw, exc, match", [
    (dict(window_left=-1), ValueError, r"window_left must be None or an int >= 0, got -1"),
    (dict(window_left=True), ValueError, r"window_left must be None or an int >= 0, got True"),
    (dict(logit_softcap=0.0), ValueError, r"logit_softcap must be finite and > 0, got 0.0"),
    (dict(logit_softcap=float("inf")), ValueError, r"logit_softcap must be finite and > 0"),
    (dict(logit_softcap="2"), TypeError, r"logit_softcap must be a real number or None, got str"),
    (dict(sinks=np.zeros(3)), ValueError, r"sinks must have shape \[2\] \(num_q_heads\), got \[3\]"),
    (dict(sinks=np.array([0.0, np.nan])), ValueError, r"sinks must be finite"),
    (dict(sinks=np.array([1, 2])), TypeError, r"sinks must be a float array"),
])
def test_options_reject_bad_values(kw, exc, match):
    q, k = np.ones((1, 2, 4)), np.ones((3, 1, 4))
    with pytest.raises(exc, match=match):
        attention(q, k, k, **kw)
