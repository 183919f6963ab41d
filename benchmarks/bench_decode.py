"""The decode benchmark's entry: ``tqkern bench decode`` run from a checkout (GPU).

Every preset's ``paged_decode`` against torch SDPA fp16 at model-like shapes, after a correctness
gate against the NumPy oracle; a table, a JSON report and optionally a plot. The code is
:mod:`tqkern_torch.bench.decode`; options are ``tqkern bench``'s:

    python benchmarks/bench_decode.py --out bench_decode.json [--shapes B32x16K] [--eager] [--plot p.png]
"""

import os
import sys

# The checkout's own tqkern, even where another copy is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqkern.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "decode", *sys.argv[1:]]))
