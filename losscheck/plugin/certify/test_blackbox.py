"""Black-box engines (`--losscheck-engine`): the engine with speculation on against itself with it
off (`losscheck.cells.engine`).

The greedy cell asserts equality on every prompt; each sampled cell is one statistical assertion
with its Bonferroni share of --losscheck-alpha — one-sample PIT when losscheck loads the engine's
target, two-sample otherwise — and errors (UnderpoweredError) rather than pass when its sample
cannot detect --losscheck-detect-tv.
"""

from __future__ import annotations

import pytest

from losscheck.plugin.certify import certify

pytestmark = pytest.mark.lossless


def test_engine_greedy_equals_baseline(engine_greedy_cell, losscheck_context, losscheck_record):
    """Speculation on == off, token for token, near-ties triaged by the float64 margin."""
    from losscheck.cells.engine import run_engine_cell

    certify(run_engine_cell, losscheck_context(engine_greedy_cell), losscheck_record)


@pytest.mark.statistical
def test_engine_sampling(engine_cell, losscheck_context, losscheck_record):
    """The engine's speculative samples follow the target's distribution (one-sample PIT) or its
    samples with drafting off (two-sample)."""
    from losscheck.cells.engine import run_engine_cell

    certify(run_engine_cell, losscheck_context(engine_cell), losscheck_record)
