"""How many sequences a sampled cell draws: the power requirement of its tests, plus a margin.

Pure functions of the cell's budget `alpha`, the `power`, the total variation `detect_tv` it must
detect and the test's shape; the runner calls them, the tests then assert their own power.
"""

from __future__ import annotations

import math

from losscheck.stats.exact import exact_required_n
from losscheck.stats.pit import pit_required_values
from losscheck.stats.power import chisquare_required_n

SAMPLE_MARGIN = 1.1  # draw 10% more than the power calculation needs (EOS shortens rows)


def pit_sequences(alpha: float, power: float, detect_tv: float, n_bins: int, horizon: int) -> int:
    """Sequences of `horizon` tokens whose pooled PIT values reach the pooled tests' power."""
    values = pit_required_values(alpha, power, detect_tv, n_bins)
    return math.ceil(values * SAMPLE_MARGIN / horizon)


def exact_sequences(n_continuations: int, horizon: int, alpha: float, power: float, detect_tv: float) -> int:
    """Sampled sequences an exact-mode cell over `n_continuations` enumerated continuations needs."""
    return math.ceil(exact_required_n(n_continuations, horizon, alpha, power, detect_tv) * SAMPLE_MARGIN)


def two_sample_rows(alpha: float, power: float, detect_tv: float, n_bins: int, horizon: int) -> int:
    """Rows per side (equal sizes) for the per-position two-sample tests (alpha split over the
    `horizon` positions and the sequence statistic) to detect `detect_tv`."""
    n_eff = chisquare_required_n(2 * detect_tv, n_bins, alpha / (horizon + 1), power)
    return math.ceil(2 * n_eff * SAMPLE_MARGIN)  # two samples of n have an effective size n/2
