"""Host-side plans of the warp-MMA decode kernel: the constexprs (a :class:`MmaPlan`) that a
layout and GQA group get (:func:`mma_plan`; ``None`` where the kernel does not apply), their
CTA-cooperative form and shared-memory sizing (:func:`coop_plan`, :func:`table256_plan`,
:func:`coop_smem_bytes`, :func:`coop_row_stride`; the variants the planner weighs per device and
launch are in :mod:`.coop_variants`), the per-warp variant
(:func:`per_warp_plan`), and the arithmetic of splits and residency (:func:`num_splits_mma`,
:func:`ctas_per_sm`). Nothing here compiles or launches: the decode plan
(:mod:`.plan`) chooses among these for a device."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from tqkern.layouts import FP8, LloydMax, PagedLayout, Uniform
from tqkern.ops.common import layout_consts

__all__ = ["DynamicSmemUnsupported", "MmaPlan", "coop_plan", "coop_row_stride", "coop_smem_bytes", "ctas_per_sm",
           "fill_sms", "mma_plan", "num_splits_mma", "per_warp_plan", "table256_plan"]


_DT = {"float16": 0, "float32": 1, "bfloat16": 2}
_NBYTES = {0: 2, 1: 4, 2: 2}


_COOP_FIELDS = ("COOP", "RS", "SMEM_OFF", "LATE_V", "LUT_AT", "NLOW", "WS", "KP")


@dataclasses.dataclass(frozen=True)
class MmaPlan:
    """The warp-MMA kernel's layout constexprs, named as :func:`.mma_kernel._paged_decode_mma_kernel`
    takes them (:meth:`constexprs`), for one layout and GQA group.

    Row geometry: ``D``, ``DP``, ``ROW_BYTES``, ``NIBBLE``. Keys: the code field ``K_A_OFF`` /
    ``K_A_STRIDE``, the norm field ``K_B_OFF`` / ``K_B_STRIDE`` of dtype id ``K_DT``, ``K_NC``
    (vLLM's decode-time norm correction), ``K_FP8``, ``K_NW`` (FP8 words per load), ``K_BITS``.
    Values: ``V_UNIFORM``, the fields ``V_A_*`` (codes), ``V_B_*`` / ``V_C_*`` (norm or scale /
    zero) of dtype id ``V_DT``, ``V_BITS``. Reads: ``K_MERGE`` / ``V_MERGE`` (chunks joined from
    two aligned words), ``K_FUN`` / ``V_FUN`` (funnel-shifted words). ``SUB``: 16-token steps per
    softmax update. Cooperative stages (``None``: the per-warp kernel): ``COOP`` stages, ``RS``
    row stride, ``SMEM_OFF``, ``LATE_V``; the PRMT-addressed table ``LUT_AT`` / ``NLOW``
    (:func:`table256_plan`); ``WS`` warps per KV head, each a split of the CTA's range
    (:func:`shared_head_plan`; ``None``: one). A GQA group of more than 8 heads (:func:`head_tiles`): ``GS`` work
    items (warps) per KV head, each with ``QT`` query column tiles of ``group / (GS·QT) <= 8``
    heads (``QT = 2``: every decoded K and V fragment feeds two MMAs). The pair table
    (:attr:`lut_bytes`): the keys' entries start at entry ``K_AT`` (0: key pairs, which 4-bit
    Lloyd-Max values of the same codebook share; 64 for 5-bit keys, with 3-bit Lloyd-Max value
    pairs below them; past the value codebook's pairs wherever values have their own: 64 after
    3-bit pairs, 256 after 4-bit ones)."""

    D: int
    DP: int
    ROW_BYTES: int
    NIBBLE: bool
    K_A_OFF: int
    K_A_STRIDE: int
    K_B_OFF: int
    K_B_STRIDE: int
    K_DT: int
    K_NC: bool
    K_FP8: bool
    K_NW: int
    K_BITS: int
    SUB: int
    V_UNIFORM: bool
    V_A_OFF: int
    V_A_STRIDE: int
    V_B_OFF: int
    V_B_STRIDE: int
    V_C_OFF: int
    V_C_STRIDE: int
    V_DT: int
    K_MERGE: bool
    V_MERGE: bool
    K_FUN: bool
    V_FUN: bool
    V_BITS: int
    GS: int = 1
    QT: int = 1
    K_AT: int = 0
    COOP: Optional[int] = None
    RS: Optional[int] = None
    SMEM_OFF: Optional[int] = None
    LATE_V: Optional[int] = None
    LUT_AT: Optional[int] = None
    NLOW: Optional[int] = None
    WS: Optional[int] = None
    KP: Optional[int] = None

    def __post_init__(self):
        # (S53 probe, H200: SUB = 4 gave turboquant_4bit_nc's per-warp kernel wrong outputs, max
        # error 8.6e-2 against 3e-5; the planner emits 1 or 2 only, the kernel is tested at those)
        if type(self.SUB) is not int or self.SUB not in (1, 2):
            raise ValueError(f"SUB (16-token steps per softmax update) must be 1 or 2, got {self.SUB!r}")
        # (the code-pair table lives in the cooperative kernel's dynamic shared memory)
        if self.KP and (self.K_BITS != 5 or not self.COOP or self.LUT_AT):
            raise ValueError(f"KP (the 5-bit code-pair table) needs a cooperative plan of 5-bit keys without LUT_AT, "
                             f"got K_BITS={self.K_BITS}, COOP={self.COOP}, LUT_AT={self.LUT_AT}")

    def constexprs(self) -> dict:
        """The kernel's constexprs (fields that are ``None`` left at the kernel's defaults)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def of_constexprs(cls, constexprs) -> "MmaPlan":
        """The plan inside a launch's constexprs (a mapping holding at least this plan's fields)."""
        return cls(**{f.name: constexprs[f.name] for f in dataclasses.fields(cls) if f.name in constexprs})

    @property
    def needs_lut(self) -> bool:
        """Whether the kernel declares the pair table (mirrors ``NEED_LUT`` in the kernel)."""
        return _needs_lut(self.K_FP8, self.V_UNIFORM)

    @property
    def lut_bytes(self) -> int:
        """Shared memory of the pair table (mirrors ``LUTB`` in the kernel; 0 without a table):
        128 bytes per entry (32 lane replicas), at least 256 entries; the PRMT-addressed table 64 KB."""
        return _lut_bytes(self.K_FP8, self.V_UNIFORM, self.K_BITS, self.K_AT, bool(self.LUT_AT), bool(self.KP))


# -- host side ------------------------------------------------------------------------------------
def mma_plan(layout: PagedLayout, group: int) -> MmaPlan | None:
    """Constexprs of the warp-MMA kernel for ``layout`` and GQA ``group``, or ``None`` where it
    does not apply (then the general kernel runs).

    It applies when keys are 4-bit Lloyd-Max codes, 3- or 5-bit Lloyd-Max codes (LSB bit order)
    or FP8, and values are 4- or 3-bit uniform codes or Lloyd-Max codes without decode-time norm
    correction: 4-bit next to 4-bit keys (the launcher also requires the keys' codebook, see
    ``tqkern.ops.paged_decode.triton.decode_path``) or 5-bit keys, 3- or 2-bit next to 3-, 4- or
    5-bit keys (``K_AT``: their pairs below the keys' table entries);
    ``head_dim`` 64 or 128 (256: FP8 or 3-bit keys with 4-bit uniform values, ``group ≤ 2`` as
    Gemma's layers have; other D256 layouts run the general kernel); ``group ≤ 8``, or a larger group that
    :func:`head_tiles` splits; rows of an even number of bytes (2 mod 4 only in
    blocks of an even number of rows and not with FP8 keys); FP8 key fields at 4-byte offsets;
    a 3-bit key field's over-read word inside the row; norms, scales and zeros aligned to their
    size in every row."""
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a tqkern.PagedLayout, got {type(layout).__name__}")
    return _mma_plan(layout, group)


def _per_warp_sub(v_uniform: bool, k_bits: int, d: int) -> int:
    """The per-warp kernel's 16-token steps per softmax update: two for Lloyd-Max values (measured
    on the H100, every benchmark shape: tq4 -1.7 to -4.9%, tqkern_k5v3 -1.6 to -2.6%; uniform
    values: mixed or slower), but one for 5-bit keys at head_dim 256, whose two-step ring needs
    255 registers and 40 bytes of stack in the loop (sm_90, 3416 instructions against 2056):
    measured on the H200 (S28 probe, kernel alone, µs) Gemma-2-9B B8x8K 107.9 -> 94.3, Gemma-7B
    B4x8K 105.8 -> 95.9 (with the 168-register cap of :func:`.plan.mma_kernel_plan`)."""
    return 1 if v_uniform or (k_bits == 5 and d == 256) else 2


@functools.lru_cache(maxsize=256)
def _mma_plan(layout: PagedLayout, group: int) -> MmaPlan | None:
    fmt = layout.format
    key, value = fmt.key, fmt.value
    d = fmt.head_dim
    k_fp8 = isinstance(key, FP8)
    k3 = isinstance(key, LloydMax) and key.bits == 3 and fmt.bit_order == "lsb"
    k5 = isinstance(key, LloydMax) and key.bits == 5 and fmt.bit_order == "lsb"
    if not ((isinstance(key, LloydMax) and key.bits == 4) or k_fp8 or k3 or k5):
        return None
    v_uniform = isinstance(value, Uniform)
    v_lm = isinstance(value, LloydMax) and value.norm_correction != "decode"
    if not ((v_lm and value.bits in (2, 3, 4)) or (v_uniform and value.bits in (3, 4))):
        return None
    # The table: 4-bit key pairs (4-bit Lloyd-Max values of the same codebook read the same
    # pairs: the launcher checks the codebooks), or the value codebook's pairs (2- and 3-bit
    # values next to 3-, 4- or 5-bit keys; 4-bit values next to 5-bit keys) below the keys'
    # entries (K_AT).
    k4 = isinstance(key, LloydMax) and key.bits == 4
    if v_lm and not ((value.bits == 4 and (k4 or k5)) or (value.bits in (2, 3) and not k_fp8)):
        return None
    k_at = 0
    if k5:
        k_at = 256 if v_lm and value.bits == 4 else 64
    elif v_lm and value.bits in (2, 3):
        k_at = 64
    tiles = head_tiles(group)
    if d not in (64, 96, 128, 256) or tiles is None:
        return None
    gs, qt = tiles
    rb = layout.row_bytes
    # Rows of 2 mod 4 bytes: a row's offset from a word boundary must follow from the token's
    # position alone (blocks of an even number of rows), and FP8 keys are read as aligned words.
    if rb % 2 or (rb % 4 and (layout.block_size % 2 or k_fp8)):
        return None
    ck, cv = d // 8, d // 16
    c = layout_consts(layout)
    # 4-bit key chunks not at fixed offsets from aligned blocks, and 5-bit keys: shifted words
    # (the joining lane's byte masks take power-of-two chunks: D96's 12 bytes are shifted instead).
    # 4-bit key fields at odd offsets (no built-in codec has them) are shifted too: the kernel reads
    # a lane's q pairs 16 bytes at a time from an even pair.
    k_joined = bool(c["K_A_OFF"] % ck or c["K_A_STRIDE"] % ck)
    k_odd = bool((c["K_A_OFF"] | c["K_A_STRIDE"]) % 2)
    k_fun = k5 or (not (k_fp8 or k3) and (rb % ck != 0 or (k_joined and bool(ck & (ck - 1))) or k_odd))
    if d == 256 and qt > 1:
        return None  # D256: two column tiles would hold 128 more accumulators (not compiled, not checked)
    # 2- and 3-bit values: always shifted (D/32- and 3D/64-byte chunks). With 3-bit keys, values
    # that would be joined are shifted too (measured 4-5% faster on the H100: docs/performance.md §25).
    # (D96: 4-bit values' 6-byte chunks are not whole words: shifted.) 4-bit value fields at odd
    # offsets (no built-in codec has them) are shifted too: read in place, their lanes' chunks would
    # rotate by an odd count, and the partials' 16-byte stores need runs from multiples of 4
    # (mma_io._store_partials).
    v_fun = (value.bits in (2, 3) or cv % 4 != 0 or rb % cv != 0
             or (k3 and bool(c["V_A_OFF"] % cv or c["V_A_STRIDE"] % cv)) or bool((c["V_A_OFF"] | c["V_A_STRIDE"]) % 2))
    last_key = c["K_A_OFF"] + (layout.num_kv_heads - 1) * c["K_A_STRIDE"]
    if k3 and last_key + 3 * (3 * d // 32) + 4 * ((3 * d + 127) // 128 + 1) > rb:
        return None  # 3-bit keys: a lane's whole words (one beyond its chunk) must stay in the row
    k_nw = 1
    if k_fp8:  # word loads of the key field: as wide as its alignment allows
        if (c["K_A_OFF"] | c["K_A_STRIDE"]) % 4:
            return None
        k_nw = next(n for n in (4, 2, 1)  # (a lane's D/16 words in whole loads)
                    if (c["K_A_OFF"] | c["K_A_STRIDE"] | rb) % (4 * n) == 0 and (d // 16) % n == 0)
    k_dt = _DT["float32" if k_fp8 else key.norm_dtype]  # FP8 keys have no factor: K_DT is unused
    k_bits = 8 if k_fp8 else key.bits
    v_dt = _DT[value.param_dtype if v_uniform else value.norm_dtype]
    factors = [(c["V_B_OFF"], v_dt), (c["V_B_STRIDE"], v_dt), (c["V_C_OFF"], v_dt), (c["V_C_STRIDE"], v_dt),
               (rb, v_dt)]
    if not k_fp8:
        factors += [(c["K_B_OFF"], k_dt), (c["K_B_STRIDE"], k_dt), (rb, k_dt)]
    if any(off % _NBYTES[dt] for off, dt in factors):
        return None
    plan = MmaPlan(
        D=d, DP=c["DP"], ROW_BYTES=rb, NIBBLE=fmt.bit_order == "nibble_high_even",
        K_A_OFF=c["K_A_OFF"], K_A_STRIDE=c["K_A_STRIDE"], K_B_OFF=c["K_B_OFF"], K_B_STRIDE=c["K_B_STRIDE"],
        K_DT=k_dt, K_NC=not k_fp8 and key.norm_correction == "decode", K_FP8=k_fp8, K_NW=k_nw, K_BITS=k_bits,
        SUB=_per_warp_sub(v_uniform, k_bits, d),
        V_UNIFORM=v_uniform, V_A_OFF=c["V_A_OFF"], V_A_STRIDE=c["V_A_STRIDE"], V_B_OFF=c["V_B_OFF"],
        V_B_STRIDE=c["V_B_STRIDE"], V_C_OFF=c["V_C_OFF"], V_C_STRIDE=c["V_C_STRIDE"], V_DT=v_dt,
        K_MERGE=key.bits == 4 and not k_fun and k_joined,
        V_MERGE=not v_fun and bool(c["V_A_OFF"] % cv or c["V_A_STRIDE"] % cv),
        K_FUN=k_fun, V_FUN=v_fun, V_BITS=value.bits, GS=gs, QT=qt, K_AT=k_at,
    )
    # CTA-cooperative stages where they apply and CTAs have at least 4 warps (each CTA fills its
    # own table), measured on the H100 (docs/performance.md §37-39, §47): Lloyd-Max values 4
    # stages of two steps (one CTA per SM); uniform values next to table-decoded keys 2 stages of
    # two steps per softmax update (two CTAs per SM; 3-7% faster than 3 stages of one step: the
    # values are read from the stage after the update, so two steps no longer spill); FP8 keys 3
    # stages of one step (two steps gained nothing). The decode plan (:func:`.plan.plan_decode`)
    # drops them where the device's shared memory is smaller.
    coop = None
    if layout.num_kv_heads >= 4 and gs == 1:  # (a cooperative CTA's warps are its KV heads)
        sub, stages = _coop_shape(v_uniform, k_fp8)
        coop = coop_plan(dataclasses.replace(plan, SUB=sub), layout, stages)
        # Lloyd-Max values at 16 KV heads (head_dim 96-128): 4 stages of two steps beside the pair
        # table exceed one CTA's shared memory; 2 stages of two steps instead of the per-warp kernel.
        # Measured (H200, S67, µs, per-warp / 3 stages / 2 stages): Phi-3-mini-TP2 (D96) B16x4K tq4
        # 68.5 / 54.3 / 52.5, k5v4h 88.0 / 68.3 / 68.8, tqkern_k5v3 90.4 / 74.5 / 72.5; B16x16K 230.8 /
        # 174.5 / 170.1, 305.0 / 224.6 / 228.7, 312.3 / 248.9 / 243.4; Llama-2-7B-TP2 (D128, 3 stages
        # do not fit) B16x4K 66.9 / - / 63.3, 135.7 / - / 76.2, 106.7 / - / 81.2. Head_dim 256 keeps
        # the per-warp kernel; where the launch is too small for the SMs, so does the decode plan
        # (:func:`.plan.plan_decode`).
        if coop is None and not v_uniform and d <= 128:
            coop = coop_plan(dataclasses.replace(plan, SUB=sub), layout, 2)
    return coop or plan


_MAX_HEAD_GROUPS = 4


def head_groups(group: int) -> int | None:
    """Query-head groups per KV head for the warp-MMA kernel, whose MMA holds at most 8 query
    heads: 1 for ``group ≤ 8``, else the fewest ``gs ≤ 4`` that divide ``group`` into groups of at
    most 8 (16 → 2 × 8, 12 → 2 × 6, 24 → 3 × 8); ``None`` where there is none (e.g. 11, 13, 40).
    Each group is one warp that reads the KV head's rows itself; the groups of one KV head are
    adjacent work items (mostly warps of one CTA), so the rows come from L1/L2 after the first read."""
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    return next((gs for gs in range(1, _MAX_HEAD_GROUPS + 1) if group % gs == 0 and group // gs <= 8), None)


def head_tiles(group: int) -> tuple[int, int] | None:
    """``(GS, QT)`` for a GQA group on the warp-MMA kernel: ``(1, 1)`` for ``group ≤ 8``; above,
    two query column tiles per warp (``QT = 2``: the decoded fragments feed two MMAs, measured
    first on the H100 in session 19) in the fewest ``GS ≤ 4`` warps per KV head whose tiles hold
    at most 8 heads (16 → 1 × 2 × 8, 12 → 1 × 2 × 6, 24 → 2 × 2 × 6, 40 → 4 × 2 × 5); a group
    no such split divides (an odd one: 9, 11, 13, …) falls back to :func:`head_groups`'s single
    tiles (9 → 3 × 3), or ``None``."""
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    if group <= 8:
        return 1, 1
    gs = next((g for g in range(1, _MAX_HEAD_GROUPS + 1) if group % (2 * g) == 0 and group // (2 * g) <= 8), None)
    if gs is not None:
        return gs, 2
    gs = head_groups(group)
    return None if gs is None else (gs, 1)


def per_warp_plan(plan: MmaPlan) -> MmaPlan:
    """``plan`` without cooperative stages (the per-warp kernel, each warp reading its own fields),
    with the per-warp kernel's steps per softmax update (uniform values: one; a cooperative plan
    may take two)."""
    if not isinstance(plan, MmaPlan):
        raise TypeError(f"plan must be an MmaPlan from mma_plan, got {type(plan).__name__}")
    out = dataclasses.replace(plan, **dict.fromkeys(_COOP_FIELDS))
    if plan.COOP:
        out = dataclasses.replace(out, SUB=_per_warp_sub(bool(plan.V_UNIFORM), plan.K_BITS, plan.D))
    return out


_COOP_SMEM_OFF = 1024  # the cooperative stages start here in the dynamic region (below: Triton's own scratch)
_COOP_PAD = 64  # slack past the last stage
_SMEM_OPTIN = 232448  # dynamic shared memory one CTA may use on sm_90 (227 KB)
_SMEM_PER_SM = 233472  # shared memory of one sm_90 multiprocessor (228 KB, the per-CTA reservations included)
# The dynamic region's shared address as sm_90 places it (past the 1 KB reserved per CTA): the
# PRMT-addressed table's layout below assumes the region starts at most this far in.
_SMEM_BASE = 0x400


def coop_plan(plan: MmaPlan, layout: PagedLayout, stages: int = 2) -> MmaPlan | None:
    """``plan`` with CTA-cooperative stages (``COOP = stages``): one CTA per (sequence, split) with
    one warp per KV head, whose threads copy each step's 16 whole rows (all heads) into a ring of
    ``stages`` shared-memory stages with ``cp.async`` (coalesced 16-byte chunks), and every head-warp
    reads its fields from there. ``None`` where it does not apply: blocks not a multiple of 16
    tokens, a KV-head count that is not a power of two up to 16 (a CTA's warps), or stages (plus
    the pair table) beyond one CTA's shared memory. The stages live in the kernel's dynamic shared memory, which the
    launcher sizes (see :func:`coop_smem_bytes`). A plan of 4-bit keys whose CTA has the SM to
    itself anyway takes the PRMT-addressed table where it fits (:func:`table256_plan`). The values
    are read from the stage after each softmax update (``LATE_V = 1``, unless ``plan`` sets it):
    they then hold no registers across the scores."""
    if not isinstance(plan, MmaPlan):
        raise TypeError(f"plan must be an MmaPlan from mma_plan, got {type(plan).__name__}")
    if not isinstance(stages, int) or not 2 <= stages <= 8:
        raise ValueError(f"stages must be an int in 2..8, got {stages!r}")
    hkv = layout.num_kv_heads
    if layout.block_size % 16 or hkv > 16 or hkv & (hkv - 1):
        return None
    out = dataclasses.replace(plan, COOP=stages, RS=coop_row_stride(layout.row_bytes), SMEM_OFF=_COOP_SMEM_OFF,
                              LATE_V=1 if plan.LATE_V is None else plan.LATE_V)
    if coop_smem_bytes(out) > _SMEM_OPTIN:
        return None
    # One CTA per SM anyway (4-bit Lloyd-Max keys, whose table lookups are most of the loop): the
    # PRMT-addressed table if it fits beside the stages
    if out.K_BITS == 4 and coop_smem_bytes(out) + _SMEM_RESERVED > _SMEM_PER_SM // 2:
        out = table256_plan(out) or out
    return out


def _coop_shape(v_uniform: bool, k_fp8: bool) -> tuple[int, int]:
    """``(SUB, stages)`` of the cooperative plans: Lloyd-Max values 4 stages of two steps, FP8 keys
    with uniform values 3 of one, other uniform values 2 of two (measured: :func:`_mma_plan`)."""
    return (2, 4) if not v_uniform else (1, 3) if k_fp8 else (2, 2)


def table256_plan(plan: MmaPlan) -> MmaPlan | None:
    """A cooperative ``plan`` with the PRMT-addressed pair table (``LUT_AT``: entries 256 bytes
    apart from a shared address whose low 16 bits are 0, so that a byte's entry address is one
    PRMT of the code byte into this lane's base instead of a PRMT and an IMAD). The table takes 64
    KB at ``LUT_AT``; stages ``0 .. NLOW - 1`` lie below it (from ``SMEM_OFF``), the others right
    above it. ``None`` if no such layout fits one CTA's shared memory, or the plan's keys are not
    4-bit codes at entry 0 (3- and 5-bit keys index the table differently; ``K_AT > 0``: the
    value codebook's pairs below them)."""
    if not isinstance(plan, MmaPlan) or not plan.COOP:
        raise TypeError(f"plan must be a cooperative plan (an MmaPlan from coop_plan), got {plan!r:.80}")
    if plan.K_BITS != 4 or plan.K_AT:
        return None
    stg = _stage_bytes(plan)
    for at in (0x10000, 0x20000, 0x30000):
        nlow = min(plan.COOP, max(0, (at - _SMEM_BASE - plan.SMEM_OFF) // stg))
        out = dataclasses.replace(plan, LUT_AT=at, NLOW=nlow)
        if coop_smem_bytes(out) <= _SMEM_OPTIN:
            return out
    return None


def coop_smem_bytes(plan: MmaPlan) -> int:
    """Dynamic shared memory of a cooperative plan's launch: Triton's scratch, the pair table, the
    stages, slack. (The table moves into the dynamic region with the stages: with a static table
    beside a dynamic region under 48 KB, no opt-in for more than 48 KB in all would be set.)"""
    if not isinstance(plan, MmaPlan) or not plan.COOP:
        raise TypeError(f"plan must be a cooperative plan (an MmaPlan from coop_plan), got {plan!r:.80}")
    stg = _stage_bytes(plan)
    if plan.LUT_AT:  # up to the last stage above the table, counted from shared address 0
        return plan.LUT_AT + 65536 + (plan.COOP - plan.NLOW) * stg + _COOP_PAD
    return plan.SMEM_OFF + plan.lut_bytes + plan.COOP * stg + _COOP_PAD


def _stage_bytes(plan: MmaPlan) -> int:
    """Bytes of one cooperative stage: ``SUB·WS`` steps of 16 rows ``RS`` bytes apart."""
    return 16 * plan.SUB * (plan.WS or 1) * plan.RS


class DynamicSmemUnsupported(RuntimeError):
    """The compiled cooperative kernel's dynamic shared memory cannot be sized safely (an unknown
    Triton metadata layout, or Triton's scratch reaching into the stages)."""


def num_splits_mma(num_seqs: int, num_kv_heads: int, max_len: int, resident_warps: int) -> int:
    """Splits (one warp each) so that the launch is one full wave of ``resident_warps`` (the
    warps the GPU holds at once for this kernel), each split at least 256 tokens of the longest
    possible sequence, at most 64; up to 128 where the splits keep ≥ 512 tokens each and all
    splits of the launch are ≤ 1024 warps (batch 1 at long contexts). Depends only on shapes
    (CUDA-graph safe).

    One wave measured best on the H100 (TQ4, B32×16K: 8 splits = 0.97 waves 245 µs; 16 splits
    = 1.94 waves 265 µs; 17 splits = 2.06 waves 301 µs). The longer cap, measured in session 17
    (Hkv 8, µs, tq4 / turboquant_4bit_nc, 64 → 128 splits): 1×128K 124.0 / 136.7 → 103.7 / 105.0
    (SDPA fp16 180.0), 1×64K 79.1 / 85.6 → 78.9 / 77.9; where the rule keeps 64: 1×32K (256
    tokens per split at 128) 54.4 / 58.0 → 61.0 / 60.9, 2×64K (2,048 warps) 93.7 → 106.5
    (turboquant_4bit_nc); 192 or 256 splits lose at 1×128K (138–167)."""
    pairs = max(1, num_seqs * num_kv_heads)
    cap = max(64, min(128, max_len // 512, 1024 // pairs))
    return int(max(1, min(resident_warps // pairs, max_len // 256, cap)))


_FILL_MIN_TOKENS = 64  # fill_sms: tokens per split it keeps at least
_FILL_LONG_SPLITS = 512  # ... with ``long``: splits it may reach where 128 fill at most half the SMs
_FILL_LONG_TOKENS = 128  # ... each then at least this many tokens


def fill_sms(num_splits: int, pairs: int, max_len: int, resident_warps: int, ctas, num_sms: int,
             step: int = 1, long: bool = False) -> int:
    """The split count for a launch of few (sequence, KV head) ``pairs`` at short contexts. Where
    ``num_splits`` (:func:`num_splits_mma`'s) holds at most half the ``resident_warps``: the most
    splits, in multiples of ``step``, up to one warp per resident warp, 128 splits (64 above 8
    pairs) and ≥ 64 tokens a split, whose launch stays within one CTA per SM (``ctas(n)``: the
    grid's CTAs at ``n`` splits). Never fewer than ``num_splits``. Depends only on shapes.
    ``long`` (the per-warp kernel at head_dim 128): where those 128 splits' CTAs fill at most half
    the SMs, up to 512 splits of ≥ 128 tokens each (H200, S69, one KV head at batch 1, 128 splits
    (32 CTAs) → these, µs: Llama-3-70B-TP8 1×128K 512 splits turboquant_4bit_nc 39.2 → 18.2, tq4
    40.7 → 24.7, k5v4h 52.3 → 27.5 (1024 splits, 256 CTAs: 19.1 / 31.7 / 33.5); Llama-3-405B-TP8
    1×32K 256 splits 18.3 → 13.7, 20.3 → 17.3, 22.0 → 18.1 (512 splits of 64 tokens: 15.3 / 21.8 /
    21.6). At 4 sequences (128 CTAs at 128 splits) 256 splits lost 10–14%; the cooperative rings of
    4–8 KV heads at batch 1, 256 splits: −10% to +23% by preset, so not theirs. Planner A/B, six
    presets, two runs each: 1×128K −39 to −53%, 1×32K −14 to −25%; 2 KV heads (Llama-3-405B-TP4)
    1×128K (264 splits) −23 to −34%, 1×32K −3 to −10% but tq4 +3%; one KV head 2×32K −5 to −8%,
    tq4 ±1%.)

    Measured (H200, session 62, CUDA graphs, µs, the planner's count before → these): Llama-3-8B (8
    KV heads) 1×4K 16 → 64 splits, turboquant_4bit_nc 26.8 → 18.0, k5v4h 32.9 → 20.1, tq4 29.5 →
    19.0, turboquant_k8v4 (the per-warp kernel) 16.6 → 11.5; 1×8K 32 → 128 splits 9–22% less;
    1×32K 64 → 128, 17–24% less; Llama-3-70B-TP4 1×16K 12–22% less, Llama-3-405B-TP8 1×32K 19–24%,
    Gemma-2-9B 1×8K (head_dim 256) 11–32%. The CTA limit is what lost past it: turboquant_k8v4's
    per-warp kernel at 8 KV heads, 1×8K 128 splits (256 CTAs) 16.4 µs, 66 (132 CTAs) 13.2; 1×16K
    128 splits 19.0, 64 17.7; Gemma-2-9B 1×8K's per-warp plans at 256 CTAs 1–14% slower than at 64.
    Slower with it: Qwen2.5-7B 1×16K's 4-warp cooperative CTAs 64 → 128 (turboquant_4bit_nc
    20.3–20.5 → 21.1, k5v4h +0.9%) and Llama-3.2-1B 1×16K turboquant_k8v4 64 → 66 (12.2 → 12.5)."""
    for name, v in (("num_splits", num_splits), ("pairs", pairs), ("max_len", max_len),
                    ("resident_warps", resident_warps), ("num_sms", num_sms), ("step", step)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not callable(ctas):
        raise TypeError(f"ctas must be a callable (splits -> CTAs), got {type(ctas).__name__}")
    if not isinstance(long, bool):
        raise TypeError(f"long must be a bool, got {type(long).__name__}")
    if 2 * pairs * num_splits > resident_warps:
        return num_splits
    most = min(resident_warps // pairs, max_len // _FILL_MIN_TOKENS, 128 if pairs <= 8 else 64)
    if long and 2 * ctas(most) <= num_sms:
        most = max(most, min(resident_warps // pairs, max_len // _FILL_LONG_TOKENS, _FILL_LONG_SPLITS))
    m = min(most, int(num_sms * num_splits / ctas(num_splits))) // step * step
    while m > num_splits and ctas(m) > num_sms:
        m -= step
    return max(num_splits, m)


def coop_row_stride(row_bytes: int) -> int:
    """Bytes between rows in a cooperative stage: rows of a multiple of 16 bytes padded to 16 mod
    32 (the value reads of a warp, 4 rows 2 apart, then fall in 4 different 32-byte bank groups);
    other rows unpadded (the stage is then a plain copy of the step's bytes)."""
    if not isinstance(row_bytes, int) or isinstance(row_bytes, bool) or row_bytes < 1:
        raise ValueError(f"row_bytes must be a positive int, got {row_bytes!r}")
    if row_bytes % 16:
        return row_bytes
    return row_bytes + (16 - row_bytes % 32) % 32


_SMEM_RESERVED = 1024  # the per-CTA reservation


def _lut_bytes(k_fp8: bool, v_uniform: bool, k_bits: int, k_at: int, prmt: bool = False,
               k_pairs: bool = False) -> int:
    """Bytes of the pair table a plan's kernel declares (:attr:`MmaPlan.lut_bytes`)."""
    if not _needs_lut(k_fp8, v_uniform):
        return 0
    if prmt:
        return 65536
    return 128 * max(256, k_at + {4: 256, 3: 64, 5: 1024 if k_pairs else 32}.get(k_bits, 0))


def _needs_lut(k_fp8: bool, v_uniform: bool) -> bool:
    """Whether the kernel declares the pair table (mirrors ``NEED_LUT`` in the kernel)."""
    return not (k_fp8 and v_uniform)


def ctas_per_sm(kernel, warps: int, extra_smem: int, props) -> int:
    """CTAs of ``warps`` warps of a compiled Triton kernel that one SM holds at once: from its
    registers, its shared memory (plus ``extra_smem`` bytes declared outside Triton and the
    per-CTA reservation), the 64 warps and 32 CTAs per SM."""
    kernel._init_handles()  # loads the binary: n_regs
    per_warp = -(-int(kernel.n_regs) * 32 // 256) * 256
    smem = extra_smem + _SMEM_RESERVED + int(getattr(kernel.metadata, "shared", 0))
    smem_sm = int(getattr(props, "shared_memory_per_multiprocessor", 233472))
    return max(1, min(65536 // (per_warp * warps), smem_sm // smem, 64 // warps, 32))
