"""The NumPy oracle and normative spec of ``replace_prefix``.

``replace_prefix(out, lse, q, k_hat, v_hat, k_exact, v_exact, *, scale, q_pos=None, k_pos=None,
window_left=None, logit_softcap=None, return_lse=False)`` with

    out      [B, T, Hq, D]   any float dtype: an attention output whose softmax attended, among
                             other keys, the N prefix positions at ``k_hat, v_hat``
    lse      [B, T, Hq]      the natural-log normaliser of ``out``'s softmax
    q        [B, Hq, T, D]   the queries, in the coordinates the kernels scored them in
    k_hat, v_hat, k_exact, v_exact   [B, Hkv, N, D], Hq a multiple of Hkv (query head h reads KV
                             head h // (Hq / Hkv)); keys in the kernels' convention (k − μ with a
                             key offset μ)
    q_pos    [B, T] int      position of each query, or None (every query after every prefix token)
    k_pos    [B, N] int      position of each prefix token (negative: not in the cache, never
                             attended), or None (0 .. N − 1)
    returns  [B, T, Hq, D]   float64 (with ``return_lse`` also the corrected normaliser's log
                             ``lse' = m + log den`` [B, T, Hq], float64)

Maths, per row (b, t) and query head h (g its KV head), in float64 from the inputs converted
exactly:

    a_j  = scale · q · k_j                for k_j = k_hat[b, g, j] (â_j) and k_exact[b, g, j] (a_j)
    a_j  = c · tanh(a_j / c)              with ``logit_softcap = c`` (as the kernels capped them)
    a_j  = −inf                           where k_pos[j] < 0, or k_pos[j] > q_pos, or
                                          q_pos − k_pos[j] > window_left (with q_pos given)
    m    = max(lse, max_j â_j, max_j a_j);  m = 0 where it is not finite (a row that attends
           nothing, or a non-finite lse: the result then follows from lse alone)
    Z    = exp(lse − m)
    num  = out · Z − Σ_j exp(â_j − m) · v_hat[j] + Σ_j exp(a_j − m) · v_exact[j]
    den  = Z − Σ_j exp(â_j − m) + Σ_j exp(a_j − m)
    res  = num / den

Exact when ``(out, lse)`` attended ``k_hat, v_hat`` at logits ``â_j``: the prefix's terms are
taken out of the softmax's numerator and normaliser and the exact ones put in. No rounding and no
ties: every operation is a float64 one, in this order.
"""

from __future__ import annotations

import numpy as np

__all__ = ["replace_prefix"]


def replace_prefix(out, lse, q, k_hat, v_hat, k_exact, v_exact, *, scale: float, q_pos=None, k_pos=None,
                   window_left=None, logit_softcap=None, return_lse: bool = False):
    """The module docstring's ``res`` (and ``lse'``; shapes there; ``ValueError`` for ones that disagree)."""
    out, lse, q = (np.asarray(x, dtype=np.float64) for x in (out, lse, q))
    k_hat, v_hat, k_exact, v_exact = (np.asarray(x, dtype=np.float64) for x in (k_hat, v_hat, k_exact, v_exact))
    b, hq, t, d = q.shape
    if out.shape != (b, t, hq, d) or lse.shape != (b, t, hq):
        raise ValueError(f"out [B, T, Hq, D] and lse [B, T, Hq] must agree with q {list(q.shape)}, got "
                         f"{list(out.shape)} and {list(lse.shape)}")
    hkv, n = k_exact.shape[1], k_exact.shape[2]
    for name, x in (("k_hat", k_hat), ("v_hat", v_hat), ("k_exact", k_exact), ("v_exact", v_exact)):
        if x.shape != (b, hkv, n, d):
            raise ValueError(f"{name} must have shape {[b, hkv, n, d]}, got {list(x.shape)}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q's {hq} heads must be a multiple of {hkv} KV heads")
    g = np.arange(hq) // (hq // hkv)
    kp = np.broadcast_to(np.arange(n), (b, n)) if k_pos is None else np.asarray(k_pos, dtype=np.int64)
    hidden = np.broadcast_to(kp[:, None, :] < 0, (b, t, n))  # [B, T, N]
    if q_pos is not None:
        qp = np.asarray(q_pos, dtype=np.int64)[:, :, None]
        hidden = hidden | (kp[:, None, :] > qp)
        if window_left is not None:
            hidden = hidden | (qp - kp[:, None, :] > window_left)

    def logits(k):  # [B, T, Hq, N]
        a = scale * np.einsum("bhtd,bhnd->bthn", q, k[:, g])
        if logit_softcap is not None:
            a = logit_softcap * np.tanh(a / logit_softcap)
        return np.where(hidden[:, :, None, :], -np.inf, a)

    a_hat, a_ex = logits(k_hat), logits(k_exact)
    with np.errstate(invalid="ignore"):
        m = np.maximum(lse, np.maximum(a_hat.max(axis=-1, initial=-np.inf), a_ex.max(axis=-1, initial=-np.inf)))
    m = np.where(np.isfinite(m), m, 0.0)
    w_hat, w_ex = np.exp(a_hat - m[..., None]), np.exp(a_ex - m[..., None])
    z = np.exp(lse - m)
    num = (out * z[..., None] - np.einsum("bthn,bhnd->bthd", w_hat, v_hat[:, g])
           + np.einsum("bthn,bhnd->bthd", w_ex, v_exact[:, g]))
    den = z - w_hat.sum(axis=-1) + w_ex.sum(axis=-1)
    res = num / den[..., None]
    if return_lse:
        with np.errstate(divide="ignore", invalid="ignore"):
            return res, m + np.log(den)
    return res
