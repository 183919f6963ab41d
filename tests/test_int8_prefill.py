"""``tqkern_torch.int8_prefill``: named edge cases against its oracle
(``tqkern.ops.int8_prefill.reference``), the NumPy fallback, a bad argument, and the plan. Its op
registration (opcheck, ``torch.compile(fullgraph=True)``) is tested beside ``prefill``'s in
``tests/test_prefill.py``; the property tests are ``property_tests/test_int8_prefill_triton.py``."""

import numpy as np
import pytest
import torch

import tqkern_torch as tqt
from tests.test_prefill import DEV, HQ, D, _qsl, case, needs_kernels  # noqa: F401  (case: the fixture)
from tqkern.ops.int8_prefill.reference import int8_prefill as oracle
from tqkern.ops.paged_decode.plan import DeviceCaps
from tqkern.ops.prefill.plan import plan_prefill


def _args(case, q_lens, seed=0):
    layout, params, cache, bt, sl = case
    qsl = _qsl(q_lens)
    q = torch.from_numpy(np.random.default_rng(seed).standard_normal((int(qsl[-1]), HQ, D))).half()
    return layout, params, cache, bt, sl, qsl, q


@needs_kernels
@pytest.mark.parametrize("q_lens", [[33, 32, 17, 0], [1, 1, 1, 0], [0, 0, 0, 0], [16, 8, 2, 0]],
                         ids=["whole", "decode", "empty", "chunks"])
def test_edges_match_oracle(case, q_lens):
    """Whole sequences, decode rows, an empty batch and chunks on cached prefixes; the kernel's
    codes equal the oracle's away from float ties, so the outputs agree to the P·V rounding."""
    layout, params, cache, bt, sl, qsl, q = _args(case, q_lens)
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, sl, qsl)]
    out, lse = tqt.int8_prefill(q.to(DEV), *t, layout, tqt.to_device(params, DEV), return_lse=True)
    eo, el = oracle(q.double().numpy(), cache, bt, sl, qsl, layout, params, return_lse=True)
    got = out.float().cpu().numpy()
    assert got.shape == eo.shape and np.all(np.isfinite(got))
    if got.size:
        assert np.abs(got - eo).max() <= 4e-3 * max(1.0, float(np.abs(eo).max()))
        assert np.abs(lse.cpu().numpy() - el).max() <= 2e-3


@needs_kernels
@pytest.mark.parametrize("route", ["checked", "max_query_len", "fused"])
def test_short_sequences_take_prefills_rows_on_every_route(case, route):
    """Sequences of <= EXACT_QUERY_MAX tokens get ``prefill``'s rows, bit for bit, from the same
    call of ``prefill`` on the same route: the checked split (short rows on the decode-kernel
    path, long ones int8), a ``max_query_len`` (all short: that path whole) and the unchecked
    fused kernel (its int8 launch must not touch the short sequences' rows); the long sequence's
    rows are int8's, not prefill's."""
    from tqkern.ops.int8_prefill.reference import EXACT_QUERY_MAX

    q_lens = [1, 8, 1, 0] if route == "max_query_len" else [1, 8, 17, 0]
    layout, params, cache, bt, sl, qsl, q = _args(case, q_lens, seed=5)
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, sl, qsl)]
    opts = {"checked": {}, "max_query_len": {"max_query_len": EXACT_QUERY_MAX},
            "fused": {"check_inputs": False}}[route]
    p = tqt.to_device(params, DEV)
    o8, l8 = tqt.int8_prefill(q.to(DEV), *t, layout, p, return_lse=True, **opts)
    o, lse = tqt.prefill(q.to(DEV), *t, layout, p, return_lse=True, **opts)
    short = slice(0, 9)
    assert torch.equal(o8[short], o[short]) and torch.equal(l8[short], lse[short])
    if route != "max_query_len":
        assert not torch.equal(o8[9:], o[9:])  # (int8 scores move the long rows)
        eo = oracle(q.double().numpy(), cache, bt, sl, qsl, layout, params)
        assert np.abs(o8.float().cpu().numpy() - eo).max() <= 4e-3 * max(1.0, float(np.abs(eo).max()))


@needs_kernels
def test_captured_mixed_batch_takes_the_fused_kernel(case, monkeypatch):
    """Under capture with host lengths that include short sequences, the rows go to the fused
    kernel (two launches), not to the tiled path, whose int8 pieces would score the short
    sequences in int8; ``tile_prefill`` itself refuses them, naming the first."""
    import importlib

    from tqkern_torch.prefill_tiles import tile_prefill

    frontend = importlib.import_module("tqkern_torch.prefill")  # (the package's `prefill` is the function)

    layout, params, cache, bt, sl, qsl, q = _args(case, [1, 8, 17, 0], seed=7)
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, sl, qsl)]
    p = tqt.to_device(params, DEV)
    with pytest.raises(ValueError, match=r"q_lens must be 0 or > 8 for int8 tiles .*got q_lens\[0\] = 1"):
        tile_prefill(q.to(DEV), *t, layout, p, q_lens=[1, 8, 17, 0], seq_lens=sl.tolist(), num_blocks=cache.shape[0],
                     errors=torch.zeros(1, dtype=torch.int32, device=DEV), scale=D ** -0.5, out=None, lse=None,
                     window_left=None, sinks=None, int8=True)

    with pytest.raises(TypeError, match="gather must be None or a GatherConfig, got tuple"):
        tile_prefill(q.to(DEV), *t, layout, p, q_lens=[1, 8, 17, 0], seq_lens=sl.tolist(), num_blocks=cache.shape[0],
                     errors=torch.zeros(1, dtype=torch.int32, device=DEV), scale=D ** -0.5, out=None, lse=None,
                     window_left=None, sinks=None, gather=(64, 2, 4))

    def no_tiles(*args, **kwargs):
        raise AssertionError("the tiled path was taken")

    monkeypatch.setattr(frontend, "tiles_supported", lambda *a, **k: True)
    monkeypatch.setattr(frontend, "tile_prefill", no_tiles)
    monkeypatch.setattr(frontend, "_tracing_or_capturing", lambda dev: True)
    got = tqt.int8_prefill(q.to(DEV), *t, layout, p, query_start_loc_cpu=torch.from_numpy(qsl),
                           seq_lens_cpu=torch.from_numpy(sl))
    want = tqt.int8_prefill(q.to(DEV), *t, layout, p, check_inputs=False)  # the fused kernel
    assert torch.equal(got, want)


def test_numpy_fallback_equals_oracle(case, monkeypatch):
    """Without a GPU and without the interpreter, CPU tensors run the int8 oracle."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    layout, params, cache, bt, sl, qsl, q = _args(case, [4, 1, 17, 0], seed=3)
    t = [torch.from_numpy(x) for x in (cache, bt, sl, qsl)]
    out = tqt.int8_prefill(q, *t, layout, params, logit_softcap=5.0)
    exp = oracle(q.double().numpy(), cache, bt, sl, qsl, layout, params, logit_softcap=5.0)
    # (the frontend's parameters hold Π in float32: the oracle's float64 result within an fp16 ulp,
    # but for a code that Π's float32 rounding moves across a half)
    assert np.allclose(out.numpy(), exp, rtol=2**-10, atol=4e-3 * float(np.abs(exp).max()))


def test_int8_prefill_checks_its_arguments_like_prefill(case):
    layout, params, cache, bt, sl, qsl, q = _args(case, [1, 1, 1, 0])
    t = [torch.from_numpy(x) for x in (cache, bt, sl, qsl)]
    with pytest.raises(TypeError, match="q must be float16 or bfloat16, got float32"):
        tqt.int8_prefill(q.float(), *t, layout, params)
    with pytest.raises(ValueError, match="query_start_loc"):
        tqt.int8_prefill(q, *t[:3], torch.tensor([0, 1, 2, 9, 3], dtype=torch.int32), layout, params)


def test_int8_plan_reads_keys_through_the_float32_loader():
    """The int8 kernel reconstructs keys in float32 (the loader), so its plan drops the keys'
    4-bit word path; values keep theirs."""
    import tqkern

    fmt = tqkern.KVFormat.preset("turboquant_4bit_nc", 128)
    lay = tqkern.PagedLayout(format=fmt, num_kv_heads=8, block_size=16)
    base = dict(plan_prefill(lay, 32, DeviceCaps.sm90()).constexprs)
    i8 = plan_prefill(lay, 32, DeviceCaps.sm90(), int8=True)
    cx = dict(i8.constexprs)
    assert i8.int8 and cx["INT8"] and not base["INT8"] and "int8" in i8.describe()
    assert base["K_FAST"] > 0 and cx["K_FAST"] == 0 and cx["V_FAST"] == base["V_FAST"]


def _tie_free(x, s, codes, expect):
    """Codes equal the oracle's wherever ``|x| / s`` is not within 1e-4 of a half-integer."""
    t = np.abs(x) / np.where(s > 0, s, 1.0)[..., None]
    near = np.abs(t - np.floor(t) - 0.5) <= 1e-4
    assert np.array_equal(codes[~near], expect[~near])


@needs_kernels
@pytest.mark.parametrize("d, rotation", [(64, "sylvester"), (128, "sylvester"), (256, "sylvester"), (64, "haar"),
                                         (256, "haar"), (64, None)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_query_codes_match_oracle(d, rotation, dtype):
    """``quantize_q`` (each rotation method: the Walsh–Hadamard transform for a signed Sylvester Π,
    split parts, float32 chunks, none):
    the oracle's codes of ``q @ Π`` away from ties, its scales to float32 rounding, NaN scales for
    rows holding a NaN or inf."""
    from tqkern.ops.int8_prefill.reference import quantize_int8
    from tqkern.rotations import haar, hadamard
    from tqkern_torch.prefill_tiles import quantize_q

    if dtype == torch.bfloat16 and DEV.type != "cuda":
        pytest.skip("the interpreter has no bf16")
    rng = np.random.default_rng(d)
    pi = np.eye(d) if rotation is None else hadamard(d, 5) if rotation == "sylvester" else haar(d, 5)
    q = torch.from_numpy(rng.standard_normal((70, 3, d)) * 3).to(dtype)
    q[5, 1, 7] = float("nan")
    q[9, 2, 0] = float("inf")
    q64 = q.double().numpy()
    rot = torch.from_numpy(pi).float().to(DEV)
    codes, scales = quantize_q(q.to(DEV), rot, rotation is not None, rotation == "sylvester")
    codes, scales = codes.cpu().numpy(), scales.cpu().numpy().astype(np.float64)
    x = q64 @ pi
    ec, es = quantize_int8(x)
    bad = ~np.all(np.isfinite(q64), axis=-1)
    assert np.all(np.isnan(scales[bad])) and np.all(np.isfinite(scales[~bad]))
    np.testing.assert_allclose(scales[~bad], es[~bad], rtol=1e-6)
    _tie_free(x[~bad], es[~bad], codes[~bad], ec[~bad])


@needs_kernels
@pytest.mark.parametrize("preset", ["tq4", "turboquant_4bit_nc", "turboquant_k8v4", "tqkern_k5v3", "fp16"])
def test_gathered_key_codes_match_oracle(preset, monkeypatch):
    """The gather's int8 keys (``K_INT8``): the oracle's codes of each key (in its codec's space,
    ``key − μ``) and its scales. Lloyd-Max keys (the codebook's int8 image: a table lookup) equal
    the oracle's codes everywhere; FP8 and raw keys (the per-token maximum of the reconstruction)
    away from float ties."""
    import tqkern
    from tqkern import reference as ref
    from tqkern.ops.decompress.reference import decompress, gather_sequences
    from tqkern.ops.int8_prefill.reference import _key_int8
    from tqkern_torch.errors import error_word
    from tqkern_torch.ops import _device_params
    from tqkern_torch.prefill_tiles import tile_prefill

    layout = tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, 64), num_kv_heads=2, block_size=16)
    params = tqkern.TQParams.default(layout.format)
    rng = np.random.default_rng(1)
    n = 40
    k, v = (rng.standard_normal((n, 2, 64)).astype(np.float16) for _ in range(2))
    bt = np.array([[2, 0, 1]], np.int32)
    slots = bt[0][np.arange(n) // 16] * 16 + np.arange(n) % 16
    cache = ref.store(np.zeros(layout.cache_shape(3), np.uint8), k, v, slots, layout, params)
    seq = gather_sequences(cache, layout, bt, np.array([n], np.int32))[0]  # [n, 2, slot_bytes]
    khat = decompress(seq, params)[0]  # [n, 2, 64]
    ec, es = _key_int8(seq, khat, params)
    seen = {}

    def attend(q, kk, vv, batch, **kw):  # the int8 keys the attention kernel is given
        seen["k"] = (kk[0].cpu().numpy(), kk[1].cpu().numpy().astype(np.float64))
        return torch.zeros_like(vv[:0].new_empty(q[0].shape)), torch.zeros(q[1].shape, device=vv.device)

    import tqkern_torch.prefill_tiles as pt
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, np.array([n], np.int32), np.array([0, n], np.int32))]
    q = torch.zeros(n, 2, 64, dtype=torch.float16, device=DEV)
    monkeypatch.setattr(pt, "attend_tiles", attend)
    tile_prefill(q, *t, layout, _device_params(params, layout, q.device), q_lens=[n], seq_lens=[n], num_blocks=3,
                 errors=error_word(DEV), scale=0.125, out=None, lse=None, window_left=None, sinks=None, int8=True)
    codes, scales = seen["k"]
    np.testing.assert_allclose(scales, es, rtol=1e-6)
    if isinstance(layout.format.key, tqkern.LloydMax):
        assert np.array_equal(codes, ec)
        assert len(np.unique(ec)) > 8  # the image's codes, not a constant
    else:
        _tie_free(khat, es, codes, ec)


def test_tile_kernels_name_bad_arguments():
    """``quantize_q`` and ``attend_tiles`` name the argument, what they expect and what they got."""
    from tqkern_torch.prefill_tiles import attend_tiles, quantize_q

    q = torch.zeros(4, 2, 64, dtype=torch.float16)
    rot = torch.eye(64)
    with pytest.raises(TypeError, match="q must be float16 or bfloat16, got float32"):
        quantize_q(q.float(), rot, True)
    with pytest.raises(ValueError, match=r"rotation must have shape \[64, 64\], got \[32, 32\]"):
        quantize_q(q, torch.eye(32), True)
    with pytest.raises(TypeError, match="rotation must be float32, got float64"):
        quantize_q(q, rot.double(), True)
    from tqkern.ops.int8_prefill.triton import quantize_config
    fwht = quantize_config(True, True, 64, interpret=True)
    assert fwht.FWHT
    with pytest.raises(ValueError, match="config.FWHT needs rotate and signed_sylvester at a power-of-two head_dim "
                                         ">= 16, got rotate=True, signed_sylvester=False, head_dim 64"):
        quantize_q(q, rot, True, False, config=fwht)
    with pytest.raises(ValueError, match="signed_sylvester=True, head_dim 48"):
        quantize_q(torch.zeros(4, 2, 48, dtype=torch.float16), torch.eye(48), True, True, config=fwht)
    k = torch.zeros(6, 1, 64, dtype=torch.float16)
    codes, scales = torch.zeros(4, 2, 64, dtype=torch.int8), torch.zeros(4, 2)
    kw = dict(causal=True, scale=0.1, window_left=None)
    with pytest.raises(TypeError, match="q and k must both be tensors"):
        attend_tiles((codes, scales), k, k, 1, **kw)
    with pytest.raises(TypeError, match="q codes must be int8, got float16"):
        attend_tiles((q, scales), (torch.zeros(6, 1, 64, dtype=torch.int8), torch.zeros(6, 1)), k, 1, **kw)
    with pytest.raises(ValueError, match=r"k scales must have shape \[6, 1\], got \[6\]"):
        attend_tiles((codes, scales), (torch.zeros(6, 1, 64, dtype=torch.int8), torch.zeros(6)), k, 1, **kw)
    with pytest.raises(ValueError, match=r"k must have shape \[6, 1, 64\], got \[5, 1, 64\]"):
        attend_tiles(q, k[:5], k, 1, **kw)
    with pytest.raises(ValueError, match="must split into batch=4 equal sequences, got 4 and 6"):
        attend_tiles(q, k, k, 4, **kw)
    with pytest.raises(ValueError, match="q's heads must be a multiple of k's, got 3 and 2"):
        attend_tiles(torch.zeros(4, 3, 64, dtype=torch.float16), torch.zeros(6, 2, 64, dtype=torch.float16),
                     torch.zeros(6, 2, 64, dtype=torch.float16), 1, **kw)


@needs_kernels
@pytest.mark.parametrize("int8", [True, False], ids=["int8", "half"])
@pytest.mark.parametrize("mask", ["causal", "window", "none"])
def test_attend_tiles_descriptor_loads_equal_pointer_loads(int8, mask):
    """K/V tiles through tensor descriptors (TMA) give the pointer loads' outputs and lse bit for
    bit: two sequences in one call (the first's last key tile reads the second's rows), chunks
    (Lq < Lk), lengths off the tile grid. The second sequence's values hold a NaN, which the
    first's rows must not see (TMA loads those rows; the kernel zeroes them)."""
    from tqkern_torch.prefill_tiles import attend_tiles, tma_supported

    g = torch.Generator().manual_seed(7)
    lq, lk, hq, hkv, d = 37, 45, 4, 2, 64
    v = torch.randn(2 * lk, hkv, d, generator=g).half()
    v[lk + 3, 1, 5] = float("nan")
    if int8:
        q = (torch.randint(-127, 128, (2 * lq, hq, d), generator=g, dtype=torch.int8),
             torch.rand(2 * lq, hq, generator=g) / 64)
        k = (torch.randint(-127, 128, (2 * lk, hkv, d), generator=g, dtype=torch.int8),
             torch.rand(2 * lk, hkv, generator=g) / 64)
    else:
        q, k = torch.randn(2 * lq, hq, d, generator=g).half(), torch.randn(2 * lk, hkv, d, generator=g).half()
    on = (lambda x: tuple(t.to(DEV) for t in x)) if int8 else (lambda x: x.to(DEV))
    q, k, v = on(q), on(k), v.to(DEV)
    assert tma_supported(k[0] if int8 else k, v, d)
    kw = dict(causal=mask != "none", scale=d ** -0.5, window_left=9 if mask == "window" else None,
              softcap=None if int8 else 20.0)
    o1, l1 = attend_tiles(q, k, v, 2, tma=True, **kw)
    o0, l0 = attend_tiles(q, k, v, 2, tma=False, **kw)
    assert torch.equal(l1, l0) and torch.equal(o1[:lq], o0[:lq]) and torch.isfinite(o1[:lq]).all()
    torch.testing.assert_close(o1, o0, rtol=0, atol=0, equal_nan=True)


def test_descriptor_rules_check_their_arguments():
    """``attend_tma`` (the planner's rule) and ``tma_supported`` (the host's check) name a bad
    argument, its expectation and what came."""
    from tqkern.ops.prefill.attend import attend_tma
    from tqkern_torch.prefill_tiles import tma_supported

    assert [attend_tma(d, i) for d, i in ((128, False), (128, True), (256, True))] == [True, False, True]
    for bad in (0, 128.0, True):
        with pytest.raises(ValueError, match=rf"head_dim must be an int >= 1, got {bad!r}"):
            attend_tma(bad, False)
    with pytest.raises(TypeError, match="int8 must be a bool, got int"):
        attend_tma(128, 1)
    k = torch.zeros(6, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"v must be a 3-d tensor \[tokens, Hkv, D\], got \(6, 64\)"):
        tma_supported(k, k[:, 0], 64)
    with pytest.raises(ValueError, match=r"k must be a 3-d tensor \[tokens, Hkv, D\], got list"):
        tma_supported([], k, 64)
    with pytest.raises(ValueError, match=r"k and v must have one shape, got \(6, 1, 64\) and \(5, 1, 64\)"):
        tma_supported(k, k[:5], 64)
    with pytest.raises(ValueError, match="dp must be an int >= 1, got 64.0"):
        tma_supported(k, k, 64.0)
    assert not tma_supported(k, k, 128)  # the box would reach into the next head


@needs_kernels
def test_attend_tiles_refuses_descriptors_where_unsupported():
    from tqkern_torch.prefill_tiles import attend_tiles

    q, k = torch.zeros(4, 2, 48, dtype=torch.float16, device=DEV), torch.zeros(6, 1, 48, dtype=torch.float16,
                                                                               device=DEV)
    with pytest.raises(ValueError, match=r"tma=True needs .* power-of-two head_dim .* got k \(6, 1, 48\)"):
        attend_tiles(q, k, k, 1, causal=True, scale=0.1, window_left=None, softcap=5.0, tma=True)
    with pytest.raises(TypeError, match="tma must be None, True or False, got 1"):
        attend_tiles(q, k, k, 1, causal=True, scale=0.1, window_left=None, softcap=5.0, tma=1)
    out, _ = attend_tiles(q, k, k, 1, causal=True, scale=0.1, window_left=None, softcap=5.0)  # pointer loads
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("preset", ["tq4", "turboquant_3bit_nc", "turboquant_k8v4", "fp16"])
def test_device_params_key_int8_table(preset):
    """The table the int8 kernels read for Lloyd-Max keys: the float32 centroids, then the int8
    image (as floats), then its scale; a 1-element placeholder for other key codecs."""
    import tqkern
    from tqkern.ops.int8_prefill.reference import int8_image

    params = tqkern.TQParams.default(tqkern.KVFormat.preset(preset, 64))
    tab = tqt.to_device(params, "cpu").key_int8_table
    assert tab.dtype == torch.float32 and tab.is_contiguous()
    if params.key_codebook is None:
        assert tab.shape == (1,)
        return
    c = params.key_codebook.centroids
    c8, s_cb = int8_image(c)
    n = len(c)
    assert tab.shape == (2 * n + 1,)
    assert np.array_equal(tab[:n].numpy(), c.astype(np.float32))
    assert np.array_equal(tab[n:2 * n].numpy(), c8.astype(np.float32))
    assert tab[2 * n].item() == np.float32(s_cb)


@needs_kernels
def test_parameters_without_the_int8_table_are_named(case):
    """A DeviceParams built without ``key_int8_table`` (to_device always fills it) is refused by
    the kernels' path, naming the table, rather than read as the centroid table."""
    import dataclasses

    layout, params, cache, bt, sl, qsl, q = _args(case, [4, 1, 2, 0])
    t = [torch.from_numpy(x).to(DEV) for x in (cache, bt, sl, qsl)]
    p = dataclasses.replace(tqt.to_device(params, DEV), key_int8_table=None)
    with pytest.raises(ValueError, match="params.key_int8_table must be a tensor for int8_prefill, got None"):
        tqt.int8_prefill(q.to(DEV), *t, layout, p)


def _int8_attention_f64(q, k, v, batch, causal, scale):
    """Float64 attention of int8 codes: per sequence, ``a_ij = scale·s_q[i]·s_k[j]·(c_q[i]·c_k[j])``,
    bottom-right causal, softmax, P·V; ``(out, lse)`` (a row with a non-finite scale: NaN)."""
    (q8, qs), (k8, ks) = q, k
    t, hq, d = q8.shape
    g = hq // k8.shape[1]
    lq, lk = t // batch, k8.shape[0] // batch
    out = torch.empty(t, hq, d, dtype=torch.float64)
    lse = torch.empty(t, hq, dtype=torch.float64)
    for b in range(batch):
        qb, kb = slice(b * lq, (b + 1) * lq), slice(b * lk, (b + 1) * lk)
        cq = q8[qb].double().transpose(0, 1)  # [hq, lq, d]
        ck = k8[kb].double().repeat_interleave(g, 1).transpose(0, 1)
        s = scale * qs[qb].double().t()[:, :, None] * ks[kb].double().repeat_interleave(g, 1).t()[:, None, :]
        s = s * (cq @ ck.transpose(1, 2))
        if causal:
            keep = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
            s = s.masked_fill(~keep, float("-inf"))
        lse[qb] = torch.logsumexp(s, -1).t()
        out[qb] = (torch.softmax(s, -1) @ v[kb].double().repeat_interleave(g, 1).transpose(0, 1)).transpose(0, 1)
    return out, lse


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon kernel runs on sm_90 GPUs only (no interpreter)")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(2, 150, 333, True), (3, 64, 64, True), (1, 700, 700, True), (2, 40, 300, False),
                                   (3, 1, 1, True)], ids=["chunks", "square", "long", "unmasked", "one"])
def test_gluon_attention_matches_float64_attention_of_the_codes(d, dtype, shape):
    """The Gluon kernel (``gluon=True``: 64 x 128 tiles at head_dim 64/128, 64 x 64 at 256) and
    the Triton kernel against float64 attention of the same codes: batches whose keys end off the
    key tile (the last tile reads the next sequence's rows, whose values hold a NaN or an inf the
    kernel must zero), chunks on a longer prefix, a query row with a NaN scale (its row NaN, the
    others finite). Both agree with the reference to the P·V rounding in v's dtype."""
    from tqkern_torch.prefill_tiles import attend_tiles, gluon_supported

    batch, lq, lk, causal = shape
    hq, hkv = 8, 2
    g = torch.Generator().manual_seed(d + lq)
    q = (torch.randint(-127, 128, (batch * lq, hq, d), generator=g, dtype=torch.int8),
         torch.rand(batch * lq, hq, generator=g) / 32)
    k = (torch.randint(-127, 128, (batch * lk, hkv, d), generator=g, dtype=torch.int8),
         torch.rand(batch * lk, hkv, generator=g) / 32)
    v = torch.randn(batch * lk, hkv, d, generator=g).to(dtype)
    v[-1, 1, 3] = float("nan")  # the last sequence's last key: read only past another sequence's end
    if batch > 1:
        v[lk + 1, 0, 5] = float("inf")  # the second sequence's: the first's last tile reads it
    q[1][lq // 2, 3] = float("nan")
    ref, ref_lse = _int8_attention_f64(q, k, v, batch, causal, d ** -0.5)
    cuda = [tuple(x.cuda() for x in q), tuple(x.cuda() for x in k), v.cuda()]
    assert gluon_supported(cuda[0][0], cuda[1][0], cuda[2], batch, window_left=None, softcap=None)
    vmax = v.float().nan_to_num(0, 0, 0).abs().max().item()
    for gluon in (True, False):
        o, lse = attend_tiles(*cuda, batch, causal=causal, scale=d ** -0.5, window_left=None, gluon=gluon)
        o, lse = o.cpu().double(), lse.cpu().double()
        bad = torch.zeros(batch * lq, hq, dtype=torch.bool)
        bad[lq // 2, 3] = True
        assert torch.isnan(o[bad]).all() and torch.isnan(lse[bad]).all(), gluon
        fin = ~bad & torch.isfinite(ref).all(-1)
        assert fin.sum() > 0
        tol = (2e-3 if dtype == torch.float16 else 1.6e-2) * vmax
        torch.testing.assert_close(o[fin], ref[fin], rtol=0, atol=tol, msg=f"gluon={gluon}")
        torch.testing.assert_close(lse[fin], ref_lse[fin], rtol=0, atol=1e-4, msg=f"gluon={gluon}")


def test_gluon_dispatch_names_bad_arguments():
    """``gluon_config`` / ``gluon_eligible`` (the shape rule) and ``attend_tiles(gluon=...)``:
    a bad head_dim and a bad flag are named; ``gluon=True`` where the kernel cannot run (the CPU,
    half-precision operands, a window) raises; the interpreter and the CPU never take it."""
    from tqkern.ops.int8_prefill.gluon import GLUON, gluon_config, gluon_eligible
    from tqkern_torch.prefill_tiles import attend_tiles, gluon_supported

    assert [gluon_config(d) is not None for d in (32, 64, 128, 256, 512)] == [False, True, True, True, False]
    for bad in (0, 64.0, True):
        with pytest.raises(ValueError, match=rf"head_dim must be an int >= 1, got {bad!r}"):
            gluon_config(bad)
    ok = dict(window=False, softcap=False, lq=5, lk=9)
    assert gluon_eligible(128, **ok) == GLUON
    assert not any(gluon_eligible(128, **{**ok, **bad}) for bad in (dict(window=True), dict(softcap=True),
                                                                   dict(lq=10), dict(lk=0, lq=0)))
    with pytest.raises(TypeError, match="window must be a bool, got int"):
        gluon_eligible(128, **{**ok, "window": 0})
    with pytest.raises(TypeError, match="softcap must be a bool, got NoneType"):
        gluon_eligible(128, **{**ok, "softcap": None})
    for name, bad in (("lq", -1), ("lk", 2.0), ("lq", True)):
        with pytest.raises(ValueError, match=rf"{name} must be an int >= 0, got {bad!r}"):
            gluon_eligible(128, **{**ok, name: bad})
    q = (torch.zeros(4, 2, 64, dtype=torch.int8), torch.ones(4, 2))
    k = (torch.zeros(6, 1, 64, dtype=torch.int8), torch.ones(6, 1))
    v = torch.zeros(6, 1, 64, dtype=torch.float16)
    assert not gluon_supported(q[0], k[0], v, 1, window_left=None, softcap=None)
    with pytest.raises(ValueError, match=r"v must be a 3-d tensor \[tokens, heads, D\], got \(6, 64\)"):
        gluon_supported(q[0], k[0], v[:, 0], 1, window_left=None, softcap=None)
    with pytest.raises(ValueError, match=r"q codes must be a 3-d tensor \[tokens, heads, D\], got list"):
        gluon_supported([], k[0], v, 1, window_left=None, softcap=None)
    for bad in (0, 1.0, True):
        with pytest.raises(ValueError, match=rf"batch must be an int >= 1, got {bad!r}"):
            gluon_supported(q[0], k[0], v, bad, window_left=None, softcap=None)
    kw = dict(causal=True, scale=0.1, window_left=None)
    with pytest.raises(TypeError, match="gluon must be None, True or False, got 1"):
        attend_tiles(q, k, v, 1, gluon=1, **kw)
    with pytest.raises(ValueError, match=r"gluon=True needs int8 operands, .* on an sm_90 GPU, got q \(4, 2, 64\) "
                                         r"torch.int8, v \(6, 1, 64\) torch.float16 on cpu, batch 1"):
        attend_tiles(q, k, v, 1, gluon=True, **kw)
    with pytest.raises(ValueError, match="gluon=True needs int8 operands"):
        attend_tiles(torch.zeros(4, 2, 64, dtype=torch.float16), v, v, 1, gluon=True, softcap=5.0, **kw)
