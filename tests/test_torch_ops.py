"""The torch frontend: op registration (opcheck, torch.compile), argument checks, CPU fallback."""

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern_torch.attention import paged_decode
from tqkern_torch.library import layout_key
from tqkern_torch.testing import device_under_test, kernels_available

DEV = device_under_test()
needs_kernels = pytest.mark.skipif(not kernels_available(), reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def setup():
    fmt = tqkern.KVFormat.preset("turboquant_4bit_nc", 64)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=2, block_size=16)
    params = tqkern.TQParams.default(fmt, seed=3)
    return layout, params, tqt.to_device(params, DEV)


def _kv(n, h=2, d=64, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, d, generator=g).to(dtype).to(DEV), torch.randn(n, h, d, generator=g).to(dtype).to(DEV))


@needs_kernels
def test_opcheck_store_and_decompress(setup):
    layout, _, dp = setup
    k, v = _kv(5)
    slots = torch.tensor([3, 17, -1, 40, 63], device=DEV)
    cache = tqt.allocate_cache(layout, 4, DEV)
    key = layout_key(layout)
    torch.library.opcheck(torch.ops.tqkern.store.default,
                          (cache, k, v, slots, dp.rotation, dp.key_boundaries, dp.key_centroids,
                           dp.value_boundaries, dp.value_centroids, None, key))
    torch.library.opcheck(torch.ops.tqkern.decompress.default,
                          (cache, slots, dp.rotation, dp.key_centroids, dp.value_centroids, key, True))


@needs_kernels
def test_opcheck_paged_decode(setup):
    layout, _, dp = setup
    k, v = _kv(40)
    cache = tqt.allocate_cache(layout, 4, DEV)
    tqt.store(cache, k, v, torch.arange(40, device=DEV), layout, dp)
    q = torch.randn(2, 4, 64, device=DEV).half()
    bt = torch.tensor([[0, 1, 2], [3, 0, 0]], dtype=torch.int32, device=DEV)
    sl = torch.tensor([40, 9], dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.tqkern.paged_decode.default,
                          (q, cache, bt, sl, dp.rotation, dp.key_centroids, dp.value_centroids, dp.key_centroids_f32,
                           dp.value_centroids_f32, out, None, layout_key(layout), 0.125, 2, False, -1, 0.0, None,
                           None, dp.signed_sylvester))


@needs_kernels
def test_torch_compile_fullgraph_store_decompress_decode(setup):
    layout, params, dp = setup
    k, v = _kv(20, seed=1)
    slots = torch.arange(20, device=DEV).flip(0)
    q = torch.randn(1, 4, 64, device=DEV).half()
    bt = torch.tensor([[1, 0]], dtype=torch.int32, device=DEV)
    sl = torch.tensor([20], dtype=torch.int32, device=DEV)

    def step(cache, k, v, slots, q):
        tqt.store(cache, k, v, slots, layout, dp)
        kk, vv = tqt.decompress(cache, slots, layout, dp, rotate_back=True)
        out = paged_decode(q, cache, bt, sl, layout, dp, check_lengths=False, num_splits=2)
        return kk, vv, out

    backend = "inductor" if DEV.type == "cuda" else "aot_eager"  # no C++ build on CPU-only CI
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    c1, c2 = tqt.allocate_cache(layout, 2, DEV), tqt.allocate_cache(layout, 2, DEV)
    got = compiled(c1, k, v, slots, q)
    want = step(c2, k, v, slots, q)
    assert torch.equal(c1, c2)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    exp = ref.paged_decode(q.float().cpu().numpy(), c2.cpu().numpy(), bt.cpu().numpy(), sl.cpu().numpy(),
                           layout, params)
    assert np.abs(got[2].float().cpu().numpy() - exp).max() < 4e-3 * float(got[1].abs().max())


def test_numpy_fallback_equals_oracle(setup, monkeypatch):
    """Without a GPU and without the interpreter, CPU tensors run the NumPy oracle."""
    layout, params, _ = setup
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    k, v = _kv(7, seed=2)
    k, v = k.cpu(), v.cpu()
    slots = torch.tensor([0, 5, 9, -1, 33, 2, 63])
    cache = tqt.allocate_cache(layout, 4, fill=7)
    tqt.store(cache, k, v, slots, layout, params)
    expect = ref.store(np.full(layout.cache_shape(4), 7, np.uint8), k.float().numpy(), v.float().numpy(),
                       slots.numpy(), layout, params)
    assert np.array_equal(cache.numpy(), expect)
    kk, vv = tqt.decompress(cache, slots, layout, params)
    ek, ev = ref.decompress(ref.gather_slots(expect, layout, slots.numpy()[slots.numpy() >= 0]), params)
    assert np.allclose(kk.numpy()[slots.numpy() >= 0], ek, rtol=1e-6, atol=1e-7)
    assert np.all(vv.numpy()[3] == 0)


def test_rotate_pack_unpack_match_oracles(setup):
    layout, params, _ = setup
    x = torch.randn(3, 5, 64)
    assert np.allclose(tqt.rotate(x, params).numpy(), ref.rotate(x.numpy(), params.rotation), atol=1e-5)
    assert np.allclose(tqt.rotate(x, params, inverse=True).numpy(),
                       ref.rotate(x.numpy(), params.rotation, inverse=True), atol=1e-5)
    rng = np.random.default_rng(0)
    for bits in range(1, 9):
        for n in (1, 7, 64, 100):
            codes = rng.integers(0, 1 << bits, size=(3, n), dtype=np.uint8)
            packed = tqt.pack(torch.from_numpy(codes), bits)
            assert np.array_equal(packed.numpy(), ref.pack(codes, bits))
            assert np.array_equal(tqt.unpack(packed, bits, n).numpy(), codes)
    codes = rng.integers(0, 16, size=(2, 64), dtype=np.uint8)
    packed = tqt.pack(torch.from_numpy(codes), 4, "nibble_high_even")
    assert np.array_equal(packed.numpy(), ref.pack(codes, 4, "nibble_high_even"))
    assert np.array_equal(tqt.unpack(packed, 4, 64, "nibble_high_even").numpy(), codes)


def test_compress_equals_oracle_bytes(setup):
    layout, params, _ = setup
    k, v = _kv(9, seed=4)
    slots = tqt.compress(k, v, params).cpu().numpy()
    expect, unsure = ref.compress(k.float().cpu().numpy(), v.float().cpu().numpy(), params, return_uncertain=True)
    assert slots.shape == expect.shape
    assert not np.any((slots != expect) & ~unsure)


# -- argument checks: each error names the argument, the expectation and what it got -------------
def test_store_rejects_bad_arguments(setup):
    layout, params, _ = setup
    k, v = _kv(4)
    cache = tqt.allocate_cache(layout, 2, DEV)
    sm = torch.arange(4, device=DEV)
    with pytest.raises(TypeError, match=r"key must be float16 or bfloat16, got float32"):
        tqt.store(cache, k.float(), v, sm, layout, params)
    with pytest.raises(ValueError, match=r"key must have shape \[\*, 2, 64\], got \[4, 2, 32\]"):
        tqt.store(cache, k[..., :32], v, sm, layout, params)
    with pytest.raises(TypeError, match=r"value must be float16, got bfloat16"):
        tqt.store(cache, k, v.bfloat16(), sm, layout, params)
    with pytest.raises(TypeError, match=r"cache must be uint8, got int8"):
        tqt.store(cache.to(torch.int8), k, v, sm, layout, params)
    with pytest.raises(ValueError, match=r"cache must have shape \[num_blocks, 16, 2, 70\]"):
        tqt.store(cache.reshape(2, 16, 140), k, v, sm, layout, params)
    with pytest.raises(ValueError, match=r"slot_mapping must have shape \[4\], got \[3\]"):
        tqt.store(cache, k, v, sm[:3], layout, params)
    with pytest.raises(TypeError, match=r"slot_mapping must be int32 or int64, got float32"):
        tqt.store(cache, k, v, sm.float(), layout, params)
    with pytest.raises(ValueError, match=r"cache must be contiguous"):
        tqt.store(cache.transpose(1, 2).contiguous().transpose(1, 2), k, v, sm, layout, params)
    with pytest.raises(ValueError, match=r"key must have a contiguous last dimension"):
        tqt.store(cache, k.transpose(0, 2).contiguous().transpose(0, 2), v, sm, layout, params)
    with pytest.raises(TypeError, match=r"layout must be a PagedLayout, got KVFormat"):
        tqt.store(cache, k, v, sm, layout.format, params)
    other = tqkern.TQParams.default(tqkern.KVFormat.preset("tq4", 64))
    with pytest.raises(ValueError, match=r"params.format must equal"):
        tqt.store(cache, k, v, sm, layout, other)
    with pytest.raises(TypeError, match=r"params must be a TQParams or DeviceParams, got str"):
        tqt.store(cache, k, v, sm, layout, "params")


def test_decompress_and_allocate_reject_bad_arguments(setup):
    layout, params, _ = setup
    cache = tqt.allocate_cache(layout, 2, DEV)
    with pytest.raises(TypeError, match=r"slot_ids must be int32 or int64, got float32"):
        tqt.decompress(cache, torch.zeros(3, device=DEV), layout, params)
    with pytest.raises(ValueError, match=r"slot_ids must have shape \[\*\], got \[3, 1\]"):
        tqt.decompress(cache, torch.zeros(3, 1, dtype=torch.long, device=DEV), layout, params)
    with pytest.raises(ValueError, match=r"num_blocks must be a non-negative int, got -1"):
        tqt.allocate_cache(layout, -1)
    for bad in (-1, 256, 1.5, True):
        with pytest.raises(ValueError, match=rf"fill must be an int in \[0, 255\], got {bad!r}"):
            tqt.allocate_cache(layout, 2, fill=bad)
    assert int(tqt.allocate_cache(layout, 1, fill=255).min()) == 255
    with pytest.raises(TypeError, match="cache must be a torch.Tensor, got NoneType"):
        tqt.decompress(None, torch.zeros(3, dtype=torch.long), layout, params)
    with pytest.raises(TypeError, match="cache must be a torch.Tensor, got NoneType"):
        tqt.decompress_sequences(None, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                 layout, params)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"seq_lens must be int32, got int64"):
        tqt.decompress_sequences(cache.cpu(), bt, torch.tensor([3]), layout, params)
    with pytest.raises(ValueError, match=r"seq_lens must be <= max_blocks \* block_size = 32, got 33"):
        tqt.decompress_sequences(cache.cpu(), bt, torch.tensor([33], dtype=torch.int32), layout, params)


@needs_kernels
def test_decompress_sequences_reads_each_sequence_in_order(setup):
    layout, params, _ = setup
    k, v = _kv(64, seed=5)
    cache = tqt.allocate_cache(layout, 4, DEV)
    tqt.store(cache, k, v, torch.arange(64, device=DEV), layout, params)
    bt = torch.tensor([[2, 0], [3, 1], [1, 2]], dtype=torch.int32, device=DEV)  # shuffled blocks
    sl = torch.tensor([20, 5, 0], dtype=torch.int32, device=DEV)
    ks, vs = tqt.decompress_sequences(cache, bt, sl, layout, params)
    assert ks.shape == vs.shape == (3, 32, 2, 64)
    for s in range(3):
        n = int(sl[s])
        slots = (bt[s].long()[:, None] * 16 + torch.arange(16, device=DEV)).reshape(-1)[:n]
        k1, v1 = tqt.decompress(cache, slots, layout, params)
        assert torch.equal(ks[s, :n], k1) and torch.equal(vs[s, :n], v1)
        assert not ks[s, n:].any() and not vs[s, n:].any()
    empty = tqt.decompress_sequences(cache, bt[:0], sl[:0], layout, params)
    assert [x.shape for x in empty] == [(0, 32, 2, 64)] * 2


@needs_kernels
def test_decompress_sequences_flags_bad_blocks_and_lengths(setup):
    """As paged_decode: a block in use outside [0, num_blocks) reads zeros and sets
    BLOCK_OUT_OF_RANGE; a negative length reads nothing and sets SEQ_LEN_OUT_OF_RANGE; a bad
    block past a sequence's length is not in use and sets nothing."""
    from tqkern.errors import ErrorFlag

    layout, params, _ = setup
    k, v = _kv(64, seed=6)
    cache = tqt.allocate_cache(layout, 4, DEV)
    tqt.store(cache, k, v, torch.arange(64, device=DEV), layout, params)
    sl = torch.tensor([20, 5], dtype=torch.int32, device=DEV)
    tqt.read_errors(DEV)
    good, _ = tqt.decompress_sequences(cache, torch.tensor([[2, -1], [3, 9]], dtype=torch.int32, device=DEV),
                                       torch.tensor([16, 5], dtype=torch.int32, device=DEV), layout, params)
    assert tqt.read_errors(DEV) == ErrorFlag(0) and good[0, :16].any()
    for bad in (-1, 4, 2**30):
        bt = torch.tensor([[2, bad], [3, 1]], dtype=torch.int32, device=DEV)
        ks, vs = tqt.decompress_sequences(cache, bt, sl, layout, params)
        assert tqt.read_errors(DEV) == ErrorFlag.BLOCK_OUT_OF_RANGE, bad
        assert not ks[0, 16:].any() and not vs[0, 16:].any() and ks[0, :16].any() and ks[1, :5].any()
    ks, _ = tqt.decompress_sequences(cache, torch.tensor([[2, 0], [3, 1]], dtype=torch.int32, device=DEV),
                                     torch.tensor([-3, 5], dtype=torch.int32, device=DEV), layout, params)
    assert tqt.read_errors(DEV) == ErrorFlag.SEQ_LEN_OUT_OF_RANGE and not ks[0].any()


def test_paged_decode_rejects_bad_arguments(setup):
    layout, params, _ = setup
    cache = tqt.allocate_cache(layout, 3, DEV)
    q = torch.randn(2, 4, 64, device=DEV).half()
    bt = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=DEV)
    sl = torch.tensor([20, 5], dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError, match=r"q must be float16 or bfloat16, got float32"):
        paged_decode(q.float(), cache, bt, sl, layout, params)
    with pytest.raises(ValueError, match=r"num_q_heads\) must be a positive multiple of num_kv_heads = 2, got 3"):
        paged_decode(q[:, :3], cache, bt, sl, layout, params)
    with pytest.raises(ValueError, match=r"q must have shape \[num_seqs, num_q_heads, 64\], got \[2, 4, 32\]"):
        paged_decode(q[..., :32], cache, bt, sl, layout, params)
    with pytest.raises(TypeError, match=r"block_table must be int32, got int64"):
        paged_decode(q, cache, bt.long(), sl, layout, params)
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[2\], got \[1\]"):
        paged_decode(q, cache, bt, sl[:1], layout, params)
    with pytest.raises(ValueError, match=r"seq_lens must be in \[0, max_blocks \* block_size = 32\], got range \[5, 33\]"):
        paged_decode(q, cache, bt, torch.tensor([33, 5], dtype=torch.int32, device=DEV), layout, params,
                     check_lengths=True)
    with pytest.raises(ValueError, match=r"block_table entries in use must be in \[0, num_blocks = 3\), got range \[0, 7\]"):
        paged_decode(q, cache, torch.tensor([[0, 7], [2, 0]], dtype=torch.int32, device=DEV), sl, layout, params,
                     check_lengths=True)
    with pytest.raises(ValueError, match=r"out must have shape \[2, 4, 64\]"):
        paged_decode(q, cache, bt, sl, layout, params, out=torch.empty(2, 4, 32, device=DEV).half())
    with pytest.raises(TypeError, match=r"out must be float16, got bfloat16"):
        paged_decode(q, cache, bt, sl, layout, params, out=torch.empty_like(q).bfloat16())
    with pytest.raises(ValueError, match=r"num_splits must be None or an int in \[1, 1024\], got 0"):
        paged_decode(q, cache, bt, sl, layout, params, num_splits=0)
    with pytest.raises(ValueError, match=r"block_table must have at least one column, got \[2, 0\]"):
        paged_decode(q, cache, bt[:, :0], sl, layout, params)
    with pytest.raises(ValueError, match=r"num_splits must be None or an int in \[1, 1024\], got True"):
        paged_decode(q, cache, bt, sl, layout, params, num_splits=True)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"scale must be finite, got {bad}"):
            paged_decode(q, cache, bt, sl, layout, params, scale=bad)
    for bad in ("0.1", True, [0.1]):
        with pytest.raises(TypeError, match=f"scale must be a real number or None, got {type(bad).__name__}"):
            paged_decode(q, cache, bt, sl, layout, params, scale=bad)
    with pytest.raises(ValueError, match=r"workspace must have at least .* = 1056 float32 elements, got 1055"):
        paged_decode(q, cache, bt, sl, layout, params, num_splits=2,
                     workspace=torch.empty(1055, dtype=torch.float32, device=DEV))


@needs_kernels
def test_paged_decode_edge_lengths(setup):
    """seq_len 0 gives zeros; seq_len 1; an exact page boundary; a batch of zero sequences."""
    layout, params, dp = setup
    k, v = _kv(48, seed=5)
    cache = tqt.allocate_cache(layout, 3, DEV)
    tqt.store(cache, k, v, torch.arange(48, device=DEV), layout, dp)
    q = torch.randn(4, 4, 64, device=DEV).half()
    bt = torch.tensor([[0, 1, 2]] * 4, dtype=torch.int32, device=DEV)
    sl = torch.tensor([0, 1, 16, 48], dtype=torch.int32, device=DEV)
    out = paged_decode(q, cache, bt, sl, layout, dp)
    assert torch.all(out[0] == 0)
    exp = ref.paged_decode(q.float().cpu().numpy(), cache.cpu().numpy(), bt.cpu().numpy(), sl.cpu().numpy(),
                           layout, params)
    assert np.abs(out.float().cpu().numpy() - exp).max() < 4e-3 * 5
    empty = paged_decode(q[:0], cache, bt[:0], sl[:0], layout, dp)
    assert empty.shape == (0, 4, 64)


def test_device_params_are_row_major_whatever_the_input_order():
    """A transposed (Fortran-ordered) rotation must reach the kernels as the same matrix."""
    fmt = tqkern.KVFormat.preset("tq4", 64)
    rot = np.linalg.qr(np.random.default_rng(0).standard_normal((64, 64)))[0].T  # F-ordered view
    params = tqkern.TQParams(format=fmt, rotation=rot, key_codebook=tqkern.lloyd_max(4, 64),
                             value_codebook=tqkern.lloyd_max(4, 64))
    assert params.rotation.flags.c_contiguous
    dp = tqt.to_device(params, "cpu")
    assert dp.rotation.is_contiguous()
    assert np.array_equal(dp.rotation.numpy(), rot.astype(np.float32))


def test_sequence_slot_ids_and_its_checks():
    bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    sl = torch.tensor([5, 0], dtype=torch.int32)
    ids = tqt.sequence_slot_ids(bt, sl, 4)
    assert ids.tolist() == [[12, 13, 14, 15, 4, -1, -1, -1], [-1] * 8]
    with pytest.raises(TypeError, match=r"block_table must be int32, got int64"):
        tqt.sequence_slot_ids(bt.long(), sl, 4)
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[2\], got \[1\]"):
        tqt.sequence_slot_ids(bt, sl[:1], 4)
    with pytest.raises(ValueError, match=r"block_size must be a positive int, got 0"):
        tqt.sequence_slot_ids(bt, sl, 0)


def test_quantize_and_compress_reject_bad_arguments(setup):
    _, params, _ = setup
    k, v = _kv(3)
    with pytest.raises(TypeError, match=r"key must be float16 or bfloat16, got float32"):
        tqt.quantize(k.float(), v, params)
    with pytest.raises(ValueError, match=r"key must have shape \[num_tokens, num_kv_heads, head_dim\]"):
        tqt.compress(k[0], v[0], params)
    with pytest.raises(TypeError, match=r"params must be a TQParams or DeviceParams, got int"):
        tqt.compress(k, v, 3)


def test_rotate_pack_unpack_to_device_reject_bad_arguments(setup):
    _, params, _ = setup
    with pytest.raises(TypeError, match=r"x must be float16 or bfloat16 or float32, got int64"):
        tqt.rotate(torch.zeros(2, 64, dtype=torch.long), params)
    with pytest.raises(ValueError, match=r"x.shape\[-1\] must be head_dim = 64, got 32"):
        tqt.rotate(torch.zeros(2, 32), params)
    with pytest.raises(TypeError, match=r"codes must be uint8, got int32"):
        tqt.pack(torch.zeros(4, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"bits must be an int in \[1, 8\], got 9"):
        tqt.pack(torch.zeros(4, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match=r"bits must be 4 with bit_order='nibble_high_even', got 3"):
        tqt.pack(torch.zeros(4, dtype=torch.uint8), 3, "nibble_high_even")
    with pytest.raises(ValueError, match=r"packed.shape\[-1\] must be 3 for n=8, bits=3, got 4"):
        tqt.unpack(torch.zeros(4, dtype=torch.uint8), 3, 8)
    for order in ("lsb", "nibble_high_even"):  # (the nibble form had put 17's high bits into its neighbour)
        with pytest.raises(ValueError, match=r"codes must be < 2\*\*bits = 16, got max 17"):
            tqt.pack(torch.tensor([0, 17, 0, 0], dtype=torch.uint8), 4, order)
        # unchecked (no sync): a bad code keeps to its own bits, its neighbours' bytes are intact
        got = tqt.pack(torch.tensor([0, 17, 0, 0], dtype=torch.uint8), 4, order, check_range=False)
        assert np.array_equal(got.numpy(), ref.pack(np.array([0, 1, 0, 0], np.uint8), 4, order))
    with pytest.raises(TypeError, match="check_range must be a bool, got int"):
        tqt.pack(torch.zeros(4, dtype=torch.uint8), 4, check_range=1)
    with pytest.raises(ValueError, match=r"codes must have at least one dimension \[..., n\], got shape \[\]"):
        tqt.pack(torch.tensor(3, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match=r"packed must have at least one dimension \[..., bytes\], got shape \[\]"):
        tqt.unpack(torch.tensor(3, dtype=torch.uint8), 4, 2)
    for bad in ("8", 7.5, -1, True):
        with pytest.raises(ValueError, match=f"n must be an int >= 0, got {bad!r}"):
            tqt.unpack(torch.zeros(4, dtype=torch.uint8), 4, bad)
    with pytest.raises(ValueError, match="n must be even for bit_order='nibble_high_even', got 7"):
        tqt.unpack(torch.zeros(4, dtype=torch.uint8), 4, 7, "nibble_high_even")
    with pytest.raises(TypeError, match=r"params must be a TQParams or DeviceParams, got dict"):
        tqt.to_device({}, "cpu")
    for bad in ("gpu0", -1, 1.5):
        with pytest.raises(ValueError, match=rf"device must be a torch device or its name .*got {bad!r}"):
            tqt.to_device(params, bad)
        with pytest.raises(ValueError, match=rf"device must be a torch device or its name .*got {bad!r}"):
            tqt.read_errors(bad)
        with pytest.raises(ValueError, match=rf"device must be a torch device or its name .*got {bad!r}"):
            tqt.check_errors(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' is not available: this torch has no usable CUDA device"):
            tqt.to_device(params, "cuda")
    with pytest.raises(TypeError, match="clear must be a bool, got str"):
        tqt.read_errors("cpu", clear="no")
    with pytest.raises(TypeError, match="inverse must be a bool, got str"):
        tqt.rotate(torch.zeros(2, 64), params, inverse="yes")
    layout = setup[0]
    cache = tqt.allocate_cache(layout, 1)
    with pytest.raises(ValueError, match=r"device must be a torch device or its name .*got 'gpu'"):
        tqt.allocate_cache(layout, 1, "gpu")
    with pytest.raises(TypeError, match="rotate_back must be a bool, got int"):
        tqt.decompress(cache, torch.zeros(1, dtype=torch.long), layout, params, rotate_back=1)


def test_a_cache_at_an_odd_address_is_refused_by_every_entry_point(setup):
    """The kernels read and write raw 16-bit fields at even offsets from the cache's first byte, so
    a contiguous cache view starting at an odd address (a misaligned 16-bit access on a GPU) is a
    ValueError naming it, before any launch."""
    layout, params, _ = setup
    n_bytes = int(np.prod(layout.cache_shape(2)))
    odd = torch.zeros(n_bytes + 1, dtype=torch.uint8, device=DEV)[1:].view(layout.cache_shape(2))
    assert odd.data_ptr() % 2 == 1 and odd.is_contiguous()
    k, v = _kv(4)
    slots = torch.arange(4, device=DEV)
    q = torch.randn(1, 4, 64, device=DEV).half()
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=DEV)
    sl = torch.tensor([4], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    calls = {
        "store": lambda: tqt.store(odd, k, v, slots, layout, params),
        "decompress": lambda: tqt.decompress(odd, slots, layout, params),
        "decompress_sequences": lambda: tqt.decompress_sequences(odd, bt, sl, layout, params),
        "paged_decode": lambda: tqt.paged_decode(q, odd, bt, sl, layout, params),
        "prefill": lambda: tqt.prefill(q, odd, bt, sl, qsl, layout, params),
        "int8_prefill": lambda: tqt.int8_prefill(q, odd, bt, sl, qsl, layout, params),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"cache must start at an even byte address .*storage offset 1"):
            call()
    fmt = layout.format
    kv_odd = torch.zeros(2 * 16 * 2 * fmt.slot_bytes + 1, dtype=torch.uint8, device=DEV)[1:].view(2, 16, 2,
                                                                                               fmt.slot_bytes)
    lengths = torch.tensor([4, 4], dtype=torch.int32, device=DEV)
    dense = {
        "dense_store": lambda: tqt.dense_store(kv_odd, k.view(2, 2, 2, 64), v.view(2, 2, 2, 64),
                                               torch.zeros(2, dtype=torch.int32, device=DEV), fmt, params),
        "dense_attention": lambda: tqt.dense_attention(torch.randn(2, 4, 1, 64, device=DEV).half(), kv_odd, lengths,
                                                       fmt, params),
    }
    for name, call in dense.items():
        with pytest.raises(ValueError, match=r"kv must start at an even byte address .*storage offset 1"):
            call()
