"""The benchmark report: its JSON schema, the text table, the speedup plot and a progress bar.

Nothing here imports torch or touches a GPU, so CI tests all of it on fake records. A report is
a dict (written as JSON by ``tqkern bench --out``)::

    {"schema": "tqkern.bench/1",
     "environment": {"gpu": str, "torch": str, "triton": str, "tqkern": str, "time": str, ...},
     "timing": str,                      # how a time was measured
     "gate": [{"op": str, "preset": str, "case": str, "ok": bool, ...}],
     "records": [{"op": "decode" | "store" | "decompress" | "prefill" | "generate", "mode": "graph" | "eager", "shape": str,
                  "variant": str, "baseline": str, "us": float, "bytes": int | None,
                  "gbps": float | None, "speedup": float,
                  "flops": int, "tflops": float,     # (flops, tflops: prefill records only)
                  "plan": str}],                     # (decode records since session 52: the plan that ran)
     "interrupted": str}                 # (only in a run cut short: where it stopped)

Each record is one timed variant (a preset, or the baseline itself) at one shape. ``baseline``
names the variant it is compared with in the same run (``sdpa_fp16`` for decode,
``fp16_index_copy`` for store, ``copy_`` for decompress); ``speedup`` is the baseline's time over this one (> 1: faster;
exactly 1.0 on the baseline's own record). ``bytes`` is what the variant moves through memory
(decode: the K/V or cache bytes read; store: fp16 K/V read plus cache bytes written;
decompress: slot bytes read plus float32 K/V written) and
``gbps`` = bytes / µs / 1e3; ``None`` where not counted (eager records). Prefill records
(baseline ``sdpa_fp16``) count the causal FLOPs instead: ``flops`` and ``tflops`` = flops / µs / 1e6.
Generate records (eager, baseline ``sdpa_dynamic_cache``; :mod:`tqkern_torch.bench.generate`) time a
decode step of ``model.generate`` (``us``) and carry ``tokens_per_s``, ``prefill_ms``, the memory
fields and the step-time ``split``; their report adds ``model``, ``no_attention`` and ``errors``.
"""

from __future__ import annotations

import json
import math
import sys
from typing import IO, Optional

__all__ = ["SCHEMA", "OPS", "MODES", "record", "validate_report", "render_table", "speedup_series",
           "write_json", "read_json", "merge_reports", "plot_report", "Progress", "PLOT_EXTRA"]

SCHEMA = "tqkern.bench/1"
OPS = ("decode", "store", "decompress", "prefill", "generate")
MODES = ("graph", "eager")
PLOT_EXTRA = "pip install 'tqkern[plot]'"

# field -> (accepted types, their name); bool is never accepted for a number.
_NUM = (int, float)
_RECORD_TYPES = {"op": (str, "str"), "mode": (str, "str"), "shape": (str, "str"), "variant": (str, "str"),
                 "baseline": (str, "str"), "us": (_NUM, "a number"), "bytes": ((int, type(None)), "int or None"),
                 "gbps": ((*_NUM, type(None)), "a number or None"), "speedup": (_NUM, "a number")}


def record(op: str, shape: str, variant: str, baseline: str, us: float, baseline_us: float, *,
           nbytes: Optional[int] = None, mode: str = "graph", flops: Optional[int] = None,
           plan: Optional[str] = None) -> dict:
    """One record of the schema (``speedup = baseline_us / us``; ``gbps`` from ``nbytes``;
    ``tflops`` from ``flops``, which only prefill records carry; ``plan``: the decode plan that
    ran, in one line)."""
    out = {"op": op, "mode": mode, "shape": shape, "variant": variant, "baseline": baseline, "us": float(us),
           "bytes": None if nbytes is None else int(nbytes),
           "gbps": None if nbytes is None else nbytes / us / 1e3, "speedup": float(baseline_us) / float(us)}
    if flops is not None:
        out["flops"] = int(flops)
        out["tflops"] = flops / us / 1e6
    if plan is not None:
        out["plan"] = plan
    return out


def validate_report(report) -> dict:
    """``report`` if it follows the schema above.

    Raises:
        TypeError: ``report`` or a record is not a dict, or a field has the wrong type.
        ValueError: the schema tag, an op or a mode is not one this version writes, a field is
            missing, a time is not a positive finite number, or a baseline's own speedup is not 1.
    """
    if not isinstance(report, dict):
        raise TypeError(f"report must be a dict, got {type(report).__name__}")
    if report.get("schema") != SCHEMA:
        raise ValueError(f"report['schema'] must be {SCHEMA!r}, got {report.get('schema')!r}")
    for key, typ in (("environment", dict), ("timing", str), ("gate", list), ("records", list)):
        if key not in report:
            raise ValueError(f"report must have a {key!r} field")
        if not isinstance(report[key], typ):
            raise TypeError(f"report[{key!r}] must be a {typ.__name__}, got {type(report[key]).__name__}")
    if "interrupted" in report and not isinstance(report["interrupted"], str):
        raise TypeError(f"report['interrupted'] must be a str, got {type(report['interrupted']).__name__}")
    for i, r in enumerate(report["records"]):
        where = f"report['records'][{i}]"
        if not isinstance(r, dict):
            raise TypeError(f"{where} must be a dict, got {type(r).__name__}")
        for key, (types, name) in _RECORD_TYPES.items():
            if key not in r:
                raise ValueError(f"{where} must have a {key!r} field")
            if not isinstance(r[key], types) or isinstance(r[key], bool):
                raise TypeError(f"{where}[{key!r}] must be {name}, got {type(r[key]).__name__}")
        if r["op"] not in OPS:
            raise ValueError(f"{where}['op'] must be one of {OPS}, got {r['op']!r}")
        if r["mode"] not in MODES:
            raise ValueError(f"{where}['mode'] must be one of {MODES}, got {r['mode']!r}")
        if not (math.isfinite(r["us"]) and r["us"] > 0):
            raise ValueError(f"{where}['us'] must be a positive finite time, got {r['us']!r}")
        if ("flops" in r) != ("tflops" in r) or ("flops" in r and (not isinstance(r["flops"], int)
                                                                   or isinstance(r["flops"], bool) or r["flops"] < 0)):
            raise ValueError(f"{where}: 'flops' (a non-negative int) and 'tflops' come together, got "
                             f"{r.get('flops')!r}, {r.get('tflops')!r}")
        if "plan" in r and not isinstance(r["plan"], str):
            raise TypeError(f"{where}['plan'] must be a str, got {type(r['plan']).__name__}")
        if r["variant"] == r["baseline"] and r["speedup"] != 1.0:
            raise ValueError(f"{where}: the baseline's own speedup must be 1.0, got {r['speedup']!r}")
    return report


def _groups(report: dict) -> dict:
    """``{(op, mode): (baseline, shapes, variants)}`` in first-seen order, baseline variant first."""
    groups: dict = {}
    for r in report["records"]:
        base, shapes, variants = groups.setdefault((r["op"], r["mode"]), (r["baseline"], [], []))
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
        if r["variant"] not in variants:
            variants.append(r["variant"])
    for base, _, variants in groups.values():
        if base in variants:
            variants.remove(base)
            variants.insert(0, base)
    return groups


def render_table(report: dict) -> str:
    """One table per (op, mode): variants × shapes, each cell ``µs (speedup x)``; ASCII only.

    The baseline's row holds its times alone; a variant not timed at a shape (it failed the
    correctness gate, or the run left it out) shows ``-``.
    """
    env = report["environment"]
    lines = [f"{env.get('gpu', '?')} | torch {env.get('torch', '?')} | triton {env.get('triton', '?')} | "
             f"tqkern {env.get('tqkern', '?')} | {report['timing']}"]
    cells = {(r["op"], r["mode"], r["variant"], r["shape"]): r for r in report["records"]}
    for (op, mode), (base, shapes, variants) in _groups(report).items():
        title = f"{op} ({'CUDA-graph replay' if mode == 'graph' else 'eager calls'}): us, and speedup over {base}"
        rows = []
        for v in variants:
            row = [v]
            for s in shapes:
                r = cells.get((op, mode, v, s))
                row.append("-" if r is None else f"{r['us']:.1f}" if v == base else
                           f"{r['us']:.1f} ({r['speedup']:.2f}x)")
            rows.append(row)
        head = ["variant", *shapes]
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]

        def fmt(cells_):
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells_, widths)))

        lines += ["", title, fmt(head), "-" * len(fmt(head)), *(fmt(r) for r in rows)]
        if op == "decode" and mode == "graph":
            lines += _bandwidth_lines(cells, op, mode, base, shapes, variants,
                                      f"decode: achieved bandwidth of the cache read, as a fraction of {base}'s on "
                                      f"fp16 K/V")
        if op == "store" and "copy_" in variants:  # issue 23's measure
            lines += _bandwidth_lines(cells, op, mode, "copy_", shapes, [v for v in variants if v != base],
                                      "store: achieved bandwidth (K/V read + bytes written), as a fraction of copy_'s")
        if op == "decompress" and "copy_" in variants:  # issue 23's measure for the read path
            lines += _bandwidth_lines(cells, op, mode, "copy_", shapes, variants,
                                      "decompress: achieved bandwidth (slots read + float32 K/V written), as a "
                                      "fraction of copy_'s")
    if not report["records"]:
        lines += ["", "no timing records"]
    lines += _generate_lines(report)
    failed = [g for g in report["gate"] if not g["ok"]]
    if failed:
        lines.append("")
    for g in failed:
        lines.append(f"gate FAILED: {g['op']} {g['preset']} {g.get('case', '')} (not timed)")
    if report.get("interrupted"):
        lines += ["", f"INCOMPLETE: {report['interrupted']}"]
    return "\n".join(lines)


def _bandwidth_lines(cells: dict, op: str, mode: str, base: str, shapes: list, variants: list,
                     title: str) -> list[str]:
    """Each variant's achieved bandwidth (its ``bytes`` per µs) as a fraction of variant
    ``base``'s at the same shape (decode: SDPA fp16 on the uncompressed K/V; store: ``copy_``);
    ``-`` where either was not timed or counted no bytes."""
    rows = []
    for v in variants:
        if v == base:
            continue
        row = [v]
        for s in shapes:
            r, b = cells.get((op, mode, v, s)), cells.get((op, mode, base, s))
            ok = r is not None and b is not None and r["gbps"] and b["gbps"]
            row.append(f"{r['gbps'] / b['gbps']:.0%}" if ok else "-")
        rows.append(row)
    if not rows:
        return []
    head = ["variant", *shapes]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = lambda cells_: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                    for i, (c, w) in enumerate(zip(cells_, widths)))
    return ["", title, fmt(head), "-" * len(fmt(head)), *(fmt(r) for r in rows)]


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def _generate_lines(report: dict) -> list[str]:
    """The generate records' own table (memory, prefill, split), the model and the errors."""
    recs = [r for r in report["records"] if r["op"] == "generate"]
    if not recs and not report.get("errors"):
        return []
    model = report.get("model", {})
    lines = ["", f"generate: {model.get('name', '?')}, {model.get('layers', '?')} of {model.get('full_layers', '?')} "
                 f"layers{' (CUT: not the full model)' if model.get('cut') else ''}; split = device time of weights / "
                 f"attention, and host (device idle), ms per decode step"]
    head = ["shape", "variant", "prefill ms", "step ms", "tok/s", "speedup", "cache MiB (used)", "peak MiB", "split w/a/h"]
    rows = []
    for r in recs:
        sp = r.get("split")
        split = "-" if sp is None else "/".join(f"{sp[k] / 1e3:.2f}"
                                                for k in ("weights_us", "attention_us", "host_us"))
        rows.append([r["shape"], r["variant"], f"{r['prefill_ms']:.0f}", f"{r['us'] / 1e3:.2f}",
                     f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                     f"{_mib(r['cache_bytes'])} ({_mib(r['cache_used_bytes'])})", _mib(r["peak_bytes"]), split])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in (head, *rows)]
    paths = {(r["variant"], r["prefill_path"], r["decode_path"]) for r in recs}
    lines += [f"  {v}: prefill {p}; decode {d}" for v, p, d in sorted(paths)]
    lines += [f"generate FAILED: {e['shape']} {e['variant']}: {e['error']}" for e in report.get("errors", [])]
    return lines


def speedup_series(report: dict) -> dict:
    """What the plot draws: ``{(op, mode): (baseline, shapes, {variant: [speedup or nan per shape]})}``,
    the baseline left out (its speedup is 1 by definition)."""
    cells = {(r["op"], r["mode"], r["variant"], r["shape"]): r["speedup"] for r in report["records"]}
    out = {}
    for (op, mode), (base, shapes, variants) in _groups(report).items():
        out[op, mode] = (base, list(shapes), {v: [cells.get((op, mode, v, s), math.nan) for s in shapes]
                                              for v in variants if v != base})
    return out


def write_json(report: dict, path: str) -> None:
    """Validate ``report`` and write it to ``path`` (indented JSON)."""
    validate_report(report)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


def read_json(path: str) -> dict:
    """A report written by :func:`write_json`, validated."""
    with open(path) as f:
        return validate_report(json.load(f))


def _record_key(r: dict) -> tuple:
    return (r["op"], r["mode"], r["shape"], r["variant"])


def _gate_key(g: dict) -> tuple:
    return (g.get("op"), g.get("case"), g.get("preset"), g.get("path"))


def merge_reports(base: dict, new: dict, note: str) -> tuple[dict, list[str]]:
    """``base`` (a GPU's baseline file, ``benchmarks/results/<gpu>.json``) with ``new``'s records
    and gates merged in, and a line per thing that changed.

    A record of ``new`` replaces ``base``'s of the same (op, mode, shape, variant), else is
    appended; a gate the same by (op, case, preset, path). Where ``new`` replaces a baseline's
    record (e.g. ``sdpa_fp16`` at a shape), ``base``'s other variants at that shape keep the
    speedups of their own runs: the lines and the history entry name them. ``base``'s
    environment gains one ``history`` entry: ``note``, ``new``'s environment, and the records
    replaced and added, each key one string ``"op mode shape variant"`` (and ``new``'s
    ``interrupted``, if any). Both reports must validate and name the same GPU (one baseline file
    per GPU); neither is modified.
    """
    validate_report(base)
    validate_report(new)
    if not isinstance(note, str) or not note.strip():
        raise ValueError(f"note must be a non-empty str saying what the merged run was, got {note!r}")
    gpu, new_gpu = base["environment"].get("gpu"), new["environment"].get("gpu")
    if gpu != new_gpu:
        raise ValueError(f"the reports must be of one GPU: base is {gpu!r}, new is {new_gpu!r}")
    out = json.loads(json.dumps(base))
    where = {_record_key(r): i for i, r in enumerate(out["records"])}
    replaced, added, stale = [], [], []
    for r in new["records"]:
        k = _record_key(r)
        if k in where:
            out["records"][where[k]] = r
            replaced.append(k)
        else:
            where[k] = len(out["records"])
            out["records"].append(r)
            added.append(k)
    new_by_key = {_record_key(r): r for r in new["records"]}
    for key in replaced:
        if key[3] != new_by_key[key]["baseline"]:
            continue  # (not a baseline's record)
        stale += [_record_key(r) for r in out["records"] if _record_key(r)[:3] == key[:3] and
                  r["baseline"] == key[3] and r["variant"] != key[3] and _record_key(r) not in new_by_key]
    gates = {_gate_key(g): i for i, g in enumerate(out["gate"])}
    for g in new["gate"]:
        k = _gate_key(g)
        if k in gates:
            out["gate"][gates[k]] = g
        else:
            gates[k] = len(out["gate"])
            out["gate"].append(g)
    entry = {"note": note, "environment": new["environment"], "replaced": [" ".join(k) for k in replaced],
             "added": [" ".join(k) for k in added], "speedups_against_earlier_baselines": [" ".join(k) for k in stale]}
    if new.get("interrupted"):
        entry["interrupted"] = new["interrupted"]
    out["environment"].setdefault("history", []).append(entry)
    validate_report(out)
    lines = [f"replaced {len(replaced)} records, added {len(added)}; {len(new['gate'])} gates merged"]
    lines += [f"kept an earlier run's speedup (its baseline replaced): {' '.join(k)}" for k in stale]
    return out, lines


def plot_report(report: dict, path: str) -> str:
    """Bars of the speedup over the baseline per shape, one panel per (op, mode), saved to ``path``.

    Raises:
        ImportError: matplotlib is not installed (the ``plot`` extra).
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"--plot needs matplotlib: {PLOT_EXTRA}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = speedup_series(report)
    colors = {}  # one colour per variant across every panel
    for _, _, by_variant in series.values():
        for v in by_variant:
            colors.setdefault(v, f"C{len(colors) % 10}")
    fig, axes = plt.subplots(len(series) or 1, 1, figsize=(9, 3.2 * max(1, len(series))), squeeze=False)
    for ax, ((op, mode), (base, shapes, by_variant)) in zip(axes[:, 0], series.items()):
        width = 0.8 / max(1, len(by_variant))
        for i, (variant, ys) in enumerate(by_variant.items()):
            ax.bar([x + (i - (len(by_variant) - 1) / 2) * width for x in range(len(shapes))], ys, width,
                   label=variant, color=colors[variant])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shapes)), shapes, fontsize=8)
        ax.set_ylabel(f"speedup over {base}")
        ax.set_title(f"{op}, {'CUDA-graph replay' if mode == 'graph' else 'eager'}", fontsize=9)
        ax.legend(fontsize=7, ncol=2)
    env = report["environment"]
    fig.suptitle(f"tqkern {env.get('tqkern', '?')} on {env.get('gpu', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


class Progress:
    """A one-line progress bar on ``stream`` (stderr by default): ``[#####.....] 3/10 label``.

    On a terminal the line is redrawn in place; elsewhere (a log file, CI) each step is its own
    line, so the log reads in order.
    """

    def __init__(self, total: int, stream: Optional[IO[str]] = None, width: int = 24):
        if not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be an int >= 0, got {total!r}")
        self.total, self.done, self.width = total, 0, width
        self.stream = sys.stderr if stream is None else stream
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def line(self, label: str) -> str:
        filled = self.width * self.done // max(1, self.total)
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {label}"

    def step(self, label: str = "") -> None:
        """Count one step done, and show it."""
        self.done += 1
        self.stream.write(("\r\x1b[K" if self._tty else "") + self.line(label) + ("" if self._tty else "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
