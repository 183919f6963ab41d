"""The decompress benchmark's entry: ``tqkern bench decompress`` run from a checkout (GPU).

Every preset's ``decompress`` of the slots a store of each store shape wrote, in its codec's space
and rotated back, against ``copy_`` of the float32 K/V it produces, after a correctness gate
against the NumPy oracle; a table, a JSON report and optionally a plot. The code is
:mod:`tqkern_torch.bench.decompress`; options are ``tqkern bench``'s:

    python benchmarks/bench_decompress.py --out bench_decompress.json [--shapes prefill_1x16384]
"""

import os
import sys

# The checkout's own tqkern, even where another copy is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqkern.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "decompress", *sys.argv[1:]]))
