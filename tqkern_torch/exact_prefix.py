"""Exact first tokens: an attention output over a compressed cache, corrected so that its first
``N`` key/value positions count with their exact K/V instead of their reconstruction.

Why: the first tokens of a sequence are where attention sinks sit. On SmolLM2-135M token 0 takes
25–71% of the attention of later queries in 25 of its 30 layers, with a value norm a quarter of
the average: its quantization error reaches the output with that weight, and its key error moves
the weight itself. Keeping those few tokens exact beside the cache costs ``N · 4 · head_dim``
bytes per KV head and sequence (float16/bfloat16 K and V) and no kernel change: the kernels attend
the whole compressed cache and return the log-sum-exp of each row, and :func:`replace_prefix`
swaps the prefix's terms of the softmax (``docs/quality.md`` measures what it is worth).

Maths (per query row and query head h, KV head g = h // (Hq / Hkv); logits in the kernels'
convention: scaled by ``scale``, keys as the cache holds them, i.e. ``k − μ`` with a key offset):

    ŝ_j = scale · q · k̂_j,   s_j = scale · q · k_j        for prefix positions j < N with j ≤ pos(q)
    Z   = exp(lse)                                          (the kernel's normaliser, k̂ included)
    o'  = (o · Z − Σ_j exp(ŝ_j) · v̂_j + Σ_j exp(s_j) · v_j) / (Z − Σ_j exp(ŝ_j) + Σ_j exp(s_j))

in float32, every exponent shifted by ``m = max(lse, max_j ŝ_j, max_j s_j)``. Exact when ``(o,
lse)`` attended ``k̂_j, v̂_j`` at logits ``ŝ_j``; a kernel's own rounding of ``ŝ_j`` (fp16/bf16 q,
its MMA order, an fp16/bf16 ``o``) leaves that rounding times the prefix's weight, of the order of
the output's own rounding. The cancellation ``o · Z − exp(ŝ_j) · v̂_j`` does not amplify ``o``'s
rounding: ``Z / Z'`` stays near 1 wherever ``s_j ≈ ŝ_j``.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["replace_prefix"]


def replace_prefix(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor,
                   k_exact: torch.Tensor, v_exact: torch.Tensor, *, scale: float,
                   q_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out`` with the prefix's reconstructed K/V replaced by the exact ones (module docstring).

    Args:
        out: ``[B, T, Hq, D]`` attention output over a cache whose first ``N`` positions hold
            ``k_hat, v_hat`` (any float dtype).
        lse: ``[B, T, Hq]`` float32 natural-log normaliser of ``out``'s softmax.
        q: ``[B, Hq, T, D]`` the queries (original coordinates, as the kernels took them).
        k_hat, v_hat, k_exact, v_exact: ``[B, Hkv, N, D]``, Hq a multiple of Hkv; keys in the
            kernels' convention (``k − μ`` with a key offset μ).
        scale: the logit scale the kernels used.
        q_pos: int ``[B, T]`` position of each query (prefix position j is attended iff
            ``j ≤ q_pos``); ``None``: every query attends the whole prefix.

    Returns:
        ``[B, T, Hq, D]`` in ``out``'s dtype.

    Raises:
        ValueError: shapes that do not agree (naming the argument).
    """
    b, hq, t, d = q.shape
    if out.shape != (b, t, hq, d):
        raise ValueError(f"out must have shape {[b, t, hq, d]} (from q {list(q.shape)}), got {list(out.shape)}")
    if lse.shape != (b, t, hq):
        raise ValueError(f"lse must have shape {[b, t, hq]}, got {list(lse.shape)}")
    if k_exact.dim() != 4:
        raise ValueError(f"k_exact must have shape [B, Hkv, N, D], got {list(k_exact.shape)}")
    hkv, n = k_exact.shape[1], k_exact.shape[2]
    for name, x in (("k_hat", k_hat), ("v_hat", v_hat), ("k_exact", k_exact), ("v_exact", v_exact)):
        if x.dim() != 4 or x.shape[0] != b or x.shape[1] != hkv or x.shape[2] != n or x.shape[3] != d:
            raise ValueError(f"{name} must have shape {[b, hkv, n, d]}, got {list(x.shape)}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q's {hq} heads must be a multiple of k_exact's {hkv} KV heads")
    if q_pos is not None and q_pos.shape != (b, t):
        raise ValueError(f"q_pos must have shape {[b, t]}, got {list(q_pos.shape)}")
    if n == 0:
        return out
    rep = hq // hkv
    qf = q.float()

    def logits(k):  # [B, Hq, T, N]
        return scale * (qf @ k.float().repeat_interleave(rep, dim=1).transpose(-1, -2))

    s_hat, s_exact = logits(k_hat), logits(k_exact)
    if q_pos is not None:
        hidden = torch.arange(n, device=q.device)[None, None, None, :] > q_pos[:, None, :, None]  # [B, 1, T, N]
        s_hat = s_hat.masked_fill(hidden, float("-inf"))
        s_exact = s_exact.masked_fill(hidden, float("-inf"))
    lse_h = lse.float().permute(0, 2, 1)  # [B, Hq, T]
    m = torch.maximum(lse_h, torch.maximum(s_hat.amax(dim=-1), s_exact.amax(dim=-1)))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row that attends nothing stays as it is
    w_hat, w_exact = (s_hat - m[..., None]).exp(), (s_exact - m[..., None]).exp()
    z = (lse_h - m).exp()
    vh, ve = v_hat.float().repeat_interleave(rep, dim=1), v_exact.float().repeat_interleave(rep, dim=1)
    num = out.float().permute(0, 2, 1, 3) * z[..., None] - w_hat @ vh + w_exact @ ve  # [B, Hq, T, D]
    den = z - w_hat.sum(dim=-1) + w_exact.sum(dim=-1)
    return (num / den[..., None]).permute(0, 2, 1, 3).to(out.dtype)


class ExactPrefix:
    """The exact first ``n`` tokens of each row of one :class:`~tqkern_torch.transformers.TQCacheLayer`
    (``TQCache(exact_prefix=n)``): their K/V in 16 bits (the layer's ``store_dtype``: bfloat16 for a
    bfloat16 model, else float16, what a 16-bit cache holds), taken at the layer's first
    attention call (its first chunk; left padding skipped, so they are each row's first real
    tokens), used by the dense path (:meth:`patch`) and after ``paged_decode`` (:meth:`correct`).

    Attributes:
        n: tokens per row.
        k, v: ``[B, Hkv, n, D]`` exact K (original scale) and V, or None before the capture.
        pos: int64 ``[B, n]`` their logical positions.
    """

    def __init__(self, n: int):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"exact_prefix must be an int >= 1, got {n!r}")
        self.n = n
        self.k = self.v = self.pos = None
        self._hat = None

    def capture(self, key: torch.Tensor, value: torch.Tensor, starts: Optional[torch.Tensor],
                dtype: torch.dtype = torch.float16) -> None:
        """Keep the first ``n`` real tokens of each row of the layer's first chunk ``key, value
        [B, Hkv, T, D]``, rounded to ``dtype``; ``starts`` int ``[B]``: each row's left padding
        (None: none).

        Raises:
            ValueError: ``starts`` of another shape; a row with fewer than ``n`` real tokens.
        """
        b, _, t, _ = key.shape
        if starts is None:
            starts = torch.zeros(b, dtype=torch.long, device=key.device)
        elif starts.shape != (b,):
            raise ValueError(f"starts must have shape {[b]} (one per row of the first chunk), got {list(starts.shape)}")
        starts = starts.to(device=key.device, dtype=torch.long)
        if int((t - starts).min()) < self.n:
            raise ValueError(f"TQCache(exact_prefix={self.n}) needs at least {self.n} real tokens in every row of the "
                             f"first chunk, got {int((t - starts).min())}")
        self.pos = starts[:, None] + torch.arange(self.n, device=key.device)[None, :]  # [B, n]
        idx = self.pos[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
        self.k, self.v = key.gather(2, idx).to(dtype), value.gather(2, idx).to(dtype)
        self._hat = None

    def patch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v [B, Hkv, seq_len, D]`` (the layer's dense K/V, logical positions) with the prefix
        positions holding the exact K/V."""
        idx = self.pos[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        return k.scatter(2, idx, self.k.to(k.dtype)), v.scatter(2, idx, self.v.to(v.dtype))

    def correct(self, layer, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
                q_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A kernel's ``out [B, T, Hq, D]`` (with ``lse [B, T, Hq]``, queries ``q [B, Hq, T, D]`` at
        paged positions ``q_pos [B, T]``, None: after every prefix token) over ``layer``'s
        re-paged rows (paged position j = the prefix's token j), with the prefix exact."""
        from tqkern_torch.ops import decompress_sequences

        if self._hat is None:  # the reconstruction the kernel attends (keys as stored: k − μ)
            bs = layer.layout.block_size
            table = layer.block_table[:, : -(-self.n // bs)]
            lens = torch.full_like(layer.seq_lens, self.n)
            kh, vh = decompress_sequences(layer.pool, table, lens, layer.layout, layer.device_params, rotate_back=True)
            self._hat = (kh[:, : self.n].transpose(1, 2), vh[:, : self.n].transpose(1, 2))  # [B, Hkv, n, D]
        k_exact = self.k.float() if layer.mu is None else self.k.float() - layer.mu
        return replace_prefix(out, lse, q, *self._hat, k_exact, self.v, scale=scale, q_pos=q_pos)
