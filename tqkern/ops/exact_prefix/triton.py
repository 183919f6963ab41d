"""The Triton kernel of ``replace_prefix`` (the spec: :mod:`.reference`): one program per (row,
query head) loads the query, the prefix's reconstructed and exact keys and values (N rows of D),
computes both sets of logits and swaps their terms in the output's softmax through its
log-sum-exp, in float32. One launch instead of the ~15 torch operations of the same maths."""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.ops.launch import BoundedCache, KernelLauncher

__all__ = ["launch_replace_prefix"]


@triton.jit
def _capped(a, cap, CAP: tl.constexpr):
    """``cap · tanh(a / cap)`` (``CAP``), from exp: tanh x = 1 − 2 / (e^{2x} + 1), exact at ±inf."""
    if CAP:
        return cap * (1.0 - 2.0 / (tl.exp(2.0 * a / cap) + 1.0))
    return a


@triton.jit
def _replace_prefix_kernel(out_ptr, lse_ptr, q_ptr, kh_ptr, vh_ptr, ke_ptr, ve_ptr, qpos_ptr, kpos_ptr, res_ptr,
                           T, HQ, HKV, N, scale, window_left, cap,
                           so_b, so_t, so_h, sl_b, sl_t, sl_h, sq_b, sq_h, sq_t,
                           G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NP: tl.constexpr,
                           QPOS: tl.constexpr, KPOS: tl.constexpr, WINDOW: tl.constexpr, CAP: tl.constexpr):
    row = tl.program_id(0)  # b · T + t
    h = tl.program_id(1)
    b = row // T
    t = row % T
    g = h // G
    d = tl.arange(0, DP)
    dm = d < D
    j = tl.arange(0, NP)
    jm = j < N
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + h * sq_h + t * sq_t + d, mask=dm, other=0.0).to(tl.float32)
    kv = ((b.to(tl.int64) * HKV + g) * N + j[:, None]) * D + d[None, :]  # [NP, DP] offsets into [B, Hkv, N, D]
    m2 = jm[:, None] & dm[None, :]
    kh = tl.load(kh_ptr + kv, mask=m2, other=0.0).to(tl.float32)
    ke = tl.load(ke_ptr + kv, mask=m2, other=0.0).to(tl.float32)
    a_hat = _capped(tl.sum(kh * q[None, :], axis=1) * scale, cap, CAP)
    a_ex = _capped(tl.sum(ke * q[None, :], axis=1) * scale, cap, CAP)
    hidden = j >= N
    if KPOS:
        kp = tl.load(kpos_ptr + b.to(tl.int64) * N + j, mask=jm, other=0).to(tl.int64)
        hidden = hidden | (kp < 0)
    else:
        kp = j.to(tl.int64)
    if QPOS:
        qp = tl.load(qpos_ptr + b.to(tl.int64) * T + t).to(tl.int64)
        hidden = hidden | (kp > qp)
        if WINDOW:
            hidden = hidden | (qp - kp > window_left)
    a_hat = tl.where(hidden, float("-inf"), a_hat)
    a_ex = tl.where(hidden, float("-inf"), a_ex)
    lse = tl.load(lse_ptr + b.to(tl.int64) * sl_b + t * sl_t + h * sl_h).to(tl.float32)
    m = tl.maximum(lse, tl.maximum(tl.max(a_hat, axis=0), tl.max(a_ex, axis=0)))
    m = tl.where((m == m) & (tl.abs(m) < float("inf")), m, 0.0)  # not finite: 0 (the oracle's rule)
    w_hat = tl.exp(a_hat - m)
    w_ex = tl.exp(a_ex - m)
    z = tl.exp(lse - m)
    vh = tl.load(vh_ptr + kv, mask=m2, other=0.0).to(tl.float32)
    ve = tl.load(ve_ptr + kv, mask=m2, other=0.0).to(tl.float32)
    o_off = b.to(tl.int64) * so_b + t * so_t + h * so_h + d
    o = tl.load(out_ptr + o_off, mask=dm, other=0.0).to(tl.float32)
    num = o * z - tl.sum(w_hat[:, None] * vh, axis=0) + tl.sum(w_ex[:, None] * ve, axis=0)
    den = z - tl.sum(w_hat, axis=0) + tl.sum(w_ex, axis=0)
    r_off = ((b.to(tl.int64) * T + t) * HQ + h) * D + d
    tl.store(res_ptr + r_off, (num / den).to(res_ptr.dtype.element_ty), mask=dm)


_LAUNCHERS = BoundedCache(64)


def launch_replace_prefix(out, lse, q, k_hat, v_hat, k_exact, v_exact, res, *, scale: float, q_pos=None, k_pos=None,
                          window_left=None, logit_softcap=None) -> None:
    """Write ``replace_prefix(...)`` (:mod:`.reference`) into ``res`` (contiguous ``[B, T, Hq, D]``).
    Shapes are the caller's to check (:func:`tqkern_torch.exact_prefix.replace_prefix`);
    ``k_hat, v_hat, k_exact, v_exact`` contiguous ``[B, Hkv, N, D]``, ``q_pos`` ``[B, T]`` and
    ``k_pos`` ``[B, N]`` contiguous integers; ``out``, ``lse`` and ``q`` any strides (unit stride
    along D). ``res`` may be ``out`` itself (each program reads its row before writing it)."""
    b, hq, t, d = q.shape
    hkv, n = k_exact.shape[1], k_exact.shape[2]
    flags = (q_pos is not None, k_pos is not None, window_left is not None, logit_softcap is not None)
    key = (b * t, hq, hq // hkv, d, max(1, n), flags)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        launcher = _LAUNCHERS.put(key, KernelLauncher(
            _replace_prefix_kernel, (b * t, hq),
            dict(G=hq // hkv, D=d, DP=triton.next_power_of_2(d), NP=max(2, triton.next_power_of_2(n)), QPOS=flags[0],
                 KPOS=flags[1], WINDOW=flags[2], CAP=flags[3]), num_warps=4 if d * max(n, 1) > 4096 else 1))
    qp = q_pos if q_pos is not None else lse
    kp = k_pos if k_pos is not None else lse
    launcher(out, lse, q, k_hat, v_hat, k_exact, v_exact, qp, kp, res, t, hq, hkv, n, float(scale),
             int(window_left or 0), float(logit_softcap or 1.0), out.stride(0), out.stride(1), out.stride(2),
             lse.stride(0), lse.stride(1), lse.stride(2), q.stride(0), q.stride(1), q.stride(2))
