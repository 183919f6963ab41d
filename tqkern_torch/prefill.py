"""Varlen causal prefill over a compressed paged cache: ``prefill`` (registers ``tqkern::prefill``)."""

from __future__ import annotations

from typing import Optional

import torch

from tqkern.ops.attention.reference import check_options, resolve_scale
from tqkern.ops.int8_prefill import reference as int8_prefill_ref
from tqkern.ops.int8_prefill.reference import EXACT_QUERY_MAX
from tqkern.ops.prefill import reference as prefill_ref
from tqkern_torch._validate import check_flag, check_tensor, use_triton
from tqkern_torch.attention import _cache_or_stand_in, _check_query, _kernel_indices, _tracing_or_capturing
from tqkern_torch.errors import check_errors, error_word
from tqkern_torch.library import _host_params, layout_key, layout_of
from tqkern_torch.ops import _check_cache, _check_layout, _device_params
from tqkern_torch.prefill_tiles import _key_table, tile_prefill, tiles_supported
from tqkern_torch.short_rows import SHORT_QUERY_MAX, short_rows

__all__ = ["int8_prefill", "prefill"]


def _check_lengths(qsl: torch.Tensor, sl: torch.Tensor, t: int, cap: int, qname: str, sname: str) -> None:
    """Host int64 copies of a varlen batch's ``query_start_loc`` and ``seq_lens`` (named
    ``qname``, ``sname`` in the messages) for ``t`` tokens and ``cap`` positions per sequence:
    ``qsl[0] == 0``, non-decreasing, ``qsl[-1] == t``, ``0 ≤ seq_lens ≤ cap`` and ``q_len ≤
    seq_len``; ``ValueError`` naming the first entry that breaks a rule."""
    # (Python ints: ~3 µs for a few sequences, where torch's small-tensor ops took ~28 µs a call;
    # ~49 µs at 256 sequences, where the call's device time dwarfs it)
    qs, ls = qsl.tolist(), sl.tolist()
    if qs[0] != 0:
        raise ValueError(f"{qname}[0] must be 0, got {qs[0]}")
    q_lens = [b - a for a, b in zip(qs, qs[1:])]
    for s, n in enumerate(q_lens):
        if n < 0:
            raise ValueError(f"{qname} must be non-decreasing, got {qname}[{s + 1}] = {qs[s + 1]} "
                             f"< {qname}[{s}] = {qs[s]}")
    if qs[-1] != t:
        raise ValueError(f"{qname}[-1] must be num_tokens = {t} (q.shape[0]), got {qs[-1]}")
    if ls and (min(ls) < 0 or max(ls) > cap):
        raise ValueError(f"{sname} must be in [0, max_blocks * block_size = {cap}], "
                         f"got range [{min(ls)}, {max(ls)}]")
    for s, (n, length) in enumerate(zip(q_lens, ls)):
        if n > length:
            raise ValueError(f"{qname}[{s + 1}] - {qname}[{s}] (q_len) must be <= {sname}[{s}] = "
                             f"{length}, got {n}")


def _inputs_checked_on_host(q, block_table, seq_lens, query_start_loc, sinks, num_blocks: int,
                            block_size: int, max_query_len: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The value checks (a device sync): ``query_start_loc`` against ``num_tokens`` and the
    lengths (:func:`_check_lengths`, and ``max_query_len``), the used ``block_table`` entries
    against the cache, finite sinks. Returns the host ``query_start_loc`` and ``seq_lens`` (int64)."""
    qsl = query_start_loc.cpu().to(torch.int64)
    sl = seq_lens.cpu().to(torch.int64)
    _check_lengths(qsl, sl, q.shape[0], block_table.shape[1] * block_size, "query_start_loc", "seq_lens")
    q_lens = qsl[1:] - qsl[:-1]
    bt = block_table.cpu()
    used = torch.arange(bt.shape[1])[None, :] * block_size < sl[:, None]
    ids = bt[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_table entries in use must be in [0, num_blocks = {num_blocks}), "
                         f"got range [{int(ids.min())}, {int(ids.max())}]")
    if sinks is not None and not bool(torch.isfinite(sinks).all()):
        raise ValueError("sinks must be finite, got a NaN or inf")
    longest = int(q_lens.max()) if q_lens.numel() else 0
    if max_query_len is not None and longest > max_query_len:
        s = int(torch.argmax(q_lens))
        raise ValueError(f"max_query_len must be >= every q_len, got {max_query_len} < q_len {longest} of sequence {s}")
    return qsl, sl


def prefill(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
            query_start_loc: torch.Tensor, layout, params, *, scale: Optional[float] = None,
            out: Optional[torch.Tensor] = None, window_left: Optional[int] = None,
            logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None, return_lse: bool = False,
            max_query_len: Optional[int] = None, query_start_loc_cpu: Optional[torch.Tensor] = None,
            seq_lens_cpu: Optional[torch.Tensor] = None, check_inputs: bool = True, debug: bool = False):
    """New tokens of several sequences attending causally to their compressed paged cache.

    The spec is the oracle's (:func:`tqkern.ops.prefill.reference.prefill`): sequence s owns the
    queries ``q[query_start_loc[s]:query_start_loc[s+1]]``, the last ``q_len`` tokens of its
    ``seq_lens[s]``, whose keys and values (the new ones included) are already in the cache
    (written by :func:`tqkern_torch.store`); query i sits at position ``seq_lens[s] − q_len + i``
    and sees keys ``0 ..`` that position (bottom-right causal). Decode rows (``q_len = 1``),
    speculative rows and prefill chunks mix freely in one call.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]`` float16 or bfloat16 (original coordinates).
        cache: uint8 ``layout.cache_shape(num_blocks)``.
        block_table: ``[num_seqs, max_blocks]`` int32. seq_lens: ``[num_seqs]`` int32, lengths
            including the new tokens.
        query_start_loc: ``[num_seqs + 1]`` int32: ``0 = qsl[0] ≤ … ≤ qsl[-1] = num_tokens``.
        layout, params: the cache's layout and its parameters: DeviceParams (``to_device``, once)
            or TQParams (copied to the device at every call, each copy a stream synchronisation).
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        out: optional output of q's shape and dtype (written, and returned).
        window_left: keys more than this many positions left of a query are masked (int ≥ 0).
        logit_softcap: ``c > 0`` caps the scaled logits as ``c·tanh(a/c)``.
        sinks: float32 ``[num_q_heads]`` per-head sink logits.
        return_lse: also return the natural-log normaliser, float32 ``[num_tokens, num_q_heads]``.
        max_query_len: an upper bound on every sequence's ``q_len`` (a host int, as serving
            stacks keep one). When the longest ``q_len`` is at most
            :data:`~tqkern_torch.short_rows.SHORT_QUERY_MAX` (8: decode and speculative rows)
            and there is no ``window_left``, the call runs the decode kernel over the cached
            prefix with the tokens as extra query heads, plus the ≤ 7 newest keys in float32
            (:mod:`tqkern_torch.short_rows`): the cache is read once per KV head instead of by
            a mostly empty query tile. The path follows the bound given (a larger one selects
            the prefill kernel) or, with none, the ``q_len`` values found by ``check_inputs``:
            a batch mixing short and longer rows then runs each kind on its path (their rows
            gathered, the results scattered back); with neither (or while tracing or capturing,
            with none given) the call takes the prefill kernel. With ``check_inputs`` a given
            bound is checked; a sequence whose ``q_len`` exceeds a bound passed unchecked gets
            zero rows before its last ``max_query_len`` ones.
        query_start_loc_cpu, seq_lens_cpu: host copies of ``query_start_loc`` and ``seq_lens``
            (both or neither; a serving stack keeps them). Rows longer than 8 tokens run the
            tiled path on CUDA (:mod:`tqkern_torch.prefill_tiles`: each key decoded once into a
            bounded fp16/bf16 workspace, cuDNN or FlashAttention over it, log-sum-exp merges;
            not with ``logit_softcap``), which plans from the host lengths: these, or the ones
            ``check_inputs`` reads. With them the call needs no sync and can be captured in a CUDA
            graph (for those lengths; a batch mixing short and long rows then runs whole on the
            tiled path); without either, and while ``torch.compile`` traces, the fused prefill
            kernel runs.
        check_inputs: check the values of ``query_start_loc`` (``qsl[0] == 0``, non-decreasing,
            ``qsl[-1] == num_tokens``, ``q_len ≤ seq_lens[s]``, ``q_len ≤ max_query_len``),
            ``seq_lens``, the used ``block_table`` entries and ``sinks`` on the host and raise
            ``ValueError`` naming them: a device sync, skipped while ``torch.compile`` traces or a
            CUDA graph is captured. Without it the kernels still never read or write outside their tensors
            (indices clamped; bad block ids and lengths flagged in the error word).
        debug: check the error word right after the call (a device sync).

    Non-finite values: a query row holding a NaN or inf gives a NaN output row (and lse).

    Returns:
        ``[num_tokens, num_q_heads, head_dim]`` in q's dtype, or ``(out, lse)`` with ``return_lse``.
    """
    return _run(q, cache, block_table, seq_lens, query_start_loc, layout, params, scale, out, window_left,
                logit_softcap, sinks, return_lse, check_inputs, debug, False, max_query_len,
                (query_start_loc_cpu, seq_lens_cpu))


def _host_lengths(pair, n: int):
    """``(query_start_loc_cpu, seq_lens_cpu)`` checked for shape and device, as int64, or None."""
    qc, sc = pair
    if qc is None and sc is None:
        return None
    if qc is None or sc is None:
        raise ValueError("query_start_loc_cpu and seq_lens_cpu must be given together, got only "
                         f"{'seq_lens_cpu' if qc is None else 'query_start_loc_cpu'}")
    cpu = torch.device("cpu")
    check_tensor(qc, "query_start_loc_cpu", shape=(n + 1,), dtypes=(torch.int32, torch.int64), device=cpu)
    check_tensor(sc, "seq_lens_cpu", shape=(n,), dtypes=(torch.int32, torch.int64), device=cpu)
    return qc.to(torch.int64), sc.to(torch.int64)


def _run(q, cache, block_table, seq_lens, query_start_loc, layout, params, scale, out, window_left, logit_softcap,
         sinks, return_lse, check_inputs, debug, int8: bool, max_query_len: Optional[int] = None,
         cpu_pair=(None, None)):
    """:func:`prefill` and :func:`int8_prefill` after their signatures: checks, allocation, the op."""
    layout = _check_layout(layout)
    _check_query(q, layout, "num_tokens")
    d = layout.head_dim
    dev = q.device
    _check_cache(cache, layout, dev)
    check_tensor(block_table, "block_table", shape=(None, None), dtypes=(torch.int32,), device=dev, contiguous=True)
    n = block_table.shape[0]
    check_tensor(seq_lens, "seq_lens", shape=(n,), dtypes=(torch.int32,), device=dev, contiguous=True)
    check_tensor(query_start_loc, "query_start_loc", shape=(n + 1,), dtypes=(torch.int32,), device=dev,
                 contiguous=True)
    if out is not None:
        check_tensor(out, "out", shape=tuple(q.shape), dtypes=(q.dtype,), device=dev, last_contiguous=True)
    if sinks is not None:
        check_tensor(sinks, "sinks", shape=(q.shape[1],), dtypes=(torch.float32,), device=dev, contiguous=True)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    check_inputs, debug = check_flag(check_inputs, "check_inputs"), check_flag(debug, "debug")
    scale = resolve_scale(scale, d)
    opts = check_options(window_left, logit_softcap, None, q.shape[1])
    if max_query_len is not None and (isinstance(max_query_len, bool) or not isinstance(max_query_len, int)
                                      or max_query_len < 0):
        raise ValueError(f"max_query_len must be None or an int >= 0, got {max_query_len!r}")
    longest = max_query_len
    capturing = _tracing_or_capturing(dev)
    checked = check_inputs and not capturing
    # while torch.compile traces, the fused kernel's op (host lengths would break the graph)
    given = None if torch.compiler.is_compiling() else _host_lengths(cpu_pair, n)
    qsl_host, sl_host = given if given is not None else (None, None)
    if checked:
        qsl_host, sl_host = _inputs_checked_on_host(q, block_table, seq_lens, query_start_loc, sinks, cache.shape[0],
                                                    layout.block_size, max_query_len)
    elif given is not None:  # the tiled path indexes the block table by them: checked on the host
        _check_lengths(qsl_host, sl_host, q.shape[0], block_table.shape[1] * layout.block_size,
                       "query_start_loc_cpu", "seq_lens_cpu")
    q_lens = None if qsl_host is None else qsl_host[1:] - qsl_host[:-1]
    if q_lens is not None and max_query_len is None:
        longest = int(q_lens.max()) if q_lens.numel() else 0
    p = _device_params(params, layout, dev)
    if int8:
        _key_table(p, int8)  # refused whichever path the rows take
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev) if return_lse else None
    run = dict(cache=cache, layout=layout, p=p, scale=float(scale), opts=opts, sinks=sinks, int8=int8)
    short_ok = bool(q.shape[0]) and opts.window_left is None and use_triton(dev)
    short = short_ok and longest is not None and 1 <= longest <= SHORT_QUERY_MAX
    # int8: a sequence of <= EXACT_QUERY_MAX tokens takes prefill's scores wherever it runs, so
    # known lengths split where the batch holds one (with a window, such rows take prefill's long-row
    # path); a batch without short rows runs whole (a tiled call of one dense call then returns the
    # dense kernel's output, not a copy of it)
    split = (not short and q_lens is not None and bool(q.shape[0]) and use_triton(dev) and not capturing
             and ((short_ok and max_query_len is None) or int8)
             and bool(((q_lens >= 1) & (q_lens <= SHORT_QUERY_MAX)).any()))
    if out is None and (short or split or not q.shape[0]):  # (the long rows allocate their own)
        out = torch.empty_like(q)
    if short:
        short_rows(q, cache, block_table, seq_lens, query_start_loc, layout, p, t=longest, scale=float(scale), out=out,
                   lse=lse, logit_softcap=opts.logit_softcap, sinks=sinks, zero_rows=not checked)
    elif split:  # mixed: each part its path
        _split_by_length(q, block_table, seq_lens, query_start_loc, qsl_host, sl_host, out, lse, run)
    elif q.shape[0]:
        host = None if qsl_host is None else (qsl_host[1:] - qsl_host[:-1], sl_host)
        out = _long_rows(q, block_table, seq_lens, query_start_loc, out, lse, host, **run)
    if debug and q.shape[0]:
        check_errors(dev)
    return (out, lse) if return_lse else out


def _long_rows(q, block_table, seq_lens, query_start_loc, out, lse, host, *, cache, layout, p, scale, opts, sinks,
               int8) -> torch.Tensor:
    """Rows through the tiled path (:mod:`tqkern_torch.prefill_tiles`) where it serves them and the
    host lengths ``host = (q_lens, seq_lens)`` are known (checked), else the fused kernel's op.
    Returns the output: ``out`` when given; with ``out`` None, a new tensor or, for a tiled call of
    one dense call, the dense kernel's own output (no copy)."""
    if int8 and host is not None and bool(((host[0] >= 1) & (host[0] <= EXACT_QUERY_MAX)).any()):
        host = None  # (captured with host lengths: the tiled path's int8 pieces would score short rows in int8)
    if host is not None and tiles_supported(q, layout, logit_softcap=opts.logit_softcap, int8=int8):
        cache_, num_blocks = _cache_or_stand_in(cache)
        return tile_prefill(q, cache_, block_table, seq_lens, query_start_loc, layout, p, q_lens=host[0].tolist(),
                            seq_lens=host[1].tolist(), num_blocks=num_blocks, errors=error_word(q.device),
                            scale=scale, out=out, lse=lse, window_left=opts.window_left, sinks=sinks, int8=int8,
                            logit_softcap=opts.logit_softcap)
    out = torch.empty_like(q) if out is None else out
    _kernel(q, block_table, seq_lens, query_start_loc, out, lse, int8, cache=cache, layout=layout, p=p, scale=scale,
            opts=opts, sinks=sinks)
    return out


def _kernel(q, block_table, seq_lens, query_start_loc, out, lse, int8, *, cache, layout, p, scale, opts, sinks):
    """The prefill (or int8) kernel's op over these rows."""
    args = (q, cache, block_table, seq_lens, query_start_loc, p.rotation, p.key_centroids, p.value_centroids,
            _key_table(p, int8), p.value_centroids_f32, sinks, out, lse, layout_key(layout), scale,
            -1 if opts.window_left is None else opts.window_left,
            0.0 if opts.logit_softcap is None else opts.logit_softcap)
    if type(q) is torch.Tensor and not torch.compiler.is_compiling():
        (_int8_prefill_impl if int8 else _prefill_impl)(*args)  # eager: the op's body, no dispatcher
    else:
        (torch.ops.tqkern.int8_prefill if int8 else torch.ops.tqkern.prefill)(*args)


def _split_by_length(q, block_table, seq_lens, query_start_loc, qsl_host, sl_host, out, lse, run) -> None:
    """A checked batch mixing short rows (``q_len ≤ SHORT_QUERY_MAX``) with longer ones: the short
    sequences through :func:`~tqkern_torch.short_rows.short_rows` (with a window, which it lacks,
    through ``prefill``'s long-row path: ``int8_prefill``'s short rows), the others through the
    prefill (or int8) path, each on its gathered rows (host-built indices: the caller has
    synchronised already), written back into ``out``/``lse``. A batch of one kind runs whole on its
    path."""
    q_lens = qsl_host[1:] - qsl_host[:-1]
    short = (q_lens > 0) & (q_lens <= SHORT_QUERY_MAX)
    long_ = q_lens > SHORT_QUERY_MAX
    dev = q.device
    for part, is_short in ((short, True), (long_, False)):
        seqs = torch.nonzero(part).flatten()
        if not seqs.numel():
            continue
        if bool(part.all()) or not bool((short | long_)[~part].any()):  # every row is this kind
            rows, sub = None, (q, block_table, seq_lens, query_start_loc)
            seqs = torch.arange(q_lens.numel())
        else:
            lens = q_lens[seqs]
            sub_qsl = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])
            # row j of the part: token qsl[s] + (j − sub_qsl[i]) of its i-th sequence s
            rows = (torch.arange(int(sub_qsl[-1])) + torch.repeat_interleave(qsl_host[:-1][seqs] - sub_qsl[:-1], lens)
                    ).to(dev)
            sub = (q.index_select(0, rows), block_table.index_select(0, seqs.to(dev)),
                   seq_lens.index_select(0, seqs.to(dev)), sub_qsl.to(dev, torch.int32))
        o = out if rows is None else torch.empty_like(sub[0])
        lp = lse if rows is None or lse is None else torch.empty(sub[0].shape[:2], dtype=torch.float32, device=dev)
        if is_short and run["opts"].window_left is None:
            short_rows(sub[0], run["cache"], *sub[1:], run["layout"], run["p"], t=int(q_lens[seqs].max()),
                       scale=run["scale"], out=o, lse=lp, logit_softcap=run["opts"].logit_softcap, sinks=run["sinks"],
                       zero_rows=False)
        else:  # (short rows with a window: int8_prefill's, on prefill's long-row path)
            _long_rows(*sub, o, lp, (q_lens[seqs], sl_host[seqs]), **dict(run, int8=run["int8"] and not is_short))
        if rows is not None:
            out.index_copy_(0, rows, o)
            if lse is not None:
                lse.index_copy_(0, rows, lp)


def _prefill_impl(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, rotation: torch.Tensor, key_centroids: torch.Tensor,
                  value_centroids: torch.Tensor, key_centroids_f32: torch.Tensor, value_centroids_f32: torch.Tensor,
                  sinks: Optional[torch.Tensor], out: torch.Tensor, lse: Optional[torch.Tensor], layout: str,
                  scale: float, window_left: int, logit_softcap: float, int8: bool = False) -> None:
    lay = layout_of(layout)
    if q.shape[0] == 0:
        return
    window = None if window_left < 0 else window_left
    cap = None if logit_softcap <= 0 else logit_softcap
    errors = error_word(q.device)
    cache, num_blocks = _cache_or_stand_in(cache)
    if use_triton(q.device):
        from tqkern.ops.prefill.triton import prefill_launch

        # (int8: key_centroids_f32 is DeviceParams.key_int8_table, whose first entries are those centroids)
        tables = {"rotation": rotation, "key_centroids_f32": key_centroids_f32,
                  "value_centroids_f32": value_centroids_f32}
        prefill_launch(out, lse, q if q.stride(2) == 1 else q.contiguous(), cache, block_table, seq_lens,
                       query_start_loc, lay, tables, errors, num_blocks, scale=scale, window_left=window,
                       logit_softcap=cap, sinks=sinks, int8=int8)
        return
    # The NumPy oracle rejects bad indices; the kernels' policy is applied here first (lengths
    # clamped, bad block entries in use clamped into [0, num_blocks), flagged).
    bt, sl, flags = _kernel_indices(block_table.numpy(), seq_lens.numpy(), num_blocks, lay.block_size)
    errors.bitwise_or_(int(flags))
    params = _host_params(lay, rotation, key_centroids, value_centroids, None)
    oracle = int8_prefill_ref.int8_prefill if int8 else prefill_ref.prefill
    res = oracle(q.float().numpy(), cache.numpy(), bt, sl, query_start_loc.numpy(), lay, params, scale=scale,
                 window_left=window, logit_softcap=cap, sinks=None if sinks is None else sinks.double().numpy(),
                 return_lse=lse is not None)
    o, l_ = res if lse is not None else (res, None)
    out.copy_(torch.from_numpy(o).to(out.dtype))
    if lse is not None:
        lse.copy_(torch.from_numpy(l_).to(lse.dtype))


prefill_op = torch.library.custom_op("tqkern::prefill", mutates_args=("out", "lse"))(_prefill_impl)


@prefill_op.register_fake
def _(q, cache, block_table, seq_lens, query_start_loc, rotation, key_centroids, value_centroids, key_centroids_f32,
      value_centroids_f32, sinks, out, lse, layout, scale, window_left, logit_softcap, int8=False) -> None:
    return None


def _int8_prefill_impl(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, rotation: torch.Tensor, key_centroids: torch.Tensor,
                       value_centroids: torch.Tensor, key_int8_table: torch.Tensor,
                       value_centroids_f32: torch.Tensor, sinks: Optional[torch.Tensor], out: torch.Tensor,
                       lse: Optional[torch.Tensor], layout: str, scale: float, window_left: int,
                       logit_softcap: float) -> None:
    """The ``int8_prefill`` op's body: :func:`_prefill_impl` with Q·Kᵀ on int8 codes; the keys'
    table is ``DeviceParams.key_int8_table`` (the float32 centroids, their int8 image, its scale)."""
    _prefill_impl(q, cache, block_table, seq_lens, query_start_loc, rotation, key_centroids, value_centroids,
                  key_int8_table, value_centroids_f32, sinks, out, lse, layout, scale, window_left, logit_softcap,
                  int8=True)


int8_prefill_op = torch.library.custom_op("tqkern::int8_prefill", mutates_args=("out", "lse"))(_int8_prefill_impl)


@int8_prefill_op.register_fake
def _(q, cache, block_table, seq_lens, query_start_loc, rotation, key_centroids, value_centroids, key_int8_table,
      value_centroids_f32, sinks, out, lse, layout, scale, window_left, logit_softcap) -> None:
    return None


def int8_prefill(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, layout, params, *, scale: Optional[float] = None,
                 out: Optional[torch.Tensor] = None, window_left: Optional[int] = None,
                 logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                 return_lse: bool = False, max_query_len: Optional[int] = None,
                 query_start_loc_cpu: Optional[torch.Tensor] = None, seq_lens_cpu: Optional[torch.Tensor] = None,
                 check_inputs: bool = True, debug: bool = False):
    """:func:`prefill` with Q·Kᵀ on int8 codes: the same arguments, checks and result; the scores
    are those of :func:`tqkern.ops.int8_prefill.reference.int8_prefill` (symmetric int8 codes of
    the rotated query per token and head and of each reconstructed key per token and KV head,
    ``s_q·s_k·(c_q·c_k)``; its docstring bounds the difference to ``prefill``), except that a
    sequence of at most :data:`~tqkern.ops.int8_prefill.reference.EXACT_QUERY_MAX` (8) new tokens
    takes ``prefill``'s exact scores: such rows are bound by reading the cache, where int8
    products save nothing. A kernel may pick the neighbouring code where a value lies within
    float32 rounding of a half-integer.

    Routing follows :func:`prefill`'s: rows all short (``max_query_len`` or the host lengths say
    so, no window) run ``prefill``'s short-row path; with host lengths outside capture the short
    and long sequences split (short ones with a window on ``prefill``'s long-row path), the long
    ones on the tiled path with int8 operands on CUDA; otherwise the fused kernel, launched once
    with int8 codes for the long sequences and once without for the short ones. Under capture
    with host lengths that include short sequences the fused kernel runs too (the tiled path's
    pieces score in int8)."""
    return _run(q, cache, block_table, seq_lens, query_start_loc, layout, params, scale, out, window_left,
                logit_softcap, sinks, return_lse, check_inputs, debug, True, max_query_len,
                (query_start_loc_cpu, seq_lens_cpu))
