"""The codec registry (``tqkern.ops.codecs``) and the page that documents it (``docs/codecs.md``)."""

import importlib
import pathlib
import re

import pytest

import tqkern
from tqkern import layouts
from tqkern.ops import codecs
from tqkern.ops.codecs import CODECS, Kind, codec_kind, layout_args, layout_consts, side_consts

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "codecs.md"


def _layout(preset, d=128, arrangement="slot"):
    return tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, d), num_kv_heads=8, block_size=16,
                              arrangement=arrangement)


# -- the registry -------------------------------------------------------------------------------
def test_kind_ids_are_stable():
    """The ids are part of compiled kernels' cache keys and of the warp-MMA plans: never renumber."""
    assert {k.name: int(k) for k in Kind} == {"LLOYD_MAX": 0, "UNIFORM": 1, "FP8": 2, "RAW": 3}
    for k in Kind:
        assert getattr(codecs, f"KIND_{k.name}").value == int(k)


def test_every_codec_class_is_registered():
    assert set(CODECS) == set(layouts._CODECS)
    assert len({spec.kind for spec in CODECS.values()}) == len(CODECS)


@pytest.mark.parametrize("codec, kind", [
    (tqkern.LloydMax(bits=3), Kind.LLOYD_MAX), (tqkern.Uniform(bits=2), Kind.UNIFORM),
    (tqkern.FP8(), Kind.FP8), (tqkern.Raw(dtype="bfloat16"), Kind.RAW)])
def test_codec_kind(codec, kind):
    assert codec_kind(codec) is kind


def test_codec_kind_rejects_a_non_codec():
    with pytest.raises(TypeError, match=r"codec must be one of \['LloydMax', 'Uniform', 'FP8', 'Raw'\], got dict"):
        codec_kind({"kind": "uniform", "bits": 2})


def test_side_consts_rejects_a_bad_side():
    with pytest.raises(ValueError, match=r"side must be 'key' or 'value', got 'keys'"):
        side_consts(_layout("fp16"), "keys")


def test_side_consts_vllm_slot():
    """turboquant_4bit_nc, D = 128, slot arrangement (vLLM's 134-byte slot): key codes 64 bytes at
    0 and an fp16 norm at 64; value codes 64 bytes at 66, fp16 scale at 130, zero at 132."""
    k = side_consts(_layout("turboquant_4bit_nc"), "key")
    v = side_consts(_layout("turboquant_4bit_nc"), "value")
    assert k == codecs.SideConsts(KIND=0, BITS=4, ROTATED=True, NORM_CORRECTION=1, PARAM_DTYPE=0,
                                  A_OFF=0, A_STRIDE=134, A_BYTES=64, B_OFF=64, B_STRIDE=134, C_OFF=0, C_STRIDE=134)
    assert v == codecs.SideConsts(KIND=1, BITS=4, ROTATED=False, NORM_CORRECTION=0, PARAM_DTYPE=0,
                                  A_OFF=66, A_STRIDE=134, A_BYTES=64, B_OFF=130, B_STRIDE=134, C_OFF=132,
                                  C_STRIDE=134)


def test_side_consts_uniform2_row():
    """2-bit uniform values (f32 scale/zero) with 4-bit keys, D = 64, 2 heads, row arrangement:
    per token [key codes 2×32 | key norms 2×4 | value codes 2×16 | scales 2×4 | zeros 2×4]."""
    fmt = tqkern.KVFormat(head_dim=64, key=tqkern.LloydMax(bits=4),
                          value=tqkern.Uniform(bits=2, param_dtype="float32"))
    lay = tqkern.PagedLayout(format=fmt, num_kv_heads=2, block_size=16, arrangement="row")
    v = side_consts(lay, "value")
    assert (v.KIND, v.BITS, v.PARAM_DTYPE) == (Kind.UNIFORM, 2, 1)
    assert (v.A_OFF, v.A_STRIDE, v.A_BYTES) == (72, 16, 16)
    assert (v.B_OFF, v.B_STRIDE, v.C_OFF, v.C_STRIDE) == (104, 4, 112, 4)


def test_layout_consts_flatten_layout_args():
    lay = _layout("tq4", arrangement="row")
    args, flat = layout_args(lay), layout_consts(lay)
    k, v = args.pop("K"), args.pop("V")
    assert flat == {**args, **{f"K_{n}": x for n, x in k._asdict().items()},
                    **{f"V_{n}": x for n, x in v._asdict().items()}}
    assert layout_args(lay) is not layout_args(lay)  # a fresh dict each call (callers may edit it)


# -- docs/codecs.md -----------------------------------------------------------------------------
def _table(title: str) -> list[list[str]]:
    text = DOC.read_text()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in r.strip("|").split(" | ")] for r in rows[2:]]  # (after the header and "| ---")


def test_doc_lists_every_kind():
    rows = _table("Kind ids")
    assert [(r[0].strip("`"), int(r[1])) for r in rows] == [(k.name, int(k)) for k in Kind]
    examples = [tqkern.LloydMax(bits=4), tqkern.Uniform(bits=4), tqkern.FP8(), tqkern.Raw()]
    by_kind = {codec_kind(c): c for c in examples}
    for r in rows:
        assert r[2] == ", ".join(f.name for f in by_kind[Kind[r[0].strip("`")]].fields(64)), r[0]


def test_doc_codec_table_is_every_preset():
    rows = _table("Codec table")
    assert [r[0].strip("`") for r in rows] == list(layouts.PRESETS)
    for name, kc, kk, kf, vc, vk, vf in rows:
        fmt = tqkern.KVFormat.preset(name.strip("`"), 128)
        for codec, text, kind, fields in ((fmt.key, kc, kk, kf), (fmt.value, vc, vk, vf)):
            assert text == f"`{codec!r}`", name
            assert kind == f"{codec_kind(codec).name} ({int(codec_kind(codec))})", name
            assert fields == ", ".join(f.name for f in codec.fields(128)), name


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_doc_names_exist():
    """Every ``tqkern.…`` name on the page resolves, and the "adding a codec" steps name the
    registry, the shared field code and the oracles."""
    text = DOC.read_text()
    names = set(re.findall(r"`(tqkern\.[\w.]+)`", text))
    for name in ("tqkern.ops.codecs.Kind", "tqkern.ops.codecs.CODECS", "tqkern.ops.fields.encode_side",
                 "tqkern.ops.fields.load_tile", "tqkern.ops.fields.token_factors",
                 "tqkern.ops.quantize.reference.quantize", "tqkern.testing.codecs"):
        assert name in names, f"docs/codecs.md no longer names {name}"
    for name in sorted(names):
        assert _resolve(name) is not None, name
    for simple in re.findall(r"`(\w+)\(layout", text):  # side_consts(layout, side), layout_args(layout)
        assert hasattr(codecs, simple), simple
    assert "`property_tests/test_codecs_triton.py`" in text
    assert (DOC.parents[1] / "property_tests" / "test_codecs_triton.py").exists()


def test_architecture_links_the_codec_page():
    arch = (DOC.parent / "architecture.md").read_text()
    where = arch.split("## Where things are", 1)[1]
    assert "docs/codecs.md" in where
