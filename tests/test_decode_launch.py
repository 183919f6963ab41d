"""The decode launcher's rules outside the kernels: which kernel runs (`decode_path`), split
counts, CTAs per SM, the cooperative plans and their shared memory. The split merge and the q
rotation, against NumPy: `test_decode_merge.py`."""

import dataclasses

import pytest

import tqkern
import tqkern_torch as tqt
from tqkern.ops.paged_decode.mma_plans import ctas_per_sm, mma_plan, per_warp_plan
from tqkern.ops.paged_decode.triton import decode_path, num_splits_for


def _path(layout, group, **kw):
    """:func:`decode_path` for equal key and value codebooks (one table serves both)."""
    return decode_path(layout, group, same_codebooks=True, **kw)


def _layout(preset, d, heads, arrangement="slot"):
    return tqkern.PagedLayout(format=tqkern.KVFormat.preset(preset, d), num_kv_heads=heads, block_size=16,
                              arrangement=arrangement)


def test_decode_path_rules_and_bad_input():
    """The warp-MMA kernel takes 4-bit, 3-bit, 5-bit (LSB) or FP8 keys and 4-bit Lloyd-Max values
    (4-bit keys, shared codebook; 5-bit keys), 3- and 2-bit Lloyd-Max values (3-, 4-, 5-bit keys;
    their own table entries below the keys') or 4-/3-bit uniform values,
    head_dim 64/128, groups up to 8 (larger ones split into 2-4 groups of at most 8), rows of an
    even number of bytes (2 mod 4 only in blocks of an even number of rows, and not with FP8 keys); fields that are not at fixed offsets from the
    lanes' aligned chunks are read as shifted words; never under the interpreter."""
    tq4 = _layout("tq4", 128, 8, "row")
    nc = _layout("turboquant_4bit_nc", 128, 8)
    assert _path(tq4, 4) == "mma" and _path(nc, 4) == "mma"
    plan = mma_plan(nc, 4)
    assert plan.K_MERGE and plan.V_MERGE and plan.K_NC and plan.V_UNIFORM  # 134-byte slots
    assert not mma_plan(tq4, 4).K_MERGE
    # 32 tokens per softmax update: Lloyd-Max values, and uniform ones under cooperative stages
    assert mma_plan(tq4, 4).SUB == 2 and mma_plan(nc, 4).SUB == 2
    assert per_warp_plan(mma_plan(nc, 4)).SUB == 1 and per_warp_plan(mma_plan(tq4, 4)).SUB == 2
    assert _path(tq4, 4, interpret=True) == "general"
    assert _path(tq4, 9) == "mma" and mma_plan(tq4, 9).GS == 3  # group > 8: 3 query-head groups of 3
    assert _path(tq4, 11) == "general"  # a group > 8 that no 2-4 groups of at most 8 divide
    assert decode_path(tq4, 4, same_codebooks=False) == "general"  # one table serves K and V
    assert decode_path(nc, 4, same_codebooks=False) == "mma"  # uniform values need no table
    assert _path(tq4, 4, cache_aligned=False) == "general"
    nc64 = _layout("turboquant_4bit_nc", 64, 3)  # 210-byte rows: odd tokens' rows 2 bytes off a word
    assert _path(nc64, 3) == "mma"
    plan = mma_plan(nc64, 3)
    assert plan.K_FUN and plan.V_FUN and not (plan.K_MERGE or plan.V_MERGE)
    assert not any(getattr(mma_plan(tq4, 4), k) for k in ("K_FUN", "V_FUN"))  # 1088-byte rows: aligned chunks
    bs1 = tqkern.PagedLayout(format=nc64.format, num_kv_heads=3, block_size=1)
    assert _path(bs1, 3) == "general"  # a row's offset from a word boundary would follow its block
    k8v4 = mma_plan(_layout("turboquant_k8v4", 128, 8), 4)  # 196-byte slots: word loads of the keys
    assert k8v4.K_FP8 and k8v4.K_NW == 1 and not k8v4.K_MERGE and k8v4.V_MERGE and not k8v4.K_NC
    assert mma_plan(_layout("turboquant_k8v4", 128, 8, "row"), 4).K_NW == 4  # 16-byte aligned key fields
    assert _path(_layout("turboquant_k8v4", 64, 3), 3) == "mma"  # 300-byte rows: 4-byte value chunks
    k8v4_3 = mma_plan(_layout("turboquant_k8v4", 128, 3), 3)  # 588-byte rows: 8-byte value chunks shifted
    assert k8v4_3.V_FUN and k8v4_3.K_FP8
    f32_2mod4 = tqkern.KVFormat(head_dim=64, key=tqkern.LloydMax(bits=4, norm_dtype="float16"),
                                value=tqkern.LloydMax(bits=4, norm_dtype="float32"), slot_alignment=2)
    assert f32_2mod4.slot_bytes == 70  # odd tokens' float32 value norms would be 2 bytes off
    assert _path(tqkern.PagedLayout(format=f32_2mod4, num_kv_heads=1, block_size=16), 1) == "general"
    k3 = mma_plan(_layout("turboquant_k3v4_nc", 128, 8), 4)  # 118-byte slots: shifted word chunks
    assert k3.K_BITS == 3 and k3.K_NC and not k3.K_MERGE and k3.V_UNIFORM
    assert k3.V_FUN and not k3.V_MERGE  # with 3-bit keys, misaligned values are shifted, not joined
    assert mma_plan(nc, 4).V_MERGE and not mma_plan(nc, 4).V_FUN  # with 4-bit keys, joined
    v3 = mma_plan(_layout("turboquant_3bit_nc", 128, 8), 4)  # 3-bit uniform values: shifted 6-byte chunks
    assert v3.V_BITS == 3 and v3.V_FUN and v3.K_BITS == 3
    assert _path(_layout("turboquant_3bit_nc", 64, 3), 3) == "mma"  # 162-byte rows, 3-byte chunks
    k5 = mma_plan(_layout("tqkern_k5v3", 128, 8), 4)  # 5-bit keys (shifted words), 3-bit Lloyd-Max values
    assert k5.K_BITS == 5 and k5.K_FUN and k5.V_BITS == 3 and not k5.V_UNIFORM
    assert decode_path(_layout("tqkern_k5v3", 128, 8), 4, same_codebooks=False) == "mma"  # both codebooks loaded
    # Lloyd-Max values with their own codebook: its pairs at table entries 0.., the keys' at K_AT
    for kb, vb, k_at, lut in ((5, 4, 256, 36864), (4, 3, 64, 40960), (4, 2, 64, 40960), (3, 3, 64, 32768),
                              (3, 2, 64, 32768), (5, 2, 64, 32768)):
        fmt = tqkern.KVFormat(head_dim=128, key=tqkern.LloydMax(bits=kb), value=tqkern.LloydMax(bits=vb))
        lay = tqkern.PagedLayout(format=fmt, num_kv_heads=8, block_size=16)
        p = per_warp_plan(mma_plan(lay, 4))
        assert (p.K_BITS, p.V_BITS, p.V_UNIFORM, p.K_AT, p.lut_bytes) == (kb, vb, False, k_at, lut), (kb, vb)
        assert decode_path(lay, 4, same_codebooks=False) == "mma"  # the value codebook is loaded
        assert mma_plan(lay, 4).LUT_AT is None  # no PRMT-addressed table: its entries are the keys' alone
    assert per_warp_plan(mma_plan(tq4, 4)).lut_bytes == 32768 and mma_plan(tq4, 4).lut_bytes == 65536
    assert mma_plan(_layout("turboquant_k8v4", 128, 8), 4).lut_bytes == 0  # FP8 keys, uniform values
    v1 = tqkern.KVFormat(head_dim=128, key=tqkern.LloydMax(bits=4), value=tqkern.LloydMax(bits=1))
    assert _path(tqkern.PagedLayout(format=v1, num_kv_heads=8, block_size=16), 4) == "general"
    k3_64 = tqkern.KVFormat(head_dim=64, key=tqkern.LloydMax(bits=3), value=tqkern.Uniform(bits=4))
    # D=64: 6-byte lane chunks of the 24-byte key field, half of them 2 bytes off a word boundary
    assert _path(tqkern.PagedLayout(format=k3_64, num_kv_heads=8, block_size=16, arrangement="row"), 4) == "mma"
    fp8_lm = tqkern.KVFormat(head_dim=128, key=tqkern.FP8(), value=tqkern.LloydMax(bits=4))
    assert _path(tqkern.PagedLayout(format=fp8_lm, num_kv_heads=8, block_size=16), 4) == "general"  # no table
    assert _path(_layout("tq4", 256, 8, "row"), 4) == "mma"  # (32-byte key chunks: two 16-byte loads)
    assert _path(_layout("tq4", 256, 1, "row"), 16) == "general"  # (D256: one query column tile only)
    # head_dim 96 (Phi-3): 4-bit values in shifted 6-byte chunks, misaligned 4-bit keys shifted (not
    # joined: 12-byte chunks); 3-bit values (12 codes = 36 bits a lane) shifted by whole bytes and a nibble
    p96 = per_warp_plan(mma_plan(_layout("turboquant_4bit_nc", 96, 16), 1))
    assert (p96.D, p96.K_FUN, p96.K_MERGE, p96.V_FUN) == (96, True, False, True)
    assert mma_plan(_layout("turboquant_k8v4", 96, 16), 1).K_NW in (1, 2)  # 6 words a lane: whole loads
    assert _path(_layout("turboquant_3bit_nc", 96, 16), 1) == "mma"
    assert mma_plan(_layout("tqkern_k5v3", 96, 16), 1).V_FUN
    with pytest.raises(TypeError, match="layout must be a tqkern.PagedLayout, got KVFormat"):
        _path(tqkern.KVFormat.preset("tq4", 128), 4)


def test_decode_path_capability_gate():
    """The warp-MMA kernel's PTX needs sm_80 (mma.sync m16n8k16, the L2::256B hint) and, for FP8
    keys, sm_89 (cvt.rn.f16x2.e4m3x2): below that the launcher's "auto" path takes the general
    kernel; ``None`` skips the check; a malformed capability is a TypeError naming it."""
    tq4 = _layout("tq4", 128, 8, "row")
    k8v4 = _layout("turboquant_k8v4", 128, 8)
    assert _path(tq4, 4, capability=(7, 5)) == "general"
    assert _path(tq4, 4, capability=(8, 0)) == "mma"
    assert _path(tq4, 4, capability=(9, 0)) == "mma"
    assert _path(k8v4, 4, capability=(8, 0)) == "general"
    assert _path(k8v4, 4, capability=(8, 6)) == "general"
    assert _path(k8v4, 4, capability=(8, 9)) == "mma"
    assert _path(k8v4, 4, capability=(10, 0)) == "mma"
    assert _path(k8v4, 4) == "mma"
    for bad in ((9,), 9, "9.0", (9.0, 0)):
        with pytest.raises(TypeError, match=r"capability must be a \(major, minor\) pair of ints, got"):
            _path(tq4, 4, capability=bad)


def test_production_kernels_have_no_timing_probes():
    """Timing probes and measured-and-lost variants live in benchmarks' history
    (docs/performance.md), not in the kernels: no probe constexpr, no shifted-read plan helper."""
    import inspect

    import tqkern.ops.paged_decode.general as general
    import tqkern.ops.paged_decode.mma_kernel as mma_kernel
    import tqkern.ops.paged_decode.mma_plans as plans
    import tqkern.ops.paged_decode.triton as tri

    assert not {"PROBE"} & set(inspect.signature(mma_kernel._paged_decode_mma_kernel.fn).parameters)
    assert not {"SKIP_K", "SKIP_V", "LUT_SELECT"} & set(inspect.signature(general._paged_decode_kernel.fn).parameters)
    assert not {"probe", "lut"} & set(inspect.signature(tri._launch_paged_decode).parameters)
    assert not hasattr(plans, "shifted_plan")


def test_same_codebooks_is_required():
    """A direct caller must say whether the key and value codebooks are equal (the warp-MMA
    kernel's one pair table serves both): no default that could give wrong outputs."""
    import inspect

    import tqkern.ops.paged_decode.triton as tri

    for fn in (tri.decode_path, tri._launch_paged_decode):
        assert inspect.signature(fn).parameters["same_codebooks"].default is inspect.Parameter.empty, fn
    with pytest.raises(TypeError, match="same_codebooks"):
        decode_path(_layout("tq4", 128, 8, "row"), 4)


def test_same_codebooks_flag():
    assert tqt.to_device(tqkern.TQParams.default(tqkern.KVFormat.preset("tq4", 128)), "cpu").same_codebooks
    assert not tqt.to_device(tqkern.TQParams.default(tqkern.KVFormat.preset("turboquant_4bit_nc", 128)),
                             "cpu").same_codebooks
    fmt = tqkern.KVFormat(head_dim=64, key=tqkern.LloydMax(bits=4, distribution="beta"),
                          value=tqkern.LloydMax(bits=4, distribution="gaussian"))
    assert not tqt.to_device(tqkern.TQParams.default(fmt), "cpu").same_codebooks


def test_num_splits_whole_waves():
    """The general kernel's split count: ~4 programs per SM (at least 4·BN tokens per split);
    with the resident program count and splits of >= 2048 tokens, the count (up to that one)
    whose last wave is fullest per unit of work, the smallest on ties."""
    # B8x64K, fp16 path on an H100 (396 programs resident): 9 splits = 576 programs = 1.45 waves
    assert num_splits_for(8, 8, 65536, 132, 64) == 9
    assert num_splits_for(8, 8, 65536, 132, 64, resident_ctas=396) == 6  # 384 programs, one wave
    assert num_splits_for(8, 8, 65536, 132, 64, resident_ctas=264) == 4  # 256 of 264
    # B32x16K: 3 splits = 768 programs = 1.94 waves of 396 is already the best
    assert num_splits_for(32, 8, 16384, 132, 64) == num_splits_for(32, 8, 16384, 132, 64, resident_ctas=396) == 3
    # short splits (SmolLM2 B32x4K: 683 tokens each) ignore waves
    assert num_splits_for(32, 3, 4096, 132, 64, resident_ctas=396) == num_splits_for(32, 3, 4096, 132, 64) == 6
    # ... unless min_tokens says otherwise (fp16 caches: whole rounds at any length; 2 rounds of 264 at 6)
    assert num_splits_for(32, 3, 4096, 132, 64, resident_ctas=264, min_tokens=0) == 5  # 480 of 528
    assert num_splits_for(8, 8, 8192, 132, 64, resident_ctas=264, min_tokens=0) == 4  # Gemma-2-9B B8x8K
    for bad in (0, -3, 2.5, "396"):
        with pytest.raises(ValueError, match="resident_ctas"):
            num_splits_for(8, 8, 65536, 132, 64, resident_ctas=bad)
    for bad in (-1, 2.0, True, None):
        with pytest.raises(ValueError, match=f"min_tokens must be a non-negative int, got {bad!r}"):
            num_splits_for(8, 8, 65536, 132, 64, resident_ctas=264, min_tokens=bad)
    for seqs in (1, 2, 5, 8, 33, 64):
        for ctas in (None, 1, 7, 132, 396, 1000):
            plain = num_splits_for(seqs, 8, 65536, 132, 64)
            n = num_splits_for(seqs, 8, 65536, 132, 64, resident_ctas=ctas)
            if ctas and 65536 // plain >= 2048:  # no count up to the plain one has fewer waves per work
                waves = [-(-seqs * 8 * k // ctas) / k for k in range(1, plain + 1)]
                best = waves.index(min(waves)) + 1
                # ... then fewer programs than SMs: ~2 per SM, splits of >= BN tokens, at most 64
                fill = min(-(-264 // (seqs * 8)), 65536 // 64, 64)
                assert n == (max(best, fill) if seqs * 8 * best < 132 else best), (seqs, ctas)
            else:
                assert 1 <= n <= plain


def test_num_splits_fill_the_sms_at_batch_1():
    """Launches of fewer programs than SMs (batch 1-2 at short contexts; fp16 caches: BN 128 and
    whole rounds at any length, as the planner asks): ~2 programs per SM, splits of >= BN tokens,
    at most 64 (session 62's H200 shapes)."""
    def splits(seqs, heads, max_len):
        return num_splits_for(seqs, heads, max_len, 132, 128, resident_ctas=264, min_tokens=0)

    assert splits(1, 8, 4096) == 32  # Llama-3-8B 1x4K: was 8 (4 BN a split)
    assert splits(1, 4, 4096) == 32  # Qwen2.5-7B 1x4K: 4K / 128
    assert splits(1, 4, 16384) == 64  # 1x16K: was 32
    assert splits(1, 2, 16384) == 64  # Llama-3-70B-TP4 1x16K: at most 64
    assert splits(1, 8, 8192) == 33  # ceil(264 / 8)
    assert splits(1, 8, 16384) == 32  # 256 programs already: kept
    assert splits(2, 8, 16384) == 16  # kept (one round of 264)


def test_num_splits_fill_the_sms_with_up_to_256_splits():
    """``most`` (the planner's 256 for fp16 caches at head_dim 96-128, S70): one or two KV heads at
    batch 1-2 take ~2 programs an SM, splits of whole BN tiles (``ceil(ceil(L/n)/BN)·BN`` tokens
    in the kernel), trimmed where the last would be empty at ``max_len``."""
    def splits(seqs, heads, max_len, most=256):
        return num_splits_for(seqs, heads, max_len, 132, 128, resident_ctas=264, min_tokens=0, most=most)

    assert splits(1, 1, 131072) == 256  # Llama-3-70B-TP8 1x128K: 264 asked, 512 tokens a split leave 256
    assert splits(1, 1, 32768) == 256  # Llama-3-405B-TP8 1x32K: 32K / 128
    assert splits(1, 2, 131072) == 128  # Llama-3-405B-TP4 1x128K: 132 asked, 1024 tokens a split
    assert splits(2, 1, 32768) == 128
    assert splits(1, 2, 20000) == 79  # 132 asked: 152 tokens rounds to 256 a split, so 79
    assert splits(1, 1, 8192) == 64  # 8K / 128: untouched
    assert splits(1, 4, 65536) == 64  # four KV heads hold 256 programs at 64: untouched
    assert splits(1, 1, 131072, most=64) == 64  # (the default: other caches)
    assert splits(1, 1, 131072, most=1000) == 256  # (never past ~2 an SM)
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match=f"most must be a positive int, got {bad!r}"):
            splits(1, 1, 131072, most=bad)


def test_ctas_per_sm():
    """Residency from a compiled kernel's registers and shared memory (H100: 64K registers,
    228 KB of shared memory, 64 warps and 32 CTAs per SM; registers allocated per warp in units
    of 256, 1 KB reserved per CTA)."""
    class Kernel:
        def __init__(self, n_regs, shared):
            self.n_regs, self.metadata = n_regs, type("M", (), {"shared": shared})()

        def _init_handles(self):
            pass
    h100 = type("Props", (), {"shared_memory_per_multiprocessor": 233472})()
    # the general kernel's fp16 path: 139 registers (144 per thread: 18432 per 4-warp CTA), 39 KB
    assert ctas_per_sm(Kernel(139, 39168), 4, 0, h100) == 3
    # the warp-MMA kernel: 128 registers and the 32 KB pair table: 4 CTAs = 16 warps
    assert ctas_per_sm(Kernel(128, 16), 4, 32768, h100) == 4
    assert ctas_per_sm(Kernel(168, 16), 4, 32768, h100) == 3  # joined fields: 12 warps
    assert ctas_per_sm(Kernel(32, 100000), 4, 0, h100) == 2  # shared memory bounds it
    assert ctas_per_sm(Kernel(16, 0), 1, 0, h100) == 32  # the CTA limit
    assert ctas_per_sm(Kernel(16, 0), 8, 0, h100) == 8  # the warp limit


def test_cooperative_plan_rules():
    """Cooperative stages (one CTA per sequence and split, a warp per KV head, whole rows through
    shared memory) are in the launcher's plan for 4-16 KV heads (a power of two) in blocks of a
    multiple of 16 tokens: 4 stages of two steps with Lloyd-Max values (2 where 4 do not fit one
    CTA: 16 KV heads at head_dim 96-128), 2 of two steps with
    uniform values next to table-decoded keys, 3 of one step with FP8 keys; values read after the
    softmax update; rows of a multiple of 16 bytes padded to 16 mod 32 in the stage."""
    from tqkern.ops.paged_decode.mma_plans import coop_plan, coop_row_stride, coop_smem_bytes

    tq4 = mma_plan(_layout("tq4", 128, 8, "row"), 4)
    nc = mma_plan(_layout("turboquant_4bit_nc", 128, 8), 4)
    assert (tq4.COOP, tq4.RS, tq4.SUB) == (4, 1104, 2)  # 1088-byte rows -> 1104
    assert (nc.COOP, nc.RS, nc.SUB) == (2, 1072, 2)  # 1072 = 16 mod 32 already
    k8v4 = mma_plan(_layout("turboquant_k8v4", 128, 8), 4)
    assert (k8v4.COOP, k8v4.SUB) == (3, 1)
    for name, k3 in (("turboquant_k3v4_nc", 3), ("turboquant_3bit_nc", 3), ("tqkern_k5v3", 5)):
        p = mma_plan(_layout(name, 128, 8), 4)
        assert p.K_BITS == k3 and (p.COOP, p.SUB) == ((4, 2) if k3 == 5 else (2, 2))
    assert tq4.LATE_V == nc.LATE_V == k8v4.LATE_V == 1
    early = coop_plan(dataclasses.replace(per_warp_plan(nc), LATE_V=0), _layout("turboquant_4bit_nc", 128, 8), 2)
    assert early.LATE_V == 0
    assert per_warp_plan(nc).SUB == 1 and per_warp_plan(nc).LATE_V is None  # the per-warp kernel's own
    # Triton's scratch, the 32 KB pair table, the stages (16 rows of RS bytes per step), slack
    assert coop_smem_bytes(nc) == nc.SMEM_OFF + 32768 + 2 * 2 * 16 * 1072 + 64
    # tq4 (one CTA per SM anyway): the PRMT-addressed 64 KB table at 128 KB, three stages below it,
    # the fourth above it; counted from shared address 0
    assert (tq4.LUT_AT, tq4.NLOW) == (0x20000, 3) and nc.LUT_AT is None
    assert coop_smem_bytes(tq4) == 0x20000 + 65536 + 1 * 2 * 16 * 1104 + 64
    assert coop_row_stride(1024) == 1040 and coop_row_stride(1072) == 1072 and coop_row_stride(216) == 216
    for heads in (1, 2, 3):  # CTAs of fewer than 4 warps (or not a power of two): per-warp kernel
        assert mma_plan(_layout("tq4", 128, heads, "row"), 4).COOP is None
    small = tqkern.PagedLayout(format=tqkern.KVFormat.preset("tq4", 128), num_kv_heads=8, block_size=4,
                               arrangement="row")
    assert mma_plan(small, 4).COOP is None
    assert coop_plan(per_warp_plan(tq4), small, 2) is None  # blocks shorter than a step
    assert coop_plan(per_warp_plan(tq4), _layout("tq4", 128, 2, "row"), 2).COOP == 2  # opt-in
    assert coop_plan(per_warp_plan(tq4), _layout("tq4", 128, 8, "row"), 8) is None  # 8 × 35 KB: too big
    assert per_warp_plan(tq4).COOP is None and per_warp_plan(tq4).SUB == 2
    # Lloyd-Max values at 16 KV heads: 2 stages where 4 do not fit one CTA; head_dim 256 stays per-warp
    for name, arr, d, stages in (("tq4", "row", 96, 2), ("k5v4h", "slot", 96, 2), ("k5v4h", "slot", 128, 2),
                                 ("tqkern_k5v3", "slot", 128, 2), ("k4v3h", "slot", 96, 4)):
        p = mma_plan(_layout(name, d, 16, arr), 1)
        assert (p.COOP, p.SUB) == (stages, 2), name
        assert (coop_plan(dataclasses.replace(per_warp_plan(p), SUB=2), _layout(name, d, 16, arr), 4) is None) == (
            stages == 2), name
    assert mma_plan(_layout("k5v4h", 256, 16), 1).COOP is None and mma_plan(_layout("k5v4h", 256, 8), 2).COOP is None
    for bad in (1, 9, 2.0):
        with pytest.raises(ValueError, match="stages must be an int in 2..8"):
            coop_plan(per_warp_plan(tq4), _layout("tq4", 128, 8, "row"), bad)
    with pytest.raises(TypeError, match="plan must be an MmaPlan from mma_plan, got NoneType"):
        coop_plan(None, _layout("tq4", 128, 8, "row"))
    with pytest.raises(TypeError, match="plan must be an MmaPlan from mma_plan, got NoneType"):
        per_warp_plan(None)


def test_table256_layouts_fit_and_do_not_overlap():
    """The PRMT-addressed table (entries 256 bytes apart from a shared address with 16 zero low
    bits): the stages below it end before it (the dynamic region starting at most 1 KB in), those
    above it start at its end, and the whole launch fits one CTA; where no such layout fits (or
    the keys are not 4-bit codes) there is none."""
    from tqkern.ops.paged_decode.mma_plans import coop_plan, coop_smem_bytes, table256_plan

    for preset, arr in (("tq4", "row"), ("turboquant_4bit_nc", "slot"), ("tqkern_k5v3", "slot")):
        base = per_warp_plan(mma_plan(_layout(preset, 128, 8, arr), 4))
        for stages in range(2, 9):
            plan = coop_plan(base, _layout(preset, 128, 8, arr), stages)
            if plan is None:
                continue
            t = table256_plan(plan)
            if base.K_BITS != 4:
                assert t is None
                continue
            if t is None:
                continue
            stg = 16 * t.SUB * t.RS
            assert t.LUT_AT % 65536 == 0 and 0 <= t.NLOW <= stages
            assert 0x400 + t.SMEM_OFF + t.NLOW * stg <= t.LUT_AT
            assert coop_smem_bytes(t) == t.LUT_AT + 65536 + (stages - t.NLOW) * stg + 64 <= 232448
    tq4 = per_warp_plan(mma_plan(_layout("tq4", 128, 8, "row"), 4))
    two = table256_plan(coop_plan(tq4, _layout("tq4", 128, 8, "row"), 2))
    assert (two.LUT_AT, two.NLOW) == (0x10000, 1)
    five = coop_plan(tq4, _layout("tq4", 128, 8, "row"), 5)  # no table layout fits: the 32 KB table
    assert five.COOP == 5 and not five.LUT_AT and table256_plan(five) is None
    nc = mma_plan(_layout("turboquant_4bit_nc", 128, 8), 4)
    assert nc.LUT_AT is None and table256_plan(nc).LUT_AT  # two CTAs per SM: not in the plan
    with pytest.raises(TypeError, match="plan must be a cooperative plan"):
        table256_plan(tq4)


class _FakeMeta(tuple):
    """A namedtuple-like stand-in for a compiled kernel's metadata (only ``shared`` matters)."""

    def __new__(cls, shared):
        return super().__new__(cls, (shared,))

    @property
    def shared(self):
        return self[0]

    def _replace(self, shared):
        return _FakeMeta(shared)


class _FakeKernel:
    def __init__(self, shared, module=None):
        self.metadata = _FakeMeta(shared)
        self.packed_metadata = (8, 1, shared)
        self.module = module


def test_dynamic_shared_memory_is_sized_before_the_binary_loads():
    """The stages live past Triton's own scratch in its dynamic region; the launcher raises the
    compiled kernel's shared-memory size (metadata and the launch's packed copy) before the
    binary is loaded, once, and refuses where it cannot do so safely."""
    from tqkern.ops.paged_decode.mma_launch import _size_dynamic_smem
    from tqkern.ops.paged_decode.mma_plans import coop_smem_bytes

    plan = mma_plan(_layout("turboquant_4bit_nc", 128, 8), 4)
    want = coop_smem_bytes(plan)
    k = _FakeKernel(32)
    _size_dynamic_smem(k, plan)
    assert k.metadata.shared == want and k.packed_metadata == (8, 1, want)
    k.module = object()  # loaded since: a second call is a no-op
    _size_dynamic_smem(k, plan)
    with pytest.raises(RuntimeError, match="cannot size"):
        _size_dynamic_smem(_FakeKernel(32, module=object()), plan)  # loaded before sizing
    with pytest.raises(RuntimeError, match="overlaps the stages"):
        _size_dynamic_smem(_FakeKernel(plan.SMEM_OFF + 16), plan)


def test_cooperative_helpers_reject_bad_input():
    from tqkern.ops.paged_decode.mma_plans import coop_row_stride, coop_smem_bytes

    for bad in (0, -16, 1088.0, True, "1088"):
        with pytest.raises(ValueError, match="row_bytes must be a positive int, got"):
            coop_row_stride(bad)
    tq4 = mma_plan(_layout("tq4", 128, 8, "row"), 4)
    for bad in (None, per_warp_plan(tq4), [1]):
        with pytest.raises(TypeError, match="plan must be a cooperative plan"):
            coop_smem_bytes(bad)
    from tqkern.ops.paged_decode.plan import plan_decode

    with pytest.raises(TypeError, match="caps must be a DeviceCaps, got str"):
        plan_decode(_layout("tq4", 128, 8, "row"), 1, 32, 1, "cuda", same_codebooks=True)


@pytest.mark.parametrize("side", ["K", "V"])
def test_four_bit_fields_at_odd_bytes_are_shifted(monkeypatch, side):
    """The warp-MMA kernel reads a lane's q pairs and writes its partials 16 bytes at a time, from
    runs that start at an even field byte; a 4-bit key or value field at an odd offset (no built-in
    codec has one: the layout's offsets are moved by a byte here) is read as shifted words instead."""
    import tqkern.ops.paged_decode.mma_plans as plans

    layout = _layout("turboquant_4bit_nc", 128, 8) if side == "K" else _layout("tq4", 128, 8, "row")
    base = plans._mma_plan.__wrapped__(layout, 4)
    assert not getattr(base, f"{side}_FUN")
    consts = plans.layout_consts
    monkeypatch.setattr(plans, "layout_consts",
                        lambda lay: {**consts(lay), f"{side}_A_OFF": consts(lay)[f"{side}_A_OFF"] + 1})
    assert getattr(plans._mma_plan.__wrapped__(layout, 4), f"{side}_FUN")


def test_every_plan_meets_the_kernels_even_field_asserts():
    """What the kernel's ``tl.static_assert``s require of every plan ``mma_plan`` emits (checked
    here, on the CPU, for the presets and kXvYh formats at every head_dim, KV-head count and
    arrangement): 4-bit key and value chunks read in place start at even field bytes."""
    formats = ["tq4", "turboquant_4bit_nc", "turboquant_k8v4", "turboquant_k3v4_nc", "turboquant_3bit_nc",
               "tqkern_k5v3", "tqkern_k4v4", "k5v4h", "k4v3h", "k4v2h", "k3v2h", "k5v3h"]
    checked = 0
    for name in formats:
        for d in (64, 96, 128, 256):
            for heads in (1, 2, 3, 4, 8, 16):
                for arr in ("slot", "row"):
                    p = mma_plan(_layout(name, d, heads, arr), 4)
                    if p is None:
                        continue
                    checked += 1
                    four_bit_keys = p.K_BITS == 4 and not p.K_FUN
                    assert not four_bit_keys or (p.K_A_OFF % 2 == 0 and p.K_A_STRIDE % 2 == 0), (name, d, heads, arr)
                    assert p.V_BITS != 4 or p.V_FUN or (p.V_A_OFF % 2 == 0 and p.V_A_STRIDE % 2 == 0), (name, d, heads)
    assert checked > 100
