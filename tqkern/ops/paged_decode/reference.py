"""Decode attention over a compressed paged cache: the NumPy oracle and spec of ``paged_decode``.

``paged_decode(q, cache, block_table, seq_lens, layout, params, *, scale=None, window_left=None,
logit_softcap=None, sinks=None, return_lse=False)``:

    q            [num_seqs, Hq, D]           float (float16/32/64), one new query per sequence
    cache        layout.cache_shape(num_blocks)   uint8
    block_table  [num_seqs, max_blocks]      int32
    seq_lens     [num_seqs]                  int32, 0 ≤ seq_lens[s] ≤ max_blocks · block_size
    out          [num_seqs, Hq, D]           float64

Sequence s holds tokens ``0 .. seq_lens[s] − 1``; token p lives in physical slot
``block_table[s, p // block_size] · block_size + p % block_size``. Only the first
``ceil(seq_lens[s] / block_size)`` entries of a row are read; they must lie in
``[0, num_blocks)``. The other entries are padding, never read and not checked.

Rotated-space attention, as a kernel does it, in float64 (Π = ``params.rotation``, ``y = x @ Π``;
GQA: query head h reads KV head ``h // (Hq // num_kv_heads)``):

    K̂, V̂ = decompress(slots of sequence s, params)   each side in its codec's space: rotated
                                                      for a rotated codec (no rotate-back)
    q_k   = q[s] @ Π   if format.key.rotated   else q[s]
    o     = attention(q_k, K̂, V̂, scale=scale, window_left=.., logit_softcap=.., sinks=..)
                                                      (tqkern.ops.attention.reference)
    out[s] = o @ Πᵀ    if format.value.rotated else o

The options are :func:`~tqkern.ops.attention.reference.attention`'s: the query sits at position
``seq_lens[s] − 1``, so ``window_left = W`` keeps its last W + 1 keys; the soft-cap applies to
``scale·q·k`` (rotation does not change the product); ``return_lse`` also returns
``lse [num_seqs, Hq]`` (natural log; −inf for an empty sequence without sinks).

Because ⟨q, k̂Πᵀ⟩ = ⟨qΠ, k̂⟩, this equals dense attention of q over
``decompress(..., rotate_back=True)`` up to float64 rounding. The key is the reconstruction of
``key − μ`` (``params.key_offset``); μ is never added back, as softmax ignores the per-query
constant ``q·μ``. ``scale`` defaults to ``1/√D``. A sequence with ``seq_lens[s] == 0`` has no
keys: its output is **zeros**. ``num_seqs == 0`` gives an empty ``[0, Hq, D]``.

Non-finite values (``docs/layout.md``): a query row ``q[s, h]`` holding a NaN or ±inf gives a
**NaN** output row ``out[s, h]`` (whatever the sequence length), and touches no other row. A cache
written by ``store`` holds no non-finite key or value (they are stored as zeros).

Bad indices: this oracle rejects them (below). The kernels instead never read outside the cache
and record them in the error flag (:class:`~tqkern.errors.ErrorFlag`): a ``seq_lens`` entry
outside ``[0, max_blocks·block_size]`` is clamped into it (``SEQ_LEN_OUT_OF_RANGE``); a sequence
with a block id in use outside ``[0, num_blocks)`` gets an unspecified output
(``BLOCK_OUT_OF_RANGE``).

Validation (at this boundary only), each error naming the argument, expected and actual:
``TypeError`` for a non-float ``q``, a non-uint8 ``cache``, ``block_table``/``seq_lens`` not
int32, ``layout``/``params`` of the wrong type; ``ValueError`` for shapes (``q.shape[-1] ==
head_dim``, ``Hq % num_kv_heads == 0``, matching ``num_seqs``, the cache shape),
``params.format != layout.format``, ``seq_lens`` out of range and block ids out of range.
"""

from __future__ import annotations

import numpy as np

from tqkern.layouts import PagedLayout
from tqkern.ops.attention.reference import attention, check_options, resolve_scale
from tqkern.ops.decompress.reference import decompress, gather_sequences
from tqkern.params import TQParams

__all__ = ["paged_decode", "merge_partials"]


def _int32(name: str, x, ndim: int) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {a.shape}")
    return a


def _check_paged(q, cache, block_table, seq_lens, layout, params, q_name: str):
    """Shared validation of the paged oracles; returns ``(q, cache, block_table, seq_lens)``
    with q as float64 ``[N, Hq, D]``."""
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a PagedLayout, got {type(layout).__name__}")
    if not isinstance(params, TQParams):
        raise TypeError(f"params must be a TQParams, got {type(params).__name__}")
    if params.format != layout.format:
        raise ValueError(f"params.format must equal layout.format {layout.format}, got {params.format}")
    h, d = layout.num_kv_heads, layout.head_dim
    if params.key_offset is not None and params.key_offset.shape[0] != h:
        raise ValueError(f"params.key_offset must have {h} rows (layout.num_kv_heads), "
                         f"got {params.key_offset.shape[0]}")
    qa = np.asarray(q)
    if not np.issubdtype(qa.dtype, np.floating):
        raise TypeError(f"q must be a float array (float16/float32/float64), got {qa.dtype}")
    if qa.ndim != 3 or qa.shape[-1] != d:
        raise ValueError(f"q must have shape [{q_name}, num_q_heads, head_dim={d}], got {qa.shape}")
    if qa.shape[1] == 0 or qa.shape[1] % h:
        raise ValueError(f"q.shape[1] (num_q_heads) must be a positive multiple of "
                         f"layout.num_kv_heads = {h}, got {qa.shape[1]}")
    ca = np.asarray(cache)
    if ca.dtype != np.uint8:
        raise TypeError(f"cache must be uint8, got {ca.dtype}")
    if ca.ndim == 0 or ca.shape != layout.cache_shape(ca.shape[0]):
        raise ValueError(f"cache must have shape {layout.cache_shape(0)[1:]} after num_blocks "
                         f"(layout.cache_shape(num_blocks)), got {ca.shape}")
    bt = _int32("block_table", block_table, 2)
    sl = _int32("seq_lens", seq_lens, 1)
    n = bt.shape[0]
    if sl.shape != (n,):
        raise ValueError(f"seq_lens must have shape ({n},) (block_table.shape[0]), got {sl.shape}")
    cap = bt.shape[1] * layout.block_size
    if n and (sl.min() < 0 or sl.max() > cap):
        raise ValueError(f"seq_lens must be in [0, {cap}] (max_blocks * block_size), "
                         f"got range [{sl.min()}, {sl.max()}]")
    used = (np.arange(bt.shape[1])[None, :] * layout.block_size) < sl[:, None]
    ids = bt[used]
    if ids.size and (ids.min() < 0 or ids.max() >= ca.shape[0]):
        raise ValueError(f"block_table entries in use must be in [0, {ca.shape[0]}) (num_blocks), "
                         f"got range [{ids.min()}, {ids.max()}]")
    return qa.astype(np.float64), ca, bt, sl


def _sequences_kv(cache, layout: PagedLayout, params: TQParams, block_table, seq_lens) -> list:
    """Per sequence, decompressed ``(K̂, V̂)`` float64 ``[seq_len, H, D]``, each side in its
    codec's own space (no rotate-back)."""
    return [decompress(slots, params) for slots in gather_sequences(cache, layout, block_table, seq_lens)]


def _to_key_space(q: np.ndarray, params: TQParams) -> np.ndarray:
    return q @ params.rotation if params.format.key.rotated else q


def _from_value_space(o: np.ndarray, params: TQParams) -> np.ndarray:
    return o @ params.rotation.T if params.format.value.rotated else o


def paged_decode(q, cache, block_table, seq_lens, layout: PagedLayout, params: TQParams, *,
                 scale=None, window_left=None, logit_softcap=None, sinks=None, return_lse: bool = False):
    """One query per sequence attending to all its cached tokens (module docstring has the spec).

    Args:
        q: float ``[num_seqs, num_q_heads, head_dim]``.
        cache: uint8 ``layout.cache_shape(num_blocks)``.
        block_table: int32 ``[num_seqs, max_blocks]``.
        seq_lens: int32 ``[num_seqs]``.
        layout: the cache's :class:`~tqkern.layouts.PagedLayout`.
        params: the format's :class:`~tqkern.params.TQParams`.
        scale: score multiplier, default ``1/√head_dim``.
        window_left, logit_softcap, sinks: as in :func:`~tqkern.ops.attention.reference.attention`.
        return_lse: also return ``lse`` float64 ``[num_seqs, num_q_heads]``.

    Returns:
        float64 ``[num_seqs, num_q_heads, head_dim]``, or ``(out, lse)`` with ``return_lse``.
    """
    q, cache, bt, sl = _check_paged(q, cache, block_table, seq_lens, layout, params, "num_seqs")
    if q.shape[0] != bt.shape[0]:
        raise ValueError(f"q.shape[0] must be num_seqs = {bt.shape[0]} (block_table.shape[0]), "
                         f"got {q.shape[0]}")
    sc = resolve_scale(scale, layout.head_dim)
    opts = check_options(window_left, logit_softcap, sinks, q.shape[1])
    out = np.zeros(q.shape, np.float64)
    lse = np.zeros(q.shape[:2], np.float64)
    for s, (k, v) in enumerate(_sequences_kv(cache, layout, params, bt, sl)):
        o, lse[s] = attention(_to_key_space(q[s: s + 1], params), k, v, scale=sc, window_left=opts.window_left,
                              logit_softcap=opts.logit_softcap, sinks=opts.sinks, return_lse=True)
        out[s] = _from_value_space(o, params)[0]
    out = poison_nonfinite_rows(out, q)
    if return_lse:
        return out, poison_nonfinite_rows(lse[..., None], q)[..., 0]
    return out


def poison_nonfinite_rows(out: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``out`` with NaN in every row ``[..., h, :]`` whose query row holds a NaN or ±inf."""
    bad = ~np.all(np.isfinite(q), axis=-1)
    out[bad] = np.nan
    return out


def merge_partials(acc, m, l, *, rotation=None, sinks=None):
    """The split-KV merge the kernels run after the decode (spec of :mod:`.merge`), in float64.

    Each of ``R`` query rows was attended in ``NS`` splits; split ``j`` of row ``r`` left an
    unnormalised partial ``acc[r, j] = Σ_t 2^(x_t − m[r, j])·v_t`` over its keys (``x`` the
    base-2 logits), its base-2 maximum ``m[r, j]`` (−inf for a split without keys) and its sum
    ``l[r, j] = Σ_t 2^(x_t − m[r, j])``. With ``M = max(max_j m[r, j], σ_r·log2 e)`` (σ: the row's
    sink logit, natural log, only with ``sinks``), ``w_j = 2^(m[r, j] − M)`` (0 for an empty split),
    ``L = Σ_j w_j·l[r, j] + 2^(σ_r·log2 e − M)``:

        o[r]   = Σ_j w_j·acc[r, j] / L            (0 where L = 0: no keys, no sink)
        out[r] = o[r] @ Πᵀ  with ``rotation`` Π ``[D, D]`` (the value codec rotated), else o[r]
        lse[r] = (M + log2 L)·ln 2                (natural log; −inf where L = 0)

    Args:
        acc: float ``[R, NS, D]``; m, l: float ``[R, NS]``; sinks: float ``[R]`` or ``None``.

    Returns:
        ``(out, lse)``: float64 ``[R, D]`` and ``[R]``. What an empty split's ``acc`` holds is never
        read (its weight is 0, not 0·acc: NaN there stays out)."""
    acc, m, l = (np.asarray(x, np.float64) for x in (acc, m, l))
    if acc.ndim != 3 or m.shape != acc.shape[:2] or l.shape != m.shape:
        raise ValueError(f"acc must be [R, NS, D] and m, l [R, NS], got {acc.shape}, {m.shape}, {l.shape}")
    sig = None if sinks is None else np.asarray(sinks, np.float64) * np.log2(np.e)
    if sig is not None and sig.shape != m.shape[:1]:
        raise ValueError(f"sinks must be [R] = [{m.shape[0]}], got {sig.shape}")
    top = m.max(axis=1) if m.shape[1] else np.full(m.shape[0], -np.inf)
    big = top if sig is None else np.maximum(top, sig)
    safe = np.where(np.isfinite(big), big, 0.0)
    keyed = np.isfinite(m)
    w = np.where(keyed, np.exp2(np.where(keyed, m, 0.0) - safe[:, None]), 0.0)
    den = (w * l).sum(axis=1) + (0.0 if sig is None else np.exp2(sig - safe))
    o = np.einsum("rj,rjd->rd", w, np.where(keyed[..., None], acc, 0.0))
    o = np.where(den[:, None] > 0, o / np.where(den > 0, den, 1.0)[:, None], 0.0)
    if rotation is not None:
        o = o @ np.asarray(rotation, np.float64).T
    lse = np.where(den > 0, (safe + np.log2(np.where(den > 0, den, 1.0))) * np.log(2.0), -np.inf)
    return o, lse
