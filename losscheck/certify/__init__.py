"""Deprecated: the certification tests moved to `losscheck.plugin.certify`.

`pytest --pyargs losscheck.certify` still collects them (each module here re-exports the one of
the same name there) and warns; run `pytest --pyargs losscheck.plugin.certify` instead. The
alias goes with the first release after 0.1.0 (CHANGELOG.md, Deprecated).
"""

from __future__ import annotations

import warnings

from losscheck.plugin.certify import certify

__all__ = ["certify"]

warnings.warn(
    "losscheck.certify moved to losscheck.plugin.certify: run `pytest --pyargs losscheck.plugin.certify` "
    "(or `losscheck certify`); the old path will be removed after 0.1.0",
    DeprecationWarning,
    stacklevel=2,
)
