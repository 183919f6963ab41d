"""The end-to-end generate benchmark's entry: ``tqkern bench generate`` run from a checkout (GPU).

``model.generate`` of a Llama-3-8B-shaped model (random weights, bf16) through a TQCache against
transformers' SDPA + DynamicCache: decode tokens/s, prefill time, cache memory and a step-time
split. The code is :mod:`tqkern_torch.bench.generate`; options are ``tqkern bench``'s:

    python benchmarks/bench_generate.py --quick --out bench_generate.json [--layers 8] [--presets tq4]
"""

import os
import sys

# The checkout's own tqkern, even where another copy is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqkern.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "generate", *sys.argv[1:]]))
