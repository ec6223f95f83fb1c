"""Errors losscheck raises on bad input or an unusable configuration.

Each message names the offending thing and the fix; none is raised for a losslessness failure
(those are test failures with a divergence or statistical report).
"""

from __future__ import annotations

import os

# `losscheck certify` sets it to "--" for the pytest run it starts (its workers inherit it), so
# that messages raised once models load name its options (--target), not pytest's.
FLAG_PREFIX_ENV = "LOSSCHECK_FLAG_PREFIX"


def flag(name: str) -> str:
    """Option `name` as the user spelled it: `--losscheck-NAME` under pytest, `--NAME` under the CLI."""
    return os.environ.get(FLAG_PREFIX_ENV, "--losscheck-") + name


class LosscheckError(Exception):
    """Base class: a configuration or input problem, not a losslessness verdict."""


class DrafterOutputError(LosscheckError):
    """A drafter returned a malformed `Proposal` (shape, dtype, range, NaN, unnormalised q)."""


class TargetError(LosscheckError):
    """The target could not be loaded or returned unusable logits."""


class UnderpoweredError(LosscheckError):
    """A statistical test's sample size cannot detect the configured effect at the configured power."""


class OptionError(LosscheckError):
    """A `--losscheck-*` option or CLI argument has a bad value."""


class CellUnavailable(LosscheckError):
    """This platform cannot run a cell (e.g. no backend to split the target over); the message
    says why. The certification tests report the cell as not run, with that reason and the scope
    term that would declare it out (`aspect`: `losscheck.plan.scope`)."""

    aspect: str | None = None
