"""Exact first tokens: an attention output over a compressed cache, corrected so that its first
``N`` key/value positions count with their exact K/V instead of their reconstruction.

Why: the first tokens of a sequence are where attention sinks sit. On SmolLM2-135M token 0 takes
25–71% of the attention of later queries in 25 of its 30 layers, with a value norm a quarter of
the average: its quantization error reaches the output with that weight, and its key error moves
the weight itself. Keeping those few tokens exact beside the cache costs ``N · 4 · head_dim``
bytes per KV head and sequence (float16/bfloat16 K and V) and no change to the attention kernels:
they attend the whole compressed cache and return the log-sum-exp of each row, and
:func:`replace_prefix` swaps the prefix's terms of the softmax, one launch of its own small kernel
(:mod:`tqkern.ops.exact_prefix`, whose NumPy oracle is the spec; ``torch.ops.tqkern.replace_prefix``
inside a compiled step) or float32 torch operations on a CPU without Triton's interpreter
(``docs/quality.md`` measures what it is worth).

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

from tqkern_torch._validate import use_triton

__all__ = ["replace_prefix"]


def replace_prefix(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor,
                   k_exact: torch.Tensor, v_exact: torch.Tensor, *, scale: float,
                   q_pos: Optional[torch.Tensor] = None, k_pos: Optional[torch.Tensor] = None,
                   window_left: Optional[int] = None, logit_softcap: Optional[float] = None,
                   impl: str = "auto") -> torch.Tensor:
    """``out`` with the prefix's reconstructed K/V replaced by the exact ones (module docstring;
    the spec: :mod:`tqkern.ops.exact_prefix.reference`).

    Args:
        out: ``[B, T, Hq, D]`` attention output over a cache whose first ``N`` positions hold
            ``k_hat, v_hat`` (any float dtype).
        lse: ``[B, T, Hq]`` float32 natural-log normaliser of ``out``'s softmax.
        q: ``[B, Hq, T, D]`` the queries (original coordinates, as the kernels took them).
        k_hat, v_hat, k_exact, v_exact: ``[B, Hkv, N, D]``, Hq a multiple of Hkv; keys in the
            kernels' convention (``k − μ`` with a key offset μ).
        scale: the logit scale the kernels used.
        q_pos: int ``[B, T]`` position of each query (prefix token j is attended iff
            ``k_pos[j] ≤ q_pos``); ``None``: every query attends the whole prefix.
        k_pos: int ``[B, N]`` position of each prefix token (one negative: not in the cache,
            never attended); ``None``: ``0 .. N − 1``.
        window_left: sliding window as the kernels take it (prefix token j attended only where
            ``q_pos − k_pos[j] ≤ window_left``; needs ``q_pos``), or ``None``.
        logit_softcap: ``c > 0``: the kernels capped each logit ``a`` as ``c·tanh(a/c)``; or ``None``.
        impl: ``"triton"`` (one kernel launch, :mod:`tqkern.ops.exact_prefix.triton`: on CUDA
            tensors, or CPU ones under ``TRITON_INTERPRET=1``), ``"torch"`` (float32 torch
            operations, any device) or ``"auto"`` (the kernel where it can run).

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
    if k_pos is not None and k_pos.shape != (b, n):
        raise ValueError(f"k_pos must have shape {[b, n]}, got {list(k_pos.shape)}")
    if window_left is not None and (not isinstance(window_left, int) or isinstance(window_left, bool)
                                    or window_left < 0 or q_pos is None):
        raise ValueError(f"window_left must be an int >= 0, with q_pos, got {window_left!r}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be > 0, got {logit_softcap!r}")
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if n == 0:
        return out
    args = (out, lse, q, k_hat, v_hat, k_exact, v_exact, scale, q_pos, k_pos, window_left, logit_softcap)
    if impl == "torch" or (impl == "auto" and not use_triton(out.device)):
        return _replace_prefix_torch(*args)
    if torch.compiler.is_compiling():  # (traced as an op: a compiled decode step launches the kernel)
        return torch.ops.tqkern.replace_prefix(*args[:10], -1 if window_left is None else window_left,
                                               0.0 if logit_softcap is None else float(logit_softcap))
    return _replace_prefix_triton(*args)


def _replace_prefix_torch(out, lse, q, k_hat, v_hat, k_exact, v_exact, scale, q_pos, k_pos, window_left,
                          logit_softcap) -> torch.Tensor:
    """:func:`replace_prefix` as float32 torch operations (any device; arguments checked)."""
    b, hq, t, d = q.shape
    hkv, n = k_exact.shape[1], k_exact.shape[2]
    rep = hq // hkv
    qf = q.float()

    def logits(k):  # [B, Hq, T, N]
        s = scale * (qf @ k.float().repeat_interleave(rep, dim=1).transpose(-1, -2))
        return s if logit_softcap is None else torch.tanh(s / logit_softcap) * logit_softcap

    s_hat, s_exact = logits(k_hat), logits(k_exact)
    hidden = None  # [B, 1, T | 1, N]: prefix tokens a query does not attend
    kp = torch.arange(n, device=q.device)[None, None, None, :] if k_pos is None else k_pos[:, None, None, :]
    if k_pos is not None:
        hidden = kp < 0
    if q_pos is not None:
        hidden = kp > q_pos[:, None, :, None] if hidden is None else hidden | (kp > q_pos[:, None, :, None])
        if window_left is not None:
            hidden = hidden | (q_pos[:, None, :, None] - kp > window_left)
    if hidden is not None:
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


def _replace_prefix_triton(out, lse, q, k_hat, v_hat, k_exact, v_exact, scale, q_pos, k_pos, window_left,
                           logit_softcap) -> torch.Tensor:
    """:func:`replace_prefix` as one launch of its Triton kernel (arguments checked)."""
    from tqkern.ops.exact_prefix.triton import launch_replace_prefix

    if out.stride(-1) != 1 or q.stride(-1) != 1:
        out, q = out.contiguous(), q.contiguous()
    res = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    kv = [x.contiguous() for x in (k_hat, v_hat, k_exact, v_exact)]
    pos = [None if p is None else p.to(torch.int64).contiguous() for p in (q_pos, k_pos)]
    launch_replace_prefix(out, lse.float(), q, *kv, res, scale=scale, q_pos=pos[0], k_pos=pos[1],
                          window_left=window_left, logit_softcap=logit_softcap)
    return res


def _as_stored(k: torch.Tensor, mu: Optional[torch.Tensor]) -> torch.Tensor:
    """Exact keys in the kernels' convention (``k − μ`` with a key offset), float32, contiguous:
    made once per capture, not at every decode step."""
    return (k.float() if mu is None else k.float() - mu).contiguous()


class ExactPrefix:
    """The exact first ``n`` tokens of each row of one :class:`~tqkern_torch.transformers.TQCacheLayer`
    (``TQCache(exact_prefix=n)``): their K/V in 16 bits (the layer's ``store_dtype``: bfloat16 for a
    bfloat16 model, else float16, what a 16-bit cache holds), taken at the layer's first
    attention call (its first chunk; left padding skipped, so they are each row's first real
    tokens), used by the dense path (:meth:`patch`) and after ``paged_decode`` (:meth:`correct`).
    A :class:`~tqkern_torch.static_cache.TQStaticCacheLayer` also calls :meth:`freeze` after its first
    prefill, so that its compiled decode steps read only tensors made before them, at fixed addresses.

    Attributes:
        n: tokens per row.
        k, v: ``[B, Hkv, n, D]`` exact K (original scale) and V, or None before the capture.
        pos: int64 ``[B, n]`` their logical positions.
        k_pos: int64 ``[B, n]`` their paged positions (negative: dropped from the cache), set by
            :meth:`freeze`; None: ``0 .. n − 1`` (the rows re-paged from their first real token).
    """

    def __init__(self, n: int):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"exact_prefix must be an int >= 1, got {n!r}")
        self.n = n
        self.k = self.v = self.pos = self.k_pos = None
        self._hat = None
        self._kept = None  # a frozen prefix's tensors across reset(), refilled in place by freeze()

    def reset(self) -> None:
        """Forget the capture (the next first chunk captures again). A frozen prefix keeps its
        tensors, and the next :meth:`freeze` refills them in place (the addresses stay)."""
        if self.k_pos is not None:
            self._kept = (self.k, self.v, self.pos, self.k_pos, *self._hat)
        self.k = self.v = self.pos = self.k_pos = self._hat = None

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
        self._hat = self.k_pos = None

    def patch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v [B, Hkv, seq_len, D]`` (the layer's dense K/V, logical positions) with the prefix
        positions holding the exact K/V."""
        idx = self.pos[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        return k.scatter(2, idx, self.k.to(k.dtype)), v.scatter(2, idx, self.v.to(v.dtype))

    def freeze(self, layer) -> None:
        """After a static layer's first prefill (its rows re-paged: row ``b``'s logical position
        ``layer.starts[b]`` at paged position 0), in eager code: each prefix token's paged position
        (:attr:`k_pos`; negative where a sliding window dropped the token, which no later query
        attends) and its reconstruction, so that :meth:`correct` in a compiled decode step is
        tensor work on tensors made before it; all of them at fixed addresses, marked static."""
        from tqkern_torch.ops import decompress_sequences

        k_pos = self.pos - layer.starts[:, None]  # < n: starts ≥ each row's left padding
        table = layer.block_table[:, : -(-self.n // layer.layout.block_size)]
        lens = layer.seq_lens.clamp(max=self.n)
        kh, vh = decompress_sequences(layer.pool, table, lens, layer.layout, layer.device_params, rotate_back=True)
        idx = k_pos.clamp(min=0)[:, :, None, None].expand(-1, -1, *kh.shape[2:])
        new = [self.k, self.v, self.pos, k_pos] + [x.gather(1, idx).transpose(1, 2).contiguous() for x in (kh, vh)]
        new.append(_as_stored(self.k, layer.mu))
        kept, self._kept = self._kept, None
        if kept is not None and all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                                    for a, b in zip(kept, new)):
            for a, b in zip(kept, new):
                a.copy_(b)
            new = list(kept)
        elif not torch.compiler.is_compiling():  # fixed addresses: a CUDA graph reads them in place
            for x in new:
                torch._dynamo.mark_static_address(x)
        self.k, self.v, self.pos, self.k_pos = new[:4]
        self._hat = tuple(new[4:])

    def correct(self, layer, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
                q_pos: Optional[torch.Tensor] = None, *, window_left: Optional[int] = None,
                logit_softcap: Optional[float] = None) -> torch.Tensor:
        """A kernel's ``out [B, T, Hq, D]`` (with ``lse [B, T, Hq]``, queries ``q [B, Hq, T, D]`` at
        paged positions ``q_pos [B, T]``, None: after every prefix token; the kernel's
        ``window_left`` and ``logit_softcap``) over ``layer``'s re-paged rows (prefix token j at
        paged position :attr:`k_pos` ``[:, j]``, by default j), with the prefix exact."""
        if self._hat is None:  # the reconstruction the kernel attends (keys as stored: k − μ)
            from tqkern_torch.ops import decompress_sequences

            bs = layer.layout.block_size
            table = layer.block_table[:, : -(-self.n // bs)]
            lens = torch.full_like(layer.seq_lens, self.n)
            kh, vh = decompress_sequences(layer.pool, table, lens, layer.layout, layer.device_params, rotate_back=True)
            hat = tuple(x[:, : self.n].transpose(1, 2).contiguous() for x in (kh, vh))  # [B, Hkv, n, D]
            self._hat = (*hat, _as_stored(self.k, layer.mu))
        k_hat, v_hat, k_exact = self._hat
        return replace_prefix(out, lse, q, k_hat, v_hat, k_exact, self.v, scale=scale, q_pos=q_pos, k_pos=self.k_pos,
                              window_left=window_left, logit_softcap=logit_softcap)
