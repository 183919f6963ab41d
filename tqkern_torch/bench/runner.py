"""Which presets and shapes a benchmark run covers (:func:`select`, no GPU), and the run (:func:`run`)."""

from __future__ import annotations

from typing import Optional, Sequence

from tqkern.layouts import is_format_name
from tqkern_torch.bench.report import SCHEMA, Progress
from tqkern_torch.bench.shapes import (DECODE_PRESETS, DECODE_SHAPES, MODEL_SHAPES, PREFILL_SHAPES, QUICK_SHAPES,
                                      STORE_SHAPES, ShapeHeadsError, decode_shape, prefill_shape, store_shape)

__all__ = ["OPS", "PRESETS", "select", "count_steps", "run"]

OPS = ("decode", "store", "decompress", "prefill", "all")
PRESETS = tuple(p for p, _ in DECODE_PRESETS)
_SHAPE_OF = {"decode": decode_shape, "store": store_shape, "decompress": store_shape, "prefill": prefill_shape}
_SHAPES = {"decode": DECODE_SHAPES, "store": STORE_SHAPES, "decompress": STORE_SHAPES, "prefill": PREFILL_SHAPES}


def _per_preset(op: str, shape, preset: str) -> int:
    """Timed variants of ``preset`` at ``shape``: prefill: prefill and int8_prefill, and past the
    short-row limit the soft-capped prefill; store: fp16 and bf16 input, and with Lloyd-Max keys
    a key offset; decompress: in the codec's space, and rotated back where a side is rotated;
    decode: one."""
    if op == "prefill":
        from tqkern_torch.short_rows import SHORT_QUERY_MAX

        return 2 + (shape.q_len > SHORT_QUERY_MAX)
    if op == "store":
        from tqkern_torch.bench.store import has_mu_variant

        return 2 + has_mu_variant(preset, shape.head_dim)
    if op == "decompress":
        from tqkern_torch.bench.decompress import has_rotated_side

        return 1 + has_rotated_side(preset, shape.head_dim)
    return 1


def select(op: str, presets: Optional[Sequence[str]] = None, shapes: Optional[Sequence[str]] = None,
           quick: bool = False) -> dict:
    """``{op: (presets, shapes)}`` for each op the run covers (``"all"``: decode, store, decompress,
    prefill; decompress runs at the store's shapes: the slots a store of that shape writes).

    ``presets`` default to every benchmark preset (any :meth:`tqkern.KVFormat.preset` name, the
    ``kXvYh`` family included, may be given); ``shapes`` to every named shape of each op
    (``quick``: two per op, :data:`~tqkern_torch.bench.shapes.QUICK_SHAPES`). A shape name goes to
    each op that knows it (decode also takes ad-hoc ``B<batch>x<tokens>K[_Hq<q>_Hkv<k>_D<d>]`` names, and ``models``:
    the model-shape table :data:`~tqkern_torch.bench.shapes.MODEL_SHAPES`).

    Raises:
        ValueError: an unknown op, preset or shape name (naming the argument and what it takes).
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    ops = ("decode", "store", "decompress", "prefill") if op == "all" else (op,)
    presets = PRESETS if presets is None else tuple(presets)
    unknown = [p for p in presets if p not in PRESETS and not is_format_name(p)]
    if unknown or not presets:
        raise ValueError(f"presets must be one or more of {', '.join(PRESETS)} or 'kXvYh' formats, "
                         f"got {list(presets)}")
    if shapes is None:
        chosen = {o: [_SHAPE_OF[o](n) for n in QUICK_SHAPES[o]] if quick else list(_SHAPES[o]) for o in ops}
    else:
        chosen = {o: [] for o in ops}
        for name in shapes:
            if name == "models" and "decode" in ops:
                chosen["decode"] += list(MODEL_SHAPES)
                continue
            hit = False
            for o in ops:
                try:
                    chosen[o].append(_SHAPE_OF[o](name))
                    hit = True
                except ShapeHeadsError:  # an ad-hoc decode shape with impossible heads: say which
                    raise
                except ValueError:
                    pass
            if not hit:
                known = [s.name for o in ops for s in (MODEL_SHAPES if o == "decode" else _SHAPES[o])]
                extra = " or B<batch>x<tokens>K[_Hq<q>_Hkv<k>_D<d>] or models" if "decode" in ops else ""
                raise ValueError(f"shapes must be among {', '.join(known)}{extra} (for {op}), got {name!r}")
    return {o: (presets, chosen[o]) for o in ops}


def count_steps(selection: dict, eager_shapes: Sequence = ()) -> int:
    """Progress steps of :func:`run`: a gate per preset and op, a timing per variant and shape."""
    n = 0
    for o, (presets, shapes) in selection.items():
        # (prefill, with presets: decompress-then-SDPA and out:<first preset>; store: copy_ beside
        # its baseline; decompress's baseline is copy_ itself)
        extra = 2 * (o == "prefill" and bool(presets)) + (o == "store")
        n += len(presets) + sum(1 + sum(_per_preset(o, s, p) for p in presets) + extra for s in shapes)
        if o == "prefill":  # SDPA's one-token decode (short shapes) or the fused kernel (long ones, with presets)
            from tqkern_torch.short_rows import SHORT_QUERY_MAX

            n += sum(s.q_len <= SHORT_QUERY_MAX or bool(presets) for s in shapes)
        if o == "decode":
            n += len(eager_shapes) * (1 + len(presets))
    return n


def _passed_at(gates, passed, shape) -> list:
    """The presets of ``passed`` whose decode gate at ``shape``'s own case (head geometry and
    attention options) did not fail."""
    from tqkern_torch.bench.decode import case_name, gate_head

    here = case_name(gate_head(shape))
    bad = {g["preset"] for g in gates if not g["ok"] and g["case"] == here}
    return [p for p in passed if p not in bad]


def _slot_gate_heads(shapes, base) -> tuple:
    """The store / decompress gate's ``(Hkv, D)`` cases: ``base`` (``store.GATE_HEADS``) and each
    timed shape's own (a plan at head_dim 256 is not the one at 128), in order, without repeats."""
    out = list(base)
    for s in shapes:
        if (s.num_kv_heads, s.head_dim) not in out:
            out.append((s.num_kv_heads, s.head_dim))
    return tuple(out)


def _slot_gate_passed(gates, passed, shape) -> list:
    """The presets of ``passed`` whose store / decompress gate at ``shape``'s own heads and
    head_dim did not fail (any variant of that case: with μ, rotated back)."""
    here = f"Hkv{shape.num_kv_heads}/D{shape.head_dim}"
    bad = {g["preset"] for g in gates if not g["ok"] and g["case"].split(" ")[0] == here}
    return [p for p in passed if p not in bad]


def _decode_gate_heads(shapes, base) -> tuple:
    """The decode gate's cases (:func:`~tqkern_torch.bench.decode.gate_head`): ``base``
    (``decode.GATE_HEADS``) and each timed shape's own (a kernel right at head_dim 128 may not be
    at 96, or with a soft-cap), in order, without repeats."""
    from tqkern_torch.bench.decode import gate_head

    out = list(base)
    for s in shapes:
        g = gate_head(s)
        if g not in out:
            out.append(g)
    return tuple(out)


def run(selection: dict, *, eager_shapes: Sequence[str] = (), quick: bool = False,
        progress: Optional[Progress] = None, timer=None) -> dict:
    """Gate, then time, every (op, preset, shape) of ``selection`` on the GPU; returns the report.

    A preset that fails its op's gate is not timed there (a decode, store or decompress gate at a
    timed shape's own case only: not at that shape). ``quick`` replays each graph for about
    25 ms instead of 100. ``timer(fn) -> µs`` replaces every runner's own (CUDA-graph replay,
    eager calls): :func:`~tqkern_torch.bench.timing.call_once` compiles without timing.
    A ``KeyboardInterrupt`` (``timeout -s INT``) ends the run early: the report then holds the
    gates and records of the shapes finished before it, and ``interrupted`` says where it stopped.
    """
    from tqkern_torch.bench import decode, decompress, prefill, store
    from tqkern_torch.bench.timing import TIMING, environment

    eager = [decode_shape(s) for s in eager_shapes]
    bar = progress or Progress(count_steps(selection, eager))
    rep_ms = 25 if quick else 100
    report = {"schema": SCHEMA, "environment": environment(), "timing": TIMING, "gate": [], "records": []}
    timed = {} if timer is None else {"timer": timer}
    where = "setup"
    try:
        for o, (presets, shapes) in selection.items():
            where = f"{o}'s gates"
            mod = {"decode": decode, "store": store, "decompress": decompress, "prefill": prefill}[o]
            gates = []
            if o == "decode":
                kw = {"heads": _decode_gate_heads(list(shapes) + eager, decode.GATE_HEADS)}
                base = {decode.case_name(h) for h in decode.GATE_HEADS}
            elif o in ("store", "decompress"):  # (their cases: "Hkv8/D128", "Hkv8/D128 mu", "... rotate_back")
                kw = {"heads": _slot_gate_heads(shapes, store.GATE_HEADS)}
                base = {f"Hkv{h}/D{d}" + x for h, d in store.GATE_HEADS for x in ("", " mu", " rotate_back")}
            else:
                kw, base = {}, None
            for p in presets:
                gates += mod.gate([p], **kw)
                bar.step(f"{o} gate {p}")
            report["gate"] += gates
            failed = {g["preset"] for g in gates if not g["ok"] and (base is None or g["case"] in base)}
            passed = [p for p in presets if p not in failed]
            bar.total -= sum(_per_preset(o, s, p) for s in shapes for p in failed) + \
                len(failed) * (len(eager) if o == "decode" else 0)
            for shape in shapes:
                ok = (_passed_at(gates, passed, shape) if o == "decode" else
                      _slot_gate_passed(gates, passed, shape) if o in ("store", "decompress") else passed)
                bar.total -= sum(_per_preset(o, shape, p) for p in passed if p not in ok)
                where = f"{o} at {shape.name}"
                report["records"] += mod.run_shape(shape, ok, bar.step, rep_ms=rep_ms, **timed)
            if o == "decode":
                for shape in eager:
                    ok = _passed_at(gates, passed, shape)
                    bar.total -= len(passed) - len(ok)
                    where = f"decode (eager) at {shape.name}"
                    report["records"] += decode.run_eager(shape, ok, bar.step, **timed)
    except KeyboardInterrupt:
        report["interrupted"] = f"interrupted in {where}; records of the shapes before it kept"
    finally:
        bar.close()
    return report
