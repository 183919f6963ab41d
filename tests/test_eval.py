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


def _run(tiny, names, offset=False, windows=2, window=24):
    model, ids, calib = tiny
    d = model.config.head_dim
    configs = [tqe.Config(n, KVFormat.preset(n, d), offset) for n in names]
    return tqe.evaluate(model, ids, configs, windows=windows, window=window, calib_ids=calib, progress=False)


def test_fp16_is_the_reference_exactly(tiny):
    r = _run(tiny, ["fp16"])["results"][0]
    assert r["delta_ppl"] == 0.0 and r["kl"] == 0.0 and r["delta_ppl_ci95"] == [0.0, 0.0]
    assert r["tokens"] == 2 * 23


def test_fp16_with_offset_differs_by_rounding_only(tiny):
    # k - mu is rounded to fp16 instead of k: a few fp16 ulps of the keys, far below any codec's error.
    r = _run(tiny, ["fp16"], offset=True)["results"][0]
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
