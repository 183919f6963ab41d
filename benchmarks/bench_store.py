"""The store benchmark's entry: ``tqkern bench store`` run from a checkout (GPU).

Every preset's ``store`` (a prefill chunk, a decode batch) against a plain torch fp16 paged-cache
write (``index_copy_``) of the same K/V, after a correctness gate against the NumPy oracle; a
table, a JSON report and optionally a plot. The code is :mod:`tqkern_torch.bench.store`;
options are ``tqkern bench``'s:

    python benchmarks/bench_store.py --out bench_store.json [--shapes decode_B32] [--plot p.png]
"""

import os
import sys

# The checkout's own tqkern, even where another copy is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqkern.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "store", *sys.argv[1:]]))
