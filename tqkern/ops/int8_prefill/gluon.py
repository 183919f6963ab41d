"""``int8_prefill``'s attention on Hopper as a Gluon kernel (no torch): the contract of
:func:`tqkern.ops.prefill.attend._tile_attend_kernel` with ``INT8`` (causal or unmasked, no
window, no soft-cap), written with explicit warpgroup MMAs so that one tile's Q·Kᵀ runs while
the previous tile's P·V is in flight.

Why a second kernel. Triton's ``tl.dot`` waits for every warpgroup MMA as soon as it is issued
(sessions 41-42, the SASS of Triton 3.6 and 3.9: a ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` after each,
whatever the source order), so the softmax, the int8 Q·Kᵀ and the fp16 P·V of the Triton kernel
run one after another. Gluon states the pipeline itself:

- K and V tiles arrive by TMA into two-slot rings (mbarriers); the query tile once;
- per key tile j: issue Q·K_jᵀ (int8, int32 sums), rescale the accumulator by α_{j−1}, issue
  P_{j−1}·V_{j−1} (fp16/bf16, float32 sums), wait for Q·K_jᵀ only, run tile j's softmax while
  P_{j−1}·V_{j−1} still runs, then wait for it before the loop's back edge (with a product still
  in flight across the back edge ptxas serialized every MMA: warning C7514, session 42 offline).

The maths are the Triton kernel's (its module docstring): ``a_ij = (scale·s_q[i])·s_k[j]·dot_ij``
in float32, bottom-right causal masking, a base-2 online softmax, P rounded to v's dtype, and a
query row with a non-finite scale written NaN (output and lse). The key tiles are ``BN = 128``
wide where the Triton kernel takes 64, so the online softmax rescales at other points: the two
agree to the P·V rounding, not bit for bit.

Rows a tile reads past its sequence's keys belong to the next sequence of the batch (or are
zero-filled by TMA past the tensor): their scores are masked, and the last tile's values are
zeroed in shared memory first when the tile runs past the sequence, so that a non-finite value
of the next sequence cannot reach an output through a zero weight.

Measured (H200, Triton 3.6, session 42, the kernel alone at Hq32/Hkv8/D128, causal, CUDA-graph
replays, against the Triton kernel and SDPA fp16 in the same run): 1x4K 312.4 µs (Triton kernel
361.7, SDPA 294.4), 1x16K 4273.5 (4654.5, 4024.7); 8 chunks of 1K on 16K keys 4160.0 (4416.5).
Of the tiles tried, 64 x 64 x 4 warps 312.6 / 4402.6 / 4223.1; 128 x 64 x 8 warps 420.9 / 5377.5
/ 5474.8, and the same with every product waited at once (the Triton kernel's order) 452.5 /
5818.0 / 5914.1. ``Lq`` and ``Lk`` are specialized as Triton specializes integers (a multiple of
16 lets the key scales load as vectors): with them unspecialized, as the Triton kernel takes them
(a ptxas crash there, not reproduced with this kernel at ``Lq = Lk = 1`` offline), the kernel took
4857.1 µs at 1x16K against 4220.5 and 353.5 against 312.2 at 1x4K (H200, session 42, same run).
The query scale is folded into exp2's argument (one FFMA a score where the scores took two FMULs
and an FADD; ``m`` runs in units of the row's scale): 1x4K 312.9 -> 308.7 µs, 1x16K 4317.0 ->
4260.9, 1K chunks 4217.4 -> 4132.7 (H200, session 43, same run). Tile j+1's key scales load while
tile j's products run (``_load_ks``; an Nsight profile had 10.9% of the stall samples on the first
multiply by scales loaded after the products' wait): ``int8_prefill`` end to end 1x16K 4264.8 ->
3961.7 µs, 1x4K 340.0 -> 319.9, 8x2K 796.8 -> 755.2 (turboquant_4bit_nc; H200, session 45, same
run; outputs bit-identical). A warp-specialized form (a
one-warp TMA loader, two consumer warpgroups of 64 rows on shared K/V tiles) was not kept: against
this kernel (both with the fold, session 43) −1.9% at 1x16K and −1.1% on the chunks but +4.7% at
1x4K, +2.5% at 8x2K and +97% at 32 x 4 speculative queries (docs/performance.md).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

__all__ = ["GLUON", "GluonConfig", "gluon_config", "gluon_eligible", "_gluon_attend_kernel", "tma_load"]

try:  # Gluon (``triton.experimental.gluon``) ships with Triton 3.5+; its Hopper ops name sm_90a instructions
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    GLUON = True
except ImportError:  # pragma: no cover - an older Triton
    GLUON = False


class GluonConfig(NamedTuple):
    """The Gluon kernel's tiles: ``BM`` query rows by ``BN`` keys, ``num_warps`` (one warpgroup)."""

    BM: int
    BN: int
    num_warps: int


def gluon_config(head_dim: int) -> Optional[GluonConfig]:
    """The tiles for ``head_dim`` (None: the kernel does not serve it). 64 x 128 at head_dim 64 and
    128 (the fastest of the tilings measured at D128, module docstring; D64 takes it untimed).
    64 x 64 at head_dim 256, where the float32 accumulator takes 128 of a thread's registers (243
    without spills offline; 64 x 128 spills): H200, session 43, 1x8K Hq16/Hkv8 bf16, the kernel
    alone 932.8 µs against the Triton kernel's 972.9 and SDPA bf16's 961.8 (64 x 32: 1130.9)."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be an int >= 1, got {head_dim!r}")
    if head_dim in (64, 128):
        return GluonConfig(64, 128, 4)
    return GluonConfig(64, 64, 4) if head_dim == 256 else None


def gluon_eligible(head_dim: int, *, window: bool, softcap: bool, lq: int, lk: int) -> bool:
    """Whether the kernel serves this call's shape and options (the host checks the device, the
    tensors' layout and alignment): Gluon importable, head_dim 64, 128 or 256, no window, no soft-cap,
    at least one key and no more queries than keys (every causal row then sees a key)."""
    for name, flag in (("window", window), ("softcap", softcap)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    for name, n in (("lq", lq), ("lk", lk)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    return GLUON and gluon_config(head_dim) is not None and not window and not softcap and 0 < lq <= lk


if GLUON:
    # Triton 3.9 renamed TMA's load and the CTA barrier (3.6: async_copy_global_to_shared, thread_barrier)
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    _cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

    @gluon.jit
    def _load_ks(ks_base, j, Lk, BN: gl.constexpr, ks_regs: gl.constexpr):
        """Tile j's key scales (0 past ``Lk``), one a thread: issued an iteration before
        :func:`_softmax` needs them, so the load's latency hides behind tile j−1's products."""
        keys = j * BN + gl.arange(0, BN, layout=ks_regs)
        return gl.load(ks_base + keys, mask=keys < Lk, other=0.0)

    @gluon.jit
    def _softmax(s, m_i, l_i, qs, ks_j, Lk, pos_q, first, j, BN: gl.constexpr, CAUSAL: gl.constexpr,
                 col_s: gl.constexpr, p_layout: gl.constexpr, P_DTYPE: gl.constexpr):
        """Tile j's int32 products ``s`` and key scales ``ks_j`` (from :func:`_load_ks`) →
        ``(P in the P·V operand layout, α, m, l)``, base 2. ``pos_q``: each row's key position;
        ``first``: the block's first row's. Masks only on the tail tile and the causal diagonal's
        tiles."""
        keys = j * BN + gl.arange(0, BN, layout=col_s)
        ks = gl.convert_layout(ks_j, col_s)
        x = s.to(gl.float32) * gl.expand_dims(ks, 0)  # in units of the row's scale qs (> 0)
        if (j * BN + BN > Lk) or (CAUSAL and j * BN + BN > first + 1):
            vis = gl.expand_dims(keys < Lk, 0)
            if CAUSAL:
                vis = vis & (gl.expand_dims(keys, 0) <= gl.expand_dims(pos_q, 1))
            x = gl.where(vis, x, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(x, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2((m_i - m_safe) * qs)
        p = gl.exp2(x * gl.expand_dims(qs, 1) - gl.expand_dims(m_safe * qs, 1))  # one FFMA a score
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return gl.convert_layout(p.to(P_DTYPE), p_layout), alpha, m_new, l_i

    @gluon.jit
    def _zero_rows_past(v_tile, row0, Lk, ROWS: gl.constexpr, v_regs: gl.constexpr):
        """Zero the rows of a ``[ROWS, D]`` value tile in shared memory whose key position
        (``row0`` + the row) is ``≥ Lk``, then fence them for the tensor cores' reads."""
        rows_v = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, v_regs))
        v_t = v_tile.load(v_regs)
        v_tile.store(gl.where(gl.expand_dims(rows_v < Lk, 1), v_t, gl.zeros_like(v_t)))
        fence_async_shared()

    @gluon.jit
    def _finish(acc, m_i, l_i, qs, poison, o_ptr, lse_ptr, b, h, m0, Lq, HQ: gl.constexpr, D: gl.constexpr,
                BM: gl.constexpr, row_s: gl.constexpr, row_o: gl.constexpr, col_o: gl.constexpr,
                V_DTYPE: gl.constexpr):
        """Rows ``m0 .. m0+BM−1`` of sequence ``b``, head ``h``: ``o = acc / l`` in v's dtype and
        the natural-log ``lse`` (``m`` is in units of the row's scale ``qs``); a row whose query
        scale was non-finite gets NaN through ``poison``; rows ``≥ Lq`` are not written."""
        inv = gl.where(l_i > 0, 1.0 / gl.where(l_i > 0, l_i, 1.0), 0.0)
        o = acc * gl.expand_dims(gl.convert_layout(inv, row_o), 1) + gl.expand_dims(gl.convert_layout(poison, row_o), 1)
        rows_o = m0 + gl.arange(0, BM, layout=row_o)
        cols_o = gl.arange(0, D, layout=col_o)
        o_off = gl.expand_dims((b * Lq + rows_o).to(gl.int64) * (HQ * D) + h * D, 1) + gl.expand_dims(cols_o, 0)
        gl.store(o_ptr + o_off, o.to(V_DTYPE), mask=gl.expand_dims(rows_o < Lq, 1))
        m_i = m_i * qs
        lse = gl.where(l_i > 0, (m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        rows_s = m0 + gl.arange(0, BM, layout=row_s)
        gl.store(lse_ptr + (b * Lq + rows_s).to(gl.int64) * HQ + h, lse + poison, mask=rows_s < Lq)

    @gluon.jit
    def _gluon_attend_kernel(q_desc, k_desc, v_desc, qs_ptr, ks_ptr, o_ptr, lse_ptr, Lq, Lk, stride_qst,
                             stride_ksh, qk_scale, HQ: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                             BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr):
        """``batch`` sequences of ``Lq`` queries on ``Lk`` keys each, one after another (query i at
        key position ``Lk − Lq + i``, ``1 ≤ Lq ≤ Lk``): ``q_desc`` / ``k_desc`` / ``v_desc`` TMA
        descriptors of the contiguous ``[batch·Lq, HQ·D]`` int8 query codes, ``[batch·Lk,
        HQ/G·D]`` int8 key codes and values (fp16/bf16), boxes ``[BM, D]`` / ``[BN, D]``; ``qs``
        float32 query scales at row stride ``stride_qst`` (heads contiguous); ``ks`` float32 key
        scales head-major (token stride 1, head stride ``stride_ksh``); ``o`` ``[batch·Lq, HQ, D]``
        in v's dtype and ``lse`` float32 ``[batch·Lq, HQ]`` (natural log), contiguous.
        ``qk_scale``: the score scale times log2 e. Grid ``(⌈Lq / BM⌉, batch·HQ)``, the last query
        block first (the longest causal rows start first)."""
        V_DTYPE: gl.constexpr = v_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BN, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        v_regs: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // (D // 8), D // 8],
                                                warps_per_cta=[num_warps, 1], order=[1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        ks_regs: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                                 warps_per_cta=[num_warps], order=[0])

        b = gl.program_id(1) // HQ
        h = gl.program_id(1) % HQ
        kh = h // G
        m0 = (gl.num_programs(0) - 1 - gl.program_id(0)) * BM
        first = Lk - Lq + m0  # the block's first row's key position (≥ 0: Lq ≤ Lk)
        if CAUSAL:
            n_tiles = gl.cdiv(gl.minimum(first + BM, Lk), BN)
        else:
            n_tiles = gl.cdiv(Lk, BN)
        q_row = b * Lq + m0
        k_row = b * Lk
        ks_base = ks_ptr + kh * stride_ksh + k_row

        q_smem = gl.allocate_shared_memory(gl.int8, [BM, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(gl.int8, [2, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(V_DTYPE, [2, BN, D], v_desc.layout)
        qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        vbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(qbar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(kbar.index(i), count=1)
            mbarrier.init(vbar.index(i), count=1)
        fence_async_shared()

        mbarrier.expect(qbar, q_desc.block_type.nbytes)
        tma_load(q_desc, [q_row, h * D], qbar, q_smem)
        for i in gl.static_range(2):
            if i < n_tiles:
                mbarrier.expect(kbar.index(i), k_desc.block_type.nbytes)
                tma_load(k_desc, [k_row + i * BN, kh * D], kbar.index(i), k_smem.index(i))
        mbarrier.expect(vbar.index(0), v_desc.block_type.nbytes)
        tma_load(v_desc, [k_row, kh * D], vbar.index(0), v_smem.index(0))

        rows_s = m0 + gl.arange(0, BM, layout=row_s)
        pos_q = Lk - Lq + rows_s
        qs = gl.load(qs_ptr + (b * Lq + rows_s).to(gl.int64) * stride_qst + h, mask=rows_s < Lq, other=0.0)
        poison = gl.where(qs - qs != 0, float("nan"), 0.0)  # a non-finite scale: the row held a NaN or ±inf
        qs = gl.maximum(qs * qk_scale, 1e-30)  # folded into exp2's argument: a zero row's scores stay ~0
        m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.full([BM], 0.0, gl.float32, layout=row_s)
        acc = gl.zeros([BM, D], gl.float32, layout=o_layout)
        zero_s = gl.zeros([BM, BN], gl.int32, layout=s_layout)

        ks_j = _load_ks(ks_base, 0, Lk, BN, ks_regs)
        ks_next = _load_ks(ks_base, 1, Lk, BN, ks_regs)
        mbarrier.wait(qbar, 0)
        mbarrier.wait(kbar.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qs, ks_j, Lk, pos_q, first, 0, BN, CAUSAL, col_s, p_layout,
                                      V_DTYPE)
        for j in range(1, n_tiles):
            ks_j = ks_next
            ks_next = _load_ks(ks_base, j + 1, Lk, BN, ks_regs)  # in flight over this tile's products
            # K_{j+1} into the slot Q·K_{j−1}ᵀ read, V_j into the one P_{j−2}·V_{j−2} read (both waited)
            if j + 1 < n_tiles:
                mbarrier.expect(kbar.index((j + 1) % 2), k_desc.block_type.nbytes)
                tma_load(k_desc, [k_row + (j + 1) * BN, kh * D], kbar.index((j + 1) % 2), k_smem.index((j + 1) % 2))
            mbarrier.expect(vbar.index(j % 2), v_desc.block_type.nbytes)
            tma_load(v_desc, [k_row + j * BN, kh * D], vbar.index(j % 2), v_smem.index(j % 2))
            mbarrier.wait(kbar.index(j % 2), (j // 2) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(j % 2).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            mbarrier.wait(vbar.index((j - 1) % 2), ((j - 1) // 2) & 1)
            acc = warpgroup_mma(p, v_smem.index((j - 1) % 2), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qs, ks_j, Lk, pos_q, first, j, BN, CAUSAL, col_s,
                                          p_layout, V_DTYPE)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        last = n_tiles - 1
        v_last = v_smem.index(last % 2)
        mbarrier.wait(vbar.index(last % 2), (last // 2) & 1)
        if last * BN + BN > Lk:  # the tile runs past the sequence: zero those rows' values
            _zero_rows_past(v_last, last * BN, Lk, BN, v_regs)
            _cta_barrier()
        acc = warpgroup_mma(p, v_last, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _finish(acc, m_i, l_i, qs, poison, o_ptr, lse_ptr, b, h, m0, Lq, HQ, D, BM, row_s, row_o, col_o, V_DTYPE)
        mbarrier.invalidate(qbar)
        for i in gl.static_range(2):
            mbarrier.invalidate(kbar.index(i))
            mbarrier.invalidate(vbar.index(i))
else:  # pragma: no cover - an older Triton
    _gluon_attend_kernel = tma_load = None
