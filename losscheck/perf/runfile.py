"""Deprecated: the perf run file and its regression compare moved to `losscheck.report.perf_run`.

This alias warns and goes with the first release after 0.1.0 (CHANGELOG.md, Deprecated).
"""

from __future__ import annotations

import warnings

from losscheck.report.perf_run import (
    SCHEMA,
    Comparison,
    Threshold,
    compare,
    environment_changes,
    load,
    metric,
    parse_thresholds,
    save,
)

__all__ = [
    "SCHEMA",
    "Comparison",
    "Threshold",
    "compare",
    "environment_changes",
    "load",
    "metric",
    "parse_thresholds",
    "save",
]

warnings.warn(
    "losscheck.perf.runfile moved to losscheck.report.perf_run; the old path will be removed after 0.1.0",
    DeprecationWarning,
    stacklevel=2,
)
