"""The draft law checked in one-sample engine cells (`losscheck.cells.engine.draft_law`): an engine that
drafts argmax(logits + bias) while giving its model as drafting argmax(logits) is lossless and
PASSes, but its counters contradict the filter's prediction and every drafter-side claim is
withdrawn by name; the same engine without the bias matches its counters to the unit."""

from __future__ import annotations

import pytest


def _t1(engine: str):
    from losscheck.cells.engine import run_engine_cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    session = Session(Options(engine=f"losscheck.selftest.engines:{engine}"))
    (cell,) = [c for c in session.plan["engine_cell"] if c.id == "engine-k4-T1"]
    return run_engine_cell(CellContext.of(session, cell))


@pytest.mark.usefixtures("one_thread")
def test_a_drafter_biased_before_its_argmax_passes_with_its_drafter_side_claims_withdrawn():
    from losscheck.plan.profiles import get_profile
    from losscheck.stats.hidden_rounds import CLASSES

    biased = _t1("biased_argmax_drafts")
    assert biased.passed, biased.message()  # lossless: the verifier uses the q it drafted from
    law = biased.facts.draft_law
    assert law is not None and law.verdict == "inconsistent", law
    classes = biased.facts.bug_classes
    assert classes is not None
    drafter_side = {c.name for c in CLASSES} & set(classes)
    assert drafter_side and all(classes[n].withdrawn and not classes[n].covered for n in drafter_side)
    assert classes["target_temperature_1.1"].covered and classes["target_temperature_1.1"].withdrawn is None

    honest = _t1("honest_argmax_drafts")
    law = honest.facts.draft_law
    assert honest.passed and law is not None and law.verdict == "consistent", law
    # its sample against Wald's bound, at the class that sized it (the biased one's are withdrawn)
    bound, classes = honest.facts.bound, honest.facts.bug_classes
    assert bound is not None and classes is not None and classes[bound.binding_class].covered, bound
    assert bound.ratio_h0 == pytest.approx(bound.tested_tokens / bound.wald_h0_tokens)
    assert bound.ratio > 1 and bound.ratio_h0 > 1  # Wald–Wolfowitz: no test at its α and power needs fewer on average
    looks = honest.facts.looks  # lossless: every class ruled out before the design's tokens
    assert looks is not None and looks.early and looks.tested_tokens < looks.tokens[-1], looks
    # its first look is at least the engine floor (the profile's `engine_min_tokens`, at whole rows)
    # and short of one row a prompt: rows for a seeded part of the prompts (`losscheck.cells.engine.deal`)
    facts = honest.facts
    per_row = facts.pilot_tested_tokens / facts.pilot_sequences
    one_row = int(per_row * facts.prompts)
    floor = get_profile("ci").engine_min_tokens * facts.pilot_tested_tokens / facts.pilot_tokens
    assert floor - per_row <= looks.tokens[0] < one_row, (looks, floor, one_row)
    assert (law.counted_first_accepted, law.counted_rounds) == (
        round(law.predicted_first_accepted),
        round(law.predicted_rounds),
    )  # argmax drafts: the filter knows every slot
    # the second stage, planned though never drawn: at least the design's last look, every covered
    # class at its share of the power there, and each claim the product of the two stages' powers
    from losscheck.stats.second_stage import stage_two_power

    second = facts.second_stage
    assert second is not None and second.rows >= looks.tokens[-1] / (one_row / facts.prompts), second
    assert {"surprisal", "support", "rounds.residual_is_p"} <= set(second.scores), second
    for name, c in classes.items():
        assert c.second_stage_power is not None and c.power <= c.second_stage_power, name
        if c.covered:
            assert c.second_stage_power >= stage_two_power(0.99) and c.power >= 0.99, (name, c)


def test_the_draft_law_table_names_a_cell_the_engine_does_not_have():
    from losscheck.selftest.draft_law import lines

    with pytest.raises(SystemExit, match="no one-sample cell 'engine-k9-T1'; the engine's are engine-k4-T1"):
        lines("losscheck.engines.spec_loop:spec_loop", ["engine-k9-T1"], 1)
