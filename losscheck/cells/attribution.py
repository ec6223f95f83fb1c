"""Deprecated: moved to `losscheck.cells.engine.attribution`, with the black-box engine cell's other phases.

This alias warns and goes with the first release after 0.1.0 (CHANGELOG.md, Deprecated).
"""

from __future__ import annotations

import warnings

from losscheck.cells.engine.attribution import *  # noqa: F403  # the public names, as they were here

warnings.warn(
    "losscheck.cells.attribution moved to losscheck.cells.engine.attribution; the old path will be removed after 0.1.0",
    DeprecationWarning,
    stacklevel=2,
)
