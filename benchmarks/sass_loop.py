"""Instruction histogram of a kernel's main loop (the longest backward branch's body) in SASS
from ``nvdisasm -c`` (e.g. ``benchmarks/aot_inspect.py --sass``): the per-iteration instruction
count that the timing notes compare before a GPU run.

    python benchmarks/sass_loop.py out.tq4.sass [more.sass ...]
"""

from __future__ import annotations

import collections
import re
import sys


def loop_histogram(path: str) -> tuple[int, collections.Counter]:
    with open(path) as f:
        lines = [re.sub(r"/\*[0-9a-f]*\*/", "", line).strip() for line in f]
    labels, best = {}, None
    for i, line in enumerate(lines):
        m = re.match(r"^\.(L_x_\d+):", line)
        if m:
            labels[m.group(1)] = i
        m = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", line)
        if m and m.group(1) in labels and (best is None or i - labels[m.group(1)] > best[1] - best[0]):
            best = (labels[m.group(1)], i)
    if best is None:
        return 0, collections.Counter()
    body = [line for line in lines[best[0]:best[1] + 1] if line and not line.startswith(".") and ";" in line]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", line).split()[0].split(".")[0] for line in body)
    return len(body), ops


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        n, ops = loop_histogram(p)
        print(f"{p}: loop {n} instructions")
        print("  " + " ".join(f"{k}:{v}" for k, v in ops.most_common(24)))
