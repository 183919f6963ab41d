"""Public torch functions: validate, allocate, launch (or fall back to the NumPy oracle).

Each function checks its arguments (``TypeError``/``ValueError`` naming the argument, expected and
actual), then calls a ``torch.ops.tqkern`` op (:mod:`tqkern_torch.library`). Dispatch inside the
ops: CUDA tensors run the Triton kernels. CPU tensors run the same Triton kernels through the
interpreter when ``TRITON_INTERPRET=1`` was set before triton was imported; otherwise they run
the NumPy oracle (:mod:`tqkern.reference`) and copy the result back. No autograd.
"""

from __future__ import annotations

import functools

import torch
from einops import rearrange

from tqkern.errors import ErrorFlag
from tqkern.layouts import PagedLayout
from tqkern.ops.pack import reference as pack_ref
from tqkern.params import TQParams
from tqkern_torch._params import DeviceParams, to_device
from tqkern_torch._validate import check_device, check_even_address, check_flag, check_tensor
from tqkern_torch.errors import error_word
from tqkern_torch.library import layout_key, store_impl

__all__ = [
    "allocate_cache",
    "rotate",
    "pack",
    "unpack",
    "store",
    "compress",
    "quantize",
    "decompress",
    "decompress_sequences",
    "sequence_slot_ids",
]

_KV_DTYPES = (torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_layout(layout) -> PagedLayout:
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a PagedLayout, got {type(layout).__name__}")
    return layout


def _device_params(params, layout_or_format, device: torch.device) -> DeviceParams:
    fmt = layout_or_format.format if isinstance(layout_or_format, PagedLayout) else layout_or_format
    if isinstance(params, TQParams):
        params = to_device(params, device)
    if not isinstance(params, DeviceParams):
        raise TypeError(f"params must be a TQParams or DeviceParams, got {type(params).__name__}")
    if params.params.format is not fmt and params.params.format != fmt:
        raise ValueError(f"params.format must equal the layout's format {fmt}, got {params.params.format}")
    if params.device != device:
        raise ValueError(f"params must be on {device}, got {params.device}")
    kv_heads = getattr(layout_or_format, "num_kv_heads", None)
    if params.key_offset is not None and kv_heads is not None and params.key_offset.shape[0] != kv_heads:
        raise ValueError(f"params.key_offset must have {kv_heads} rows (num_kv_heads), got {params.key_offset.shape[0]}")
    return params


@functools.lru_cache(maxsize=256)
def _block_shape(layout: PagedLayout) -> tuple:
    """One block's shape (``cache_shape`` without the block count; derived once per layout)."""
    return tuple(layout.cache_shape(0)[1:])


def _check_cache(cache, layout: PagedLayout, device=None):
    check_tensor(cache, "cache", dtypes=(torch.uint8,), device=device, contiguous=True)
    # (while dynamo traces, the uncached function: it warns about tracing through lru_cache)
    want = _block_shape.__wrapped__(layout) if torch.compiler.is_compiling() else _block_shape(layout)
    if cache.dim() != len(want) + 1 or tuple(cache.shape[1:]) != want:
        raise ValueError(f"cache must have shape [num_blocks, {', '.join(map(str, want))}], got {list(cache.shape)}")
    check_even_address(cache, "cache")


def allocate_cache(layout: PagedLayout, num_blocks: int, device="cpu", *, fill: int = 0) -> torch.Tensor:
    """A uint8 cache of ``layout.cache_shape(num_blocks)`` filled with ``fill`` (a byte value)."""
    _check_layout(layout)
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
    if isinstance(fill, bool) or not isinstance(fill, int) or not 0 <= fill <= 255:
        raise ValueError(f"fill must be an int in [0, 255], got {fill!r}")
    return torch.full(layout.cache_shape(num_blocks), fill, dtype=torch.uint8, device=check_device(device))


def rotate(x: torch.Tensor, params, *, inverse: bool = False) -> torch.Tensor:
    """``x @ Π`` (or ``x @ Πᵀ``) in float32; ``x [..., D]`` float16/bfloat16/float32."""
    check_tensor(x, "x", dtypes=(torch.float16, torch.bfloat16, torch.float32))
    p = params if isinstance(params, DeviceParams) else to_device(params, x.device)
    d = p.params.format.head_dim
    if x.shape[-1] != d:
        raise ValueError(f"x.shape[-1] must be head_dim = {d}, got {x.shape[-1]}")
    if p.device != x.device:
        raise ValueError(f"params must be on {x.device}, got {p.device}")
    r = p.rotation.T if check_flag(inverse, "inverse") else p.rotation
    return x.float() @ r


def pack(codes: torch.Tensor, bits: int, bit_order: str = "lsb", *, check_range: bool = True) -> torch.Tensor:
    """Pack uint8 codes ``[..., n]`` (each < 2**bits) into ``[..., ⌈n·bits/8⌉]`` uint8 (see the pack
    oracle). ``check_range`` (default): a code ≥ 2**bits raises, checked on the host (a device sync;
    skipped under CUDA-graph capture and ``torch.compile``); without it nothing syncs and each code
    is masked to its low ``bits`` bits, so a bad code never reaches its neighbours' bits."""
    check_tensor(codes, "codes", dtypes=(torch.uint8,))
    pack_ref._check(bits, bit_order)
    if codes.dim() < 1:
        raise ValueError(f"codes must have at least one dimension [..., n], got shape {list(codes.shape)}")
    capturing = codes.is_cuda and torch.cuda.is_current_stream_capturing()
    checked = check_flag(check_range, "check_range") and not capturing and not torch.compiler.is_compiling()
    if codes.numel() and checked and int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes must be < 2**bits = {1 << bits}, got max {int(codes.max())}")
    if not checked and bits < 8:
        codes = codes & ((1 << bits) - 1)
    n = codes.shape[-1]
    if bit_order == "nibble_high_even":
        if n % 2:
            raise ValueError(f"codes.shape[-1] must be even for bit_order='nibble_high_even', got {n}")
        return (codes[..., 0::2] << 4) | codes[..., 1::2]
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    stream = ((codes[..., None] >> shifts) & 1).reshape(*codes.shape[:-1], n * bits)
    nbytes = pack_ref.packed_bytes(n, bits)
    stream = torch.nn.functional.pad(stream, (0, nbytes * 8 - n * bits))
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32))
    return (stream.reshape(*codes.shape[:-1], nbytes, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int, bit_order: str = "lsb") -> torch.Tensor:
    """Inverse of :func:`pack`."""
    check_tensor(packed, "packed", dtypes=(torch.uint8,))
    pack_ref._check(bits, bit_order)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if packed.dim() < 1:
        raise ValueError(f"packed must have at least one dimension [..., bytes], got shape {list(packed.shape)}")
    if bit_order == "nibble_high_even" and n % 2:
        raise ValueError(f"n must be even for bit_order='nibble_high_even', got {n}")
    nbytes = pack_ref.packed_bytes(n, bits)
    if packed.shape[-1] != nbytes:
        raise ValueError(f"packed.shape[-1] must be {nbytes} for n={n}, bits={bits}, got {packed.shape[-1]}")
    if bit_order == "nibble_high_even":
        return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(*packed.shape[:-1], n)
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = ((packed[..., None] >> shifts) & 1).reshape(*packed.shape[:-1], nbytes * 8)[..., : n * bits]
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int32))
    return (stream.reshape(*packed.shape[:-1], n, bits).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def _check_kv(key, value, layout: PagedLayout):
    h, d = layout.num_kv_heads, layout.head_dim
    check_tensor(key, "key", shape=(None, h, d), dtypes=_KV_DTYPES, last_contiguous=True)
    check_tensor(value, "value", shape=(key.shape[0], h, d), dtypes=(key.dtype,), device=key.device,
                 last_contiguous=True)


def store(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
          layout: PagedLayout, params) -> torch.Tensor:
    """Compress new tokens' K/V and write them into ``cache`` in place; returns ``cache``.

    Args:
        cache: uint8 ``layout.cache_shape(num_blocks)``, contiguous.
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` float16 or bfloat16 (last dim
            contiguous; other strides free).
        slot_mapping: ``[num_tokens]`` int32/int64 physical slots (negative = skip), each
            < num_blocks·block_size and not repeated.
        layout: the cache's :class:`PagedLayout`.
        params: :class:`DeviceParams` (:func:`~tqkern_torch.to_device`, once) or :class:`TQParams`
            of ``layout.format`` (copied to the device at every call: ~10 small host-to-device
            copies, each a stream synchronisation on CUDA).
    """
    layout = _check_layout(layout)
    _check_kv(key, value, layout)
    dev = key.device
    _check_cache(cache, layout, dev)
    check_tensor(slot_mapping, "slot_mapping", shape=(key.shape[0],), dtypes=_INDEX_DTYPES, device=dev,
                 contiguous=True)
    p = _device_params(params, layout, dev)
    args = (cache, key, value, slot_mapping, p.rotation, p.key_boundaries, p.key_centroids, p.value_boundaries,
            p.value_centroids, p.key_offset, layout_key(layout), p.signed_sylvester, p.symmetric_codebooks,
            p.key_offset_signed, p.rotation_parts)
    if type(key) is torch.Tensor and not torch.compiler.is_compiling():
        store_impl(*args)  # eager: the op's body without the dispatcher's layers (host time)
    else:
        torch.ops.tqkern.store(*args)
    return cache


def compress(key: torch.Tensor, value: torch.Tensor, params) -> torch.Tensor:
    """Slots ``[num_tokens, num_kv_heads, slot_bytes]`` uint8 of ``params.format`` (the store
    kernel writing into a fresh one-token-per-block cache)."""
    p = params.params if isinstance(params, DeviceParams) else params
    if not isinstance(p, TQParams):
        raise TypeError(f"params must be a TQParams or DeviceParams, got {type(params).__name__}")
    check_tensor(key, "key", dtypes=_KV_DTYPES)
    if key.dim() != 3:
        raise ValueError(f"key must have shape [num_tokens, num_kv_heads, head_dim], got {list(key.shape)}")
    layout = PagedLayout(format=p.format, num_kv_heads=key.shape[1], block_size=1)
    cache = allocate_cache(layout, key.shape[0], key.device)
    slots = torch.arange(key.shape[0], device=key.device, dtype=torch.int64)
    store(cache, key, value, slots, layout, params)
    return cache.reshape(key.shape[0], key.shape[1], p.format.slot_bytes)


def _decode_fields(slots: torch.Tensor, fmt, side: str) -> dict:
    out = {}
    codec = getattr(fmt, side)
    for qual, f, off in fmt.slot_fields():
        if not qual.startswith(side + "."):
            continue
        raw = slots[..., off: off + f.nbytes].contiguous()
        if f.dtype == "codes":
            out["codes"] = unpack(raw, codec.bits, fmt.head_dim, fmt.bit_order)
        elif f.dtype == "float8_e4m3fn":
            out["data"] = raw.view(torch.float8_e4m3fn).float()
        elif f.name == "data":
            out["data"] = raw.view(torch.float16 if f.dtype == "float16" else torch.bfloat16).float()
        else:
            out[f.name] = raw.view(getattr(torch, f.dtype)).float()[..., 0]
    return out


def quantize(key: torch.Tensor, value: torch.Tensor, params) -> tuple[dict, dict]:
    """Quantize K and V with ``params.format``'s codecs (the store kernel, then the fields read
    back): two dicts with ``"codes"`` (uint8 ``[N, H, D]``, packed codecs), ``"data"`` (float32
    ``[N, H, D]``, FP8/raw codecs) and the stored per-vector floats (``"norm"``, or ``"scale"``
    and ``"zero"``, float32 ``[N, H]``), as :func:`tqkern.ops.quantize.reference.quantize`
    defines them (the key after subtracting ``params.key_offset``)."""
    slots = compress(key, value, params)
    fmt = (params.params if isinstance(params, DeviceParams) else params).format
    return _decode_fields(slots, fmt, "key"), _decode_fields(slots, fmt, "value")


def _check_slot_ids(slot_ids, cache, layout, dev):
    check_tensor(slot_ids, "slot_ids", shape=(None,), dtypes=_INDEX_DTYPES, device=dev, contiguous=True)


def decompress(cache: torch.Tensor, slot_ids: torch.Tensor, layout: PagedLayout, params, *,
               rotate_back: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the slots ``slot_ids [N]`` (negative = leave zeros) back to float32 ``(key, value)``
    ``[N, num_kv_heads, head_dim]``, each in its codec's space unless ``rotate_back``.

    The key is the reconstruction of ``key − μ`` (see the decompress oracle)."""
    layout = _check_layout(layout)
    _check_cache(cache, layout)
    dev = cache.device
    _check_slot_ids(slot_ids, cache, layout, dev)
    p = _device_params(params, layout, dev)
    return torch.ops.tqkern.decompress(cache, slot_ids, p.rotation, p.key_centroids, p.value_centroids,
                                       layout_key(layout), check_flag(rotate_back, "rotate_back"),
                                       p.signed_sylvester)


def sequence_slot_ids(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Physical slots ``[num_seqs, max_blocks·block_size]`` (int64) of every position of every
    sequence, −1 at positions ≥ seq_len. Device-side only (no host sync)."""
    check_tensor(block_table, "block_table", shape=(None, None), dtypes=(torch.int32,))
    check_tensor(seq_lens, "seq_lens", shape=(block_table.shape[0],), dtypes=(torch.int32,),
                 device=block_table.device)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    blocks, used, slot = _positions(block_table, seq_lens, block_size)
    return torch.where(used, blocks * block_size + slot, -1)


def _positions(block_table, seq_lens, block_size: int):
    """Per sequence and position ``[num_seqs, max_blocks·block_size]``: the block (int64), whether
    the position is below seq_len, and the offset in the block (``[max_blocks·block_size]``)."""
    pos = torch.arange(block_table.shape[1] * block_size, device=block_table.device)
    return block_table.long()[:, pos // block_size], pos[None, :] < seq_lens.long()[:, None], pos % block_size


def decompress_sequences(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         layout: PagedLayout, params, *, rotate_back: bool = False):
    """Whole sequences: float32 ``(key, value)`` ``[num_seqs, max_blocks·block_size, H, D]``,
    zero at positions ≥ seq_len. ``block_table [num_seqs, max_blocks]`` and ``seq_lens [num_seqs]``
    int32. Entries of ``seq_lens`` must be ≤ max_blocks·block_size (checked on the host for CPU
    tensors only, to keep CUDA paths free of syncs). As ``paged_decode`` does, without a sync: a
    negative ``seq_lens`` entry reads nothing and sets ``SEQ_LEN_OUT_OF_RANGE``; a ``block_table``
    entry in use outside ``[0, num_blocks)`` reads zeros and sets ``BLOCK_OUT_OF_RANGE``."""
    layout = _check_layout(layout)
    _check_cache(cache, layout)
    dev = cache.device
    check_tensor(block_table, "block_table", shape=(None, None), dtypes=(torch.int32,), device=dev)
    check_tensor(seq_lens, "seq_lens", shape=(block_table.shape[0],), dtypes=(torch.int32,), device=dev)
    cap = block_table.shape[1] * layout.block_size
    if dev.type == "cpu" and seq_lens.numel() and int(seq_lens.max()) > cap:
        raise ValueError(f"seq_lens must be <= max_blocks * block_size = {cap}, got {int(seq_lens.max())}")
    blocks, used, slot = _positions(block_table, seq_lens, layout.block_size)
    inside = (blocks >= 0) & (blocks < cache.shape[0])
    ids = torch.where(used & inside, blocks * layout.block_size + slot, -1)
    if ids.numel():
        flags = ((used & ~inside).any().to(torch.int32) * int(ErrorFlag.BLOCK_OUT_OF_RANGE)
                 + (seq_lens < 0).any().to(torch.int32) * int(ErrorFlag.SEQ_LEN_OUT_OF_RANGE))
        error_word(dev).bitwise_or_(flags)
    k, v = decompress(cache, ids.reshape(-1), layout, params, rotate_back=rotate_back)
    seqs, positions = ids.shape
    return tuple(rearrange(x, "(seq pos) h d -> seq pos h d", seq=seqs, pos=positions) for x in (k, v))
