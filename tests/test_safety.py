"""No index value makes a kernel read or write outside its tensors; what the kernels skip or
change is recorded in the error word; non-finite inputs follow one policy (docs/layout.md).

Every cache here is a view into a larger buffer whose bytes around the cache are poisoned:
a write outside the cache shows up as a changed guard byte, a read outside it as a NaN (the
guard is 0xFF, which every float field decodes as NaN). Runs on the GPU (the warp-MMA kernel
included) and on the CPU (Triton interpreter, or the NumPy fallback).
"""

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern.errors import ErrorFlag
from tqkern_torch.testing import device_under_test, store_for_tests, to_torch_kv

# NaN inputs are the point of some tests: the interpreter's and NumPy's warnings about them are expected.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:All-NaN:RuntimeWarning")

DEV = device_under_test()
ON_GPU = DEV.type == "cuda"
GUARD = 4096
# (preset, arrangement, head_dim, num_kv_heads, group): the GPU shapes take the warp-MMA kernel
CASES = [("tq4", "row", 128, 8, 4), ("turboquant_4bit_nc", "slot", 128, 8, 4),
         ("turboquant_k8v4", "slot", 128, 8, 4), ("tqkern_k5v3", "slot", 128, 8, 4), ("fp16", "slot", 64, 2, 2)]
if not ON_GPU:  # the interpreter is slow: small heads
    CASES = [(p, a, 32, 2, 2) for p, a, _, _, _ in CASES]


def _guarded_cache(layout, num_blocks, fill=0xFF):
    shape = layout.cache_shape(num_blocks)
    size = int(np.prod(shape))
    buf = torch.full((size + 2 * GUARD,), fill, dtype=torch.uint8, device=DEV)
    return buf, buf[GUARD: GUARD + size].view(shape)


def _guard_intact(buf, fill=0xFF) -> bool:
    return bool((buf[:GUARD] == fill).all()) and bool((buf[-GUARD:] == fill).all())


def _setup(preset, arrangement, d, hkv, block_size=16, seed=0):
    fmt = tqkern.KVFormat.preset(preset, head_dim=d)
    layout = tqkern.PagedLayout(format=fmt, num_kv_heads=hkv, block_size=block_size, arrangement=arrangement)
    params = tqt.to_device(tqkern.TQParams.default(fmt, seed=seed), DEV)
    return layout, params


@pytest.fixture(autouse=True)
def _clear_errors():
    tqt.read_errors()
    yield
    tqt.read_errors()


def test_check_errors_is_quiet_without_errors():
    tqt.check_errors()
    assert tqt.read_errors(DEV) == ErrorFlag(0)


@pytest.mark.parametrize("bad", [0, 1, 10**6, 2**31 - 1, 2**40])
@pytest.mark.parametrize("case", CASES[:2] + CASES[4:], ids=lambda c: c[0])
def test_store_past_the_cache_writes_nothing(case, bad):
    preset, arrangement, d, hkv, _ = case
    layout, params = _setup(preset, arrangement, d, hkv)
    num_blocks = 2
    cap = num_blocks * layout.block_size
    rng = np.random.default_rng(1)
    k, _ = to_torch_kv(rng.standard_normal((3, hkv, d)), torch.float16, DEV)
    v, _ = to_torch_kv(rng.standard_normal((3, hkv, d)), torch.float16, DEV)
    dtype = torch.int64 if cap + bad >= 2**31 else torch.int32
    buf, cache = _guarded_cache(layout, num_blocks)
    tqt.store(cache, k, v, torch.tensor([0, cap + bad, 5], dtype=dtype, device=DEV), layout, params)
    assert _guard_intact(buf)
    with pytest.raises(tqt.TQKernError, match="SLOT_OUT_OF_RANGE") as err:
        tqt.check_errors(DEV)
    assert err.value.flags == ErrorFlag.SLOT_OUT_OF_RANGE
    tqt.check_errors(DEV)  # cleared by the check
    _, clean = _guarded_cache(layout, num_blocks)
    tqt.store(clean, k, v, torch.tensor([0, -1, 5], dtype=dtype, device=DEV), layout, params)
    assert torch.equal(cache, clean)
    assert tqt.read_errors(DEV) == ErrorFlag(0)  # a negative slot is a skip, not an error


def test_decompress_past_the_cache_reads_zeros():
    preset, arrangement, d, hkv, _ = CASES[0]
    layout, params = _setup(preset, arrangement, d, hkv)
    buf, cache = _guarded_cache(layout, 1, fill=0)
    k, _ = to_torch_kv(np.ones((2, hkv, d)), torch.float16, DEV)
    tqt.store(cache, k, k, torch.tensor([0, 1], dtype=torch.int64, device=DEV), layout, params)
    ids = torch.tensor([0, 16, 10**9, -1, 1], dtype=torch.int64, device=DEV)
    kd, vd = tqt.decompress(cache, ids, layout, params)
    assert tqt.read_errors(DEV) == ErrorFlag.SLOT_OUT_OF_RANGE
    for x in (kd, vd):
        assert torch.all(x[1:4] == 0) and torch.all(x[[0, 4]].abs().sum(-1) > 0)


def _decode_setup(case, num_seqs=3, seq_len=100, num_blocks=24):
    """A guarded cache of ``num_blocks`` blocks of random K/V (the store kernel on a GPU, the store
    oracle elsewhere: the same bytes; the store's own guards are tested above), a shuffled block
    table of ``num_seqs`` sequences of ``seq_len`` tokens (8 blocks a row), lengths and fp16 queries."""
    preset, arrangement, d, hkv, g = case
    layout, params = _setup(preset, arrangement, d, hkv)
    rng = np.random.default_rng(2)
    buf, cache = _guarded_cache(layout, num_blocks)
    n = num_blocks * layout.block_size
    host = tqkern.TQParams.default(layout.format, seed=0)  # (_setup's params, on the host)
    store_for_tests(cache, rng.standard_normal((n, hkv, d)), rng.standard_normal((n, hkv, d)), np.arange(n), layout,
                    host, torch.float16)
    assert tqt.read_errors(DEV) == ErrorFlag(0)
    max_blocks = 8
    bt = torch.from_numpy(rng.permutation(num_blocks)[: num_seqs * max_blocks].reshape(num_seqs, max_blocks)
                          .astype(np.int32)).to(DEV)
    sl = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=DEV)
    q = torch.from_numpy(rng.standard_normal((num_seqs, hkv * g, d)).astype(np.float32)).half().to(DEV)
    return layout, params, buf, cache, bt, sl, q


@pytest.mark.parametrize("bad", [-1, -2**31, 24, 2**31 - 1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_paged_decode_bad_block_reads_nothing_outside(case, bad):
    layout, params, buf, cache, bt, sl, q = _decode_setup(case)
    clean = tqt.paged_decode(q, cache, bt, sl, layout, params)
    assert tqt.read_errors(DEV) == ErrorFlag(0)
    bt_bad = bt.clone()
    bt_bad[1, 3] = bad  # in use: positions 48..63 of a 100-token sequence
    bt_bad[2, 7] = bad  # padding (past seq_lens): never read, not an error
    out = tqt.paged_decode(q, cache, bt_bad, sl, layout, params)
    assert tqt.read_errors(DEV) == ErrorFlag.BLOCK_OUT_OF_RANGE
    assert torch.isfinite(out).all(), "a read outside the cache (its guard decodes as NaN)"
    assert torch.equal(out[[0, 2]], clean[[0, 2]]), "other sequences must not change"
    assert _guard_intact(buf)


@pytest.mark.parametrize("case", CASES[:1] + CASES[4:], ids=lambda c: c[0])
def test_paged_decode_clamps_bad_lengths(case):
    layout, params, buf, cache, bt, sl, q = _decode_setup(case)
    cap = bt.shape[1] * layout.block_size
    want = tqt.paged_decode(q, cache, bt, torch.tensor([cap, 0, 7], dtype=torch.int32, device=DEV), layout, params)
    assert tqt.read_errors(DEV) == ErrorFlag(0)
    out = tqt.paged_decode(q, cache, bt, torch.tensor([cap + 1, -5, 7], dtype=torch.int32, device=DEV), layout,
                           params)
    assert tqt.read_errors(DEV) == ErrorFlag.SEQ_LEN_OUT_OF_RANGE
    assert torch.equal(out, want)
    assert torch.all(out[1] == 0)


def test_paged_decode_on_an_empty_cache():
    layout, params = _setup(*CASES[0][:4])
    d, h = layout.head_dim, layout.num_kv_heads
    cache = tqt.allocate_cache(layout, 0, DEV)
    bt = torch.zeros((2, 4), dtype=torch.int32, device=DEV)
    q = torch.ones((2, h * 2, d), dtype=torch.float16, device=DEV)
    out = tqt.paged_decode(q, cache, bt, torch.tensor([0, 9], dtype=torch.int32, device=DEV), layout, params)
    assert tqt.read_errors(DEV) == ErrorFlag.BLOCK_OUT_OF_RANGE
    assert torch.all(out[0] == 0) and torch.isfinite(out).all()


def test_debug_raises_right_after_the_call():
    layout, params, _, cache, bt, sl, q = _decode_setup(CASES[0])
    bt[0, 0] = 10**6
    with pytest.raises(tqt.TQKernError, match="BLOCK_OUT_OF_RANGE"):
        tqt.paged_decode(q, cache, bt, sl, layout, params, debug=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_nonfinite_query_rows_give_nan_rows(case):
    layout, params, _, cache, bt, sl, q = _decode_setup(case)
    clean = tqt.paged_decode(q, cache, bt, sl, layout, params)
    q2 = q.clone()
    q2[0, 1, 3] = float("nan")
    q2[2, 0, 0] = float("inf")
    q2[1, 2, 5] = float("-inf")
    sl2 = sl.clone()
    sl2[1] = 0  # an empty sequence too: the NaN row wins over its zeros
    out = tqt.paged_decode(q2, cache, bt, sl2, layout, params)
    bad = torch.zeros(out.shape[:2], dtype=torch.bool, device=DEV)
    bad[0, 1] = bad[2, 0] = bad[1, 2] = True
    assert torch.isnan(out[bad]).all()
    keep = ~bad
    keep[1] = False
    assert torch.equal(out[keep], clean[keep])
    assert torch.all(out[1][~bad[1]] == 0)
    assert tqt.read_errors(DEV) == ErrorFlag(0)  # a query is not stored: nothing to flag


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_nonfinite_keys_and_values_are_stored_as_zeros(case):
    preset, arrangement, d, hkv, _ = case
    layout, params = _setup(preset, arrangement, d, hkv)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((4, hkv, d))
    v = rng.standard_normal((4, hkv, d))
    k[1, 0, 2] = np.nan
    v[2, hkv - 1, 0] = -np.inf
    kt, k64 = to_torch_kv(k, torch.float16, DEV)
    vt, v64 = to_torch_kv(v, torch.float16, DEV)
    buf, cache = _guarded_cache(layout, 1)
    slots = np.array([3, 0, 7, 1])
    tqt.store(cache, kt, vt, torch.from_numpy(slots).to(DEV), layout, params)
    assert tqt.read_errors(DEV) == ErrorFlag.NONFINITE_INPUT
    got = ref.gather_slots(cache.cpu().numpy(), layout, slots)
    want, unsure, flags = ref.compress(k64, v64, params.params, return_uncertain=True, return_flags=True)
    assert flags == ErrorFlag.NONFINITE_INPUT
    k0, v0 = k64.copy(), v64.copy()
    k0[1, 0] = 0.0
    v0[2, hkv - 1] = 0.0
    assert np.array_equal(want, ref.compress(k0, v0, params.params))  # the oracle: zero vectors
    assert np.array_equal(got[~unsure], want[~unsure])
    kd, vd = tqt.decompress(cache, torch.from_numpy(slots).to(DEV), layout, params)
    assert torch.isfinite(kd).all() and torch.isfinite(vd).all()
    assert torch.all(kd[1, 0] == 0) and torch.all(vd[2, hkv - 1] == 0)
    assert _guard_intact(buf)


@pytest.mark.parametrize("preset, big", [("turboquant_4bit_nc", 15000.0), ("turboquant_k8v4", 1000.0)])
def test_out_of_range_floats_saturate_and_are_flagged(preset, big):
    layout, params = _setup(preset, "slot", 64 if ON_GPU else 32, 2)
    d = layout.head_dim
    k = np.random.default_rng(4).standard_normal((2, 2, d)).clip(-3, 3)
    k[1, 1] *= big  # fp16 norm: ~15000·√D > 65504 (each element < 65504); FP8: |k| up to 3000 > 448
    kt, k64 = to_torch_kv(k, torch.float16, DEV)
    _, cache = _guarded_cache(layout, 1)
    tqt.store(cache, kt, kt, torch.tensor([0, 1], device=DEV), layout, params)
    assert tqt.read_errors(DEV) == ErrorFlag.SATURATED
    slots, unsure, flags = ref.compress(k64, k64, params.params, return_uncertain=True, return_flags=True)
    assert flags == ErrorFlag.SATURATED
    got = ref.gather_slots(cache.cpu().numpy(), layout, np.array([0, 1]))
    assert np.array_equal(got[~unsure], slots[~unsure])
    kd, _ = tqt.decompress(cache, torch.tensor([1], device=DEV), layout, params, rotate_back=True)
    assert torch.isfinite(kd).all()


def test_device_params_tables_must_fit_the_format():
    """The kernels index the centroid tables by codes and read Π and μ by head_dim without masks:
    a DeviceParams whose tables do not match its params' format (e.g. built by
    ``dataclasses.replace``) is refused, naming the table."""
    import dataclasses

    fmt = tqkern.KVFormat.preset("k5v4h", 64)
    params = tqkern.TQParams.default(fmt, key_offset=np.zeros((3, 64)))
    dp = tqt.to_device(params, DEV)
    with pytest.raises(ValueError, match=r"DeviceParams.rotation must be a contiguous torch.float32 tensor of shape "
                                         r"\(64, 64\) on .*, got torch.float32 \(4, 4\)"):
        dataclasses.replace(dp, rotation=dp.rotation[:4, :4].contiguous())
    with pytest.raises(ValueError, match=r"DeviceParams.key_centroids must be .* of shape \(32,\) .*, got torch.float64 "
                                         r"\(2,\)"):
        dataclasses.replace(dp, key_centroids=dp.key_centroids[:2].contiguous())
    with pytest.raises(ValueError, match=r"DeviceParams.value_centroids_f32 must be .*torch.float32.*, got torch.float64"):
        dataclasses.replace(dp, value_centroids_f32=dp.value_centroids)
    with pytest.raises(ValueError, match=r"DeviceParams.key_offset must be .* of shape \(3, 64\)"):
        dataclasses.replace(dp, key_offset=dp.key_offset[:, :8].contiguous())
    with pytest.raises(ValueError, match=r"DeviceParams.key_offset_signed must be .* of shape \(3, 64\)"):
        dataclasses.replace(dp, key_offset_signed=dp.key_offset_signed[:2].contiguous())
    assert dp.key_int8_table.shape == (65,)  # 32 centroids, their int8 image, its scale
    with pytest.raises(ValueError, match=r"DeviceParams.key_int8_table must be .* of shape \(65,\) .*, got "
                                         r"torch.float32 \(32,\)"):
        dataclasses.replace(dp, key_int8_table=dp.key_int8_table[:32].contiguous())
    with pytest.raises(TypeError, match="DeviceParams.key_boundaries must be a torch.Tensor, got ndarray"):
        dataclasses.replace(dp, key_boundaries=dp.key_boundaries.cpu().numpy())
    plain = tqt.to_device(tqkern.TQParams.default(fmt), DEV)
    with pytest.raises(ValueError, match="DeviceParams.key_offset must be None when params.key_offset is None"):
        dataclasses.replace(plain, key_offset=dp.key_offset)
    with pytest.raises(ValueError, match="DeviceParams.key_offset_signed must be None when params.key_offset is None"):
        dataclasses.replace(plain, key_offset_signed=dp.key_offset_signed)
    assert dataclasses.replace(dp).key_centroids.shape == (32,)
    wide = tqt.to_device(tqkern.TQParams.default(tqkern.KVFormat.preset("tq4", 256)), DEV)
    with pytest.raises(ValueError, match=r"DeviceParams.rotation_parts must be a contiguous torch.float16 tensor of "
                                         r"shape \(2, 256, 256\) .*, got torch.float32 \(256, 256\)"):
        dataclasses.replace(wide, rotation_parts=wide.rotation)
