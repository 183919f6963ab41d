"""Property tests: Hypothesis profiles and poisoning helpers.

Importing :mod:`tqkern.testing` registers the ``ci`` and ``thorough`` profiles. ``ci`` is loaded
unless the command line chose one with ``--hypothesis-profile`` (Hypothesis' pytest plugin then
loads that one itself).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings

import tqkern.testing  # noqa: F401  (registers the profiles)


def pytest_configure(config):
    try:
        chosen = config.getoption("hypothesis_profile")
    except ValueError:  # Hypothesis' pytest plugin not loaded
        chosen = None
    if not chosen:
        settings.load_profile("ci")


def poison_bytes(shape, seed: int) -> np.ndarray:
    """Random uint8 bytes of ``shape``: the content of a cache nobody has written yet."""
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


@pytest.fixture(scope="session")
def poison():
    """``poison(shape, seed)``: random bytes for caches (see :func:`poison_bytes`). Session
    scoped (it holds no state), so ``@given`` tests may use it too."""
    return poison_bytes
