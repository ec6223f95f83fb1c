"""Deprecated: the black-box engine cell is the package `losscheck.cells.engine`, a module per phase.

This alias warns and goes with the first release after 0.1.0 (CHANGELOG.md, Deprecated).
"""

from __future__ import annotations

import warnings

from losscheck.cells.engine import as_generation, engine_draws, min_horizon, request, run_engine_cell
from losscheck.cells.engine.greedy import engine_greedy
from losscheck.cells.engine.handle import CONFIRM_TOKENS, NO_SLOTS
from losscheck.cells.engine.one_sample import (
    TOP_LOGPROBS,
    EngineDesign,
    one_sample,
    rounds_coverage,
    target_side_coverage,
)
from losscheck.cells.engine.proxy import TwoSampleDesign
from losscheck.cells.engine.two_sample import two_sample

__all__ = [
    "CONFIRM_TOKENS",
    "NO_SLOTS",
    "TOP_LOGPROBS",
    "EngineDesign",
    "TwoSampleDesign",
    "as_generation",
    "engine_draws",
    "engine_greedy",
    "min_horizon",
    "one_sample",
    "request",
    "rounds_coverage",
    "run_engine_cell",
    "target_side_coverage",
    "two_sample",
]

warnings.warn(
    "losscheck.cells.blackbox moved to the package losscheck.cells.engine (run_engine_cell there); "
    "the old path will be removed after 0.1.0",
    DeprecationWarning,
    stacklevel=2,
)
