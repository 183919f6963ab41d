"""Per-lane building blocks of the warp store kernel (:mod:`tqkern.ops.store.warp`; GPU only):
inline-PTX lane exchange and group reductions, the reads and finiteness of a lane's 16-bit words,
the rotation's sign words and in-register Walsh–Hadamard transform, the half-table Lloyd-Max
search (from :mod:`tqkern.ops.fields`), uniform codes (a float32 estimate, checked), and the
packing and writing of a lane's code chunk. Every tensor holds one value per thread, ``L`` lanes
per vector (the kernel's docstring says how lanes map to vectors)."""

from __future__ import annotations

import triton
import triton.language as tl

from tqkern.ops.fields import half_bounds as _half_bounds, symmetric_codes as _sym_codes

__all__ = [
    "_bfly", "_bfly64", "_lane_of64", "_lane_of", "_group_sum64", "_group_min_max", "_group_all", "_or",
    "_finite", "_sign_words", "_half_bounds", "_sym_codes", "_read", "_unpack",
    "_vector", "_fwht", "_xor", "_chunk", "_zero_chunk", "_where_chunk", "_store16", "_write_chunks",
    "_uniform_codes",
]


# -- lane exchange (inline PTX; every lane of the warp executes each) ---------------------------
def _shfl64_asm(mode: str) -> str:
    """PTX moving the 64-bit ``$1`` from the lane that ``shfl.sync.{mode}`` with ``$2`` names into
    ``$0`` (two 32-bit shuffles)."""
    return ("{\n.reg .b32 lo, hi;\nmov.b64 {lo, hi}, $1;\n"
            f"shfl.sync.{mode}.b32 lo, lo, $2, 0x1f, -1;\nshfl.sync.{mode}.b32 hi, hi, $2, 0x1f, -1;\n"
            "mov.b64 $0, {lo, hi};\n}")


_BFLY64_ASM = tl.constexpr(_shfl64_asm("bfly"))
_IDX64_ASM = tl.constexpr(_shfl64_asm("idx"))


@triton.jit
def _bfly(x, m):
    """float32 ``x`` of lane ``l ^ m``."""
    return tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, $2, 0x1f, -1;", "=f,f,r", [x, m],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _bfly64(x, m):
    """float64 ``x`` of lane ``l ^ m``."""
    return tl.inline_asm_elementwise(_BFLY64_ASM, "=d,d,r", [x, m], dtype=tl.float64, is_pure=True, pack=1)


@triton.jit
def _lane_of64(x, src):
    """uint64 ``x`` of lane ``src`` (0..31)."""
    return tl.inline_asm_elementwise(_IDX64_ASM, "=l,l,r", [x, src], dtype=tl.uint64, is_pure=True, pack=1)


@triton.jit
def _lane_of(x, src):
    """uint32 ``x`` of lane ``src`` (0..31)."""
    return tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;", "=r,r,r", [x, src],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _group_sum64(x, lane, LB: tl.constexpr):
    """Sum over the 2^LB lanes of a vector (butterfly: every lane gets the same bits)."""
    for j in tl.static_range(LB):
        x = x + _bfly64(x, lane * 0 + (1 << j))
    return x


@triton.jit
def _group_min_max(lo, hi, lane, LB: tl.constexpr):
    for j in tl.static_range(LB):
        m = lane * 0 + (1 << j)
        lo = tl.minimum(lo, _bfly(lo, m))
        hi = tl.maximum(hi, _bfly(hi, m))
    return lo, hi


@triton.jit
def _group_all(ok, lane, LB: tl.constexpr):
    """Whether ``ok`` holds on every lane of the vector (a butterfly min of 0/1)."""
    a = ok.to(tl.float32)
    for j in tl.static_range(LB):
        a = tl.minimum(a, _bfly(a, lane * 0 + (1 << j)))
    return a > 0


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _finite(words, lane, E: tl.constexpr, LB: tl.constexpr, IN_BF16: tl.constexpr):
    """Whether every element of the vector whose lane words (:func:`_read`) these are is finite,
    on the raw 16-bit values: ``t = ~w & EXP`` (the exponent bits of each element, complemented)
    is zero in an element's 16 bits exactly when they are all set (inf or NaN), and
    ``(t − 0x0001…0001) & 0x8000…8000`` marks those (t's elements lie below 0x8000 and are
    multiples of 0x80 where not zero, so no borrow reaches a nonzero element's top bit)."""
    EXP: tl.constexpr = 0x7F807F807F807F80 if IN_BF16 else 0x7C007C007C007C00
    bad = words[0] * 0
    for i in tl.static_range(len(words)):
        t = ~words[i] & EXP
        bad = bad | ((t - 0x0001000100010001) & -0x7FFF7FFF7FFF8000)  # -0x7FFF...8000 = 0x8000800080008000
    if E == 2:  # one int32 word, sign-extended: its two elements only
        bad = bad & 0x80008000
    return _group_all(bad == 0, lane, LB)


@triton.jit
def _sign_words(rot_ptr, p, E: tl.constexpr, D: tl.constexpr):
    """The lane's words of sign bits: bit ``16·k + 15`` of word ``i`` set where
    ``Π[E·p + 4·i + k, 0] < 0`` (XOR with a word of :func:`_read` multiplies those elements by
    ``s_i``, exactly, for fp16 and bf16 alike)."""
    NW: tl.constexpr = (E + 3) // 4
    KW: tl.constexpr = 4 if E >= 4 else E
    words = ()
    for i in tl.static_range(NW):
        w = p.to(tl.int64) * 0
        for k in tl.static_range(KW):
            neg = tl.load(rot_ptr + (E * p + 4 * i + k) * D) < 0
            w = w | tl.where(neg, 1 << (16 * k + 15), 0).to(tl.int64)
        words = words + (w,)
    return words


# -- reads ---------------------------------------------------------------------------------------
@triton.jit
def _read(ptr, off, p, ok, E: tl.constexpr):
    """Elements ``E·p ..`` of one vector (element offset ``off``) as integer words (int64; one
    int32 for E = 2)."""
    if E == 2:
        w = tl.load((ptr + off + 2 * p).to(tl.pointer_type(tl.int32)), mask=ok, other=0)
        return (w.to(tl.int64),)
    words = ()
    a = (ptr + off + E * p).to(tl.pointer_type(tl.int64))
    for i in tl.static_range(E // 4):
        words = words + (tl.load(a + i, mask=ok, other=0),)
    return words


@triton.jit
def _unpack(words, E: tl.constexpr, IN_BF16: tl.constexpr):
    """The E float32 elements of :func:`_read`'s words."""
    DT: tl.constexpr = tl.bfloat16 if IN_BF16 else tl.float16
    xs = ()
    for e in tl.static_range(E):
        w = words[e // 4]
        xs = xs + (((w >> (16 * (e % 4))) & 0xFFFF).to(tl.int16).to(DT, bitcast=True).to(tl.float32),)
    return xs


@triton.jit
def _vector(t, num_tokens, h, slot_ptr, num_slots, stride_t, stride_h):
    """(element offset of the vector in its tensor, slot, vector written, slot too large)."""
    live = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=live, other=-1).to(tl.int64)
    ok = live & (slot >= 0) & (slot < num_slots)
    return t.to(tl.int64) * stride_t + h * stride_h, tl.where(ok, slot, 0), ok, live & (slot >= num_slots)


# -- encoding ------------------------------------------------------------------------------------
@triton.jit
def _fwht(xs, lane, E: tl.constexpr, LB: tl.constexpr):
    """The unnormalised Walsh–Hadamard transform of a vector (element ``E·p + e`` in ``xs[e]`` of
    its lane ``p``, ``2^LB`` lanes): ``Σ_i x_i·(−1)^popcount(i & j)`` in float32, in place."""
    LOG_E: tl.constexpr = (E > 1) + (E > 2) + (E > 4) + (E > 8) + (E > 16)
    for b in tl.static_range(LOG_E):
        ys = ()
        for e in tl.static_range(E):
            if (e & (1 << b)) == 0:
                ys = ys + (xs[e] + xs[e + (1 << b)],)
            else:
                ys = ys + (xs[e - (1 << b)] - xs[e],)
        xs = ys
    for j in tl.static_range(LB):
        m = lane * 0 + (1 << j)
        sgn = tl.where((lane & (1 << j)) != 0, -1.0, 1.0)
        ys = ()
        for e in tl.static_range(E):
            ys = ys + (_bfly(xs[e], m) + sgn * xs[e],)
        xs = ys
    return xs


@triton.jit
def _scaled_diff(y, h, lo_h, F32: tl.constexpr):
    """fl32(y·h − lo_h) for lo_h = fl32(lo·h): y − lo itself where ``F32`` (h = 1)."""
    if F32:
        return y - lo_h
    else:
        return tl.fma(y, h, -lo_h)


@triton.jit
def _uniform_codes(ys, lo, hi, BITS: tl.constexpr, E: tl.constexpr, F32: tl.constexpr, F32_FLOOR: tl.constexpr):
    """⌊(y − lo)·(2^b − 1)/(hi − lo) + 1/2⌋ per element (÷1e-8 where the scale is floored): the
    tile kernel's float32 estimate and proof (:func:`tqkern.ops.fields._uniform_codes_f32`);
    if the proof fails for any element of the warp, every element's estimate q is decided by one of
    the oracle's two exact float64 comparisons (:func:`tqkern.ops.quantize.reference._uniform_codes`),
    the one at the boundary nearer t: q + 1 where t ≥ q and ``(q + 1/2)·den ≤ num``, q − 1 where t < q
    and ``(q − 1/2)·den > num`` (since session 78; both before). The farther comparison cannot hold:
    t lies within 7u·(2^b − 1) of the quotient τ, so t ≥ q puts τ above q − 1/2, and t < q below
    q + 1/2; where τ lies near q itself neither holds, whichever side t says. The codes stay in
    [0, 2^b − 1] (τ does), as the oracle's clamp leaves them.
    The scale is floored where ``hi − lo < fl(1e-8·(2^b − 1))``, exactly the oracle's
    ``fl(span/(2^b − 1)) < 1e-8`` (a correctly rounded quotient is monotone in ``span``, and that
    product is the least float64 span it floors for b ≤ 8: ``tests/test_store_warp_float32.py``).
    ``F32`` (fp16 rows without a key offset: ``hi − lo`` below 2^22): the ratio r is
    ``div.full.f32(2^b − 1, fl32(hi − lo))`` (within 5u of the quotient, u = 2^-24) instead of a
    float64 division rounded to float32; t = fl(fl(y − lo)·r) then lies within 7u·(2^b − 1)
    < (2^b − 1)·2^-20 of the exact quotient, inside the proof's margin. Otherwise (bf16 rows) spans
    from 2^120 take t = fl(y·2^-8 − lo·2^-8)·fl32(2^8·r), as y − lo may overflow float32 (lo·2^-8
    loses at most 2^-150, far inside the margin). ``F32_FLOOR`` (``F32`` on an
    unrotated side: hi and lo are float16 values, so hi − lo is a multiple of 2^-24, none of which
    lies within 0.16·2^-24 of the threshold T for b ≤ 8): the floor from ``fl32(hi − lo) < fl32(T)``,
    the same decision (rounding is monotone, and T's float32 neighbours are nearer to it than
    that). int32 codes."""
    levels: tl.constexpr = (1 << BITS) - 1
    tol: tl.constexpr = 0.5 - levels * 2.0**-20
    magic: tl.constexpr = 12582912.0
    if F32_FLOOR:
        floored = hi - lo < 1e-8 * levels
    else:
        floored = hi.to(tl.float64) - lo.to(tl.float64) < 1e-8 * levels  # (the span is exact in float64)
    if F32:
        r = tl.where(floored, 1e8, levels / tl.where(floored, 1.0, hi - lo))
        h = 1.0
    else:  # from spans of 2^120 (bf16 rows) y − lo may overflow float32: both scaled by h = 2^-8 first
        span = hi.to(tl.float64) - lo.to(tl.float64)
        big = span >= 2.0**120
        r = (tl.where(floored, 1e8, levels / tl.where(floored, 1.0, span)) * tl.where(big, 256.0, 1.0)).to(tl.float32)
        h = tl.where(big, 2.0**-8, 1.0).to(tl.float32)
    lo_h = lo * h
    codes = ()
    worst = lo * 0.0
    for e in tl.static_range(E):
        t = _scaled_diff(ys[e], h, lo_h, F32) * r
        s = t + magic
        worst = tl.maximum(worst, tl.abs(t - (s - magic)))
        codes = codes + (s.to(tl.int32, bitcast=True) - 0x4B400000,)
    if tl.max(worst, axis=0) >= tol:  # exact ties (frequent for bf16 inputs) or near them
        lo64 = lo.to(tl.float64)
        den = tl.where(floored, 1e-8, hi.to(tl.float64) - lo64)
        exact = ()
        for e in tl.static_range(E):
            d = ys[e].to(tl.float64) - lo64
            num = tl.where(floored, d, d * levels)
            q = codes[e]
            # t again (the same operations): kept from the loop above it would hold E more registers
            # across the hot path for a branch taken by a minority of iterations
            up = _scaled_diff(ys[e], h, lo_h, F32) * r >= q.to(tl.float32)
            x = (q.to(tl.float64) + tl.where(up, 0.5, -0.5)) * den - num
            q = q + tl.where(up, (x <= 0).to(tl.int32), -((x > 0).to(tl.int32)))
            exact = exact + (q,)
        codes = exact
    return codes


@triton.jit
def _xor(words, masks):
    out = ()
    for i in tl.static_range(len(words)):
        out = out + (words[i] ^ masks[i],)
    return out


@triton.jit
def _chunk(codes, BITS: tl.constexpr, E: tl.constexpr):
    """The lane's E codes (each below 2^BITS) as one LSB-first chunk of BITS·E bits: a uint32, a
    uint64 past 32 bits, a tuple of uint32 words past 64 (whole 16-bit words: the planner's
    condition). Built from 32-bit words by shifted adds (one instruction per code and word)."""
    CB: tl.constexpr = BITS * E
    NW: tl.constexpr = (CB + 31) // 32
    words = ()
    for i in tl.static_range(NW):
        acc = codes[0].to(tl.uint32) * 0
        for e in tl.static_range(E):
            if (BITS * e < 32 * i + 32) and (BITS * e + BITS > 32 * i):  # code e overlaps word i
                if BITS * e >= 32 * i:
                    acc = acc + (codes[e].to(tl.uint32) << (BITS * e - 32 * i))
                else:
                    acc = acc + (codes[e].to(tl.uint32) >> (32 * i - BITS * e))
        words = words + (acc,)
    if CB > 64:
        w = words
    elif CB > 32:
        w = (words[1].to(tl.uint64) << 32) | words[0].to(tl.uint64)
    else:
        w = words[0]
    return w


@triton.jit
def _zero_chunk(lane, CB: tl.constexpr):
    """A chunk of CB zero bits (:func:`_chunk`'s type)."""
    z = (lane * 0).to(tl.uint32)
    if CB > 64:
        w = ()
        for i in tl.static_range((CB + 31) // 32):
            w = w + (z,)
    elif CB > 32:
        w = z.to(tl.uint64)
    else:
        w = z
    return w


@triton.jit
def _where_chunk(cond, a, b, CB: tl.constexpr):
    """``a`` where ``cond``, else ``b``, for chunks of CB bits."""
    if CB > 64:
        w = ()
        for i in tl.static_range((CB + 31) // 32):
            w = w + (tl.where(cond, a[i], b[i]),)
    else:
        w = tl.where(cond, a, b)
    return w


@triton.jit
def _store16(ptr, j, bits, mask, ALIGNED: tl.constexpr):
    """16-bit value ``bits`` at byte ``ptr + 2·j``."""
    if ALIGNED:
        tl.store(ptr.to(tl.pointer_type(tl.int16)) + j, bits.to(tl.int16), mask=mask)
    else:
        tl.store(ptr + 2 * j, (bits & 255).to(tl.uint8), mask=mask)
        tl.store(ptr + 2 * j + 1, ((bits >> 8) & 255).to(tl.uint8), mask=mask)


@triton.jit
def _write_chunks(field, w, lane, p, ok, CB: tl.constexpr, NBYTES: tl.constexpr, L: tl.constexpr,
                  ALIGNED: tl.constexpr):
    """Write a vector's LSB-first stream of CB-bit chunks (its lane p's at bit CB·p; its L lanes
    are ``lane − p ..``) as NBYTES bytes at ``field``."""
    if CB > 64:  # a tuple of 32-bit words, whole 16-bit words per lane
        for i in tl.static_range(CB // 16):
            _store16(field, (CB // 16) * p + i, ((w[i // 2] >> (16 * (i % 2))) & 0xFFFF), ok, ALIGNED)
    elif CB % 16 == 0:  # whole 16-bit words per lane
        for i in tl.static_range(CB // 16):
            _store16(field, (CB // 16) * p + i, ((w >> (16 * i)) & 0xFFFF).to(tl.uint32), ok, ALIGNED)
    elif CB == 8:
        tl.store(field + p, w.to(tl.uint8), mask=ok)
    else:  # 16-bit word j (lane p = j, then j − L, ...) from the lanes whose chunks overlap its bits
        MAXL: tl.constexpr = (16 + CB - 2) // CB + 1
        NH: tl.constexpr = NBYTES // 2
        SH: tl.constexpr = 63 if CB > 32 else 31
        for r in tl.static_range((NH + L - 1) // L):
            j = p + L * r
            first = (16 * j) // CB
            hw = w * 0
            for k in tl.static_range(MAXL):
                src = first + k
                if CB > 32:
                    part = _lane_of64(w, lane - p + tl.minimum(src, L - 1))
                else:
                    part = _lane_of(w, lane - p + tl.minimum(src, L - 1))
                off = src * CB - 16 * j  # where src's chunk starts, relative to bit 16j
                up = tl.minimum(tl.maximum(off, 0), SH).to(w.dtype)
                down = tl.minimum(tl.maximum(-off, 0), SH).to(w.dtype)
                part = tl.where(off >= 0, part << up, part >> down)
                hw = hw | tl.where(off < 16, part, 0)
            _store16(field, j, (hw & 0xFFFF).to(tl.uint32), ok & (j < NH), ALIGNED)
