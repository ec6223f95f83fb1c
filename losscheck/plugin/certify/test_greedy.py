"""Greedy gate: speculative decoding equals plain target decoding token for token."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.lossless


def test_greedy_equals_baseline(greedy_cell, losscheck_session, losscheck_record):
    from losscheck.cells.runner import run_greedy

    outcome = run_greedy(losscheck_session, greedy_cell)
    losscheck_record.update(outcome.to_record())
    assert outcome.passed, outcome.message()
