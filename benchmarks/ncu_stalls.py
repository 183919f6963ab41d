"""Summarise Nsight Compute's per-instruction source page of one kernel: warp-stall samples by
reason, and executed instructions and stall samples by opcode.

    ncu --import report.ncu-rep --page source --csv --print-source sass | gzip > sass.csv.gz
    python benchmarks/ncu_stalls.py sass.csv.gz
"""

from __future__ import annotations

import collections
import csv
import gzip
import sys


def summarise(path: str, top: int = 30) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    hdr = rows[1]
    ix = {h: i for i, h in enumerate(hdr)}
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    by_reason, op_inst, op_samp = collections.Counter(), collections.Counter(), collections.Counter()
    samples = inst = 0
    for r in rows[2:]:
        try:
            s = int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
            ex = int(r[ix["Instructions Executed"]] or 0)
        except (ValueError, IndexError):
            continue
        samples += s
        inst += ex
        words = [w for w in r[ix["Source"]].split() if not w.startswith("@")]
        op = words[0].split(".")[0] if words else "?"
        op_inst[op] += ex
        op_samp[op] += s
        for c in stall_cols:
            by_reason[c] += int(r[ix[c]] or 0)
    out = [f"{path}: {samples} stall samples, {inst} warp instructions executed"]
    out += [f"  {c:24s} {v / max(samples, 1):6.1%}" for c, v in by_reason.most_common(12)]
    out.append("  opcode     executed  share  stall samples")
    out += [f"  {o:10s} {v:10d} {v / max(inst, 1):6.1%} {op_samp[o] / max(samples, 1):6.1%}"
            for o, v in op_inst.most_common(top)]
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        print(summarise(p))
