"""Greedy gate: speculative decoding equals plain target decoding token for token."""

from __future__ import annotations

import pytest

from losscheck.plugin.certify import certify

pytestmark = pytest.mark.lossless


def test_greedy_equals_baseline(greedy_cell, losscheck_context, losscheck_record):
    from losscheck.cells.greedy import run_greedy

    certify(run_greedy, losscheck_context(greedy_cell), losscheck_record)
