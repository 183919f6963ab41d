"""``tqkern eval --layer-formats`` on the tiny random Llama (2 layers, 2 KV heads, head_dim 16):
argument errors, the per-layer map reaching the cache, the average bytes, μ per layer (``auto``)."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tqkern.cli import main  # noqa: E402
from tqkern.layouts import KVFormat, PagedLayout, layout_to_dict  # noqa: E402
import tqkern_torch.transformers as tqt  # noqa: E402

# Bytes per token per KV head at head_dim 16, from the codecs' definitions (docs/layout.md):
K8V4 = 16 + (16 * 4 // 8 + 2 + 2)  # FP8 key: 1 byte/element; uniform 4-bit value: 8 B codes + fp16 scale, zero
K4V4 = 2 * (16 * 4 // 8 + 4)  # tqkern_k4v4: Lloyd-Max 4-bit codes + float32 norm, for K and for V
FP16 = 2 * 16 * 2  # raw float16 K and V


def _eval(tmp_path, *layer_formats, mus=("none",), window=16):
    args = ["eval", "--model", "tiny-random", "--windows", "1", "--window", str(window), "--formats",
            "--mu", *mus, "--out", str(tmp_path)]
    for text in layer_formats:
        args += ["--layer-formats", text]
    assert main(args) == 0
    return json.loads((tmp_path / "quality.json").read_text())


@pytest.mark.parametrize("text, says", [
    ("nope", "[LABEL=]JSON object"),
    ("[1, 2]", "must be a JSON object"),
    ('{"0": "fp16"}', '"*" entry'),
    ('{"*": "fp16", "first": "fp16"}', "layer indices or"),
    ('{"*": "turboquant_5bit"}', "must be a preset"),
    ('{"*": 4}', "preset name or a format object"),
    ('{"*": "fp16", "2": "tq4"}', "layer indices in [-2, 2), got 2"),
    ('{"*": "fp16", "-3": "tq4"}', "layer indices in [-2, 2), got -3"),
    ('{"*": "fp16", "1": "tq4", "-1": "fp16"}', "names layer 1 twice"),
    ('{"*": {"key": {"kind": "lloyd_max", "bits": 12}, "value": {"kind": "raw"}}}', "not a valid format"),
    ('={"*": "fp16"}', "empty LABEL"),
])
def test_layer_formats_errors_name_the_argument(text, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", "tiny-random", "--windows", "1", "--window", "16", "--formats",
              "--layer-formats", text])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--layer-formats" in err and says in err, err


def test_layer_formats_duplicate_labels_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", "tiny-random", "--windows", "1", "--window", "16", "--formats",
              "--layer-formats", 'a={"*": "fp16"}', "--layer-formats", 'a={"*": "tq4"}'])
    assert e.value.code == 2 and "labels must be unique" in capsys.readouterr().err


def test_layer_map_reaches_the_cache(tmp_path, monkeypatch):
    seen = []

    class Spy(tqt.TQCache):
        def __init__(self, model, *, params=None, **kw):
            seen.append([(p.format, p.key_offset is not None) for p in params])
            super().__init__(model, params=params, **kw)

    monkeypatch.setattr(tqt, "TQCache", Spy)
    report = _eval(tmp_path, '{"*": "turboquant_k8v4", "-1": "tqkern_k4v4"}', mus=("none", "auto", "calibrated"))
    k8v4, k4v4 = KVFormat.preset("turboquant_k8v4", 16), KVFormat.preset("tqkern_k4v4", 16)
    # one window, three rows, in row order; auto: μ only for the Lloyd-Max layer, not the FP8 one
    assert seen == [[(k8v4, False), (k4v4, False)], [(k8v4, False), (k4v4, True)], [(k8v4, True), (k4v4, True)]]
    assert [r["label"] for r in report["results"]] == ["layers1"] * 3
    assert sorted(report["per_window"]) == ["layers1", "layers1+mu", "layers1+mu_auto"]


def test_layer_map_changes_the_logits_exactly_where_it_says(tmp_path):
    # every layer overridden to fp16: the reference bit for bit; one layer compressed: not.
    report = _eval(tmp_path, 'all_fp16={"*": "turboquant_3bit_nc", "0": "fp16", "-1": "fp16"}',
                   'last_3bit={"*": "fp16", "1": "turboquant_3bit_nc"}')
    exact, lossy = report["results"]
    assert exact["label"] == "all_fp16" and exact["kl"] == 0.0 and exact["delta_ppl"] == 0.0
    assert lossy["label"] == "last_3bit" and lossy["kl"] > 1e-7


def test_average_bytes_over_layers(tmp_path, capsys):
    assert (K8V4, K4V4, FP16) == tuple(KVFormat.preset(n, 16).slot_bytes
                                       for n in ("turboquant_k8v4", "tqkern_k4v4", "fp16"))
    custom = layout_to_dict(PagedLayout(format=KVFormat.preset("tqkern_k4v4", 16), num_kv_heads=1,
                                        block_size=16))["format"]
    del custom["head_dim"]
    report = _eval(tmp_path, json.dumps({"*": "turboquant_k8v4", "-1": "fp16"}),
                   "obj=" + json.dumps({"*": custom, "0": "fp16"}))
    a, b = report["results"]
    assert a["slot_bytes"] == (K8V4 + FP16) / 2 == 46.0 and a["layer_slot_bytes"] == [K8V4, FP16]
    assert a["bytes_per_token"] == (K8V4 + FP16) * 2  # 2 KV heads
    assert a["compression"] == pytest.approx(4 * 16 / 46.0)
    assert a["layer_formats"] == {"*": "turboquant_k8v4", "-1": "fp16"}  # the map as given
    assert b["slot_bytes"] == (FP16 + K4V4) / 2 == 44.0 and b["layer_formats"] == {"*": custom, "0": "fp16"}
    out = capsys.readouterr().out
    assert "46.00" in out and "44.00" in out
