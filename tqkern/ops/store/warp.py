"""The warp store kernel (GPU only): ``L`` lanes of a warp per (token, KV head) vector pair, the
signed Hadamard rotation as an in-register fast Walsh–Hadamard transform.

Every tensor here holds one value per thread (shape ``[32·WARPS]``), as in the warp-MMA decode
kernel, so that inline PTX shuffles move values between lanes (the per-lane building blocks:
:mod:`tqkern.ops.store.lanes`). A program's ``32·WARPS/L`` lane
groups store one vector each per iteration (group ``g`` of program ``P`` at iteration ``i``:
vector ``v = (P·ITERS + i)·32·WARPS/L + g``, head ``v % H`` of token ``v // H``), and the data of
iteration ``i + 1`` is loaded before iteration ``i`` is encoded, so the next loads stay in flight
while the lanes compute.

Lane ``p`` of a group holds elements ``E·p .. E·p + E − 1`` of each side (``E = D/L``: 4 to 32
bytes, read as int32/int64 words). Per side, as :func:`tqkern.ops.fields.encode_side` does for a
tile:

* finiteness from the raw 16-bit words (:func:`~.lanes._finite`: integer operations, four elements per
  word), a butterfly over the group; a vector that is not finite is encoded as it comes and its
  codes, norm or bounds are then replaced by the zero vector's (one select per lane, not per
  element);
* the rotation's signs ``s_i`` as an XOR of the words' sign bits (:func:`~.lanes._sign_words`), exact;
* the norm: for float16 norms, a float32 sum of the squares (:func:`_sum_sq_f32`: exact squares,
  or with a key offset the squares of ``fl(x − μ)``) whose error bound decides the float16 bytes
  (the norm, or the norm over
  the codes' centroid norm where that correction is stored) and the saturation flag unless the
  value lies within ``2^-18`` of a rounding tie or of 65504 (:func:`_f16_unsure`); a warp with
  such a vector recomputes them in float64 (a rare branch). Other Lloyd-Max sides take the
  float64 sum (each lane's ``E`` squares, then a butterfly over the group: every lane gets the
  same bits), so the stored norm bytes equal the oracle's as the tile kernel's do. ``c/‖x − μ‖``
  (the codes' scale) stays in float32's normal range for fp16 rows (``‖x − μ‖`` is 0 or in
  [2^-126, 2^121] when μ's elements are 0 or normal float32 below 2^120 in magnitude: ``TQParams``
  stores subnormal μ elements as zeros); a warp of bf16 rows with a norm outside
  [2^-50, 2^50] (subnormal rows reach 2^-133) codes them again from ``y·2^∓64`` (exact) and a float64
  scale (:func:`_rescaled_codes`, a rare branch: session 76 found the codes of such rows wrong);
* ``y = (x − μ) @ Π`` for ``Π = diag(s)·H/√D`` as ``FWHT(s ⊙ x − s ⊙ μ) · |Π[0, 0]|`` in float32
  (``s ⊙ μ`` from the host, read as int64 words: no sign floats held in registers):
  ``log2 E`` butterfly stages inside the lane, then ``log2 L`` across lanes (``shfl.bfly``; the
  lane whose stage bit is set keeps ``partner − own``). Every output is a sum of D terms ``±x_i``
  in float32, well inside the oracle's ``EPS = 2^-16·‖x‖`` of uncertainty; ``|Π[0, 0]|`` and the
  Lloyd-Max ``1/‖x‖`` are one product;
* Lloyd-Max codes: with an antisymmetric boundary table (``symmetric_codebooks``, codes of up to
  5 bits) a binary search of ``|y|`` over the positive half held in registers (:func:`tqkern.ops.fields.symmetric_codes`:
  one level and half the selects fewer), else the tile kernel's search of the whole table
  (:func:`tqkern.ops.fields._lloyd_max_codes`); uniform codes by its float32 estimate checked
  exactly (a program where the check fails for some element takes the float64 decision for
  all), and for fp16 rows without a key offset the estimate's ratio, the floor of the scale
  and the stored scale and zero from float32 values, each decided exactly (session 77:
  :func:`~.lanes._uniform_codes` and the uniform branch of :func:`_encode`); FP8 by the hardware's
  saturating conversion;
* packing: a lane's ``E`` codes are one ``BITS·E``-bit chunk of the LSB-first stream (at most 64
  bits, or up to 128 bits of whole 16-bit words held as 32-bit words: the planner's condition).
  Chunks of whole bytes are written by their own lane; other
  widths (3- and 5-bit codes) are joined into 16-bit words by ``shfl.idx`` from the lanes whose
  chunks overlap each word (lane p makes words p, p + L, ...). A field is written as 16-bit
  stores where every head's field starts at an even byte, else byte by byte. Lane 0 of the group
  writes the per-vector floats.

A program is one warp (``WARPS = 1`` in the plan): its reductions (the fall-back branches) are
shuffles, with no barrier between warps.

Safety and errors as the tile kernel (:mod:`tqkern.ops.store.kernel`): a slot outside
``[0, num_slots)`` writes nothing (flagged when too large), a non-finite vector is stored as the zero vector
(flagged), saturating floats are flagged; one atomic OR per program, only when set.

Which layouts and inputs take it, and the measured lane counts: :mod:`tqkern.ops.store.plan`. No
torch here: :mod:`tqkern.ops.store.aot` compiles it with Triton alone.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.errors import ErrorFlag
from tqkern.ops.codecs import DT_F16, KIND_FP8, KIND_LLOYD_MAX, NC_STORED
from tqkern.ops.common import f32_to_f16_sat, f32_to_fp8e4m3_bits, f64_to_bits, store_bytes
from tqkern.ops.fields import _lloyd_max_codes, _saturates
from tqkern.ops.store.lanes import (
    _bfly, _group_sum64, _group_min_max, _or, _finite, _sign_words, _half_bounds, _sym_codes, _read, _unpack,
    _vector, _fwht, _xor, _chunk, _zero_chunk, _where_chunk, _write_chunks, _uniform_codes,
)

__all__ = ["_store_warp_kernel"]

_ERR_NONFINITE = tl.constexpr(int(ErrorFlag.NONFINITE_INPUT))
_ERR_SLOT = tl.constexpr(int(ErrorFlag.SLOT_OUT_OF_RANGE))
_ERR_SATURATED = tl.constexpr(int(ErrorFlag.SATURATED))


@triton.jit
def _sum_sq_f32(xs, lane, E: tl.constexpr, LB: tl.constexpr):
    """Σ x² over the vector in float32: four in-lane partial sums (short dependency chains), then
    a butterfly over the group (every lane gets the same bits). Each x² is exact in float32 (11
    or 8 significant bits; for bf16 only where the sum lies in [2^-100, 2^100]: the caller
    takes the float64 norm elsewhere, as a float32 within 2^-24), and every term passes through
    at most ``h = E/4 − 1 + 2 + LB ≤ 14`` additions (E ≤ 32 a power of two, L ≤ 32), so
    ``|ŝ − s| ≤ γ_h·s < 2^-20·s`` (``γ_h = h·u/(1 − h·u)``, u = 2^-24); its correctly rounded
    square root is within ``2^-21 + 2^-24`` of √s, relative. With a key offset the caller passes
    ``x̂ = fl(x − μ) = (x − μ)(1 + δ)``, ``|δ| ≤ u``, whose rounded square is
    ``(x − μ)²(1 + δ)²(1 + ε)``: each term within ``3u + u²`` of its exact value, the sum within
    ``(3 + h)u + O(u²) ≤ 17.1u < 2^-19.9`` relative, the root within ``2^-20.9``: inside the
    ``2^-19`` that :func:`_f16_unsure` assumes."""
    tl.static_assert(E <= 32)
    if E >= 4:
        a0 = xs[0] * xs[0]
        a1 = xs[1] * xs[1]
        a2 = xs[2] * xs[2]
        a3 = xs[3] * xs[3]
        for e in tl.static_range(4, E, 4):
            a0 = xs[e] * xs[e] + a0
            a1 = xs[e + 1] * xs[e + 1] + a1
            a2 = xs[e + 2] * xs[e + 2] + a2
            a3 = xs[e + 3] * xs[e + 3] + a3
        ss = (a0 + a1) + (a2 + a3)
    else:  # E = 2
        ss = xs[0] * xs[0] + xs[1] * xs[1]
    for j in tl.static_range(LB):
        ss = ss + _bfly(ss, lane * 0 + (1 << j))
    return ss


@triton.jit
def _centroid_norm_f32(cs, lane, LB: tl.constexpr):
    """‖c‖ for float16 norms with a stored correction, from each lane's float64 sum ``cs`` of its
    codes' squared centroids (E ≤ 32 float64 products and sums: relative error under 2^-47): that
    sum rounded to float32 (u = 2^-24), a butterfly of ``LB ≤ 5`` float32 additions (every lane
    gets the same bits; ``γ_LB`` relative), the correctly rounded square root: within
    ``(1 + LB)u/2 + u ≤ 4u = 2^-22`` of the float64 ``‖c‖``. The caller's ``n / ‖c‖`` (n within
    ``2^-21 + 2^-24`` of ``‖x‖``, :func:`_sum_sq_f32`; a division within 2 ulp) then lies within
    ``2^-21 + 2^-24 + 2^-22 + 2^-23 < 2^-19.9`` of the oracle's float64 quotient: inside the
    ``2^-19`` that :func:`_f16_unsure` assumes. 1.0 where the sum is 0 (as the oracle)."""
    c = cs.to(tl.float32)
    for j in tl.static_range(LB):
        c = c + _bfly(c, lane * 0 + (1 << j))
    return tl.where(c > 0, tl.sqrt_rn(c), 1.0)


@triton.jit
def _centroid_norm_f64(cs, lane, LB: tl.constexpr):
    """‖c‖ in float64 from each lane's float64 sum ``cs`` (a butterfly over the group, every lane
    the same bits; the oracle's value); 1.0 where the sum is 0."""
    cn = tl.sqrt(_group_sum64(cs, lane, LB))
    return tl.where(cn > 0, cn, 1.0)


@triton.jit
def _f16_unsure(r):
    """Whether a float32 ``r`` within ``2^-19`` (relative) of a float64 value ``ρ`` may not
    decide ``ρ``'s float16 bytes (nearest-even, clamped at 65504) or ``ρ > 65504``: the ends of
    ``[r·(1 − 2^-18), r·(1 + 2^-18)]`` (which holds ρ, the products' own rounding far below the
    slack) round to different float16 values, or straddle 65504."""
    lo = r * (1.0 - 2.0**-18)
    hi = r * (1.0 + 2.0**-18)
    lo_b = f32_to_f16_sat(lo, False).to(tl.int16, bitcast=True)
    hi_b = f32_to_f16_sat(hi, False).to(tl.int16, bitcast=True)
    return (lo_b != hi_b) | ((lo <= 65504.0) & (hi > 65504.0))


@triton.jit
def _f16_bits(v, SIGNED: tl.constexpr):
    """The stored bytes (int64, low 16 bits) of a float32 ``v`` as a float16 field: ``f32_to_f16_sat``."""
    return f32_to_f16_sat(v, SIGNED).to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF


@triton.jit
def _read_f32(ptr, off, p, E: tl.constexpr):
    """Elements ``E·p ..`` of a float32 vector at element offset ``off`` (8-byte aligned), read as
    ``E/2`` int64 words."""
    xs = ()
    a = (ptr + off + E * p).to(tl.pointer_type(tl.int64))
    for i in tl.static_range(E // 2):
        w = tl.load(a + i)
        xs = xs + ((w & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True),
                   (w >> 32).to(tl.int32).to(tl.float32, bitcast=True))
    return xs


@triton.jit
def _norm_f64(xs, mus, lane, HAS_MU: tl.constexpr, E: tl.constexpr, LB: tl.constexpr):
    """The vector's norm in float64 (exact squares and sum: every lane gets the oracle's bits)."""
    ss = lane.to(tl.float64) * 0.0
    for e in tl.static_range(E):
        x64 = xs[e].to(tl.float64)
        if HAS_MU:
            x64 = x64 - mus[e].to(tl.float64)
        ss += x64 * x64
    return tl.sqrt(_group_sum64(ss, lane, LB))


@triton.jit
def _lm_codes(ys, scale, bnd, bnd_ptr, BITS: tl.constexpr, E: tl.constexpr, SYM: tl.constexpr):
    """Lloyd-Max codes of ``ys[e] · scale`` for the lane's E elements (a tuple)."""
    codes = ()
    for e in tl.static_range(E):
        if SYM:
            codes = codes + (_sym_codes(ys[e] * scale, bnd, BITS),)
        else:
            codes = codes + (_lloyd_max_codes(ys[e] * scale, bnd_ptr, BITS),)
    return codes


@triton.jit
def _rescaled_codes(ys, n64, c, bnd, bnd_ptr, BITS: tl.constexpr, E: tl.constexpr, SYM: tl.constexpr,
                    ROTATED: tl.constexpr):
    """:func:`_lm_codes` of ``ys`` over the float64 norm ``n64`` (times ``c`` where ``ROTATED``) for norms
    outside [2^-50, 2^50] too: such a vector's ``ys`` take 2^64 (norm below) or 2^-64 (above), exact,
    and the scale ``c / (n64 · 2^±64)`` stays inside float32's normal range."""
    ysc = tl.where(n64 < 2.0**-50, 2.0**64, tl.where(n64 > 2.0**50, 2.0**-64, 1.0))
    cs = c.to(tl.float64) if ROTATED else 1.0
    scale = tl.where(n64 > 0, cs / tl.where(n64 > 0, n64 * ysc, 1.0), 0.0).to(tl.float32)
    ysc32 = ysc.to(tl.float32)
    zs = ()
    for e in tl.static_range(E):
        zs = zs + (ys[e] * ysc32,)
    return _lm_codes(zs, scale, bnd, bnd_ptr, BITS, E, SYM)


@triton.jit
def _encode(xs, mus, fin, zchunk, c, row, h, ok, lane, p, bnd, bnd_ptr, cen_ptr, HAS_MU: tl.constexpr,
            IN_BF16: tl.constexpr, E: tl.constexpr, L: tl.constexpr, LB: tl.constexpr, HW_FP8: tl.constexpr,
            ALIGNED: tl.constexpr, SYM: tl.constexpr, S: tl.constexpr):
    """Encode one side (``S``) of the warp's vector ``xs`` (E float32 per lane, already multiplied
    by the rotation's signs where ``S.ROTATED``; ``mus`` likewise) into the row ``row``; a vector
    that is not finite (``fin`` false) is written as the zero vector (its codes' chunk ``zchunk``,
    zero norm or bounds). Returns the SATURATED bit where set (int32 per lane)."""
    KIND: tl.constexpr = S.KIND
    BITS: tl.constexpr = S.BITS
    PB: tl.constexpr = 2 + 2 * S.PARAM_DTYPE
    field = row + S.A_OFF + h * S.A_STRIDE
    first = ok & (p == 0)
    ys = xs
    if HAS_MU:
        ys = ()
        for e in tl.static_range(E):
            ys = ys + (xs[e] - mus[e],)
    d32 = ys  # fl(x − μ) before the rotation: the float32 norm's terms (_sum_sq_f32's 17u bound)
    NORM32: tl.constexpr = S.PARAM_DTYPE == DT_F16
    if KIND == KIND_LLOYD_MAX:  # the norm's sum first: with a key offset it decides the scale below
        if NORM32:
            ss = _sum_sq_f32(d32, lane, E, LB)
        else:
            n = tl.where(fin, _norm_f64(xs, mus, lane, HAS_MU, E, LB), 0.0)  # the norm bytes equal the oracle's
    if S.ROTATED:
        if IN_BF16:
            # bf16 elements reach 2^128, so the unnormalised transform's sums of D of them overflow
            # float32: the elements are scaled by 2^-16 first and c by 2^16 (session 78). Exact
            # without a key offset: bf16 values are multiples of 2^-133, and so is every partial sum
            # (below 2^-110 it needs at most 23 bits, and above it rounds alike at either scale), so
            # each scaled sum is the sum times 2^-16. fl(x − μ) has no such grain: with a key offset
            # only vectors of ‖x − μ‖ above 2^50 are scaled (a Lloyd-Max side's own norm sum decides;
            # other sides, custom formats only, a butterfly max of |x − μ| from 2^50), where an
            # element's rounding at 2^-149 is below 2^-183 of the norm
            sc = 2.0**-16
            cm = 65536.0
            if HAS_MU:
                if KIND == KIND_LLOYD_MAX:
                    if NORM32:
                        big = ss > 2.0**100  # (inf too)
                    else:
                        big = n > 2.0**50
                else:
                    m = tl.abs(ys[0])
                    for e in tl.static_range(1, E):
                        m = tl.maximum(m, tl.abs(ys[e]))
                    _, m = _group_min_max(m, m, lane, LB)  # (its min unused: pure shuffles, dropped)
                    big = m >= 2.0**50
                sc = tl.where(big, 2.0**-16, 1.0)
                cm = tl.where(big, 65536.0, 1.0)
            zs = ()
            for e in tl.static_range(E):
                zs = zs + (ys[e] * sc,)
            ys = _fwht(zs, lane, E, LB)
            c = c * cm
        else:
            ys = _fwht(ys, lane, E, LB)  # c = |Π[0, 0]| applied below
    if KIND == KIND_LLOYD_MAX:
        # float16 norms from a float32 sum of squares (of fl(x − μ) with a key offset: 17u),
        # decided by its error bound or recomputed in float64 for the warp (rare); float32 norms
        # need the float64 sum (docstring)
        STORED: tl.constexpr = S.NORM_CORRECTION == NC_STORED
        # bf16 rows with ‖x − μ‖ outside [2^-50, 2^50] (rare): the warp's norms from float64 and, as c/‖x − μ‖
        # may leave float32's range there (subnormal rows: down to 2^-133), codes of y·2^∓64 (_rescaled_codes).
        # fp16 rows: ‖x − μ‖ is 0 or in [2^-126, 2^121] (docstring)
        if NORM32:
            n = tl.where(fin, tl.sqrt_rn(ss), 0.0)
            inv = tl.where(n > 0, 1.0 / tl.where(n > 0, n, 1.0), 0.0)
            codes = _lm_codes(ys, inv * c if S.ROTATED else inv, bnd, bnd_ptr, BITS, E, SYM)
            if IN_BF16:  # (squares beyond float32's range)
                if tl.max((((ss < 2.0**-100) | (ss > 2.0**100)) & fin).to(tl.int32), axis=0) > 0:
                    n64 = tl.where(fin, _norm_f64(xs, mus, lane, HAS_MU, E, LB), 0.0)
                    n = n64.to(tl.float32)
                    codes = _rescaled_codes(ys, n64, c, bnd, bnd_ptr, BITS, E, SYM, S.ROTATED)
        else:
            inv = tl.where(n > 0, 1.0 / tl.where(n > 0, n, 1.0), 0.0).to(tl.float32)
            codes = _lm_codes(ys, inv * c if S.ROTATED else inv, bnd, bnd_ptr, BITS, E, SYM)
            if IN_BF16:
                if tl.max((((n < 2.0**-50) | (n > 2.0**50)) & fin).to(tl.int32), axis=0) > 0:
                    codes = _rescaled_codes(ys, n, c, bnd, bnd_ptr, BITS, E, SYM, S.ROTATED)
        chunk = _where_chunk(fin, _chunk(codes, BITS, E), zchunk, BITS * E)
        _write_chunks(field, chunk, lane, p, ok, BITS * E, S.A_BYTES, L, ALIGNED)
        cn = 1.0
        cs = 0.0
        if STORED:  # the stored norm is ‖x‖ / ‖centroids of the codes‖: the lane's sum in float64
            cs = lane.to(tl.float64) * 0.0
            for e in tl.static_range(E):
                ce = tl.load(cen_ptr + codes[e])
                cs += ce * ce
            if NORM32:  # then float32 across the lanes (_centroid_norm_f32's bound)
                cn = _centroid_norm_f32(cs, lane, LB)
            else:
                cn = _centroid_norm_f64(cs, lane, LB)
        if NORM32:
            r = n / cn if STORED else n  # within 2^-19 of the oracle's (_centroid_norm_f32)
            nbits = _f16_bits(r, False)
            sat = r > 65504.0
            if tl.max((_f16_unsure(r) & fin).to(tl.int32), axis=0) > 0:  # rare: float64
                cn64 = _centroid_norm_f64(cs, lane, LB) if STORED else 1.0
                r64 = tl.where(fin, _norm_f64(xs, mus, lane, HAS_MU, E, LB), 0.0) / cn64
                nbits = f64_to_bits(r64, S.PARAM_DTYPE)
                sat = _saturates(r64, S.PARAM_DTYPE)
        else:
            r64 = n / cn
            nbits = f64_to_bits(r64, S.PARAM_DTYPE)
            sat = _saturates(r64, S.PARAM_DTYPE)
        store_bytes(row + S.B_OFF + h * S.B_STRIDE, nbits, PB, first)
        err = tl.where(ok & fin & sat, _ERR_SATURATED, 0)
    elif KIND == KIND_FP8:
        if S.ROTATED:
            zs = ()
            for e in tl.static_range(E):
                zs = zs + (ys[e] * c,)
            ys = zs
        codes = ()
        big = lane < 0
        for e in tl.static_range(E):
            big = big | (tl.abs(ys[e]) > 448.0)
            if HW_FP8:  # cvt.rn.satfinite: beyond ±448 the largest finite value, as clamping first gives
                q = ys[e].to(tl.float8e4nv, fp_downcast_rounding="rtne")
                codes = codes + (q.to(tl.uint8, bitcast=True),)
            else:
                codes = codes + (f32_to_fp8e4m3_bits(ys[e]).to(tl.uint8),)
        _write_chunks(field, _where_chunk(fin, _chunk(codes, 8, E), zchunk, 8 * E), lane, p, ok, 8 * E, S.A_BYTES, L,
                      ALIGNED)
        err = tl.where(ok & fin & big, _ERR_SATURATED, 0)
    else:  # KIND_UNIFORM (asymmetric; unrotated with a key offset is not eligible)
        if S.ROTATED:
            zs = ()
            for e in tl.static_range(E):
                zs = zs + (ys[e] * c,)
            ys = zs
        lo = ys[0]
        hi = ys[0]
        for e in tl.static_range(1, E):
            lo = tl.minimum(lo, ys[e])
            hi = tl.maximum(hi, ys[e])
        lo, hi = _group_min_max(lo, hi, lane, LB)
        lo = tl.where(fin, lo, 0.0)  # the zero vector's bounds; its codes are zchunk's
        hi = tl.where(fin, hi, 0.0)
        F32: tl.constexpr = not IN_BF16 and not HAS_MU  # (|y| ≤ 2^16·√D: hi − lo stays far inside float32)
        codes = _uniform_codes(ys, lo, hi, BITS, E, F32, F32 and not S.ROTATED)
        _write_chunks(field, _where_chunk(fin, _chunk(codes, BITS, E), zchunk, BITS * E), lane, p, ok, BITS * E,
                      S.A_BYTES, L, ALIGNED)
        if not HAS_MU and S.PARAM_DTYPE == DT_F16:
            # the scale's float16 bytes from a float32 quotient within 5u of the oracle's float64
            # (fl32(hi − lo), div.full's 2 ulp), decided by _f16_unsure (the floor's 1e-8 and its
            # float32 neighbour both round to float16 0; a bf16 span beyond float32's range gives
            # inf: 65504 and SATURATED, as the oracle's); the zero is lo (a float32 value) rounded
            # once by the hardware after clamping to ±65504, as f64_to_bits rounds it
            sc = tl.maximum((hi - lo) / ((1 << BITS) - 1), 1e-8)
            sbits = _f16_bits(sc, False)
            sat = sc > 65504.0
            if tl.max((_f16_unsure(sc) & ok).to(tl.int32), axis=0) > 0:  # rare: float64
                scale = tl.maximum((hi.to(tl.float64) - lo.to(tl.float64)) / ((1 << BITS) - 1), 1e-8)
                sbits = f64_to_bits(scale, DT_F16)
                sat = _saturates(scale, DT_F16)
            zbits = _f16_bits(lo, True)
            sat = sat | (tl.abs(lo) > 65504.0)
        else:
            lo64 = lo.to(tl.float64)
            scale = tl.maximum((hi.to(tl.float64) - lo64) / ((1 << BITS) - 1), 1e-8)
            sbits = f64_to_bits(scale, S.PARAM_DTYPE)
            zbits = f64_to_bits(lo64, S.PARAM_DTYPE)
            sat = _saturates(scale, S.PARAM_DTYPE) | _saturates(lo64, S.PARAM_DTYPE)
        store_bytes(row + S.B_OFF + h * S.B_STRIDE, sbits, PB, first)
        store_bytes(row + S.C_OFF + h * S.C_STRIDE, zbits, PB, first)
        err = tl.where(ok & sat, _ERR_SATURATED, 0)
    return err


@triton.jit
def _side_tables(bnd_ptr, S: tl.constexpr, SYM: tl.constexpr, lane, E: tl.constexpr):
    """Per program, for one side: its positive boundaries (a symmetric Lloyd-Max table, else
    ``()``) and the chunk of the zero vector's codes (Lloyd-Max: the code of 0; else 0)."""
    bnd = ()
    if S.KIND == KIND_LLOYD_MAX:
        zero = lane.to(tl.float32) * 0.0
        if SYM:
            bnd = _half_bounds(bnd_ptr, S.BITS)
            z = _sym_codes(zero, bnd, S.BITS)
        else:
            z = _lloyd_max_codes(zero, bnd_ptr, S.BITS)
        zs = ()
        for e in tl.static_range(E):
            zs = zs + (z,)
        zchunk = _chunk(zs, S.BITS, E)
    else:
        zchunk = _zero_chunk(lane, 8 * E if S.KIND == KIND_FP8 else S.BITS * E)
    return bnd, zchunk


@triton.jit
def _store_warp_kernel(
    key_ptr, value_ptr, slot_ptr, cache_ptr, rot_ptr, kb_ptr, kc_ptr, vb_ptr, vc_ptr, mu_ptr, err_ptr,
    num_tokens, num_slots, stride_kt, stride_kh, stride_vt, stride_vh,
    HAS_MU: tl.constexpr, IN_BF16: tl.constexpr, H: tl.constexpr, WARPS: tl.constexpr, ITERS: tl.constexpr,
    L: tl.constexpr, ROTATE: tl.constexpr, K_ALIGNED: tl.constexpr, V_ALIGNED: tl.constexpr,
    HW_FP8: tl.constexpr, D: tl.constexpr, ROW_BYTES: tl.constexpr, PAD_OFF: tl.constexpr,
    PAD_STRIDE: tl.constexpr, PAD_BYTES: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    K_SYM: tl.constexpr, V_SYM: tl.constexpr,
):
    NT: tl.constexpr = 32 * WARPS
    E: tl.constexpr = D // L  # elements per lane
    LB: tl.constexpr = (L > 1) + (L > 2) + (L > 4) + (L > 8) + (L > 16)  # log2(L)
    VPI: tl.constexpr = NT // L  # vectors per program and iteration
    t_ = tl.arange(0, NT)
    lane = t_ % 32
    p = t_ % L  # this lane's place in its vector's L lanes
    # the rotation's signs s_i = sign(Π[i, 0]) of this lane's elements (as sign-bit words, and as
    # floats for μ) and c = |Π[0, 0]| = 1/√D
    smask = ()
    c = 1.0
    if ROTATE:
        smask = _sign_words(rot_ptr, p, E, D)
        c = tl.abs(tl.load(rot_ptr))
    kbnd, kzero = _side_tables(kb_ptr, K, K_SYM, lane, E)
    vbnd, vzero = _side_tables(vb_ptr, V, V_SYM, lane, E)
    err = lane * 0
    v = tl.program_id(0) * (ITERS * VPI) + t_ // L
    t = v // H
    h = v % H
    koff, slot, ok, past = _vector(t, num_tokens, h, slot_ptr, num_slots, stride_kt, stride_kh)
    kw = _read(key_ptr, koff, p, ok, E)
    vw = _read(value_ptr, t.to(tl.int64) * stride_vt + h * stride_vh, p, ok, E)
    for i in range(ITERS):
        # the next vector's reads go out before this one is encoded
        v_n = v + VPI
        t_n = v_n // H
        h_n = v_n % H
        koff_n, slot_n, ok_n, past_n = _vector(t_n, num_tokens, h_n, slot_ptr, num_slots, stride_kt, stride_kh)
        ok_n = ok_n & (i + 1 < ITERS)
        past_n = past_n & (i + 1 < ITERS)
        kw_n = _read(key_ptr, koff_n, p, ok_n, E)
        vw_n = _read(value_ptr, t_n.to(tl.int64) * stride_vt + h_n * stride_vh, p, ok_n, E)

        err = err | tl.where(past, _ERR_SLOT, 0)
        row = cache_ptr + slot * ROW_BYTES
        kfin = _finite(kw, lane, E, LB, IN_BF16)
        vfin = _finite(vw, lane, E, LB, IN_BF16)
        err = err | tl.where(ok & ~(kfin & vfin), _ERR_NONFINITE, 0)
        if K.ROTATED:
            kw = _xor(kw, smask)
        if V.ROTATED:
            vw = _xor(vw, smask)
        ks = _unpack(kw, E, IN_BF16)
        vs = _unpack(vw, E, IN_BF16)
        mus = ()
        if HAS_MU:
            mus = _read_f32(mu_ptr, h * D, p, E)
        err = err | _encode(ks, mus, kfin, kzero, c, row, h, ok, lane, p, kbnd, kb_ptr, kc_ptr, HAS_MU, IN_BF16, E,
                            L, LB, HW_FP8, K_ALIGNED, K_SYM, K)
        err = err | _encode(vs, mus, vfin, vzero, c, row, h, ok, lane, p, vbnd, vb_ptr, vc_ptr, False, IN_BF16, E,
                            L, LB, HW_FP8, V_ALIGNED, V_SYM, V)
        if PAD_BYTES > 0:
            for k in tl.static_range(0, PAD_BYTES, L):
                tl.store(row + PAD_OFF + h * PAD_STRIDE + k + p, tl.zeros_like(lane).to(tl.uint8),
                         mask=ok & (k + p < PAD_BYTES))
        v = v_n
        h = h_n
        slot = slot_n
        ok = ok_n
        past = past_n
        kw = kw_n
        vw = vw_n
    e_all = tl.reduce(err, 0, _or)
    tl.atomic_or(err_ptr, e_all, mask=e_all != 0, sem="relaxed")
