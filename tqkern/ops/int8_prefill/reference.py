"""Prefill with int8 Q·Kᵀ: the NumPy oracle and spec of ``int8_prefill``.

``int8_prefill(q, cache, block_table, seq_lens, query_start_loc, layout, params, *, scale=None)``
takes the arguments of :func:`tqkern.ops.prefill.reference.prefill` and returns float64
``[num_tokens, Hq, D]``; positions, paging, causal masking (bottom-right aligned), the rotated
space and validation are exactly those of ``prefill``. Only the scores differ: Q and K enter
them through symmetric int8 quantization.

int8 quantization of one vector x ``[D]`` (:func:`quantize_int8`), in float64:

    s     = max_d |x_d| / 127                       (symmetric; one scale per vector)
    c_d   = clamp(round_half_even(x_d / s), −127, 127)     (``numpy.rint``; −128 never occurs)
    x = 0 (every entry zero): s = 0 and c = 0.

Granularity: one scale per (query token, query head) for Q and per (key token, KV head) for K.
The vectors quantized are those the kernel multiplies: the query in the key codec's space
(``q_k = q @ Π`` if ``format.key.rotated``, else ``q``) and each decompressed key ``K̂`` in its
codec's space (rotated for a rotated key codec, original coordinates otherwise; always the
reconstruction of ``key − μ``).

Lloyd-Max keys take their codes from the codebook's **int8 image** instead (:func:`int8_image`),
so that a key's int8 codes are a table lookup of its stored codes, as its fp16 values are:
``K̂_d = α·c[code_d]`` with the per-token factor ``α`` (the stored norm; divided by ``‖c[codes]‖``
with ``norm_correction="decode"``, 0 where that is 0), and

    s_0   = max_j |c_j| / 127
    s_cb  = argmin over s ∈ {s_0·(1 + k/1024) : k = 0 .. 512} of Σ_j (c_j − s·rint(c_j / s))²
            (the first minimum: the smallest k)
    c8_j  = rint(c_j / s_cb)                  (ties to even; |c8_j| ≤ 127 since s_cb ≥ s_0)
    codes c_k[d] = c8[code_d],  scale s_k = α · s_cb

The scale is chosen over the centroids only (no distribution: caller-supplied codebooks get one
too). Over random keys through every Lloyd-Max preset at head_dim 64–256 this image's score error
was at most that of the per-token maximum (within 1%) and up to 6x smaller (3-bit codes); both are
under 1% of the score spread, against 5–18% from the codec itself (session 32, a NumPy study).
Uniform, FP8 and raw keys keep the per-token maximum above. With ``g(h) = h // (Hq // num_kv_heads)``:

    dot_ij   = Σ_d c_q[i, h, d] · c_k[j, g(h), d]    (integer, exact: |dot| ≤ 127² · D)
    s_ij     = ((scale · s_q[i, h]) · s_k[j, g(h)]) · dot_ij     (float64, left to right)
    s_ij     = −inf where j > seq_len − q_len + i    (causal)
    out      = softmax_attend(s, V̂)                  (P·V in float64 with the decompressed V̂)
    out      = out @ Πᵀ if format.value.rotated

**Short rows take exact scores.** A sequence with ``1 ≤ q_len ≤ EXACT_QUERY_MAX`` (8: decode and
speculative rows) is scored as ``prefill`` scores it, ``s_ij = scale · (q_k[i] · K̂_j)`` in
float64, with no int8 quantization of its queries or keys (session 36). Such rows are bound by
reading the cache, where int8 products save nothing, and ``prefill``'s decode-kernel path serves
them with one pass over the cache per KV head; the rule is per sequence, so a sequence's rows do
not depend on which other sequences share the call, and the error bound below applies to the
longer sequences only (the short ones equal ``prefill``).

Rows follow ``attention``'s conventions (stable softmax; a row with no visible key is zeros).
A kernel computing s and x/s in float32 may pick the neighbouring code where x_d / s lies within
float32 rounding (~1e-7 relative) of a half-integer; compare kernels on outputs with a tolerance,
and on codes only away from such ties. The int8 image's codes are exact in a kernel (a table made on
the host by :func:`int8_image`); its ``s_k`` may be rounded to float32.

Error versus ``prefill``: x = s·(c + e) with |e_d| ≤ 1/2 (for the int8 image, ``α·c_j =
s_k·(c8_j + e)`` with ``|e| = |c_j/s_cb − c8_j| ≤ 1/2``: the same form), so per score
|q_k·k̂ − s_q·s_k·dot| ≤ s_q·s_k·(‖c_q‖₁ + ‖c_k‖₁ + D/2)/2, times ``scale``. If every visible
score of a row moves by at most Δ, every softmax weight changes by a factor within e^{±2Δ}, so
Σ_j |p'_j − p_j| ≤ e^{2Δ} − 1 and the output row (per token and head) moves by at most
(e^{2Δ} − 1)·max_j ‖V̂_j‖₂ in the 2-norm, which Πᵀ preserves. That bound is rigorous and loose;
for Gaussian-like vectors (no outlier channel dominating the max) the rounding errors are
independent and the typical score error is ~0.01× the score's spread.

Non-finite values, as in ``paged_decode``: a query row holding a NaN or ±inf gives a **NaN**
output row and touches no other row; a cache written by ``store`` holds no non-finite key or
value. Bad indices: as in ``paged_decode`` (this oracle rejects them; kernels clamp and flag).
"""

from __future__ import annotations

import numpy as np
from einops import repeat

from tqkern.layouts import LloydMax, PagedLayout
from tqkern.ops.attention.reference import (attention, causal_visible, check_options, resolve_scale, softcap,
                                           softmax_attend, window_visible)
from tqkern.ops.decompress.reference import _parse_side, decompress, gather_sequences
from tqkern.ops.paged_decode.reference import _from_value_space, _to_key_space, poison_nonfinite_rows
from tqkern.ops.quantize.reference import _codebook_for
from tqkern.ops.prefill.reference import _check_varlen
from tqkern.params import TQParams

__all__ = ["int8_prefill", "int8_image", "quantize_int8", "INT8_MAX", "IMAGE_STEPS", "EXACT_QUERY_MAX"]

INT8_MAX = 127
EXACT_QUERY_MAX = 8  # sequences of 1 .. 8 new tokens take prefill's exact scores
IMAGE_STEPS = (512, 1024)  # int8_image's candidate scales: s_0·(1 + k/1024), k = 0 .. 512


def quantize_int8(x) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-vector int8 quantization over the last axis (module docstring has the maths).

    Args:
        x: float ``[..., D]``.

    Returns:
        ``(codes, scales)``: int8 ``[..., D]`` in [−127, 127] and float64 ``[...]`` with
        ``x ≈ codes · scales[..., None]``.
    """
    x = np.asarray(x, dtype=np.float64)
    s = np.max(np.abs(x), axis=-1) / INT8_MAX if x.shape[-1] else np.zeros(x.shape[:-1])
    t = np.divide(x, s[..., None], out=np.zeros_like(x), where=s[..., None] > 0)
    return np.clip(np.rint(t), -INT8_MAX, INT8_MAX).astype(np.int8), s


def int8_image(centroids) -> tuple[np.ndarray, float]:
    """The int8 image of a Lloyd-Max codebook (module docstring has the maths).

    Args:
        centroids: float ``[n]`` (read in float64), finite, not all zero.

    Returns:
        ``(c8, s_cb)``: int8 ``[n]`` in [−127, 127] and the float64 scale with
        ``centroids ≈ s_cb · c8`` (``|centroids − s_cb·c8| ≤ s_cb/2``).
    """
    c = np.asarray(centroids, dtype=np.float64)
    if c.ndim != 1 or not c.size or not np.all(np.isfinite(c)) or not np.any(c):
        raise ValueError(f"centroids must be a finite 1-D array, not all zero, got {c!r}")
    k, n = IMAGE_STEPS
    s = np.max(np.abs(c)) / INT8_MAX * (1.0 + np.arange(k + 1) / n)  # [k + 1]
    err = np.sum((c[None, :] - s[:, None] * np.rint(c[None, :] / s[:, None])) ** 2, axis=1)
    s_cb = float(s[int(np.argmin(err))])  # argmin: the first minimum
    return np.clip(np.rint(c / s_cb), -INT8_MAX, INT8_MAX).astype(np.int8), s_cb


def _key_int8(slots: np.ndarray, k: np.ndarray, params: TQParams) -> tuple[np.ndarray, np.ndarray]:
    """Int8 codes ``[Tk, Hkv, D]`` and scales ``[Tk, Hkv]`` of one sequence's keys: the codebook's
    int8 image for Lloyd-Max keys (read from the slots ``[Tk, Hkv, slot_bytes]``), else the
    per-token maximum of ``k`` (the decompressed keys)."""
    codec = params.format.key
    if not isinstance(codec, LloydMax):
        return quantize_int8(k)
    side = _parse_side(slots, params.format, "key")
    cb = _codebook_for(codec, params.key_codebook)
    c8, s_cb = int8_image(cb.centroids)
    alpha = side.params["norm"]
    if codec.norm_correction == "decode":
        c = cb.centroids[side.codes]
        cn = np.sqrt(np.sum(c * c, axis=-1))
        alpha = np.divide(alpha, cn, out=np.zeros_like(alpha), where=cn > 0)
    return c8[side.codes], alpha * s_cb


def _int8_scores(q_k: np.ndarray, ck: np.ndarray, sk: np.ndarray, scale: float) -> np.ndarray:
    """float64 scores ``[Hq, Tq, Tk]`` of ``q_k [Tq, Hq, D]`` against keys of int8 codes
    ``ck [Tk, Hkv, D]`` and scales ``sk [Tk, Hkv]``."""
    cq, sq = quantize_int8(q_k)
    group = q_k.shape[1] // ck.shape[1]  # query head h = kv·group + g reads KV head kv
    ckg = repeat(ck.astype(np.int64), "tk hkv d -> (hkv g) d tk", g=group)  # [Hq, D, Tk]
    dot = cq.astype(np.int64).transpose(1, 0, 2) @ ckg  # [Hq, Tq, Tk], exact
    skg = repeat(sk, "tk hkv -> (hkv g) tk", g=group)  # [Hq, Tk]
    return (scale * sq.T[:, :, None]) * skg[:, None, :] * dot.astype(np.float64)


def int8_prefill(q, cache, block_table, seq_lens, query_start_loc, layout: PagedLayout,
                 params: TQParams, *, scale=None, window_left=None, logit_softcap=None, sinks=None,
                 return_lse: bool = False):
    """``prefill`` with int8 Q·Kᵀ (see module docstring).

    Args:
        q: float ``[num_tokens, num_q_heads, head_dim]``.
        cache: uint8 ``layout.cache_shape(num_blocks)``, already holding the new tokens.
        block_table: int32 ``[num_seqs, max_blocks]``.
        seq_lens: int32 ``[num_seqs]``, lengths including the new tokens.
        query_start_loc: int32 ``[num_seqs + 1]``.
        layout: the cache's :class:`~tqkern.layouts.PagedLayout`.
        params: the format's :class:`~tqkern.params.TQParams`.
        scale: score multiplier, default ``1/√head_dim``.
        window_left, logit_softcap, sinks, return_lse: as in ``prefill`` (the soft-cap applies to
            the int8 scores ``s_ij``).

    Returns:
        float64 ``[num_tokens, num_q_heads, head_dim]``, or ``(out, lse)`` with ``return_lse``.
    """
    q, cache, bt, sl, qsl = _check_varlen(q, cache, block_table, seq_lens, query_start_loc, layout, params)
    sc = resolve_scale(scale, layout.head_dim)
    opts = check_options(window_left, logit_softcap, sinks, q.shape[1])
    out = np.zeros(q.shape, np.float64)
    lse = np.zeros(q.shape[:2], np.float64)
    for s, slots in enumerate(gather_sequences(cache, layout, bt, sl)):
        k, v = decompress(slots, params)
        a, b = int(qsl[s]), int(qsl[s + 1])
        q_k = _to_key_space(q[a:b], params)
        if b - a <= EXACT_QUERY_MAX:  # prefill's scores and rows (module docstring)
            o, lse[a:b] = attention(q_k, k, v, scale=sc, causal=True, window_left=opts.window_left,
                                    logit_softcap=opts.logit_softcap, sinks=opts.sinks, return_lse=True)
        else:
            ck, sk = _key_int8(slots, k, params)
            scores = softcap(_int8_scores(q_k, ck, sk, sc), opts.logit_softcap)
            visible = causal_visible(b - a, k.shape[0])
            if opts.window_left is not None:
                visible &= window_visible(b - a, k.shape[0], opts.window_left)
            o, lse[a:b] = softmax_attend(np.where(visible[None], scores, -np.inf), v, sinks=opts.sinks,
                                         return_lse=True)
        out[a:b] = _from_value_space(o, params)
    out = poison_nonfinite_rows(out, q)
    if return_lse:
        return out, poison_nonfinite_rows(lse[..., None], q)[..., 0]
    return out
