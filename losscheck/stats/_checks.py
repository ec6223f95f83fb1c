"""Argument checks shared by the statistics modules; each raises `LosscheckError` naming the value."""

from __future__ import annotations

import math

import torch

from losscheck.errors import LosscheckError

# Rows may miss 1 by the rounding of a reduced-precision softmax (bf16: up to ~1e-2), not more.
_PROB_SUM_TOL = 1e-2


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


def normalized_rows(probs: torch.Tensor, what: str) -> torch.Tensor:
    """`probs` [..., V] in float64, each row renormalised to sum to 1 exactly, after checking
    that it is a distribution up to rounding (finite, >= 0, sum within 1e-2 of 1)."""
    p = probs.to(torch.float64)
    total = p.sum(-1, keepdim=True)  # [..., 1]
    # a row holding NaN or inf sums to NaN or inf: its total says so without a pass over every entry
    if not torch.isfinite(total).all() or (p < 0).any() or ((total - 1).abs() > _PROB_SUM_TOL).any():
        raise LosscheckError(f"{what}: rows must be probability distributions (finite, >= 0, summing to 1)")
    return p / total
