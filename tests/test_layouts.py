"""Layout descriptors: golden sizes and offsets, validation, and the dataclass contract.

Expected sizes and offsets are the peers' published layouts (docs/algorithms.md names the
peers) or are computed here from the byte rules written out in the test (never read back from
``tqkern.layouts``).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from tqkern import layouts
from tqkern.layouts import FP8, KVFormat, LloydMax, PagedLayout, Raw, Uniform

# -- golden slot sizes -----------------------------------------------------------------------

# vLLM's turboquant_* cache dtypes (vllm-project/vllm#38479): slot bytes at head_dim 64 / 128 / 256.
VLLM_SLOT_BYTES = {
    "turboquant_k8v4": (100, 196, 388),
    "turboquant_4bit_nc": (70, 134, 262),
    "turboquant_k3v4_nc": (62, 118, 230),
    "turboquant_3bit_nc": (54, 102, 198),
}


@pytest.mark.parametrize("name", sorted(VLLM_SLOT_BYTES))
@pytest.mark.parametrize("i, head_dim", list(enumerate((64, 128, 256))))
def test_vllm_preset_slot_bytes(name, i, head_dim):
    fmt = KVFormat.preset(name, head_dim=head_dim)
    assert fmt.slot_bytes == VLLM_SLOT_BYTES[name][i]
    assert fmt.key_bytes + fmt.value_bytes + fmt.pad_bytes == fmt.slot_bytes
    # vLLM pads to even and these sizes are already even: no padding.
    assert fmt.pad_bytes == 0


@pytest.mark.parametrize("head_dim, expected", [(64, 72), (128, 136), (256, 264)])
def test_tq4_slot_bytes(head_dim, expected):
    # turboquant-vllm: H·(D + 8) bytes per token row, i.e. D + 8 per head, no padding.
    fmt = KVFormat.preset("tq4", head_dim=head_dim)
    assert fmt.slot_bytes == expected == head_dim + 8
    assert fmt.pad_bytes == 0


def test_tq4_compression_vs_fp16():
    # turboquant-vllm (PyPI): 136 bytes per head at D=128 is 3.76x vs fp16 (2 · 2 · 128 = 512 bytes).
    assert KVFormat.preset("tq4", head_dim=128).compression == pytest.approx(3.76, abs=0.005)
    assert KVFormat.preset("turboquant_4bit_nc", head_dim=128).compression == pytest.approx(512 / 134)


def test_unknown_preset_names_the_argument():
    with pytest.raises(ValueError, match=r"name must be one of .*'turboquant_k8v4'.*got 'turboquant_2bit'"):
        KVFormat.preset("turboquant_2bit", head_dim=128)


def test_preset_codecs():
    f = KVFormat.preset("turboquant_4bit_nc", head_dim=128)
    assert f.key == LloydMax(bits=4, distribution="gaussian", norm_dtype="float16", norm_correction="decode")
    assert f.value == Uniform(bits=4, param_dtype="float16", rotated=False)
    assert (f.bit_order, f.rotation, f.slot_alignment) == ("lsb", "hadamard", 2)
    f = KVFormat.preset("turboquant_k8v4", head_dim=128)
    assert f.key == FP8(rotated=False) and not f.rotated
    f = KVFormat.preset("turboquant_3bit_nc", head_dim=128)
    assert f.key.bits == 3 and f.value == Uniform(bits=3)
    f = KVFormat.preset("tq4", head_dim=128)
    assert f.key == f.value == LloydMax(bits=4, distribution="gaussian", norm_dtype="float32",
                                        norm_correction="none")
    assert (f.bit_order, f.rotation, f.slot_alignment) == ("nibble_high_even", "haar", 1)


@pytest.mark.parametrize("name, bytes_64", [("k4v2h", 52), ("k3v2h", 44), ("k4v3h", 60), ("k5v3h", 68),
                                             ("k5v4h", 76)])
def test_lloyd_max_family_names(name, bytes_64):
    """``kXvYh``: docs/quality.md's per-layer formats by name (bytes at head_dim 64 as that page
    lists them: norms 2 + 2, codes X·64/8 + Y·64/8)."""
    f = KVFormat.preset(name, head_dim=64)
    kb, vb = int(name[1]), int(name[3])
    assert f.key == LloydMax(bits=kb, distribution="beta", norm_dtype="float16", norm_correction="stored")
    assert f.value == LloydMax(bits=vb, distribution="beta", norm_dtype="float16", norm_correction="stored")
    assert (f.bit_order, f.rotation, f.slot_alignment) == ("lsb", "hadamard_signed", 2)
    assert f.slot_bytes == bytes_64
    assert layouts.is_format_name(name) and layouts.is_format_name("tq4")
    # tqkern_k5v3 is the same codecs with float32 norms
    own = KVFormat.preset("tqkern_k5v3", 128)
    assert KVFormat.preset("k5v3h", 128).key == dataclasses.replace(own.key, norm_dtype="float16")
    assert KVFormat.preset("k5v3h", 128).value == dataclasses.replace(own.value, norm_dtype="float16")


@pytest.mark.parametrize("bad", ["k9v3h", "k0v3h", "k4v3", "K4v3h", "k4v3h ", "k44v3h", 43])
def test_family_name_outside_it_names_the_argument(bad):
    assert not layouts.is_format_name(bad)
    with pytest.raises(ValueError, match=r"name must be one of .*'kXvYh' \(X, Y in 1\.\.8\)"):
        KVFormat.preset(bad, head_dim=64)


# -- field offsets ---------------------------------------------------------------------------

def test_worked_slot_turboquant_4bit_nc_d128():
    fmt = KVFormat.preset("turboquant_4bit_nc", head_dim=128)
    got = [(name, off, f.nbytes, f.dtype) for name, f, off in fmt.slot_fields()]
    assert got == [
        ("key.codes", 0, 64, "codes"),
        ("key.norm", 64, 2, "float16"),
        ("value.data", 66, 64, "codes"),
        ("value.scale", 130, 2, "float16"),
        ("value.zero", 132, 2, "float16"),
    ]
    assert fmt.field_offset("value.scale") == 130
    assert (fmt.key_bytes, fmt.value_bytes, fmt.slot_bytes) == (66, 68, 134)


def test_worked_slot_turboquant_k8v4_d128():
    fmt = KVFormat.preset("turboquant_k8v4", head_dim=128)
    got = [(name, off, f.nbytes, f.dtype) for name, f, off in fmt.slot_fields()]
    assert got == [
        ("key.data", 0, 128, "float8_e4m3fn"),
        ("value.data", 128, 64, "codes"),
        ("value.scale", 192, 2, "float16"),
        ("value.zero", 194, 2, "float16"),
    ]


def test_field_offset_unknown_name():
    fmt = KVFormat.preset("tq4", head_dim=128)
    with pytest.raises(ValueError, match=r"name must be one of .*got 'key.scale'"):
        fmt.field_offset("key.scale")
    layout = PagedLayout(format=fmt, num_kv_heads=2, block_size=16, arrangement="row")
    with pytest.raises(ValueError, match=r"name must be one of .*got 'value.data'"):
        layout.field("value.data")


def test_field_descriptors_name_a_bad_value():
    """Field and FieldAddress are built by the codecs and layouts, but they are public types:
    a wrong name, size or dtype is refused, naming the attribute."""
    from tqkern.layouts import Field, FieldAddress

    assert Field("codes", 48, "codes").nbytes == 48
    with pytest.raises(ValueError, match=r"Field.name must be one of .*'codes'.*, got 'cods'"):
        Field("cods", 48, "codes")
    with pytest.raises(ValueError, match=r"Field.nbytes must be in \[1, 1048576\], got 0"):
        Field("norm", 0, "float16")
    with pytest.raises(TypeError, match="Field.nbytes must be an int, got float"):
        Field("norm", 2.0, "float16")
    with pytest.raises(ValueError, match=r"Field.dtype must be one of .*, got 'float64'"):
        Field("norm", 8, "float64")
    assert FieldAddress(0, 0, 0, "uint8").nbytes == 0  # a format without padding
    with pytest.raises(ValueError, match=r"FieldAddress.offset must be in \[0, 1073741824\], got -1"):
        FieldAddress(-1, 4, 4, "uint8")
    with pytest.raises(TypeError, match="FieldAddress.head_stride must be an int, got bool"):
        FieldAddress(0, True, 4, "uint8")
    with pytest.raises(ValueError, match="FieldAddress.dtype must be one of"):
        FieldAddress(0, 4, 4, "int4")


def test_row_arrangement_tq4_h8_d128():
    # turboquant-vllm's TQ4 row with H=8, D=128: [K codes h·64 | K norms 512 + 4h |
    # V codes 544 + h·64 | V norms 1056 + 4h], 1088 bytes per token row.
    fmt = KVFormat.preset("tq4", head_dim=128)
    lay = PagedLayout(format=fmt, num_kv_heads=8, block_size=16, arrangement="row")
    assert lay.row_bytes == 8 * (128 + 8) == 1088
    assert lay.cache_shape(3) == (3, 16, 1088)
    assert lay.block_bytes == 16 * 1088
    addr = lay.fields()
    assert list(addr) == ["key.codes", "key.norm", "value.codes", "value.norm"]
    for h in range(8):
        k = addr["key.codes"]
        assert k.offset + h * k.head_stride == h * 64 and k.nbytes == 64 and k.dtype == "codes"
        kn = addr["key.norm"]
        assert kn.offset + h * kn.head_stride == 8 * 64 + 4 * h and kn.nbytes == 4
        assert kn.dtype == "float32"
        v = addr["value.codes"]
        assert v.offset + h * v.head_stride == 8 * 64 + 32 + h * 64 and v.nbytes == 64
        vn = addr["value.norm"]
        assert vn.offset + h * vn.head_stride == 8 * 128 + 32 + 4 * h and vn.nbytes == 4
    assert lay.pad_address().nbytes == 0


def test_slot_arrangement_turboquant_4bit_nc_h8():
    fmt = KVFormat.preset("turboquant_4bit_nc", head_dim=128)
    lay = PagedLayout(format=fmt, num_kv_heads=8, block_size=16)
    assert lay.arrangement == "slot"
    assert lay.cache_shape(5) == (5, 16, 8, 134)
    assert lay.row_bytes == 8 * 134
    expected = {"key.codes": (0, 64), "key.norm": (64, 2), "value.data": (66, 64),
                "value.scale": (130, 2), "value.zero": (132, 2)}
    for name, (off, nb) in expected.items():
        a = lay.field(name)
        assert (a.offset, a.head_stride, a.nbytes) == (off, 134, nb)


def _my_field_sizes(codec, d):
    """Field sizes written from the byte rules of docs/layout.md, independently of layouts.py."""
    packed = -(-d * getattr(codec, "bits", 0) // 8)
    if isinstance(codec, LloydMax):
        return [("codes", packed), ("norm", {"float16": 2, "float32": 4}[codec.norm_dtype])]
    if isinstance(codec, Uniform):
        p = {"float16": 2, "float32": 4}[codec.param_dtype]
        return [("data", packed), ("scale", p), ("zero", p)]
    if isinstance(codec, FP8):
        return [("data", d)]
    return [("data", 2 * d)]


CODECS = [
    LloydMax(bits=1), LloydMax(bits=3, norm_dtype="float16"), LloydMax(bits=5), LloydMax(bits=8),
    Uniform(bits=2), Uniform(bits=3, param_dtype="float32"), Uniform(bits=7), FP8(), Raw(),
    Raw(dtype="bfloat16"),
]


@pytest.mark.parametrize("head_dim", [2, 6, 64, 96, 100, 128, 130, 256])
@pytest.mark.parametrize("align", [1, 2, 4, 16])
def test_sizes_and_both_arrangements_match_byte_rules(head_dim, align):
    h_count = 3
    for key in CODECS:
        for value in CODECS[::3]:
            fmt = KVFormat(head_dim=head_dim, key=key, value=value, slot_alignment=align)
            kf, vf = _my_field_sizes(key, head_dim), _my_field_sizes(value, head_dim)
            used = sum(n for _, n in kf + vf)
            slot = -(-used // align) * align
            assert (fmt.key_bytes, fmt.value_bytes) == (sum(n for _, n in kf), sum(n for _, n in vf))
            assert (fmt.slot_bytes, fmt.pad_bytes) == (slot, slot - used)
            names = [f"key.{n}" for n, _ in kf] + [f"value.{n}" for n, _ in vf]
            sizes = [n for _, n in kf + vf]
            slot_lay = PagedLayout(format=fmt, num_kv_heads=h_count, block_size=4, arrangement="slot")
            row_lay = PagedLayout(format=fmt, num_kv_heads=h_count, block_size=4, arrangement="row")
            assert slot_lay.row_bytes == row_lay.row_bytes == h_count * slot
            in_slot = region = 0
            for name, nb in zip(names, sizes):
                a = slot_lay.field(name)
                assert (a.offset, a.head_stride, a.nbytes) == (in_slot, slot, nb)
                a = row_lay.field(name)
                assert (a.offset, a.head_stride, a.nbytes) == (region, nb, nb)
                in_slot += nb
                region += h_count * nb
            p = slot_lay.pad_address()
            assert (p.offset, p.head_stride, p.nbytes) == (used, slot, slot - used)
            p = row_lay.pad_address()
            assert (p.offset, p.head_stride, p.nbytes) == (h_count * used, slot - used, slot - used)


def test_row_arrangement_covers_each_row_byte_once():
    fmt = KVFormat(head_dim=10, key=LloydMax(bits=3), value=Uniform(bits=5), slot_alignment=16)
    lay = PagedLayout(format=fmt, num_kv_heads=3, block_size=2, arrangement="row")
    hits = np.zeros(lay.row_bytes, int)
    for a in [*lay.fields().values(), lay.pad_address()]:
        for h in range(3):
            hits[a.offset + h * a.head_stride: a.offset + h * a.head_stride + a.nbytes] += 1
    assert hits.tolist() == [1] * lay.row_bytes


# -- 3-bit codes at head_dim not a multiple of 8 ---------------------------------------------

def test_three_bit_codes_at_head_dim_100_pack_into_ceil_bytes_with_zero_pad_bits():
    from tqkern.ops.compress.reference import compress
    from tqkern.params import TQParams

    fmt = KVFormat(head_dim=100, key=LloydMax(bits=3, norm_dtype="float16"),
                   value=Uniform(bits=3), rotation="hadamard_signed")
    assert fmt.key_fields[0].nbytes == fmt.value_fields[0].nbytes == 38  # ⌈300 / 8⌉
    assert (fmt.key_bytes, fmt.value_bytes, fmt.slot_bytes) == (40, 42, 82)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((64, 2, 100))
    v = rng.standard_normal((64, 2, 100))
    slots = compress(k, v, TQParams.default(fmt, seed=3))
    # 300 code bits end in the low nibble of byte 37: the high nibble is padding.
    key_last = slots[..., 37]
    value_last = slots[..., 40 + 37]
    assert np.all(key_last >> 4 == 0) and np.all(value_last >> 4 == 0)
    # ...and the low nibbles are not all zero (the test can see code bits there).
    assert np.any(key_last & 15) and np.any(value_last & 15)


# -- validation: every bad field raises, naming it ------------------------------------------

def _raises(exc, field, fn, actual=None):
    pattern = re.escape(field)
    if actual is not None:
        pattern += r".*" + re.escape(repr(actual) if exc is ValueError else actual)
    with pytest.raises(exc, match=pattern):
        fn()


@pytest.mark.parametrize("bits", [0, -1, 9, 16])
def test_lloyd_max_bits_out_of_range(bits):
    _raises(ValueError, "LloydMax.bits", lambda: LloydMax(bits=bits), bits)


@pytest.mark.parametrize("bits", [1, 0, 9])
def test_uniform_bits_out_of_range(bits):
    _raises(ValueError, "Uniform.bits", lambda: Uniform(bits=bits), bits)


@pytest.mark.parametrize("bits", [4.0, "4", True, None])
def test_bits_of_wrong_type(bits):
    _raises(TypeError, "LloydMax.bits", lambda: LloydMax(bits=bits))
    _raises(TypeError, "Uniform.bits", lambda: Uniform(bits=bits))


def test_valid_bit_ranges_construct():
    for b in range(1, 9):
        assert LloydMax(bits=b).bits == b
    for b in range(2, 9):
        assert Uniform(bits=b).bits == b


@pytest.mark.parametrize("field, make, actual", [
    ("LloydMax.distribution", lambda: LloydMax(bits=4, distribution="uniform"), "uniform"),
    ("LloydMax.norm_dtype", lambda: LloydMax(bits=4, norm_dtype="bfloat16"), "bfloat16"),
    ("LloydMax.norm_correction", lambda: LloydMax(bits=4, norm_correction="both"), "both"),
    ("LloydMax.norm_correction", lambda: LloydMax(bits=4, norm_correction=None), None),
    ("Uniform.param_dtype", lambda: Uniform(bits=4, param_dtype="bfloat16"), "bfloat16"),
    ("Raw.dtype", lambda: Raw(dtype="float32"), "float32"),
])
def test_bad_codec_strings(field, make, actual):
    _raises(ValueError, field, make, actual)


@pytest.mark.parametrize("rotated", [1, 0, "yes", None])
def test_rotated_must_be_bool(rotated):
    _raises(TypeError, "Uniform.rotated", lambda: Uniform(bits=4, rotated=rotated))
    _raises(TypeError, "FP8.rotated", lambda: FP8(rotated=rotated))


def _fmt(**kw):
    base = dict(head_dim=128, key=LloydMax(bits=4), value=LloydMax(bits=4))
    base.update(kw)
    return KVFormat(**base)


@pytest.mark.parametrize("head_dim", [127, 1, 3, 101])
def test_odd_head_dim(head_dim):
    _raises(ValueError, "KVFormat.head_dim", lambda: _fmt(head_dim=head_dim), head_dim)


@pytest.mark.parametrize("head_dim", [0, -2, 1026, 2048])
def test_head_dim_out_of_range(head_dim):
    _raises(ValueError, "KVFormat.head_dim", lambda: _fmt(head_dim=head_dim), head_dim)


@pytest.mark.parametrize("head_dim", [128.0, "128", None])
def test_head_dim_wrong_type(head_dim):
    _raises(TypeError, "KVFormat.head_dim", lambda: _fmt(head_dim=head_dim))


@pytest.mark.parametrize("side", ["key", "value"])
@pytest.mark.parametrize("bad", ["lloyd_max", 4, None, LloydMax])
def test_codec_of_wrong_type(side, bad):
    _raises(TypeError, f"KVFormat.{side}", lambda: _fmt(**{side: bad}))


@pytest.mark.parametrize("side, codec", [
    ("key", LloydMax(bits=3)), ("value", LloydMax(bits=3)), ("key", Uniform(bits=8)),
    ("value", Uniform(bits=2)), ("key", LloydMax(bits=5)),
])
def test_nibble_order_needs_4_bit_codes(side, codec):
    _raises(ValueError, f"KVFormat.{side}.bits",
            lambda: _fmt(bit_order="nibble_high_even", **{side: codec}), codec.bits)


def test_nibble_order_accepts_unpacked_codecs():
    # FP8 and Raw hold no codes, so the nibble order does not constrain them.
    f = _fmt(bit_order="nibble_high_even", key=FP8(), value=Uniform(bits=4))
    assert f.bit_order == "nibble_high_even"
    f = _fmt(bit_order="nibble_high_even", key=Raw(), value=LloydMax(bits=4))
    assert f.value_fields[0].nbytes == 64


@pytest.mark.parametrize("field, kw, actual", [
    ("KVFormat.bit_order", dict(bit_order="msb"), "msb"),
    ("KVFormat.rotation", dict(rotation="random"), "random"),
    ("KVFormat.slot_alignment", dict(slot_alignment=3), 3),
    ("KVFormat.slot_alignment", dict(slot_alignment=6), 6),
    ("KVFormat.slot_alignment", dict(slot_alignment=0), 0),
    ("KVFormat.slot_alignment", dict(slot_alignment=512), 512),
])
def test_bad_format_fields(field, kw, actual):
    _raises(ValueError, field, lambda: _fmt(**kw), actual)


def _lay(**kw):
    base = dict(format=KVFormat.preset("tq4", head_dim=128), num_kv_heads=8, block_size=16)
    base.update(kw)
    return PagedLayout(**base)


@pytest.mark.parametrize("block_size", [3, 6, 24, 100, 1000])
def test_block_size_not_power_of_two(block_size):
    _raises(ValueError, "PagedLayout.block_size", lambda: _lay(block_size=block_size), block_size)


@pytest.mark.parametrize("block_size", [0, -16, 2048])
def test_block_size_out_of_range(block_size):
    _raises(ValueError, "PagedLayout.block_size", lambda: _lay(block_size=block_size), block_size)


def test_block_sizes_powers_of_two_accepted():
    for p in range(11):
        assert _lay(block_size=2**p).block_size == 2**p


@pytest.mark.parametrize("arrangement", ["column", "rows", None, "SLOT"])
def test_bad_arrangement(arrangement):
    _raises(ValueError, "PagedLayout.arrangement", lambda: _lay(arrangement=arrangement), arrangement)


@pytest.mark.parametrize("heads", [0, -1])
def test_bad_num_kv_heads(heads):
    _raises(ValueError, "PagedLayout.num_kv_heads", lambda: _lay(num_kv_heads=heads), heads)


def test_paged_layout_format_type():
    _raises(TypeError, "PagedLayout.format", lambda: _lay(format="tq4"))
    _raises(TypeError, "PagedLayout.num_kv_heads", lambda: _lay(num_kv_heads=8.0))


# -- the dataclass contract ------------------------------------------------------------------

INSTANCES = [
    LloydMax(bits=4), Uniform(bits=4), FP8(), Raw(),
    KVFormat.preset("tq4", head_dim=128),
    PagedLayout(format=KVFormat.preset("tq4", head_dim=128), num_kv_heads=2, block_size=16),
]


@pytest.mark.parametrize("obj", INSTANCES, ids=lambda o: type(o).__name__)
def test_frozen_and_slotted(obj):
    name = dataclasses.fields(obj)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, name, getattr(obj, name))
    with pytest.raises((dataclasses.FrozenInstanceError, AttributeError, TypeError)):
        obj.extra = 1
    assert "__slots__" in type(obj).__dict__
    assert not hasattr(obj, "__dict__")


@pytest.mark.parametrize("cls, args", [
    (LloydMax, (4,)), (Uniform, (4,)), (FP8, (True,)), (Raw, ("float16",)),
    (KVFormat, (128, LloydMax(bits=4), LloydMax(bits=4))),
    (PagedLayout, (KVFormat.preset("tq4", head_dim=128), 8, 16)),
])
def test_keyword_only(cls, args):
    with pytest.raises(TypeError):
        cls(*args)


def test_equal_descriptors_hash_equal():
    a = KVFormat.preset("turboquant_k3v4_nc", head_dim=96)
    b = KVFormat(head_dim=96, key=LloydMax(bits=3, distribution="gaussian", norm_dtype="float16",
                                           norm_correction="decode"),
                 value=Uniform(bits=4), bit_order="lsb", rotation="hadamard", slot_alignment=2)
    assert a == b and hash(a) == hash(b)
    assert a != a.replace(head_dim=128)
    assert {PagedLayout(format=a, num_kv_heads=2, block_size=16)} == {
        PagedLayout(format=b, num_kv_heads=2, block_size=16)}
