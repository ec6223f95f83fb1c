"""Deprecated: moved to `losscheck.cells.engine.logprobs`, with the black-box engine cell's other phases.

This alias warns and goes with the first release after 0.1.0 (CHANGELOG.md, Deprecated).
"""

from __future__ import annotations

import warnings

from losscheck.cells.engine.logprobs import *  # noqa: F403  # the public names, as they were here

warnings.warn(
    "losscheck.cells.engine_logprobs moved to losscheck.cells.engine.logprobs; "
    "the old path will be removed after 0.1.0",
    DeprecationWarning,
    stacklevel=2,
)
