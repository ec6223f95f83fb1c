"""Deprecated: moved to `losscheck.cells.engine.proxy`, with the black-box engine cell's other phases.

This alias warns and goes with the first release after 0.1.0 (CHANGELOG.md, Deprecated).
"""

from __future__ import annotations

import warnings

from losscheck.cells.engine.proxy import *  # noqa: F403  # the public names, as they were here

warnings.warn(
    "losscheck.cells.proxy_design moved to losscheck.cells.engine.proxy; the old path will be removed after 0.1.0",
    DeprecationWarning,
    stacklevel=2,
)
