"""The compileable cache (``TQCache(model, max_cache_len=N)``, :class:`TQStaticCacheLayer`) on
tiny randomly initialised models: the same tokens as transformers' own attention, every decode
step through ``paged_decode``, the decode step traced whole by ``torch.compile`` (``fullgraph``,
the ``eager`` backend: the CUDA-graph replay itself needs a GPU), no recompilation from step to
step, and the capacity's limits."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tqkern_torch.transformers as tqt  # noqa: E402
from tqkern_torch.errors import TQKernError, check_errors, read_errors  # noqa: E402
from tests.test_transformers import MODELS, _Counter, _gemma2, _generate, _ids, _left_padded, _qwen2  # noqa: E402


@pytest.fixture(params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


@pytest.mark.parametrize("batch", [1, 2])
def test_static_fp16_generate_matches_sdpa(model, batch, monkeypatch):
    ids = _ids(batch, 11)
    ref = _generate(model, ids)
    tqt.install(model, "fp16", block_size=4)
    counter = _Counter(monkeypatch)
    cache = tqt.TQCache(model, max_cache_len=21)  # 11 + 8 tokens: 19, not a whole number of blocks
    assert cache.is_compileable and all(isinstance(layer, tqt.TQStaticCacheLayer) for layer in cache.layers)
    out = _generate(model, ids, cache=cache)
    assert out.tolist() == ref.tolist()
    assert counter.calls == 7 * 2
    for layer in cache.layers:
        assert layer.seq_lens.tolist() == [18] * batch and int(layer.cumulative_length) == 18
        assert layer.pool.shape[0] == batch * 6 and layer.block_table.tolist() == torch.arange(
            batch * 6).reshape(batch, 6).tolist()


@pytest.mark.parametrize("pads", [(0, 5), (3, 8)])
def test_static_left_padding_dropped_at_prefill(model, pads, monkeypatch):
    ids, mask = _left_padded(pads, 11, seed=1)
    ref = _generate(model, ids, mask)
    tqt.install(model, "fp16", block_size=4)
    counter = _Counter(monkeypatch)
    cache = tqt.TQCache(model, max_cache_len=20)
    out = _generate(model, ids, mask, cache=cache)
    assert out.tolist() == ref.tolist()
    assert counter.calls == 7 * 2
    for layer in cache.layers:
        assert layer.starts.tolist() == list(pads) and layer.seq_lens.tolist() == [18 - p for p in pads]


def test_static_padding_keeps_addresses_and_bytes(model):
    ids, mask = _ids(2, 7, seed=9), torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    tqt.install(model, "tq4", block_size=2, key_offset=None)
    cache = tqt.TQCache(model, max_cache_len=12)
    with torch.no_grad():
        layer = cache.layers[0]
        seen = {}

        def before_drop(attention_mask, windowed, inner=tqt.TQStaticCacheLayer.drop_padding):
            seen["pool"] = layer.pool.clone()
            return inner(layer, attention_mask, windowed)

        layer.drop_padding = before_drop
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    addr = layer.pool.data_ptr()
    rows = layer.pool.view(2, 6 * 2, -1)
    old = seen["pool"].view(2, 6 * 2, -1)
    assert torch.equal(rows[0, :7], old[0, :7]) and torch.equal(rows[1, :4], old[1, 3:7])  # slot bytes moved
    assert layer.seq_lens.tolist() == [7, 4] and layer.starts.tolist() == [0, 3]
    with torch.no_grad():
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        model(torch.tensor([[4], [4]]), attention_mask=step_mask, past_key_values=cache, use_cache=True)
    assert layer.pool.data_ptr() == addr and layer.seq_lens.tolist() == [8, 5]


def test_static_sliding_window_and_softcap_decode_paged(monkeypatch):
    """A sliding-window layer decodes through paged_decode(window_left=W - 1); Gemma-2's
    soft-capping through paged_decode(logit_softcap=)."""
    model = _qwen2(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    ids = _ids(1, 9, seed=5)
    ref = _generate(model, ids)
    tqt.install(model, "fp16")
    counter = _Counter(monkeypatch)
    assert _generate(model, ids, cache=tqt.TQCache(model, max_cache_len=17)).tolist() == ref.tolist()
    assert counter.calls == 7 * 2  # both layers, the windowed one included
    gemma = _gemma2()
    ids = _ids(1, 9, seed=6)
    ref = _generate(gemma, ids)
    tqt.install(gemma, "fp16")
    counter.calls = 0
    assert _generate(gemma, ids, cache=tqt.TQCache(gemma, max_cache_len=17)).tolist() == ref.tolist()
    assert counter.calls == 7 * 2


def test_softcap_gets_no_key_offset(monkeypatch):
    """The paged kernels attend k − μ and drop q·μ, which the soft-cap does not ignore: ``"auto"``
    gives a soft-capped model no μ, and the static cache refuses soft-capping with μ (a Gemma-2
    with large key and query biases, cap 1.0: with μ its static decode logits were 2.3 std off)."""
    gemma = _gemma2()
    spec = tqt.install(gemma, "tq4")
    assert spec.key_offset_sources == ("off (soft-capping)",) * 2 and all(p.key_offset is None for p in spec.params)
    tqt.TQCache(gemma, max_cache_len=16)
    for key_offset in ("prefill", tqt.calibrate(gemma, _ids(1, 12, seed=4))):
        tqt.install(gemma, "tq4", key_offset=key_offset)
        with pytest.raises(ValueError, match=r"soft-capped attention logits .* μ on layers \[0, 1\]"):
            tqt.TQCache(gemma, max_cache_len=16)
        tqt.TQCache(gemma)  # the growing cache attends soft-capped steps densely, μ added back
    llama = MODELS["llama"]()
    assert tqt.install(llama, "tq4", calibration=_ids(1, 12)).key_offset_sources == ("calibration",) * 2


def test_decode_step_compiles_whole_and_once():
    """The decode step traced by torch.compile(fullgraph=True) (any graph break raises), no
    recompilation across steps (error_on_recompile), and the same tokens as the eager cache. On
    Qwen2 (projection biases) only, for CI time: the cache's traced code is the same for Llama."""
    model = MODELS["qwen2"]()
    ids = _ids(2, 9, seed=3)
    tqt.install(model, "tq4", key_offset=None)
    tokens = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        cache = tqt.TQCache(model, max_cache_len=16)
        step = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
        with torch.no_grad():
            logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
            seq = [logits.argmax(-1)]
            with torch._dynamo.config.patch(error_on_recompile=True, automatic_dynamic_shapes=False):
                for i in range(5):
                    pos = torch.full((2, 1), 9 + i, dtype=torch.long)
                    logits = step(seq[-1][:, None], position_ids=pos, past_key_values=cache, use_cache=True).logits
                    seq.append(logits[:, -1].argmax(-1))
        tokens[compiled] = torch.stack(seq, 1).tolist()
    assert tokens[True] == tokens[False]


def test_generate_compiles_the_decode_step(model):
    """``generate`` compiles the decode step itself when the cache is compileable (here on the
    CPU through ``CompileConfig(_compile_all_devices=True)``, the eager backend)."""
    ids = _ids(1, 10, seed=4)
    ref = _generate(model, ids)
    tqt.install(model, "fp16")
    torch._dynamo.reset()
    cfg = transformers.CompileConfig(backend="eager", fullgraph=True)
    cfg._compile_all_devices = True
    torch._dynamo.utils.counters.clear()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         past_key_values=tqt.TQCache(model, max_cache_len=18), compile_config=cfg)
    assert out.tolist() == ref.tolist()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the decode step ran compiled


def test_static_capacity(model):
    read_errors("cpu")  # bits earlier tests left
    tqt.install(model, "fp16", block_size=4)
    cache = tqt.TQCache(model, max_cache_len=10)  # 12 positions with whole blocks
    with pytest.raises(ValueError, match="max_cache_len = 10 tokens per row"), torch.no_grad():
        model(_ids(1, 13), past_key_values=cache, use_cache=True)
    cache = tqt.TQCache(model, max_cache_len=10)
    check_errors("cpu")
    with torch.no_grad():
        model(_ids(1, 12), past_key_values=cache, use_cache=True)
        model(torch.tensor([[3]]), position_ids=torch.tensor([[12]]), past_key_values=cache, use_cache=True)
    with pytest.raises(TQKernError, match="SEQ_LEN_OUT_OF_RANGE"):  # the 13th token was not stored
        check_errors("cpu")
    cache.reset()
    assert all(int(layer.seq_lens.max()) == 0 and int(layer.cumulative_length) == 0 for layer in cache.layers)
    with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
        tqt.TQCache(model, max_cache_len=0)


def test_reset_cache_and_later_chunks_attend_causally(model):
    """A reset cache generates as a fresh one (what ``bench generate`` times), and a second chunk
    after a first one attends as one prefill. The model's offsets come from the cache's live
    length tensor, which the layers' updates advance in place before the mask is built: the mask
    must use the offsets as they were (session 48: a reset cache's prefill attended non-causally)."""
    ids = _ids(1, 10, seed=4)
    ref = _generate(model, ids)
    with torch.no_grad():
        logits = model(ids).logits
    tqt.install(model, "fp16", block_size=4, key_offset=None)
    cache = tqt.TQCache(model, max_cache_len=20)
    _generate(model, _ids(1, 6, seed=5), cache=cache)
    cache.reset()
    assert _generate(model, ids, cache=cache).tolist() == ref.tolist()
    cache = tqt.TQCache(model, max_cache_len=20)
    with torch.no_grad():
        model(ids[:, :6], past_key_values=cache, use_cache=True)
        second = model(ids[:, 6:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(second, logits[:, 6:], atol=2e-3, rtol=0)


def test_prefill_reads_the_device_length_only_after_decode_steps(model, monkeypatch):
    """A fresh or reset cache's prefill takes each layer's length (0) from the host: no device
    read, no sync per layer (the model's own ``get_seq_length`` is one per forward). After decode
    steps (replayed as CUDA graphs, unseen by Python) a prefill chunk reads it, and continues
    where they left off."""
    reads, updating = [], [False]
    real_int, real_update = torch.Tensor.__int__, tqt.TQStaticCacheLayer.update

    def counting_int(t):
        if updating[0] and t.dim() == 0:
            reads.append(t)
        return real_int(t)

    def update(layer, *a, **k):
        updating[0] = True
        try:
            return real_update(layer, *a, **k)
        finally:
            updating[0] = False

    monkeypatch.setattr(torch.Tensor, "__int__", counting_int)
    monkeypatch.setattr(tqt.TQStaticCacheLayer, "update", update)
    tqt.install(model, "fp16", block_size=4, key_offset=None)  # (μ from each cache's first prompt: no pool equality)
    ids = _ids(1, 9, seed=2)
    ref = tqt.TQCache(model, max_cache_len=16)
    with torch.no_grad():
        model(ids, past_key_values=ref, use_cache=True)
    assert reads == []
    cache = tqt.TQCache(model, max_cache_len=16)
    with torch.no_grad():
        model(_ids(1, 5, seed=3), past_key_values=cache, use_cache=True)
        cache.reset()
        model(ids, past_key_values=cache, use_cache=True)
    assert reads == []
    for layer, want in zip(cache.layers, ref.layers):
        assert layer.seq_len == 9 and torch.equal(layer.pool, want.pool)
    with torch.no_grad():  # a decode step, then a chunk of 2: read from the device, stored after the step
        model(torch.tensor([[5]]), position_ids=torch.tensor([[9]]), past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            layer.seq_len = -1  # (what a replayed step leaves: Python's length stale)
        model(torch.tensor([[6, 7]]), position_ids=torch.tensor([[10, 11]]), past_key_values=cache, use_cache=True)
    assert len(reads) == len(cache.layers)
    assert all(layer.seq_len == 12 and int(layer.cumulative_length) == 12 for layer in cache.layers)


def test_drop_padding_rejects_masks_it_cannot_serve(model):
    """drop_padding: a last query row that is not one run up to the last position, a later
    chunk masking another prefix, and a row of padding only are refused (the decode steps read no
    mask, so serving them would attend the wrong positions)."""
    params = tqt.layer_params(model, "fp16")[0]

    def layer_after_prefill(tokens=6):
        layer = tqt.TQStaticCacheLayer(params, 2, max_cache_len=16, block_size=4)
        k = torch.randn(2, 2, tokens, params.format.head_dim)
        layer.update(k, torch.randn_like(k))
        return layer

    def mask(allowed_last_rows):  # [b, 1, q = 1, kv] boolean masks from the last query rows
        return torch.tensor(allowed_last_rows, dtype=torch.bool)[:, None, None, :]

    with pytest.raises(NotImplementedError, match="one contiguous run"):
        layer_after_prefill().drop_padding(mask([[1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 1, 1]]), windowed=False)
    with pytest.raises(ValueError, match="masks every position of a row"):
        layer_after_prefill().drop_padding(mask([[1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]]), windowed=False)
    layer = layer_after_prefill()
    layer.drop_padding(mask([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]), windowed=False)
    assert layer.starts.tolist() == [0, 2] and layer.seq_lens.tolist() == [6, 4]
    with pytest.raises(NotImplementedError, match="masks a different prefix"):
        layer.drop_padding(mask([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]), windowed=False)
    layer.drop_padding(mask([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]), windowed=False)  # the same prefix: fine
