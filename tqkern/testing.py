"""Hypothesis strategies and helpers shared by tqkern's property tests (and other stacks' tests).

Importing this module needs ``hypothesis`` (the ``test`` extra); ``tqkern`` itself does not.

Profiles (``settings.load_profile``): ``ci`` (CPU interpreter, small shapes, few examples) and
``thorough`` (GPU, larger shapes, 150 examples or ``$TQKERN_MAX_EXAMPLES``; no shrinking with
``TQKERN_NO_SHRINK=1``). Select with
``pytest --hypothesis-profile=thorough``; property tests size their shapes with :func:`scale`.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from tqkern.layouts import FP8, KVFormat, LloydMax, PagedLayout, Raw, Uniform
from tqkern.params import TQParams

__all__ = [
    "HEAD_DIMS",
    "lloyd_max_codecs",
    "uniform_codecs",
    "codecs",
    "kv_formats",
    "paged_layouts",
    "tq_params",
    "float_arrays",
    "kv_arrays",
    "paged_batches",
    "PagedBatch",
    "varlen_batches",
    "VarlenBatch",
    "scale",
    "is_thorough",
    "Rounding",
]

settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=int(os.environ.get("TQKERN_MAX_EXAMPLES", "150")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # TQKERN_NO_SHRINK=1: report a failing example as drawn (no shrinking), for short GPU leases.
    **({"phases": [Phase.explicit, Phase.reuse, Phase.generate]} if os.environ.get("TQKERN_NO_SHRINK") else {}),
)

HEAD_DIMS = (64, 96, 128, 256)

U_FP16, U_BF16 = 2.0**-11, 2.0**-8  # unit roundoffs (round to nearest: 11 and 8 significant bits)


@dataclasses.dataclass(frozen=True)
class Rounding:
    """The half-precision roundings of an attention route over the cache, which set the attention
    property tests' budget: each logit moves by at most ``δ = 2·dot_u·scale·Σ_d |q_d|·|k̂_d|`` (q
    and the decoded key each rounded once to the products' dtype); softmax then moves by at most
    ``2δ`` in L1; V̂, the probabilities P and the output are each rounded once more. An all-fp16
    route is held to ``(4e-3 + 2δ)·max|V̂|``; each of those three roundings done in bf16 instead
    adds ``(2^-8 − 2^-11)·max|V̂|``, its worst case.

    Attributes:
        dot_u: the unit roundoff of the logit products' operands, :data:`U_FP16` or :data:`U_BF16`.
        bf16_steps: how many of V̂, P and the output are rounded to bf16 (0..3).
    """

    dot_u: float
    bf16_steps: int

    @classmethod
    def of(cls, fmt: KVFormat, q_dtype: str, *, workspace: bool) -> "Rounding":
        """The roundings of a route for queries of ``q_dtype`` (``"float16"``/``"bfloat16"``) over a
        ``fmt`` cache. The fused kernels (decode, prefill, short rows) multiply in fp16, or in bf16
        for a raw bf16 codec (q, k̂, V̂ and P in bf16), and write the output in q's dtype. A
        ``workspace`` route (the tiled prefill, the decompress path) rounds k̂ and V̂ to q's dtype,
        and its dense kernel multiplies and rounds P in q's dtype (a raw bf16 codec's values keep
        bf16's ``dot_u``: fp16 holds them within its range)."""
        if q_dtype not in ("float16", "bfloat16"):
            raise ValueError(f"q_dtype must be 'float16' or 'bfloat16', got {q_dtype!r}")
        raw_bf16 = "bfloat16" in (getattr(fmt.key, "dtype", ""), getattr(fmt.value, "dtype", ""))
        q_bf16 = q_dtype == "bfloat16"
        if workspace:
            return cls(U_BF16 if q_bf16 or raw_bf16 else U_FP16, 3 if q_bf16 else 0)
        return cls(U_BF16 if raw_bf16 else U_FP16, 2 * raw_bf16 + q_bf16)

    def logit_bound(self, q: np.ndarray, khat: np.ndarray, group: int) -> float:
        """δ = ``2·dot_u/√D · max Σ_d |q_d|·|k̂_d|`` over every (query row, key) pair of one
        sequence: ``q`` ``[Hq, D]`` or ``[T, Hq, D]`` in the keys' space (rotated where they are),
        ``khat`` the decoded keys ``[n, Hkv, D]``, query head ``h`` reading KV head ``h // group``;
        0 where either is empty."""
        if not isinstance(group, int) or isinstance(group, bool) or group < 1:
            raise ValueError(f"group must be a positive int, got {group!r}")
        if q.ndim not in (2, 3) or khat.ndim != 3 or q.shape[-1] != khat.shape[-1] \
                or q.shape[-2] != khat.shape[1] * group:
            raise ValueError(f"q must be [Hq, D] or [T, Hq, D] and khat [n, Hkv, D] with Hq = Hkv·group = "
                             f"{khat.shape[1] if khat.ndim == 3 else '?'}·{group}, got q {list(q.shape)}, "
                             f"khat {list(khat.shape)}")
        if not q.size or not khat.size:
            return 0.0
        qa = np.abs(q).reshape(-1, *q.shape[-2:])  # [T, Hq, D]
        kv = np.repeat(np.abs(khat), group, axis=1)  # [n, Hq, D]
        # 64 query rows at a time ([64, Hq, n])
        pair = max(float(np.einsum("thd,nhd->thn", qa[i:i + 64], kv).max()) for i in range(0, len(qa), 64))
        return float(2 * self.dot_u / np.sqrt(q.shape[-1]) * pair)

    def atol(self, delta: float, vmax: float) -> float:
        """The budget of an output row: ``(4e-3 + bf16_steps·(2^-8 − 2^-11) + 2δ)·max|V̂| + 1e-6``."""
        return (4e-3 + self.bf16_steps * (U_BF16 - U_FP16) + 2 * delta) * vmax + 1e-6


def is_thorough() -> bool:
    current = getattr(settings, "get_current_profile_name", None)
    return (current() if current else settings._current_profile) == "thorough"


def scale(ci: int, thorough: int) -> int:
    """A size bound: ``ci`` under the ci profile, ``thorough`` otherwise."""
    return thorough if is_thorough() else ci


def lloyd_max_codecs(bits=st.integers(1, 8)) -> st.SearchStrategy[LloydMax]:
    return st.builds(
        LloydMax,
        bits=bits,
        distribution=st.sampled_from(["beta", "gaussian"]),
        norm_dtype=st.sampled_from(["float16", "float32"]),
        norm_correction=st.sampled_from(["none", "decode", "stored"]),
    )


def uniform_codecs(bits=st.integers(2, 8)) -> st.SearchStrategy[Uniform]:
    return st.builds(Uniform, bits=bits, param_dtype=st.sampled_from(["float16", "float32"]),
                     rotated=st.booleans())


def codecs(*, fp8: bool = True, raw: bool = True, max_bits: int = 8) -> st.SearchStrategy:
    """Any codec; ``fp8=False`` drops FP8 (the CPU interpreter cannot run it)."""
    options = [lloyd_max_codecs(st.integers(1, max_bits)), uniform_codecs(st.integers(2, max(2, max_bits)))]
    if fp8:
        options.append(st.builds(FP8, rotated=st.booleans()))
    if raw:
        options.append(st.builds(Raw, dtype=st.sampled_from(["float16", "bfloat16"])))
    return st.one_of(options)


@st.composite
def kv_formats(draw, head_dims=None, *, fp8: bool = True, raw: bool = True, max_bits: int = 8) -> KVFormat:
    """A format with K and V codecs drawn independently; head_dim from ``head_dims`` (default:
    64/96/128/256 or any other even value up to 256)."""
    if head_dims is None:
        head_dims = st.one_of(st.sampled_from(HEAD_DIMS), st.integers(1, 128).map(lambda n: 2 * n))
    d = draw(head_dims, label="head_dim")
    key = draw(codecs(fp8=fp8, raw=raw, max_bits=max_bits), label="key")
    value = draw(codecs(fp8=fp8, raw=raw, max_bits=max_bits), label="value")
    packed4 = all((not c.packed) or c.bits == 4 for c in (key, value))
    orders = ["lsb", "nibble_high_even"] if packed4 else ["lsb"]
    return KVFormat(
        head_dim=d, key=key, value=value,
        bit_order=draw(st.sampled_from(orders), label="bit_order"),
        rotation=draw(st.sampled_from(["hadamard", "hadamard_signed", "haar"]), label="rotation"),
        slot_alignment=draw(st.sampled_from([1, 2, 4, 16]), label="slot_alignment"),
    )


@st.composite
def paged_layouts(draw, formats=None, *, num_kv_heads=st.integers(1, 4),
                  block_sizes=st.sampled_from([16, 32, 64, 128])) -> PagedLayout:
    fmt = draw(formats if formats is not None else kv_formats(), label="format")
    return PagedLayout(
        format=fmt,
        num_kv_heads=draw(num_kv_heads, label="num_kv_heads"),
        block_size=draw(block_sizes, label="block_size"),
        arrangement=draw(st.sampled_from(["slot", "row"]), label="arrangement"),
    )


@st.composite
def tq_params(draw, fmt: KVFormat, num_kv_heads: int, *, key_offset=st.booleans()) -> TQParams:
    """Default parameters of ``fmt`` with a drawn seed and, maybe, a random key offset."""
    seed = draw(st.integers(0, 2**16), label="seed")
    mu = None
    if draw(key_offset, label="with_key_offset"):
        rng = np.random.default_rng(seed + 1)
        mu = (rng.standard_normal((num_kv_heads, fmt.head_dim)) * 0.5).astype(np.float32)
    return TQParams.default(fmt, seed=seed, key_offset=mu)


@st.composite
def float_arrays(draw, shape, *, dtype=np.float16, outliers: bool = True) -> np.ndarray:
    """Gaussian data of a drawn scale, with occasional outlier channels, exact zero vectors and
    special elements: the inputs real K/V caches present. Special elements (drawn): about 5% of
    the elements −0.0 or +0.0 (ReLU-like sparsity, padding), 2% float16 subnormals of either sign,
    and a vector of −0.0 only."""
    seed = draw(st.integers(0, 2**32 - 1), label="data_seed")
    rng = np.random.default_rng(seed)
    sigma = draw(st.sampled_from([0.05, 1.0, 8.0]), label="sigma")
    x = rng.standard_normal(shape) * sigma
    if outliers and len(shape) and draw(st.booleans(), label="outlier_channels"):
        ch = rng.integers(0, shape[-1], size=max(1, shape[-1] // 32))
        x[..., ch] *= 20.0
    if len(shape) > 1 and shape[0] > 0 and draw(st.booleans(), label="zero_vector"):
        x[0] = 0.0
    if x.size and draw(st.booleans(), label="special_elements"):
        u = rng.random(shape)
        x = np.where(u < 0.025, -0.0, np.where(u < 0.05, 0.0, x))
        sub = rng.integers(1, 1024, size=shape) * 2.0**-24 * rng.choice([-1.0, 1.0], size=shape)
        x = np.where((u >= 0.05) & (u < 0.07), sub, x)
        if len(shape) > 1 and shape[0] > 1:
            x[-1] = -0.0
    return x.astype(dtype)


def kv_arrays(num_tokens: int, num_kv_heads: int, head_dim: int, *, dtype=np.float16):
    shape = (num_tokens, num_kv_heads, head_dim)
    return st.tuples(float_arrays(shape, dtype=dtype), float_arrays(shape, dtype=dtype))


class PagedBatch:
    """A batch of sequences in a paged cache: ``block_table [num_seqs, max_blocks]`` int32 with
    physical blocks shuffled across sequences, ``seq_lens [num_seqs]`` int32 and the
    ``num_blocks`` the cache needs (block 0..num_blocks−1; unused blocks exist too)."""

    def __init__(self, block_table: np.ndarray, seq_lens: np.ndarray, num_blocks: int, block_size: int):
        self.block_table = block_table
        self.seq_lens = seq_lens
        self.num_blocks = num_blocks
        self.block_size = block_size

    def slot_ids(self, s: int) -> np.ndarray:
        pos = np.arange(int(self.seq_lens[s]))
        return self.block_table[s, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size

    def __repr__(self) -> str:
        return f"PagedBatch(seq_lens={self.seq_lens.tolist()}, num_blocks={self.num_blocks})"


@st.composite
def paged_batches(draw, block_size: int, *, max_seqs: int = 4, max_len: int = 200,
                  min_len: int = 1) -> PagedBatch:
    """Sequences with lengths in [min_len, max_len] (often exact page boundaries), their blocks
    drawn without replacement from a shuffled pool with spare blocks."""
    n = draw(st.integers(1, max_seqs), label="num_seqs")
    lens = draw(st.lists(
        st.one_of(st.integers(min_len, max_len),
                  st.integers(1, max(1, max_len // block_size)).map(lambda b: b * block_size)),
        min_size=n, max_size=n), label="seq_lens")
    lens = [max(min_len, min(x, max_len)) for x in lens]
    blocks_per = [-(-x // block_size) for x in lens]
    max_blocks = max(blocks_per) + draw(st.integers(0, 2), label="extra_table_columns")
    spare = draw(st.integers(0, 3), label="spare_blocks")
    num_blocks = sum(blocks_per) + spare
    perm = np.random.default_rng(draw(st.integers(0, 2**16), label="perm_seed")).permutation(num_blocks)
    table = np.zeros((n, max_blocks), np.int32)
    # Unused table entries point at arbitrary (valid) blocks: kernels must not read them.
    table[:] = perm[-1]
    i = 0
    for s, nb in enumerate(blocks_per):
        table[s, :nb] = perm[i: i + nb]
        i += nb
    return PagedBatch(table, np.array(lens, np.int32), num_blocks, block_size)


class VarlenBatch(PagedBatch):
    """A :class:`PagedBatch` with new tokens: sequence s's last ``q_lens[s]`` tokens are its queries
    (``query_start_loc [num_seqs + 1]`` int32, their offsets in a ``[num_tokens, ...]`` array)."""

    def __init__(self, block_table, seq_lens, num_blocks, block_size, q_lens):
        super().__init__(block_table, seq_lens, num_blocks, block_size)
        self.q_lens = np.asarray(q_lens, np.int32)
        self.query_start_loc = np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    def __repr__(self) -> str:
        return f"VarlenBatch(seq_lens={self.seq_lens.tolist()}, q_lens={self.q_lens.tolist()}, " \
               f"num_blocks={self.num_blocks})"


@st.composite
def varlen_batches(draw, block_size: int, *, max_seqs: int = 4, max_len: int = 100,
                   max_q_len: int | None = None) -> VarlenBatch:
    """A mixed batch for varlen prefill: per sequence a length in [0, max_len] (often a page
    boundary) and a ``q_len`` of one of the kinds a serving step mixes: 0 (no new token), 1
    (decode), 2..8 (speculative), the whole sequence (no cached prefix), or any chunk; at most
    ``max_q_len`` when given. Blocks are drawn as in :func:`paged_batches` (shuffled across
    sequences, spare blocks)."""
    n = draw(st.integers(1, max_seqs), label="num_seqs")
    lens = draw(st.lists(
        st.one_of(st.integers(0, max_len),
                  st.integers(1, max(1, max_len // block_size)).map(lambda b: b * block_size)),
        min_size=n, max_size=n), label="seq_lens")
    lens = [min(x, max_len) for x in lens]
    q_lens = []
    for s, L in enumerate(lens):
        kind = draw(st.sampled_from(["decode", "speculative", "whole", "chunk", "empty"]), label=f"q_kind{s}")
        q = {"decode": 1, "speculative": draw(st.integers(2, 8), label=f"spec{s}"), "whole": L, "empty": 0,
             "chunk": draw(st.integers(0, max(0, L)), label=f"chunk{s}")}[kind]
        q_lens.append(min(q, L, L if max_q_len is None else max_q_len))
    blocks_per = [-(-x // block_size) for x in lens]
    max_blocks = max(1, max(blocks_per)) + draw(st.integers(0, 2), label="extra_table_columns")
    spare = draw(st.integers(0, 3), label="spare_blocks")
    num_blocks = max(1, sum(blocks_per) + spare)
    perm = np.random.default_rng(draw(st.integers(0, 2**16), label="perm_seed")).permutation(num_blocks)
    table = np.zeros((n, max_blocks), np.int32)
    table[:] = perm[-1]  # unused entries: arbitrary valid blocks, never read
    i = 0
    for s, nb in enumerate(blocks_per):
        table[s, :nb] = perm[i: i + nb]
        i += nb
    return VarlenBatch(table, np.array(lens, np.int32), num_blocks, block_size, q_lens)
