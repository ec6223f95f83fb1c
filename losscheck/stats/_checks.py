"""Argument checks shared by the statistics modules; each raises `LosscheckError` naming the value."""

from __future__ import annotations

import math

from losscheck.errors import LosscheckError


def check_open_unit(name: str, value: float) -> float:
    """`value` as a float, which must lie strictly between 0 and 1 (a level or a power)."""
    if not (isinstance(value, (int, float)) and 0.0 < value < 1.0):
        raise LosscheckError(f"{name} must lie strictly between 0 and 1, got {value!r}")
    return float(value)


def check_tv(name: str, value: float) -> float:
    """`value` as a float, which must be a total-variation distance in (0, 1]."""
    if not (isinstance(value, (int, float)) and 0.0 < value <= 1.0):
        raise LosscheckError(f"{name} must be a total-variation distance in (0, 1], got {value!r}")
    return float(value)


def check_positive(name: str, value: float) -> float:
    """`value` as a float, which must be finite and > 0 (a sample size or an effect size)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise LosscheckError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)
