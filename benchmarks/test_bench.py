"""pytest-benchmark entries (GPU only): ``pytest benchmarks --benchmark-only``.

One run compares each op with its torch baseline: pytest-benchmark's table groups ``decode
B32x4K`` (``paged_decode`` of four presets and torch SDPA fp16 on contiguous K/V), ``store
<shape>`` (``store`` of the same presets and an fp16 paged-cache ``index_copy_``), ``decompress
prefill_1x4096`` (``decompress`` of the same presets' slots, rotated back, and ``copy_`` of the
float32 K/V it writes), ``prefill
full_1x4K`` (``prefill`` of the same presets and SDPA fp16 causal) and ``generate B1x1K`` (a whole
greedy ``model.generate`` of a Llama-3-8B-shaped model, 129 tokens, through a TQCache of
turboquant_4bit_nc and through transformers' SDPA + DynamicCache). Each preset
passes its op's correctness gate against the NumPy oracle before it is timed. These time eager
calls with a device sync (pytest-benchmark's timer); the full table, CUDA-graph timing, JSON and
plot come from ``tqkern bench`` (:mod:`tqkern_torch.bench`).
"""

import pytest
import torch

import tqkern_torch as tqt
from tqkern_torch.attention import paged_decode
from tqkern_torch.bench import decode, decompress, generate, prefill, store
from tqkern_torch.bench.shapes import (BLOCK_SIZE, STORE_CACHE_TOKENS, decode_shape, generate_shape, prefill_shape,
                                      store_shape)

pytestmark = [pytest.mark.benchmark,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (no CUDA device found)")]
PRESETS = ["tq4", "turboquant_4bit_nc", "turboquant_k8v4", "fp16"]
DECODE_SHAPE = "B32x4K"
STORE_SHAPES = ["decode_B32", "prefill_1x4096"]
DECOMPRESS_SHAPE = "prefill_1x4096"
PREFILL_SHAPE = "full_1x4K"
GENERATE_SHAPE = "B1x1K"


def _gated_layout(mod, preset, shape):
    """``(layout, params)`` of ``preset`` at ``shape``'s heads, after ``mod``'s oracle gate passed."""
    gates = mod.gate([preset])
    assert all(g["ok"] for g in gates), gates
    return decode.make_layout(preset, shape.num_kv_heads, shape.head_dim)


def _timed(benchmark, fn):
    def run():
        fn()
        torch.cuda.synchronize()

    benchmark(run)


@pytest.mark.parametrize("preset", PRESETS)
def test_decode(benchmark, preset):
    s = decode_shape(DECODE_SHAPE)
    layout, params = _gated_layout(decode, preset, s)
    g = torch.Generator(device="cuda").manual_seed(0)
    nb = s.batch * s.seq_len // BLOCK_SIZE
    bt = torch.randperm(nb, device="cuda", generator=g).int().reshape(s.batch, -1)
    sl = torch.full((s.batch,), s.seq_len, dtype=torch.int32, device="cuda")
    cache = decode.fill_cache(layout, params, nb, g)
    q = torch.randn(s.batch, s.num_q_heads, s.head_dim, device="cuda", dtype=torch.float16, generator=g)
    out = torch.empty_like(q)
    benchmark.group = f"decode {DECODE_SHAPE}"
    _timed(benchmark, lambda: paged_decode(q, cache, bt, sl, layout, params, out=out, check_lengths=False))


def test_decode_baseline_sdpa_fp16(benchmark):
    s = decode_shape(DECODE_SHAPE)
    q = torch.randn(s.batch, s.num_q_heads, 1, s.head_dim, device="cuda", dtype=torch.float16)
    k = torch.randn(s.batch, s.num_kv_heads, s.seq_len, s.head_dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    benchmark.group = f"decode {DECODE_SHAPE}"
    _timed(benchmark, lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def _store_inputs(name):
    s = store_shape(name)
    g = torch.Generator(device="cuda").manual_seed(2)
    k = torch.randn(s.num_tokens, s.num_kv_heads, s.head_dim, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn_like(k)
    return s, k, v, store.slot_mapping(s, STORE_CACHE_TOKENS // BLOCK_SIZE, g)


@pytest.mark.parametrize("shape", STORE_SHAPES)
@pytest.mark.parametrize("preset", PRESETS)
def test_store(benchmark, preset, shape):
    s, k, v, slots = _store_inputs(shape)
    layout, params = _gated_layout(store, preset, s)
    cache = torch.zeros(layout.cache_shape(STORE_CACHE_TOKENS // BLOCK_SIZE), dtype=torch.uint8, device="cuda")
    benchmark.group = f"store {shape}"
    _timed(benchmark, lambda: tqt.store(cache, k, v, slots, layout, params))


@pytest.mark.parametrize("shape", STORE_SHAPES)
def test_store_baseline_fp16_index_copy(benchmark, shape):
    s, k, v, slots = _store_inputs(shape)
    k_cache = torch.zeros(STORE_CACHE_TOKENS, s.num_kv_heads, s.head_dim, device="cuda", dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)

    def write():
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    benchmark.group = f"store {shape}"
    _timed(benchmark, write)


@pytest.mark.parametrize("preset", PRESETS)
def test_decompress(benchmark, preset):
    s, k, v, slots = _store_inputs(DECOMPRESS_SHAPE)
    layout, params = _gated_layout(decompress, preset, s)
    cache = torch.zeros(layout.cache_shape(STORE_CACHE_TOKENS // BLOCK_SIZE), dtype=torch.uint8, device="cuda")
    tqt.store(cache, k, v, slots, layout, params)
    benchmark.group = f"decompress {DECOMPRESS_SHAPE}"
    _timed(benchmark, lambda: tqt.decompress(cache, slots, layout, params, rotate_back=True))


def test_decompress_baseline_copy(benchmark):
    s = store_shape(DECOMPRESS_SHAPE)
    src = torch.randn(2, s.num_tokens, s.num_kv_heads, s.head_dim, device="cuda")
    dst = torch.empty_like(src)
    benchmark.group = f"decompress {DECOMPRESS_SHAPE}"
    _timed(benchmark, lambda: dst.copy_(src))


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill(benchmark, preset):
    s = prefill_shape(PREFILL_SHAPE)
    layout, params = _gated_layout(prefill, preset, s)
    g = torch.Generator(device="cuda").manual_seed(3)
    cache, bt, sl, qsl, q = prefill.batch(layout, params, [s.context] * s.num_seqs, [s.q_len] * s.num_seqs,
                                          s.num_q_heads, g, "cuda")
    out = torch.empty_like(q)
    benchmark.group = f"prefill {PREFILL_SHAPE}"
    _timed(benchmark, lambda: tqt.prefill(q, cache, bt, sl, qsl, layout, params, out=out, check_inputs=False))


def test_prefill_baseline_sdpa_fp16(benchmark):
    s = prefill_shape(PREFILL_SHAPE)
    q = torch.randn(s.num_seqs, s.num_q_heads, s.q_len, s.head_dim, device="cuda", dtype=torch.float16)
    k = torch.randn(s.num_seqs, s.num_kv_heads, s.context, s.head_dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    benchmark.group = f"prefill {PREFILL_SHAPE}"
    _timed(benchmark, lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                               enable_gqa=True))


@pytest.fixture(scope="module")
def llama8b():
    pytest.importorskip("transformers")
    return generate.build_model(generate.llama3_8b_config(), "cuda")


@pytest.mark.parametrize("variant", [generate.BASELINE, "turboquant_4bit_nc"])
def test_generate(benchmark, llama8b, variant):
    import tqkern_torch.transformers as tqtf

    s = generate_shape(GENERATE_SHAPE)
    ids = torch.randint(0, llama8b.config.vocab_size, (s.batch, s.prompt), device="cuda")
    if variant == generate.BASELINE:
        llama8b.set_attn_implementation("sdpa")
        make_cache = lambda: None  # noqa: E731
    else:
        _gated_layout(decode, variant, decode_shape(DECODE_SHAPE))
        tqtf.install(llama8b, variant)
        make_cache = lambda: tqtf.TQCache(llama8b)  # noqa: E731
    benchmark.group = f"generate {GENERATE_SHAPE}"
    try:
        benchmark.pedantic(lambda: generate.time_generate(llama8b, ids, generate.NEW_TOKENS, make_cache()),
                           rounds=3, warmup_rounds=1)
    finally:
        if variant != generate.BASELINE:
            tqtf.uninstall(llama8b)
