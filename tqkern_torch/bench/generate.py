"""The end-to-end generate benchmark (GPU): ``model.generate`` of a Llama-3-8B-shaped model with
random weights through a :class:`~tqkern_torch.transformers.TQCache`, against transformers' own
SDPA attention over its ``DynamicCache`` (``sdpa_dynamic_cache``, timed in the same run).

Model: :func:`llama3_8b_config` (hidden 4096, 32 heads, 8 KV heads, head_dim 128, intermediate
14336, vocab 128256, 32 layers; ``layers`` cuts the layer count and the report's ``model`` says
so), bfloat16, built on the device by transformers' own initialisation (normal draws on the GPU:
seconds for 8B parameters), seeded. Weights do not change what is timed.

Per shape (``batch`` prompts of ``prompt`` random tokens, no padding,
:data:`~tqkern_torch.bench.shapes.GENERATE_SHAPES`) and variant (the baseline, then each preset
through ``install(model, preset)`` and a fresh ``TQCache``; ``PRESET:static`` through
``TQCache(model, max_cache_len=prompt + new_tokens + 1)``, whose decode step ``generate`` compiles
(``CompileConfig()``: inductor, ``mode="reduce-overhead"``, i.e. CUDA graphs); and
``sdpa_static_cache``, transformers' SDPA over its ``StaticCache``, compiled the same way, to
show what compiling alone gives): greedy ``generate`` of exactly ``new_tokens + 1`` tokens
(``min_new_tokens`` = ``max_new_tokens``: no early stop). Each variant runs twice at identical
shapes: a warm-up (compiles, records the CUDA graphs and plans; on CUDA its middle
:data:`PROFILED_STEPS` decode steps are profiled for the split) and the timed run (a compileable
cache is reset and reused, so the recorded graphs replay).

Timing: a logits processor, which ``generate`` calls after every forward, synchronises the
device and reads ``time.perf_counter()``. ``prefill_ms``: from the ``generate`` call to the first
call (input preparation, the prompt's forward, the first logits). Decode: from the first call to
the last, ``new_tokens`` decode forwards; ``us`` is the mean per step (so ``speedup`` is the
baseline's step time over the variant's) and ``tokens_per_s`` = batch × new_tokens / that time.
``generate`` synchronises every step anyway (its stopping check reads a device flag), so the
clock's sync adds no wait the loop did not have.

Memory (CUDA only, else ``None``): ``peak_bytes`` = ``torch.cuda.max_memory_allocated()`` during
the timed ``generate`` minus what was allocated before it (the weights): cache, activations and
temporaries at the peak. ``cache_bytes``: the cache's own tensors after the run (DynamicCache:
keys and values; TQCache: every layer's pool as allocated, which grows by doubling, and its
tables); ``cache_used_bytes``: the part holding tokens (TQCache: blocks in use × block bytes).

Step-time split (``split``, µs per decode step; CUDA only): device time = the sum of the CUDA
activity (kernels, copies, memsets) that ``torch.profiler`` records over the profiled steps.

* ``weights``: device time per step of the same model and batch with attention replaced by a
  no-op (zeros) over a :data:`NOOP_PROMPT`-token prompt and a DynamicCache: all but attention
  (eager kernels: a compiled variant's fused kernels make its ``attention`` part a lower bound).
* ``attention``: the variant's device time per step minus ``weights``: attention kernels and cache
  writes (DynamicCache's concatenation; TQCache's ``store`` and its slot arithmetic).
* ``host``: the timed step minus the variant's device time: the time the device waits for the
  host (Python, launches, transformers' loop, tqkern's per-layer calls). One stream, so device
  activity does not overlap itself.

``prefill_path`` says how the variant attends the prompt and ``decode_path`` how many decode
attention calls of the timed run went through ``paged_decode``.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, Optional, Sequence

import torch

from tqkern.layouts import PRESETS as FORMAT_PRESETS
from tqkern.layouts import is_format_name
from tqkern_torch.bench.report import SCHEMA, Progress, record
from tqkern_torch.bench.shapes import GENERATE_SHAPES, QUICK_SHAPES, GenerateShape, generate_shape

__all__ = ["BASELINE", "COMPILED_BASELINE", "DEFAULT_PRESETS", "STATIC", "FULL_LAYERS", "NEW_TOKENS", "NOOP_PROMPT",
           "PREFILL_PATHS", "PROFILED_STEPS", "QUICK_PRESETS", "TIMING", "build_model", "cache_bytes", "count_steps",
           "llama3_8b_config", "run", "run_shape", "select", "time_generate"]

BASELINE = "sdpa_dynamic_cache"
COMPILED_BASELINE = "sdpa_static_cache"  # transformers' StaticCache: generate compiles its decode step too
STATIC = ":static"  # a preset's variant through TQCache(max_cache_len=...): the compiled, CUDA-graph decode step
DEFAULT_PRESETS = ("turboquant_4bit_nc", "turboquant_4bit_nc:static", "turboquant_k8v4", "k5v4h", "k5v4h:static",
                   COMPILED_BASELINE)  # k5v4h: install's DEFAULT_FORMAT
QUICK_PRESETS = ("turboquant_4bit_nc", "turboquant_4bit_nc:static")
NEW_TOKENS = 128
PROFILED_STEPS = 16
NOOP_PROMPT = 16
FULL_LAYERS = 32
TIMING = (f"model.generate, greedy, {NEW_TOKENS} decode steps after the prefill; a logits processor syncs and "
          f"reads perf_counter after every forward; one warm-up run, then one timed run")
PREFILL_PATHS = {
    BASELINE: "transformers sdpa over the prompt's K/V (DynamicCache)",
    COMPILED_BASELINE: "transformers sdpa over the prompt's K/V (StaticCache)",
    "tqkern": "tqkern_torch.prefill over the compressed cache (tiled path: each key decoded once into a bounded "
              "workspace, cuDNN attention, log-sum-exp merge)",
}
_NOOP = "tqkern_bench_noop"


def llama3_8b_config(layers: int = FULL_LAYERS):
    """A ``LlamaConfig`` of Llama-3-8B's shapes (rope θ 500,000), ``layers`` decoder layers."""
    import transformers

    if not isinstance(layers, int) or not 1 <= layers <= FULL_LAYERS:
        raise ValueError(f"layers must be an int in [1, {FULL_LAYERS}], got {layers!r}")
    return transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                    num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                    head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
                                    rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
                                    attn_implementation="sdpa")


def build_model(config, device, dtype=torch.bfloat16, seed: int = 0):
    """``LlamaForCausalLM(config)`` in ``dtype``, its weights created and initialised on ``device``."""
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


class _Clock:
    """A logits processor: after every forward of ``generate``, sync and read the time; profile
    the device over forwards ``start + 1 .. start + steps`` (calls ``start`` to ``start + steps``)."""

    def __init__(self, device: torch.device, start: int = 0, steps: int = 0):
        self.device, self.start, self.steps = device, start, steps
        self.times: list[float] = []
        self.device_us: Optional[float] = None
        self._prof = None

    def __call__(self, input_ids, scores):
        _sync(self.device)
        self.times.append(time.perf_counter())
        i = len(self.times) - 1
        if self.steps and i == self.start:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA])
            self._prof.start()
        elif self._prof is not None and i == self.start + self.steps:
            self._prof.stop()
            cuda = torch.autograd.DeviceType.CUDA
            total = sum(e.time_range.elapsed_us() for e in self._prof.events() if e.device_type == cuda)
            self.device_us = total / self.steps if total > 0 else None
            self._prof = None
        return scores


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _count_paged_decode():
    """Counts the calls of ``tqkern_torch.transformers.paged_decode`` (the decode path it took)."""
    import tqkern_torch.transformers as tqt

    inner, calls = tqt.paged_decode, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    tqt.paged_decode = counted
    try:
        yield calls
    finally:
        tqt.paged_decode = inner


def cache_bytes(cache) -> tuple[int, int]:
    """``(allocated, used)`` bytes of a cache's own tensors (see the module docstring)."""
    from tqkern_torch.transformers import TQCache

    alloc = used = 0
    for layer in cache.layers:
        if not layer.is_initialized:  # never written: holds nothing
            continue
        if isinstance(cache, TQCache):
            tables = layer.block_table.nbytes + layer.seq_lens.nbytes + layer.starts.nbytes
            per_block = layer.pool.nbytes // max(1, layer.pool.shape[0])
            alloc += layer.pool.nbytes + tables
            used += layer.blocks_used * per_block + tables
        else:
            n = layer.keys.nbytes + layer.values.nbytes
            alloc, used = alloc + n, used + n
    return alloc, used


def time_generate(model, ids: torch.Tensor, new_tokens: int, cache=None, *, profile_steps: int = 0) -> dict:
    """One greedy ``generate`` of ``new_tokens + 1`` tokens after ``ids [batch, prompt]``.

    Returns ``prefill_s``, ``step_s`` (mean decode step), ``device_us`` (device time per profiled
    step, or None), ``peak_bytes`` (CUDA, else None), ``cache`` (the cache generate used)."""
    from transformers import LogitsProcessorList

    dev = ids.device
    steps = min(profile_steps, new_tokens) if dev.type == "cuda" else 0  # the middle decode steps
    clock = _Clock(dev, (new_tokens - steps) // 2, steps)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    _sync(dev)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens + 1,
                         min_new_tokens=new_tokens + 1, do_sample=False, past_key_values=cache,
                         logits_processor=LogitsProcessorList([clock]), return_dict_in_generate=True,
                         pad_token_id=model.config.eos_token_id)
    peak = torch.cuda.max_memory_allocated(dev) - base if base is not None else None
    if len(clock.times) != new_tokens + 1 or out.sequences.shape[1] != ids.shape[1] + new_tokens + 1:
        raise RuntimeError(f"generate made {len(clock.times)} forwards, expected {new_tokens + 1}")
    return {"prefill_s": clock.times[0] - t0, "step_s": (clock.times[-1] - clock.times[0]) / new_tokens,
            "device_us": clock.device_us, "peak_bytes": peak, "cache": out.past_key_values}


def _noop_attention(module, query, key, value, attention_mask, **kwargs):
    b, hq, tq, d = query.shape
    return query.new_zeros(b, tq, hq, d), None


def _no_attention_run(model, batch: int, new_tokens: int, g: torch.Generator) -> dict:
    """Decode step time and device time with attention replaced by a no-op (the ``weights`` part)."""
    import transformers
    from transformers.masking_utils import sdpa_mask

    transformers.AttentionInterface.register(_NOOP, _noop_attention)
    transformers.AttentionMaskInterface.register(_NOOP, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_NOOP)
    try:
        ids = _prompt(model, batch, NOOP_PROMPT, g)
        run = time_generate(model, ids, new_tokens, profile_steps=PROFILED_STEPS)
    finally:
        model.set_attn_implementation(previous)
    return {"batch": batch, "prompt": NOOP_PROMPT, "step_us": run["step_s"] * 1e6, "device_us": run["device_us"]}


def _prompt(model, batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, length), device=g.device, generator=g)


def _split(step_us: float, device_us: Optional[float], weights_us: Optional[float]) -> Optional[dict]:
    if device_us is None or weights_us is None:
        return None
    return {"weights_us": weights_us, "attention_us": device_us - weights_us, "host_us": step_us - device_us}


def _run_variant(model, variant: str, ids: torch.Tensor, new_tokens: int) -> dict:
    """The warm-up (profiled) and the timed run of one variant: the timed run's numbers, with the
    warm-up's ``device_us`` and the timed decode's ``paged_decode`` calls."""
    import tqkern_torch.transformers as tqt

    capacity = ids.shape[1] + new_tokens + 1
    if variant in (BASELINE, COMPILED_BASELINE):
        model.set_attn_implementation("sdpa")
    else:
        tqt.install(model, variant.removesuffix(STATIC))
    try:
        if variant == BASELINE:
            make_cache = lambda: None  # noqa: E731  (generate's DynamicCache)
        elif variant == COMPILED_BASELINE:
            from transformers import StaticCache

            make_cache = lambda: StaticCache(config=model.config, max_cache_len=capacity)  # noqa: E731
        elif variant.endswith(STATIC):
            make_cache = lambda: tqt.TQCache(model, max_cache_len=capacity)  # noqa: E731
        else:
            make_cache = lambda: tqt.TQCache(model)  # noqa: E731
        cache = make_cache()
        device_us = time_generate(model, ids, new_tokens, cache, profile_steps=PROFILED_STEPS)["device_us"]
        if cache is not None and cache.is_compileable:  # the same tensors again: the recorded CUDA graphs replay
            cache.reset()
        else:
            cache = make_cache()
        # (a compiled step would guard on the counter and recompile at every step: not counted there)
        counting = contextlib.nullcontext([0]) if cache is not None and cache.is_compileable else _count_paged_decode()
        with counting as paged:
            run = time_generate(model, ids, new_tokens, cache)
    finally:
        if variant not in (BASELINE, COMPILED_BASELINE):
            tqt.uninstall(model)
    return dict(run, device_us=device_us, paged_calls=paged[0])


def run_shape(model, shape: GenerateShape, presets: Sequence[str], step: Callable[[str], None], *,
              new_tokens: int = NEW_TOKENS, weights_us: Optional[float] = None, seed: int = 0) -> tuple[list, list]:
    """``(records, errors)`` of the baseline and every preset at ``shape`` on the model's device;
    ``step(label)`` after each variant. ``weights_us``: the no-op run's device time per step at this
    batch (for the split). A variant that runs out of memory becomes an error entry, and the
    presets' ``speedup`` is NaN where the baseline did."""
    dev = next(model.parameters()).device
    layers = model.config.num_hidden_layers
    records, errors, base_us = [], [], None
    for variant in (BASELINE, *presets):
        ids = _prompt(model, shape.batch, shape.prompt, torch.Generator(device=dev).manual_seed(seed))
        try:
            run = _run_variant(model, variant, ids, new_tokens)
        except torch.cuda.OutOfMemoryError as e:
            errors.append({"op": "generate", "shape": shape.name, "variant": variant,
                           "error": f"out of memory: {str(e).splitlines()[0]}"})
            step(f"generate {shape.name} {variant} (out of memory)")
            continue
        finally:
            ids = None
            gc.collect()
        us = run["step_s"] * 1e6
        if variant == BASELINE:
            base_us = us
        alloc, used = cache_bytes(run["cache"])
        run["cache"] = None
        rec = record("generate", shape.name, variant, BASELINE, us, us if base_us is None else base_us, mode="eager")
        if base_us is None:
            rec["speedup"] = float("nan")
        rec.update(batch=shape.batch, prompt=shape.prompt, new_tokens=new_tokens, layers=layers,
                   tokens_per_s=shape.batch / run["step_s"], prefill_ms=run["prefill_s"] * 1e3,
                   peak_bytes=run["peak_bytes"], cache_bytes=alloc, cache_used_bytes=used,
                   prefill_path=PREFILL_PATHS.get(variant, PREFILL_PATHS["tqkern"]),
                   decode_path=_decode_path(variant, run["paged_calls"], layers * new_tokens),
                   split=_split(us, run["device_us"], weights_us))
        records.append(rec)
        step(f"generate {shape.name} {variant}")
    return records, errors


def _decode_path(variant: str, paged_calls: int, calls: int) -> str:
    if variant == BASELINE:
        return "transformers sdpa"
    if variant == COMPILED_BASELINE:
        return "transformers sdpa over StaticCache, decode step compiled by generate (CUDA graphs)"
    if variant.endswith(STATIC):  # (a compiled step replays without running the Python that counts)
        return "paged_decode every step (TQCache(max_cache_len=...)), decode step compiled by generate (CUDA graphs)"
    return f"paged_decode in {paged_calls} of {calls} decode attention calls"


def select(presets: Optional[Sequence[str]] = None, shapes: Optional[Sequence[str]] = None,
           quick: bool = False) -> tuple[tuple[str, ...], list[GenerateShape]]:
    """``(presets, shapes)`` of a run: by default :data:`DEFAULT_PRESETS` and every named shape;
    ``quick``: :data:`QUICK_PRESETS` and ``QUICK_SHAPES["generate"]`` (where not given).

    Raises:
        ValueError: an unknown preset or shape name.
    """
    presets = tuple(presets) if presets is not None else QUICK_PRESETS if quick else DEFAULT_PRESETS
    unknown = [p for p in presets if p != COMPILED_BASELINE and not is_format_name(p.removesuffix(STATIC))]
    if unknown:
        raise ValueError(f"presets must be among {', '.join(FORMAT_PRESETS)} or kXvYh (each also as "
                         f"PRESET{STATIC}: the compileable TQCache) or {COMPILED_BASELINE}, got {unknown}")
    names = shapes if shapes is not None else QUICK_SHAPES["generate"] if quick else [s.name for s in GENERATE_SHAPES]
    return presets, [generate_shape(n) for n in names]


def count_steps(presets: Sequence[str], shapes: Sequence[GenerateShape]) -> int:
    """Progress steps of :func:`run`: a gate per preset, a no-op run per batch, a variant per shape."""
    return len(presets) + len({s.batch for s in shapes}) + len(shapes) * (1 + len(presets))


def run(presets: Sequence[str], shapes: Sequence[GenerateShape], *, layers: int = FULL_LAYERS, config=None,
        device: str = "cuda", new_tokens: int = NEW_TOKENS, gate: bool = True,
        progress: Optional[Progress] = None) -> dict:
    """Gate the presets (the decode and store gates against the NumPy oracle; a preset that fails
    is not timed), build the model (``config``, default :func:`llama3_8b_config` of ``layers``),
    then time every shape: per batch first the no-op run, then the variants. Returns the report."""
    from tqkern_torch.bench import decode, store
    from tqkern_torch.bench.timing import environment

    dev = torch.device(device)
    bar = progress or Progress(count_steps(presets, shapes))
    report = {"schema": SCHEMA, "environment": environment() if dev.type == "cuda" else
              {"device": str(dev), "torch": str(torch.__version__)},
              "timing": TIMING, "gate": [], "records": [], "errors": [], "no_attention": []}
    try:
        passed = []
        for p in presets:
            fmt = p.removesuffix(STATIC)
            gates = (decode.gate([fmt]) + store.gate([fmt])) if gate and p != COMPILED_BASELINE else []
            report["gate"] += gates
            if all(g["ok"] for g in gates):
                passed.append(p)
            bar.step(f"generate gate {p}")
        bar.total -= (len(presets) - len(passed)) * len(shapes)
        name = "Llama-3-8B-shaped (llama3_8b_config)" if config is None else "a given LlamaConfig"
        config = config if config is not None else llama3_8b_config(layers)
        model = build_model(config, dev)
        report["model"] = {"name": f"{name}, random weights", "layers": config.num_hidden_layers,
                           "full_layers": FULL_LAYERS, "cut": config.num_hidden_layers < FULL_LAYERS,
                           "dtype": "bfloat16", "parameters": sum(p.numel() for p in model.parameters()),
                           "weight_bytes": sum(p.nbytes for p in model.parameters())}
        weights = {}
        for shape in shapes:
            if shape.batch not in weights:
                g = torch.Generator(device=dev).manual_seed(1)
                noop = _no_attention_run(model, shape.batch, new_tokens, g)
                report["no_attention"].append(noop)
                weights[shape.batch] = noop["device_us"]
                bar.step(f"generate no-attention B{shape.batch}")
            records, errors = run_shape(model, shape, passed, bar.step, new_tokens=new_tokens,
                                        weights_us=weights[shape.batch])
            report["records"] += records
            report["errors"] += errors
    finally:
        bar.close()
    return report
