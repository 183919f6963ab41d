"""decompress rotated back at every padded width, against the oracle; the program tiles the GPU
takes run in the interpreter too."""

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.errors import ErrorFlag
from tqkern_torch.testing import device_under_test, kernels_available

DEV = device_under_test()
pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")


def _filled(preset, d, hkv=2, n=70, seed=0):
    """A cache holding ``n`` random tokens at shuffled slots (two of them past the cache, one −1)."""
    fmt = tqkern.KVFormat.preset(preset, d)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=hkv, block_size=16)
    params = tqkern.TQParams.default(fmt, seed=seed)
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(n, hkv, d, generator=g) * 2).half().to(DEV)
    v = torch.randn(n, hkv, d, generator=g).half().to(DEV)
    blocks = 6
    slots = torch.randperm(blocks * 16, generator=g)[:n].to(DEV)
    cache = tqt.allocate_cache(layout, blocks, DEV)
    tqt.store(cache, k, v, slots, layout, params)
    ids = slots.clone()
    ids[3], ids[10], ids[11] = -1, blocks * 16, blocks * 16 + 5
    return layout, params, cache, ids


def _expect(layout, params, cache, ids, rotate_back):
    """The oracle's float64 K and V of the slots ``ids`` (zero where out of range)."""
    ids_np = ids.cpu().numpy()
    keep = (ids_np >= 0) & (ids_np < cache.shape[0] * layout.block_size)
    shape = (len(ids_np), layout.num_kv_heads, layout.head_dim)
    out = [np.zeros(shape), np.zeros(shape)]
    kk, vv = ref.decompress(ref.gather_slots(cache.cpu().numpy(), layout, ids_np[keep]), params, rotate_back=rotate_back)
    out[0][keep], out[1][keep] = kk, vv
    return out


@pytest.mark.parametrize("preset,d", [("turboquant_4bit_nc", 64), ("tq4", 96), ("k5v4h", 128), ("tqkern_k5v3", 256),
                                      ("turboquant_k8v4", 128), ("fp16", 64)])
def test_rotate_back_matches_oracle(preset, d):
    """Both sides rotated back equal the oracle within one float32 product's error over D terms
    (the property test's bound), at every padded width; raw fp16 fields (16-bit loads) exactly
    as stored."""
    layout, params, cache, ids = _filled(preset, d)
    tqt.read_errors(DEV)
    got = tqt.decompress(cache, ids, layout, params, rotate_back=True)
    assert tqt.read_errors(DEV) & ErrorFlag.SLOT_OUT_OF_RANGE
    for name, g, x in zip(("key", "value"), got, _expect(layout, params, cache, ids, True)):
        g = g.cpu().numpy().astype(np.float64)
        tol = 4 * np.sqrt(d) * 2.0**-24 * np.linalg.norm(x, axis=-1, keepdims=True)
        assert np.all(np.abs(g - x) <= tol), f"{name}: max error {np.abs(g - x).max():.3g}"
        assert np.all(g[[3, 10, 11]] == 0), f"{name}: slots outside the cache must read zeros"


@pytest.mark.parametrize("preset,d", [("tq4", 128), ("turboquant_4bit_nc", 96), ("tqkern_k5v3", 256)])
def test_gpu_tiles_match_oracle(preset, d):
    """The program tiles the GPU takes (:func:`decompress_config` off the interpreter: 4 slots a
    program in the codec's space, 8 with the Walsh–Hadamard rotate-back (k5v3 at D256) and 4 below
    ``SMALL_ROWS`` rows, 64, 16 or 32 with the product (tq4's dense rotation at D128 for large and
    small calls; D96), the last one partial) give the oracle's values, rotated back and in the
    codec's space (the property tests' bounds), and write zeros for slots outside the cache over an
    output that held NaN."""
    from tqkern.ops.decompress.triton import _launch_decompress, decompress_config
    from tqkern_torch._params import to_device

    layout, params, cache, ids = _filled(preset, d)
    p = to_device(params, DEV)
    tables = {"rotation": p.rotation, "key_centroids": p.key_centroids, "value_centroids": p.value_centroids}
    for rotate_back, rows in ((True, None), (True, 8), (False, None)):
        cfg = decompress_config(rotate_back, interpret=False, head_dim=d, signed_sylvester=p.signed_sylvester,
                                rows=rows)
        assert (cfg.BT >= (32 if rows is None else 4) or cfg.fwht) == rotate_back
        assert cfg.fwht == (rotate_back and preset != "tq4" and d & (d - 1) == 0)  # (tq4: a dense rotation)
        got = [torch.full((len(ids), layout.num_kv_heads, d), float("nan"), device=DEV) for _ in range(2)]
        _launch_decompress(got[0], got[1], cache, ids, layout, tables, torch.zeros(1, dtype=torch.int32, device=DEV),
                           rotate_back=rotate_back, interpret=DEV.type == "cpu", config=cfg,
                           signed_sylvester=p.signed_sylvester)
        for name, g, x in zip(("key", "value"), got, _expect(layout, params, cache, ids, rotate_back)):
            g = g.cpu().numpy().astype(np.float64)
            if rotate_back:
                tol = 4 * np.sqrt(d) * 2.0**-24 * np.linalg.norm(x, axis=-1, keepdims=True)
            else:
                tol = 8 * 2.0**-24 * np.max(np.abs(x), axis=-1, keepdims=True)
            assert np.all(np.abs(g - x) <= tol), f"{name} rotate_back={rotate_back}: max error {np.abs(g - x).max():.3g}"
            assert np.all(g[[3, 10, 11]] == 0), f"{name}: slots outside the cache must read zeros"


def test_launcher_refuses_the_transform_at_a_non_power_of_two_head_dim():
    from tqkern.ops.decompress.triton import DecompressConfig, _launch_decompress
    from tqkern_torch._params import to_device

    layout, params, cache, ids = _filled("turboquant_4bit_nc", 96)
    p = to_device(params, DEV)
    out = [torch.empty((len(ids), layout.num_kv_heads, 96), device=DEV) for _ in range(2)]
    with pytest.raises(ValueError, match="config.fwht needs a power-of-two head_dim, got 96"):
        _launch_decompress(out[0], out[1], cache, ids, layout, p.tables(), torch.zeros(1, dtype=torch.int32, device=DEV),
                           rotate_back=True, interpret=DEV.type == "cpu", config=DecompressConfig(4, 16, 1, 1, True))


def test_decompress_config_takes_bools():
    from tqkern.ops.decompress.triton import decompress_config

    with pytest.raises(TypeError, match="rotate_back must be a bool, got int"):
        decompress_config(1, False)
    with pytest.raises(TypeError, match="interpret must be a bool, got str"):
        decompress_config(True, "no")
    for bad, kind in ((64.0, "float"), (True, "bool")):
        with pytest.raises(TypeError, match=f"head_dim must be an int, got {kind}"):
            decompress_config(True, False, bad)
    with pytest.raises(ValueError, match="head_dim must be positive, got 0"):
        decompress_config(True, False, 0)
    with pytest.raises(TypeError, match="signed_sylvester must be a bool, got NoneType"):
        decompress_config(True, False, 128, None)
    assert decompress_config(True, False, 96, True).fwht is False  # (no transform at D96)
    assert decompress_config(False, False, 128, True).fwht is False
    with pytest.raises(TypeError, match="rows must be None or an int, got float"):
        decompress_config(True, False, 128, False, 8.0)
    with pytest.raises(ValueError, match="rows must be non-negative, got -1"):
        decompress_config(True, False, 128, False, -1)


def test_decompress_config_small_calls_take_small_product_tiles():
    """Below ``SMALL_ROWS`` slot-head rows (a short-row prefill's tail keys): the D128 product path
    takes 16-slot tiles (64 from there on), the Walsh–Hadamard path 4 (8 from there on, at every
    power-of-two head_dim); other paths do not depend on the row count."""
    from tqkern.ops.decompress.triton import SMALL_ROWS, decompress_config

    assert decompress_config(True, False, 128, False, SMALL_ROWS - 1).BT == 16
    assert decompress_config(True, False, 128, False, SMALL_ROWS).BT == 64
    assert decompress_config(True, False, 128, False).BT == 64
    assert decompress_config(True, False, 96, False, 8).BT == 16  # (pads to 128)
    for d in (64, 128, 256):
        assert decompress_config(True, False, d, True, SMALL_ROWS - 1) == (4, 16, 1, 1, True)
        assert decompress_config(True, False, d, True, SMALL_ROWS) == (8, 16, 1, 1, True)
        assert decompress_config(True, False, d, True) == (8, 16, 1, 1, True)
    for args in ((True, False, 256, False), (False, False, 128, True), (False, False, 128, False)):
        assert decompress_config(*args, 8) == decompress_config(*args, SMALL_ROWS)
