"""Sampling gate: the spec loop's tokens follow the target's distribution (docs/statistics.md).

Each test is one statistical assertion with its Bonferroni share of --losscheck-alpha; it errors
(UnderpoweredError) rather than pass when its sample cannot detect --losscheck-detect-tv.
"""

from __future__ import annotations

import pytest

from losscheck.plugin.certify import certify

pytestmark = [pytest.mark.lossless, pytest.mark.statistical]


def test_pit_uniform(sampling_cell, losscheck_context, losscheck_record):
    """Teacher-forced randomized PIT of whole multi-round sequences on the main target."""
    from losscheck.cells.sampled import run_pit

    certify(run_pit, losscheck_context(sampling_cell), losscheck_record)


def test_exact_distribution(exact_cell, losscheck_context, losscheck_record):
    """Exact enumeration of every continuation on the small-vocabulary target."""
    from losscheck.cells.sampled import run_exact

    certify(run_exact, losscheck_context(exact_cell), losscheck_record)
