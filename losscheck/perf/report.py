"""Deprecated: the perf report (perf.md, plots) moved to `losscheck.report.perf`.

This alias warns and goes with the first release after 0.1.0 (CHANGELOG.md, Deprecated).
"""

from __future__ import annotations

import warnings

from losscheck.report.perf import markdown, plot, write_report

__all__ = ["markdown", "plot", "write_report"]

warnings.warn(
    "losscheck.perf.report moved to losscheck.report.perf; the old path will be removed after 0.1.0",
    DeprecationWarning,
    stacklevel=2,
)
