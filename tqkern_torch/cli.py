"""Former home of the ``tqkern`` command line, kept so old imports keep working.

The command line lives in :mod:`tqkern.cli` (NumPy only, so ``tqkern info`` runs without torch);
this module re-exports it, and ``python -m tqkern_torch.cli`` still runs it.
"""

import sys

from tqkern.cli import (  # noqa: F401
    COMMANDS,
    Command,
    MissingDependency,
    UsageError,
    describe_codec,
    info_report,
    main,
    render_info,
    require_torch,
)

__all__ = ["main", "Command", "COMMANDS", "info_report"]

if __name__ == "__main__":
    sys.exit(main())
