"""The store plan: every choice a ``store`` launch makes, as one typed, frozen value
(:class:`StorePlan`) built by one pure function (:func:`plan_store`).

A store program takes ``tiles`` consecutive tiles of ``block_vectors`` vectors each, a vector
being one (token, KV head) pair in the order ``v = token · Hkv + head`` (consecutive heads of a
token are adjacent in memory for a contiguous ``[T, Hkv, D]`` input). The rotation operand is
built once per program and serves all its tiles, both sides.

Rotation methods (``y = x @ Π`` in float32, for the rotated sides):

- ``"none"``: no codec is rotated.
- ``"pm1"``: Π = diag(s)·H/√D (:func:`tqkern.rotations.is_signed_sylvester`, D ≤ 128):
  ``y = (x @ B) · |Π[0,0]|`` with B = sign(Π), an exact ±1 matrix in the input's dtype (fp16/bf16;
  fp16 with a key offset, below), on the tensor cores with float32 accumulation: every product is
  exact.
- ``"split"``: any other Π (D ≤ 128): ``16·Π ≈ Π_1 + Π_2``, Π_2 the rounding of what Π_1 leaves,
  in fp16 (~22 bits, the factor 16 keeping Π_2 out of fp16's subnormals), one tensor-core product
  per part, then ``y = acc / 16`` (exact). The error of y stays near ``√D · 2^-22 · ‖x‖``, far
  inside the oracle's EPS = 2^-16 of ‖x‖. bf16 inputs enter as fp16 (below; before session 73:
  three bf16 parts of Π, 24 bits, three products).
- ``"chunked"``: D > 128: fp32 Π and x (minus μ) read in ``KC``-wide chunks inside every tile,
  three-pass tf32 products (the interpreter computes every product in float32): 16 vectors per
  tile, 8 warps, ``KC`` = 32 (:data:`CHUNKED_KC`), no software pipelining (session 73; its 4-warp,
  64-row form spilled 14 KB under Triton 3.6: ``docs/performance.md`` "S73"). A key offset μ on a
  rotated key took it at every D before session 73. Since session 74 a ``chunked`` store whose
  rotated sides are all Lloyd-Max (every preset's; head_dim a multiple of 64) takes Π's columns :data:`WIDE_COLS` at a
  time (``COLS``; :mod:`tqkern.ops.store.wide`): the norm first, from x, then per column chunk
  ``y[:, c]`` over :data:`WIDE_KC`-row blocks on fp16 operands (Π in two parts, x exact or scaled as
  ``F16_ROT``'s), searched and packed at once. 64 vectors × 8 warps (:data:`WIDE_TILE`; a short
  store 32 × 8, :data:`WIDE_TILE_SMALL`; from :data:`WIDE_LARGE_VECTORS` vectors 128 × 8,
  :data:`WIDE_TILE_LARGE`), and for fp16 inputs without μ on those two tiles a row-block loop of
  :data:`WIDE_STAGES` software-pipelined stages (others unrolled). H200, tq4 16K × 8 × 256, fp16
  / bf16 / with μ: S73's path 1913.9 / 2000.1 / 2056.1 µs → 64 × 8 830.4 / 803.7 / 933.7 (S74) →
  518.7 / 616.4 / 772.0 after 128 × 8 for every input, Π's parts made once per rotation and the
  3-stage loop (S75; 3 stages lost 11–43% for bf16 and μ); 512 tokens 23.2 at 32 × 8; S76 (no whole
  rows loaded: each side checks its rows' finiteness in its norm pass) 489.2 / 603.1 / 694.0 →
  411.1 / 495.8 / 563.1. 128 × 8 from 12,288 vectors (S76, fp16 / bf16: 2K tokens 81.5 / 79.5 → 44.7 /
  56.9, 1,536 tokens 80.7 / 78.9 → 42.8 / 55.9; at 8,192 vectors 41.9 / 39.8 → 41.7 / 55.4, so 64 × 8 below;
  8,193–12,287 untimed). Every sweep:
  ``docs/performance.md`` "S74"–"S76" under "Store".

A key offset μ on a rotated key (``pm1`` / ``split``; ``F16_ROT``): ``x − μ`` is inexact in the
input's dtype, so the rotation takes fp16 operands whatever the input dtype: each row of ``x − μ``
(float32) scaled by a power of two to a largest element in [2^13, 2^14) and rounded to fp16 in two
parts hi + lo (~22 bits); ``split`` adds hi·Π_1 + hi·Π_2 + lo·Π_1 (the left-out lo·Π_2 is ~2^-22 of
the product, as in tf32x3), ``pm1`` hi·B + lo·B; the row's power of two is divided out after. The
error of y stays near ``√D · 2^-21 · ‖x − μ‖``, inside EPS = 2^-16 as ``split``'s. bf16 rows of
``split`` and ``pm1`` (``pm1`` since session 77: its ±1 operand was exact in bf16, but rows with
norms near bf16's smallest overflowed the float32 reciprocal of their norm, as the warp kernel's
did; ``chunked`` scales bf16 rows in float32 since then too) scale into one fp16 part exactly (bf16's 8
significant bits fit fp16's 11; only elements below 2^-30 of their row's largest lose bits to fp16's
subnormals). The scaling also keeps rows of any magnitude exact: x − μ beyond fp16's range, or
float32 rows so small that the reciprocal of their norm would overflow float32.

Tile sizes were picked by the offline sm_90 compile (``tests/test_store_sm90_compile.py``): 64
vectors per tile (the tensor-core M of 4 warps), 8 warps (4 warps spill: 255 registers; 8 warps
take 160–245 and no stack); tiles per program 2 (``pm1``: its operand costs one column read and
~D²/128 integer ops per thread) or 4 (``split``, before session 72: a 64 KB fp32 Π read from L2 per
program, against 256 KB of fp16 K/V read from HBM), 1 otherwise. Measured on the H100 (16K tokens × 8 heads × 128,
copy_ of the same bytes 45.9 µs; session 17): turboquant_4bit_nc 216 / 209 µs (slot / row) with
these, 255–348 µs with 16–128 vectors × 4–8 warps × 1–2 tiles; but the unrotated quantized codes
(``turboquant_k8v4``: FP8 keys, uniform values) take 134 / 102 µs with them and 73.3 / 52.4 µs
with 16 vectors × 4 warps × 1 tile (32: 104.5 / 65.7; 64 × 4 warps: 146.3 / 100.0), so every
``"none"`` plan that quantizes takes the small tile; raw fp16/bf16 (``fp16``: 91.6% of copy_)
took 64 × 8 until S76; since, :data:`RAW_TILE_ELEMENTS` elements a tile, 8 warps (H200, 16K × 8 heads, fp16 /
bf16 µs, ``copy_`` 35.6 / 66.8 at head_dim 128 / 256: D128 64 vectors 40.2 / 51.8, 32 36.6 / 37.2, 16 36.5 /
40.7; D256 64 117.8 / 138.4, 32 87.4 / 79.3, 16 74.4 / 71.2, 8 70.2 / 76.5; D64 (64 vectors) 20.4 / 20.6, 32
19.8 / 22.3).

A short store (at most :data:`SMALL_STORE_VECTORS` vectors: a decode step's batch, a short chunk)
takes 16 vectors × 4 warps × 1 tile whatever its rotation (but ``chunked``'s 8 warps, session 73): the
large tiles leave most SMs idle
there (512 tokens × 8 heads is 64 tiles of 64, 32 programs of 2 tiles) and the launch lasts as
long as one program's serial work. Measured on the H100 (session 22, Hkv8/D128, µs, default →
16 × 4 × 1, same bytes): 32 tokens turboquant_4bit_nc 25.8 → 7.8, tq4 48.4 → 6.7, turboquant_3bit_nc
26.6 → 6.8, tqkern_k5v3 37.3 → 8.9; 512 tokens 25.6 → 9.5, 48.5 → 9.2, 28.4 → 9.1, 40.7 → 11.8. At
2,048 tokens (16,384 vectors) neither wins everywhere (turboquant_4bit_nc 26.0 → 32.8, tq4 48.6 →
32.2), so the threshold stays at the largest measured size where the small tile won for every preset.

A dense rotation's store (``split``: tq4, Haar rotations) of more than ``SMALL_STORE_VECTORS`` vectors
(:func:`_split_tile`) takes 32 vectors x 4 warps (:data:`SPLIT_TILE`; keys minus a key offset: 16 x 4,
:data:`SPLIT_TILE_MU`, but bf16 above head_dim 64), with up to 8 tiles a program, halved while the grid
would have fewer than
:data:`SPLIT_MIN_PROGRAMS` programs. Session 71's rule (64 x 8 x 4; one tile a program below 65,536
vectors) left one 254-register CTA an SM. H200, session 72, tq4, µs (CUDA graphs, the public ``store``
with the tile forced, same bytes in every cell): sweep at 16K tokens x 8 heads x 128, fp16: 64 x 8 x 4
192.6, 32 x 4 x 2 / 4 / 8 162.4 / 156.7 / 153.8, 16 x 4 x 4 187.1, 32 x 8 x 2 220.8; at 4K x 8 x 128,
32 x 4 x 8 (128 programs) 59.2 against x 4 40.1. A/B of this rule against session 71's (two runs within
0.6 µs, µs before → after): fp16 16K x 8 x 128 193.1 → 153.8, 4K 50.8 → 40.4, 2K 25.8 → 20.8; 16K x 16
x 96 384.0 → 259.2; 32K x 3 x 64 75.6 → 46.9, 4K x 3 x 64 8.9 → 8.0.

Since session 73 the ``split`` and ``pm1`` products take fp16 operands (``F16_ROT``) for keys minus a
key offset (before: ``chunked``, 16 x 4 x 1) and for bf16 inputs (``split``; ``pm1`` since session
77; before: three bf16 parts of Π): module docstring above. The tile sweeps behind
:data:`SPLIT_TILE_MU` and the bf16 rule (H200, tq4; e.g. fp16 with μ at 16K x 8 x 128 469.8 µs ``chunked`` → 201.7 at 16 x 4 x 8):
``docs/performance.md`` "S73" under "Store".

**The warp kernel** (``kernel="warp"``, :mod:`tqkern.ops.store.warp`, session 24) takes every GPU
store whose layout :func:`warp_store_eligible` accepts and whose inputs are vector-aligned (contiguous
K/V are): ``L`` lanes per vector (``WARP_STORE_LANES``: 4 at head_dim 64, 8 at 128, 16 at 256; at least
``WARP_STORE_SHORT_LANES`` = 8 for a store of at most ``WARP_STORE_SHORT_VECTORS`` vectors; doubled
until a lane's codes fit 64 bits, or since session 26 up to 128 bits of whole 16-bit words but for
FP8 sides), one warp per program (``WARP_STORE_WARPS``; four before session
26), 8 iterations per program (fewer where the grid would have fewer than ``WARP_STORE_PROGRAMS``
programs: a short store takes 1); the rotation as an in-register Walsh–Hadamard transform; bf16
inputs without a key offset compile under a cap of ``WARP_STORE_MAXNREG_BF16`` registers (session 41:
Triton 3.6's ptxas gives k5v4h's bf16 form 188 registers against its fp16 form's 148, ten one-warp
programs per SM; capped at 128, sixteen. H200, 16K × 8 × 128, bf16 in, µs, bytes equal: k5v4h
111.67 → 97.19, turboquant_4bit_nc 72.40 → 69.39, k4v3h 77.63 → 73.75; 96 registers: k5v4h 111.97.
fp16 inputs lose or stay (k5v4h 92.41 → 96.03, turboquant_4bit_nc 56.84 → 56.91), so they keep
Triton's choice; a key offset's bf16 form spills 168 bytes under the cap (untimed), so it does too).
fp16 inputs without a key offset at head_dim 128 whose two sides are Lloyd-Max with a stored norm
correction (the kXvYh formats, tqkern_k5v3) compile under ``WARP_STORE_MAXNREG_STORED`` registers
(session 56, H200, 16K × 8 × 128, µs, uncapped → 112, two alternations each, bytes equal: k4v2h 69.1 →
65.3 (139 registers uncapped under Triton 3.6, after session 55's float32 centroid norm), tqkern_k5v3
85.7 → 83.4 (142), k5v4h 90.2 → 89.2 (151), k4v3h 68.3 → 68.4 (110 uncapped, 112 capped); a cap of
128: k4v2h 66.2, k5v4h 92.4, k4v3h 69.1. The others lose under 112: turboquant_4bit_nc 56.7 → 58.2
(136), turboquant_3bit_nc 49.6 → 51.0 (149), turboquant_k8v4 43.4 → 43.9 (86). Other head_dims
untimed, so uncapped).
``block_vectors`` is then the vectors of one iteration (``WARP_STORE_WARPS·32/L``) and ``tiles`` the
iterations. Session 24's lane sweep on the H100 (tile kernel against 8 / 16 / 32 lanes, and no warp
kernel for unrotated formats below head_dim 128): ``docs/performance.md`` "The warp store kernel".
One warp per program (session 26) and chunks past 64 bits (taken but for FP8 sides): the same
section of ``docs/performance.md``.
Head_dim 64 at 4 lanes (16 elements a lane, as head_dim 128 at 8; session 71, H200, CUDA graphs, the
public ``store`` with the lane count forced, each count timed twice, the better kept, µs 8 → 4 lanes):
16K tokens × 3 heads (SmolLM2) turboquant_4bit_nc 14.5 → 13.3, turboquant_3bit_nc 15.4 → 11.8, tqkern_k5v3
23.9 → 18.0, k5v4h 22.6 → 17.5, k4v2h 16.2 → 13.7; × 8 heads (Llama-3.2-1B) −12 to −25% fp16, × 2
(Qwen2.5-0.5B) −6 to −23%; bf16 and key-offset inputs −0.2 to −30% but mu:k4v2h at 16K × 8 (+0.5%).
Short stores lose (512 × 8 heads −1.8 to +20.9%, 32 × 3 +12 to +26%: half the programs); between them
(4 against 8 lanes at 8,192–24,576 vectors) the 3- and 5-bit presets gain 4–20% and
turboquant_4bit_nc moves 0 to +3.2%; at 32,768 every one gains (−8 to −25%). Hence 8 lanes up to
``SMALL_STORE_VECTORS``. At head_dim 128, 4 lanes (32 elements a lane) take 255 registers and lose
(16K × 8: turboquant_4bit_nc 56.7 → 97.1, turboquant_3bit_nc 49.7 → 62.5; capped at 168: 81.7 / 77.4).
"""

from __future__ import annotations

import dataclasses
import functools
import types

import triton
import triton.language as tl

from tqkern.layouts import LloydMax, PagedLayout, Raw
from tqkern.ops.codecs import KIND_FP8, KIND_LLOYD_MAX, KIND_UNIFORM, layout_args
from tqkern.ops.common import halfword_aligned

__all__ = ["StorePlan", "plan_store", "rotation_method", "warp_store_eligible", "default_signed_sylvester",
           "ROTATIONS", "ROT_NONE", "ROT_PM1", "ROT_SPLIT", "ROT_CHUNKED", "SMALL_STORE_VECTORS", "WARP_STORE_WARPS",
           "SPLIT_TILE", "SPLIT_TILE_MU", "SPLIT_MIN_PROGRAMS", "WARP_STORE_ITERS", "WARP_STORE_PROGRAMS",
           "WIDE_COLS", "WIDE_KC", "WIDE_TILE", "WIDE_TILE_SMALL", "WIDE_TILE_LARGE", "WIDE_LARGE_VECTORS",
           "WIDE_STAGES", "RAW_TILE_ELEMENTS",
           "WARP_STORE_LANES", "WARP_STORE_SHORT_LANES", "WARP_STORE_SHORT_VECTORS", "WARP_STORE_MAXNREG_BF16",
           "WARP_STORE_MAXNREG_STORED"]

ROTATIONS = ("none", "pm1", "split", "chunked")
# The kernel's ROT constexpr (the index in ROTATIONS); kernels compare with these names.
ROT_NONE, ROT_PM1, ROT_SPLIT, ROT_CHUNKED = (tl.constexpr(i) for i in range(4))
HOIST_MAX_DP = 128  # widest padded head_dim whose [DP, DP] operand is built once per program
CHUNKED_KC = 32  # the ``chunked`` method's chunk of Π's rows (16 vectors x 8 warps; docstring)
# ``chunked`` where every rotated side is Lloyd-Max: Π's columns WIDE_COLS at a time over WIDE_KC-row blocks,
# (vectors a tile, warps) WIDE_TILE, WIDE_TILE_SMALL for a short store, WIDE_TILE_LARGE for stores of at least
# WIDE_LARGE_VECTORS vectors (tqkern.ops.store.wide; docstring)
WIDE_COLS = 64
WIDE_KC = 64
WIDE_TILE = (64, 8)
WIDE_TILE_SMALL = (32, 8)
WIDE_TILE_LARGE = (128, 8)
WIDE_LARGE_VECTORS = 12288
WIDE_STAGES = 3  # pipelined stages of the row-block loop: fp16 without μ, but the 64-vector tile (docstring)
RAW_TILE_ELEMENTS = 32 * 128  # raw K/V (both sides Raw): vectors a tile = this / padded head_dim, at most 64
SMALL_STORE_VECTORS = 4096  # (token, head) vectors up to which a store takes the small tile (docstring)
# a dense rotation's store (``split``): (vectors a tile, warps, most tiles a program), and for fp16 keys minus a
# key offset (two fp16 parts); tiles halve until the grid has SPLIT_MIN_PROGRAMS (docstring)
SPLIT_TILE = (32, 4, 8)
SPLIT_TILE_MU = (16, 4, 8)
SPLIT_MIN_PROGRAMS = 256
WARP_STORE_WARPS = 1  # the warp kernel: warps per program (docstring)
WARP_STORE_ITERS = 8  # the warp kernel: iterations per program at most (a long store)
WARP_STORE_MAX_CHUNK = 128  # the warp kernel: most code bits per lane and side (docstring)
WARP_STORE_PROGRAMS = 4096  # ... fewer while the grid would have fewer programs (one-warp programs)
WARP_STORE_MAXNREG_BF16 = 128  # the warp kernel's register cap for bf16 inputs (docstring)
WARP_STORE_MAXNREG_STORED = 112  # ... for fp16 inputs of stored-correction formats at head_dim 128 (docstring)
# the warp kernel's lanes per vector by head_dim (docstring); a store of at most WARP_STORE_SHORT_VECTORS
# vectors takes at least WARP_STORE_SHORT_LANES (more programs for few vectors: session 71)
WARP_STORE_LANES = types.MappingProxyType({64: 4, 128: 8, 256: 16})
WARP_STORE_SHORT_LANES = 8
WARP_STORE_SHORT_VECTORS = SMALL_STORE_VECTORS


@dataclasses.dataclass(frozen=True)
class StorePlan:
    """Everything one ``store`` launch runs, but the grid's size (:meth:`grid`).

    Attributes:
        layout: the cache's layout.
        in_dtype: ``"fp16"`` or ``"bf16"``: the dtype of key and value.
        has_mu: a key offset μ is subtracted from the keys.
        rotation: one of :data:`ROTATIONS` (module docstring).
        block_vectors: (token, head) vectors per tile (``BV``).
        tiles: tiles per program (``TILES``).
        num_warps, num_stages: compile options (``num_stages`` None: Triton's default).
        dot_precision: ``input_precision`` of the fp32 products (``"tf32x3"``; ``"ieee"`` in the
            interpreter).
        constexprs: the store kernel's constexprs (name, value pairs in a fixed order).
        kernel: ``"tile"`` or ``"warp"``.
        maxnreg: the compile's register cap per thread (None: Triton's choice).
        columns: Π's columns a chunk (``COLS``: the column-chunked store, which reads Π's fp16
            parts instead of Π), or 0.
    """

    layout: PagedLayout
    in_dtype: str
    has_mu: bool
    rotation: str
    block_vectors: int
    tiles: int
    num_warps: int
    num_stages: int | None
    dot_precision: str
    constexprs: tuple[tuple[str, object], ...]
    kernel: str = "tile"
    maxnreg: int | None = None
    columns: int = 0

    @property
    def vectors_per_program(self) -> int:
        return self.block_vectors * self.tiles

    def grid(self, num_tokens: int) -> tuple[int]:
        """The store kernel's grid for ``num_tokens`` tokens."""
        return (max(1, triton.cdiv(num_tokens * self.layout.num_kv_heads, self.vectors_per_program)),)

    def kwargs(self) -> dict:
        """The constexprs and compile options, as launch keywords."""
        opts = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        return {**dict(self.constexprs), **opts}

    def describe(self) -> str:
        """One line: kernel, rotation, tile, tiles per program, warps."""
        cx = dict(self.constexprs)
        half = ", half-table search" if cx["K_SYM"] or cx["V_SYM"] else ""
        if self.kernel == "warp":
            warps = f"{self.num_warps} warp{'s' if self.num_warps > 1 else ''}"
            iters = f"{self.tiles} iteration{'s' if self.tiles > 1 else ''}"
            cap = f", <= {self.maxnreg} registers" if self.maxnreg is not None else ""
            return (f"store {self.in_dtype}{' mu' if self.has_mu else ''}: warp kernel, rotation {self.rotation}, "
                    f"{cx['L']} lanes per vector{half}, {warps} x {iters}{cap}")
        f16 = ", fp16 operands" if cx.get("F16_ROT") else ""
        if self.columns:
            f16 = f", fp16 operands, Π's columns {self.columns} at a time"
        return (f"store {self.in_dtype}{' mu' if self.has_mu else ''}: rotation {self.rotation}{f16}, "
                f"{self.block_vectors} vectors x {self.tiles} tiles per program, {self.num_warps} warps{half}")


def plan_store(layout: PagedLayout, in_dtype: str = "fp16", *, has_mu: bool = False, signed_sylvester: bool = False,
               interpret: bool = False, num_vectors: int | None = None, vector_aligned: bool = False,
               symmetric_codebooks: bool = False) -> StorePlan:
    """The plan of a ``store`` into ``layout`` (pure; cached).

    Args:
        layout: the cache's layout.
        in_dtype: ``"fp16"`` or ``"bf16"``.
        has_mu: the parameters hold a key offset.
        signed_sylvester: the rotation is ``diag(s)·H/√D``
            (:func:`tqkern.rotations.is_signed_sylvester`).
        interpret: the launch runs in Triton's CPU interpreter.
        num_vectors: (token, KV head) vectors the launch stores; up to :data:`SMALL_STORE_VECTORS`
            it takes the small tile (module docstring). ``None``: a long store's plan.
        vector_aligned: every key and value vector starts at a multiple of 8 bytes (the warp
            kernel's per-lane int64 loads; contiguous inputs do).
        symmetric_codebooks: every Lloyd-Max boundary table is antisymmetric (``b == −b[::-1]``
            in float32, as :attr:`tqkern_torch.DeviceParams.symmetric_codebooks` checks): both
            kernels then search the positive half (codes of up to 5 bits; the tile kernel since
            session 72).
    """
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a PagedLayout, got {type(layout).__name__}")
    if in_dtype not in ("fp16", "bf16"):
        raise ValueError(f"in_dtype must be 'fp16' or 'bf16', got {in_dtype!r}")
    if num_vectors is not None and (not isinstance(num_vectors, int) or isinstance(num_vectors, bool)
                                    or num_vectors < 0):
        raise ValueError(f"num_vectors must be None or an int >= 0, got {num_vectors!r}")
    for name, flag in (("has_mu", has_mu), ("signed_sylvester", signed_sylvester), ("interpret", interpret),
                       ("vector_aligned", vector_aligned), ("symmetric_codebooks", symmetric_codebooks)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    small = num_vectors is not None and num_vectors <= SMALL_STORE_VECTORS
    if vector_aligned and warp_store_eligible(layout, has_mu=has_mu, signed_sylvester=signed_sylvester,
                                              interpret=interpret):
        lanes = _warp_lanes(layout, num_vectors)
        return _plan_warp(layout, in_dtype, has_mu, lanes, _warp_iters(layout, num_vectors, lanes), symmetric_codebooks)
    split = None
    rot = rotation_method(layout, has_mu, signed_sylvester, interpret)
    if not small and rot == "split":
        split = _split_tile(layout_args(layout)["DP"], in_dtype, has_mu and layout.format.key.rotated, num_vectors)
    wide = _wide_tile(in_dtype, small, num_vectors) if rot == "chunked" and _columns_apply(layout) else None
    return _plan_store(layout, in_dtype, bool(has_mu), bool(signed_sylvester), bool(interpret), small, split,
                       symmetric_codebooks, wide)


def _split_tile(dp: int, in_dtype: str, key_offset: bool, num_vectors: int | None) -> tuple[int, int, int]:
    """``(block_vectors, num_warps, tiles)`` of a dense rotation's store of ``num_vectors`` vectors
    (``None``: a long store) at padded head_dim ``dp`` (module docstring): :data:`SPLIT_TILE`, or
    :data:`SPLIT_TILE_MU` where the rotated keys take a key offset (but bf16 inputs above head_dim
    64), with the tiles a program halved while the grid would have fewer than
    :data:`SPLIT_MIN_PROGRAMS` programs."""
    mu_tile = key_offset and (in_dtype == "fp16" or dp <= 64)
    bv, warps, tiles = SPLIT_TILE_MU if mu_tile else SPLIT_TILE
    while num_vectors is not None and tiles > 1 and triton.cdiv(num_vectors, bv * tiles) < SPLIT_MIN_PROGRAMS:
        tiles //= 2
    return bv, warps, tiles


def _wide_tile(in_dtype: str, small: bool, num_vectors: int | None) -> tuple[int, int]:
    """``(block_vectors, num_warps)`` of the column-chunked store (module docstring):
    :data:`WIDE_TILE_SMALL` for a short store, :data:`WIDE_TILE_LARGE` for stores of at least
    :data:`WIDE_LARGE_VECTORS` vectors (``None``: a long store), :data:`WIDE_TILE` otherwise."""
    if small:
        return WIDE_TILE_SMALL
    if num_vectors is None or num_vectors >= WIDE_LARGE_VECTORS:
        return WIDE_TILE_LARGE
    return WIDE_TILE


def default_signed_sylvester(layout: PagedLayout) -> bool:
    """Whether ``TQParams.default``'s rotation for ``layout``'s format is ``diag(s)·H/√D`` (the
    ``signed_sylvester`` argument of :func:`plan_store` for default parameters): a Hadamard
    rotation at a power-of-two head_dim."""
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a PagedLayout, got {type(layout).__name__}")
    d = layout.head_dim
    return layout.format.rotation in ("hadamard", "hadamard_signed") and d & (d - 1) == 0


def warp_store_eligible(layout: PagedLayout, *, has_mu: bool, signed_sylvester: bool, interpret: bool) -> bool:
    """Whether the warp kernel (:mod:`tqkern.ops.store.warp`) can store into ``layout``: a GPU
    launch, head_dim 64, 128 or 256, no raw side, rotated sides with the signed Hadamard
    rotation (formats with no rotated side: head_dim ≥ 128, where the warp kernel was measured
    faster than the small tile), LSB bit order, at most 64 code bits per lane at 32 lanes
    (``BITS·D/32``), and no unrotated uniform keys with a key offset (their codes need ``x − μ``
    in float64)."""
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a PagedLayout, got {type(layout).__name__}")
    if interpret or layout.head_dim not in (64, 128, 256) or layout.format.bit_order != "lsb":
        return False
    if not (layout.format.key.rotated or layout.format.value.rotated) and layout.head_dim < 128:
        return False
    c = layout_args(layout)
    per_lane = layout.head_dim // 32  # elements per lane at 32 lanes per vector (the most)
    for name, side in (("key", c["K"]), ("value", c["V"])):
        if side.KIND not in (KIND_LLOYD_MAX.value, KIND_UNIFORM.value, KIND_FP8.value):
            return False
        if side.ROTATED and not signed_sylvester:
            return False
        if side.BITS * per_lane > 64:
            return False
        if name == "key" and has_mu and side.KIND == KIND_UNIFORM.value and not side.ROTATED:
            return False
    return True


def _chunk_fits(side, per_lane: int) -> bool:
    """Whether a lane's ``per_lane`` codes of ``side`` suit the warp kernel: one 64-bit word, or
    (but FP8: measured slower, docstring) up to ``WARP_STORE_MAX_CHUNK`` bits of whole 16-bit
    words."""
    bits = side.BITS * per_lane
    return bits <= 64 or (side.KIND != KIND_FP8.value and bits <= WARP_STORE_MAX_CHUNK and bits % 16 == 0)


def _warp_lanes(layout: PagedLayout, num_vectors: int | None) -> int:
    """Lanes per vector: ``WARP_STORE_LANES`` (at least ``WARP_STORE_SHORT_LANES`` for a store of
    at most ``WARP_STORE_SHORT_VECTORS`` vectors; ``None``: a long store), doubled until a lane's
    codes fit its chunk (:func:`_chunk_fits`, both sides)."""
    c = layout_args(layout)
    lanes = WARP_STORE_LANES[layout.head_dim]
    if num_vectors is not None and num_vectors <= WARP_STORE_SHORT_VECTORS:
        lanes = max(lanes, WARP_STORE_SHORT_LANES)
    while lanes < 32 and not all(_chunk_fits(side, layout.head_dim // lanes) for side in (c["K"], c["V"])):
        lanes *= 2
    return lanes


def _warp_iters(layout: PagedLayout, num_vectors: int | None, lanes: int) -> int:
    """Iterations per program: the most (up to ``WARP_STORE_ITERS``, a power of two) that still
    leaves ``WARP_STORE_PROGRAMS`` programs; a long store's (``None``) the most."""
    if num_vectors is None:
        return WARP_STORE_ITERS
    per_iter = WARP_STORE_WARPS * 32 // lanes
    iters = WARP_STORE_ITERS
    while iters > 1 and num_vectors < WARP_STORE_PROGRAMS * per_iter * iters:
        iters //= 2
    return iters


@functools.lru_cache(maxsize=512)
def _plan_warp(layout: PagedLayout, in_dtype: str, has_mu: bool, lanes: int, iters: int, symmetric: bool) -> StorePlan:
    c = layout_args(layout)
    rotate = layout.format.key.rotated or layout.format.value.rotated
    cx = dict(
        HAS_MU=has_mu, IN_BF16=in_dtype == "bf16", H=layout.num_kv_heads, WARPS=WARP_STORE_WARPS, ITERS=iters,
        L=lanes, ROTATE=rotate, K_ALIGNED=halfword_aligned(layout, "key"), V_ALIGNED=halfword_aligned(layout, "value"),
        HW_FP8=True, D=c["D"], ROW_BYTES=c["ROW_BYTES"], PAD_OFF=c["PAD_OFF"], PAD_STRIDE=c["PAD_STRIDE"],
        PAD_BYTES=c["PAD_BYTES"], K=c["K"], V=c["V"],
        **_symmetric_sides(c, symmetric),
    )
    return StorePlan(layout=layout, in_dtype=in_dtype, has_mu=has_mu, rotation="fwht" if rotate else "none",
                     block_vectors=WARP_STORE_WARPS * 32 // lanes, tiles=iters, num_warps=WARP_STORE_WARPS,
                     num_stages=None, dot_precision="none", constexprs=tuple(cx.items()), kernel="warp",
                     maxnreg=_warp_maxnreg(layout, in_dtype, has_mu))


def _symmetric_sides(c: dict, symmetric: bool) -> dict:
    """``K_SYM`` / ``V_SYM``: that side's Lloyd-Max codes (of at most 5 bits) take the half-table search."""
    return {f"{s}_SYM": symmetric and c[s].KIND == KIND_LLOYD_MAX.value and c[s].BITS <= 5 for s in ("K", "V")}


def _warp_maxnreg(layout: PagedLayout, in_dtype: str, has_mu: bool) -> int | None:
    """The warp kernel's register cap (module docstring: each rule's measurement), None: Triton's choice."""
    if has_mu:
        return None
    if in_dtype == "bf16":
        return WARP_STORE_MAXNREG_BF16
    sides = (layout.format.key, layout.format.value)
    if layout.head_dim == 128 and all(isinstance(c, LloydMax) and c.norm_correction == "stored" for c in sides):
        return WARP_STORE_MAXNREG_STORED
    return None


def rotation_method(layout: PagedLayout, has_mu: bool, signed_sylvester: bool, interpret: bool) -> str:
    """The rotation method (module docstring) for these inputs."""
    fmt = layout.format
    if not (fmt.key.rotated or fmt.value.rotated):
        return "none"
    if layout_args(layout)["DP"] > HOIST_MAX_DP:
        return "chunked"
    return "pm1" if signed_sylvester else "split"


def _column_stages(in_dtype: str, has_mu: bool, wide: tuple[int, int] | None) -> int:
    """``COL_STAGES``: :data:`WIDE_STAGES` for fp16 inputs without μ on the large and short tiles
    (session 75: −6 to −23%), 0 (unrolled) for bf16, μ and the 64-vector tile (+11 to +43% there)."""
    if wide is None or in_dtype != "fp16" or has_mu or wide == WIDE_TILE:
        return 0
    return WIDE_STAGES


def _columns_apply(layout: PagedLayout) -> bool:
    """Whether a ``chunked`` store takes Π's columns :data:`WIDE_COLS` at a time
    (:mod:`tqkern.ops.store.wide`): every rotated side is Lloyd-Max (its codes need ``y`` a column
    chunk at a time; other kinds need the whole row) and head_dim is a multiple of the chunks."""
    fmt = layout.format
    sides = [s for s in (fmt.key, fmt.value) if s.rotated]
    d = fmt.head_dim
    return bool(sides) and all(isinstance(s, LloydMax) for s in sides) and d % WIDE_COLS == 0 and d % WIDE_KC == 0


@functools.lru_cache(maxsize=512)
def _plan_store(layout: PagedLayout, in_dtype: str, has_mu: bool, signed_sylvester: bool,
                interpret: bool, small: bool, split: tuple[int, int, int] | None, symmetric: bool,
                wide: tuple[int, int] | None) -> StorePlan:
    c = layout_args(layout)
    rot = rotation_method(layout, has_mu, signed_sylvester, interpret)
    bv, warps, stages, kc = (16, 8, 1, CHUNKED_KC) if rot == "chunked" else (64, 8, None, c["DP"])
    tiles = 2 if rot == "pm1" else 1
    fmt = layout.format
    cols = 0
    if wide is not None:  # Π's columns a chunk at a time (plan_store: chunked, every rotated side Lloyd-Max)
        cols, kc = WIDE_COLS, WIDE_KC
        bv, warps = wide
    raw = isinstance(fmt.key, Raw) and isinstance(fmt.value, Raw)
    if (rot == "none" or small) and not raw and rot != "chunked":
        bv, warps, tiles = 16, 4, 1  # unrotated codes (FP8 keys, uniform values), short stores: docstring
    elif raw:  # (8 warps)
        bv = min(64, RAW_TILE_ELEMENTS // c["DP"])
    elif rot == "split":  # a dense rotation's tile by dtype, head_dim and length (docstring)
        bv, warps, tiles = split
    precision = "ieee" if interpret else "tf32x3"
    # F16_ROT (module docstring): fp16 operands for a key offset on a rotated key (x − μ in two parts) and
    # for bf16 inputs (one exact part, scaled so that rows of any magnitude find their codes)
    f16_rot = rot in ("pm1", "split") and (has_mu and fmt.key.rotated or in_dtype == "bf16")
    cx = dict(
        HAS_MU=has_mu, IN_BF16=in_dtype == "bf16", H=layout.num_kv_heads, BV=bv, TILES=tiles,
        ROT=ROTATIONS.index(rot), KC=kc, DOT_PRECISION=precision,
        K_ALIGNED=halfword_aligned(layout, "key"), V_ALIGNED=halfword_aligned(layout, "value"), HW_FP8=not interpret,
        **c, F16_ROT=f16_rot, COLS=cols, COL_STAGES=_column_stages(in_dtype, has_mu, wide),
        **_symmetric_sides(c, symmetric),
    )
    return StorePlan(layout=layout, in_dtype=in_dtype, has_mu=has_mu, rotation=rot, block_vectors=bv, tiles=tiles,
                     num_warps=warps, num_stages=stages, dot_precision=precision, constexprs=tuple(cx.items()),
                     columns=cols)
