"""The q contract judged in engine cells (`losscheck.stats.hidden_rounds`, `q_raw_in_verify`,
`q_raw_in_draft`): an engine whose draft is drawn from one law of its draft model and verified
with another — transformers #47932's shape — fails its one-sample cell through the round filter,
blamed on speculation; where the two laws are one (T = 1, nothing processed) the classes are named
not judged and spend no α."""

from __future__ import annotations

import pytest

from losscheck.core.sampling import SamplingParams


def _cell(engine: str, cell_id: str):
    from losscheck.cells.engine import run_engine_cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    path = engine if ":" in engine else f"losscheck.selftest.engines:{engine}"
    session = Session(Options(engine=path))
    (cell,) = [c for c in session.plan["engine_cell"] if c.id == cell_id]
    return run_engine_cell(CellContext.of(session, cell))


@pytest.mark.usefixtures("one_thread")
def test_a_verifier_using_the_raw_q_where_the_draft_drew_the_processed_one_fails_at_t_0_3():
    outcome = _cell("q_raw_in_verify", "engine-k4-T0.3")
    assert not outcome.passed, outcome.message()
    failed = {r.name for r in outcome.verdict.results if not r.passed}
    assert outcome.facts.attribution is not None and outcome.facts.attribution.finding == "speculation"
    first = " ".join(outcome.facts.attribution.first_stage_failed)
    assert "rounds.q_raw_in_verify" in first, first
    assert failed, outcome.message()
    # its rounds test crossed at a look before the last: the cell stopped drawing there, and its
    # second stage drew as many rows a side as the design's last look would have
    looks, attribution = outcome.facts.looks, outcome.facts.attribution
    assert looks is not None and looks.rejected and looks.stopped_at < len(looks.tokens), looks
    assert attribution.rows * 16 > looks.tokens[-1] > looks.tested_tokens, (attribution.rows, looks)


@pytest.mark.slow  # the other direction and a cut-off (~40 s)
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    ("engine", "cell_id"), [("q_raw_in_draft", "engine-k4-T0.3"), ("q_raw_in_verify", "engine-k4-T1-topk8")]
)
def test_each_direction_and_a_cut_off_fail_too(engine, cell_id):
    outcome = _cell(engine, cell_id)
    assert not outcome.passed, outcome.message()
    assert outcome.facts.attribution is not None
    assert f"rounds.{engine}" in " ".join(outcome.facts.attribution.first_stage_failed)


@pytest.mark.slow  # Hugging Face assisted generation draws a row per generate call (62 s, 2026-12-06)
@pytest.mark.usefixtures("one_thread")
def test_hugging_face_assisted_generation_verifying_with_the_raw_q_fails_at_t_0_3():
    """transformers #47932's shape planted in transformers itself (`losscheck.selftest.hf`): the
    assistant drafts from its processed logits, the verifier accepts and recovers with its raw ones.
    The one-sample cell at T 0.3 fails through `rounds.q_raw_in_verify` (p = 1.0e-15 at α 1.1e-4,
    its first look: 2,304 tokens, 2026-12-06), blamed on speculation."""
    outcome = _cell("losscheck.selftest.hf:hf_assisted_q_raw_in_verify", "engine-k4-T0.3")
    assert not outcome.passed, outcome.message()
    assert outcome.facts.attribution is not None and outcome.facts.attribution.finding == "speculation"
    first = " ".join(outcome.facts.attribution.first_stage_failed)
    assert "rounds.q_raw_in_verify" in first, first


def test_where_the_two_laws_are_one_the_classes_are_not_judged_and_spend_nothing():
    from losscheck.cells.engine.rounds import has_other_q, not_judged
    from losscheck.stats import registry

    t1, cooled = SamplingParams(), SamplingParams(temperature=0.3)
    assert not has_other_q(t1, "processed") and has_other_q(cooled, "processed")
    assert has_other_q(t1, "greedy")  # argmax drafts: the law before the argmax is the other
    assert has_other_q(SamplingParams(top_k=8), "processed") and not has_other_q(SamplingParams(top_k=8), "temperature")
    said = not_judged("processed", t1)
    assert "no other q" in said["q_raw_in_verify"] and "no other q" in said["q_raw_in_draft"]
    assert "q_raw_in_verify" not in not_judged("processed", cooled)
    other = frozenset({registry.OTHER_Q})
    assert registry.budget_count(registry.ROUNDS, missing=other) == registry.budget_count(registry.ROUNDS) - 2
