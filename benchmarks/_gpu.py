"""The GPU scripts' guard for machines without a CUDA device: one line on stderr, no traceback."""

from __future__ import annotations

import os
import sys

__all__ = ["NO_CUDA_EXIT", "require_cuda"]

# Exit status of a GPU script run where no CUDA device is found. 2, not 0: nothing was measured,
# so a caller that chains the script (`bench_decode.py --out d && publish d`, a CI step) must
# not take the run for a success; 2 is also what argparse returns for a script that cannot run
# as invoked. What matters to a person is the message, which says why, with no traceback.
NO_CUDA_EXIT = 2


def require_cuda(script: str) -> None:
    """Exit with status :data:`NO_CUDA_EXIT` and a one-line message where torch sees no CUDA device.

    Args:
        script: the calling script's path (``__file__``); its file name starts the message.
    """
    import torch

    if torch.cuda.is_available():
        return
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    print(f"{os.path.basename(script)} needs a CUDA GPU: no CUDA device found (torch {torch.__version__}, "
          f"{build}); nothing was run", file=sys.stderr)
    raise SystemExit(NO_CUDA_EXIT)
