"""``torch.library`` registration: ``tqkern::store``, ``tqkern::decompress`` and ``tqkern::replace_prefix``.

The layout travels as a JSON string (static for a compiled graph); the parameters as tensors.
Fake (meta) implementations make the ops traceable by ``torch.compile(fullgraph=True)``.
The public, validating functions live in :mod:`tqkern_torch.ops` and call these.
"""

from __future__ import annotations

import functools
import json
from typing import Optional

import numpy as np
import torch

from tqkern.codebooks import Codebook
from tqkern.errors import ErrorFlag
from tqkern.layouts import LloydMax, PagedLayout, layout_from_dict
from tqkern.ops.decompress import reference as decompress_ref
from tqkern.ops.store import reference as store_ref
from tqkern.params import TQParams
from tqkern_torch._validate import use_triton
from tqkern_torch.errors import error_word

__all__ = ["layout_key", "layout_of"]


def layout_key(layout: PagedLayout) -> str:
    """The op argument that names ``layout`` (``layout.key``: a plain attribute, which
    ``torch.compile`` reads as a constant)."""
    return layout.key


@functools.lru_cache(maxsize=256)
def layout_of(key: str) -> PagedLayout:
    return layout_from_dict(json.loads(key))


def _host_params(layout: PagedLayout, rotation, kc, vc, mu, kb=None, vb=None) -> TQParams:
    """Rebuild NumPy parameters from the op's tensors (for the CPU oracle fallback).

    ``kb`` / ``vb`` are the device boundary tables (float32, as the kernels read them); when given
    the codebooks use them exactly, so the fallback decides codes against the same boundaries as
    the kernel. Without them (decompress and attention read centroids only) the boundaries are
    the centroids' midpoints."""
    fmt = layout.format
    cbs = {}
    for side, c, b in (("key", kc, kb), ("value", vc, vb)):
        codec = getattr(fmt, side)
        cbs[f"{side}_codebook"] = (
            Codebook.from_centroids(c.cpu().numpy(), dim=fmt.head_dim,
                                    boundaries=None if b is None else b.cpu().double().numpy())
            if isinstance(codec, LloydMax) else None
        )
    rot = rotation.cpu().double().numpy() if fmt.rotated else None
    return TQParams(format=fmt, rotation=rot, key_offset=None if mu is None else mu.cpu().numpy(), **cbs)


def _tables(rotation, kb, kc, vb, vc, mu, mu_signed=None, parts=None) -> dict:
    return {"rotation": rotation, "key_boundaries": kb, "key_centroids": kc, "value_boundaries": vb,
            "value_centroids": vc, "key_offset": mu, "key_offset_signed": mu_signed, "rotation_parts": parts}


@torch.library.custom_op("tqkern::store", mutates_args=("cache",))
def store_op(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             rotation: torch.Tensor, key_boundaries: torch.Tensor, key_centroids: torch.Tensor,
             value_boundaries: torch.Tensor, value_centroids: torch.Tensor, key_offset: Optional[torch.Tensor],
             layout: str, signed_sylvester: bool = False, symmetric_codebooks: bool = False,
             key_offset_signed: Optional[torch.Tensor] = None, rotation_parts: Optional[torch.Tensor] = None) -> None:
    store_impl(cache, key, value, slot_mapping, rotation, key_boundaries, key_centroids, value_boundaries,
               value_centroids, key_offset, layout, signed_sylvester, symmetric_codebooks, key_offset_signed,
               rotation_parts)


def store_impl(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
               rotation: torch.Tensor, key_boundaries: torch.Tensor, key_centroids: torch.Tensor,
               value_boundaries: torch.Tensor, value_centroids: torch.Tensor, key_offset: Optional[torch.Tensor],
               layout: str, signed_sylvester: bool = False, symmetric_codebooks: bool = False,
               key_offset_signed: Optional[torch.Tensor] = None,
               rotation_parts: Optional[torch.Tensor] = None) -> None:
    """The body of ``torch.ops.tqkern.store`` (eager calls run it without the dispatcher's layers).
    ``signed_sylvester``: ``rotation`` is ``diag(s)·H/√D`` (``DeviceParams.signed_sylvester``):
    the kernel may rotate with an exact ±1 matrix; ``symmetric_codebooks``: the boundary tables
    are antisymmetric (``DeviceParams.symmetric_codebooks``); ``key_offset_signed``:
    ``DeviceParams.key_offset_signed`` (made per call from ``key_offset`` when ``None``);
    ``rotation_parts``: ``DeviceParams.rotation_parts`` (likewise from ``rotation``). These are
    claims about the values, made on the host with the parameters, not checked here."""
    lay = layout_of(layout)
    if key.shape[0] == 0:
        return
    if use_triton(key.device):
        from tqkern.ops.store.triton import _launch_store

        tables = _tables(rotation, key_boundaries, key_centroids, value_boundaries, value_centroids, key_offset,
                         key_offset_signed, rotation_parts)
        _launch_store(cache, key, value, slot_mapping, lay, tables, error_word(key.device),
                      interpret=key.device.type == "cpu", signed_sylvester=signed_sylvester,
                      symmetric_codebooks=symmetric_codebooks)
        return
    params = _host_params(lay, rotation, key_centroids, value_centroids, key_offset, key_boundaries,
                          value_boundaries)
    out, flags = store_ref.store(cache.numpy(), key.float().numpy(), value.float().numpy(), slot_mapping.numpy(),
                                 lay, params, return_flags=True)
    cache.copy_(torch.from_numpy(out))
    error_word(key.device).bitwise_or_(int(flags))


@store_op.register_fake
def _(cache, key, value, slot_mapping, rotation, key_boundaries, key_centroids, value_boundaries,
      value_centroids, key_offset, layout, signed_sylvester=False, symmetric_codebooks=False,
      key_offset_signed=None, rotation_parts=None) -> None:
    return None


@torch.library.custom_op("tqkern::decompress", mutates_args=())
def decompress_op(cache: torch.Tensor, slot_ids: torch.Tensor, rotation: torch.Tensor,
                  key_centroids: torch.Tensor, value_centroids: torch.Tensor, layout: str,
                  rotate_back: bool, signed_sylvester: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``signed_sylvester``: ``rotation`` is ``diag(s)·H/√D`` (``DeviceParams.signed_sylvester``):
    the kernel then rotates back by the Walsh–Hadamard transform."""
    lay = layout_of(layout)
    n, h, d = slot_ids.shape[0], lay.num_kv_heads, lay.head_dim
    dev = cache.device
    if use_triton(dev):  # the kernel writes every row (zeros for ids outside the cache): no memset
        from tqkern.ops.decompress.triton import _launch_decompress

        k = torch.empty((n, h, d), dtype=torch.float32, device=dev)
        v = torch.empty((n, h, d), dtype=torch.float32, device=dev)
        if n == 0:
            return k, v
        tables = {"rotation": rotation, "key_centroids": key_centroids, "value_centroids": value_centroids}
        _launch_decompress(k, v, cache, slot_ids, lay, tables, error_word(dev), rotate_back=rotate_back,
                           interpret=dev.type == "cpu", signed_sylvester=signed_sylvester)
        return k, v
    k = torch.zeros((n, h, d), dtype=torch.float32, device=dev)
    v = torch.zeros((n, h, d), dtype=torch.float32, device=dev)
    if n == 0:
        return k, v
    params = _host_params(lay, rotation, key_centroids, value_centroids, None)
    ids = slot_ids.cpu().numpy().astype(np.int64)
    cap = cache.shape[0] * lay.block_size
    valid = (ids >= 0) & (ids < cap)
    if np.any(ids >= cap):
        error_word(dev).bitwise_or_(int(ErrorFlag.SLOT_OUT_OF_RANGE))
    if valid.any():
        slots = decompress_ref.gather_slots(cache.cpu().numpy(), lay, ids[valid])
        kk, vv = decompress_ref.decompress(slots, params, rotate_back=rotate_back)
        sel = torch.from_numpy(np.nonzero(valid)[0]).to(dev)
        k[sel] = torch.from_numpy(kk).float().to(dev)
        v[sel] = torch.from_numpy(vv).float().to(dev)
    return k, v


@decompress_op.register_fake
def _(cache, slot_ids, rotation, key_centroids, value_centroids, layout, rotate_back, signed_sylvester=False):
    lay = layout_of(layout)
    shape = (slot_ids.shape[0], lay.num_kv_heads, lay.head_dim)
    return cache.new_empty(shape, dtype=torch.float32), cache.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("tqkern::replace_prefix", mutates_args=())
def replace_prefix_op(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k_hat: torch.Tensor,
                      v_hat: torch.Tensor, k_exact: torch.Tensor, v_exact: torch.Tensor, scale: float,
                      q_pos: Optional[torch.Tensor], k_pos: Optional[torch.Tensor], window_left: int,
                      logit_softcap: float) -> torch.Tensor:
    """``tqkern_torch.exact_prefix.replace_prefix`` as an op (``window_left < 0``, ``logit_softcap
    <= 0``: none), so that a compiled decode step traces the kernel's launch; its Triton kernel where
    kernels run, the float32 torch operations elsewhere."""
    from tqkern_torch.exact_prefix import _replace_prefix_torch, _replace_prefix_triton

    fn = _replace_prefix_triton if use_triton(out.device) else _replace_prefix_torch
    return fn(out, lse, q, k_hat, v_hat, k_exact, v_exact, scale, q_pos, k_pos,
              None if window_left < 0 else window_left, None if logit_softcap <= 0 else logit_softcap)


@replace_prefix_op.register_fake
def _(out, lse, q, k_hat, v_hat, k_exact, v_exact, scale, q_pos, k_pos, window_left, logit_softcap):
    return torch.empty(out.shape, dtype=out.dtype, device=out.device)
