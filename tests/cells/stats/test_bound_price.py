"""`losscheck.selftest.bound_price` on the bundled text pair, a few short rows."""

from __future__ import annotations

import math


def test_a_bounded_rule_out_never_exceeds_the_one_that_knows_the_kept_set(capsys):
    """Rows drawn from the target's own top-p 0.9 law (the kept set losscheck computes): scored
    with that set known, and bounded over every set the fp32 tolerance allows. Row by row the
    bound's numerator is at most the known law and its denominator at least the member's, so each
    class's log rule-out e-value is at most the known one's; where positions are ambiguous, the
    selftest says how many and how much their uncertain tokens weigh."""
    from losscheck.selftest.bound_price import measure

    growth = measure(seed=3, rows=1, horizon=4)
    assert set(growth) == {
        "residual_is_p",
        "bonus_from_previous_slot",
        "top_p_one_side",
        "q_raw_in_verify",
        "q_raw_in_draft",
    }
    for name, (known, bounded, predicted) in growth.items():
        assert bounded <= known + 1e-6 * max(1.0, abs(known)) or (known == bounded == math.inf), name
        assert math.isfinite(predicted), name
    assert "positions ambiguous" in capsys.readouterr().out
