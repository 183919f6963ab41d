"""The prefill benchmark's entry: ``tqkern bench prefill`` run from a checkout (GPU).

Every preset's ``prefill`` (full prefills, a chunk on a cached prefix, speculative tokens) against
torch SDPA fp16 with the same bottom-right causal mask, and decompress-then-SDPA, after a
correctness gate against the NumPy oracle; a table (TFLOP/s in the JSON), a JSON report and
optionally a plot. The code is :mod:`tqkern_torch.bench.prefill`; options are ``tqkern bench``'s:

    python benchmarks/bench_prefill.py --out bench_prefill.json [--shapes full_1x4K] [--plot p.png]
"""

import os
import sys

# The checkout's own tqkern, even where another copy is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqkern.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "prefill", *sys.argv[1:]]))
