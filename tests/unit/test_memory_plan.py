"""The memory plan of a black-box engine run (`losscheck.plan.memory`): phases drawn side by side,
what is alive in each, and how many instances the run builds."""

from __future__ import annotations

from losscheck.plan.memory import PLAIN, SPECULATIVE, TARGET, memory_lines, next_side, phases
from losscheck.plan.modes import Mode

ONE_SAMPLE_RUN = [(Mode.ONE_SAMPLE, True)] * 5 + [(Mode.ENGINE_GREEDY, True)]


def test_the_speculative_side_is_drawn_while_any_cell_waits_for_it():
    assert next_side([{False}, {True, False}]) is True
    assert next_side([{False}, set()]) is False


def test_a_one_sample_run_draws_the_plain_side_last_and_only_to_attribute():
    """Pilots (with the greedy cell's on side), their scoring, the sample's first look, its PIT and
    stop rule, each later look the stop rule asks for; then, at worst (every first stage rejected),
    the attribution rows of both sides with every plain draw, scored last."""
    found = phases(ONE_SAMPLE_RUN)
    assert [p.alive for p in found] == [SPECULATIVE, TARGET] * 3 + [SPECULATIVE, PLAIN, TARGET]
    assert found[0].work == (("one-sample pilot", 5), ("greedy (on)", 1))
    assert found[2].work == (("one-sample sample, first look", 5),)
    assert found[4].work == (("one-sample sample, each later look (until the stop rule holds)", 5),)
    assert found[7].work == (("one-sample attribution (after a rejection only)", 5), ("greedy (off)", 1))
    lines = memory_lines(ONE_SAMPLE_RUN, "one-at-a-time")
    assert lines[1] == "  phase 1: speculative engine  draws 5 x one-sample pilot, 1 x greedy (on)"
    assert lines[-1].startswith("  engine instances built: 5; scoring phases: 4")


def test_a_two_sample_run_scores_its_pilots_and_samples_through_the_proxy():
    found = phases([(Mode.TWO_SAMPLE, False)] * 5 + [(Mode.ENGINE_GREEDY, True)])
    assert [p.alive for p in found] == [SPECULATIVE, PLAIN, TARGET, SPECULATIVE, PLAIN, TARGET]
    assert found[1].work == (("two-sample pilot", 5), ("greedy (off)", 1))
    assert found[2].work == (
        ("two-sample pilot (the proxy sizes the sample)", 5),
        ("greedy margins (where on and off diverge)", 1),
    )
    alone = phases([(Mode.TWO_SAMPLE, False)])
    assert [p.alive for p in alone] == [PLAIN, TARGET, SPECULATIVE, PLAIN, TARGET]


def test_keep_all_and_unknown_engines_say_everything_stays_alive():
    assert "stay alive together" in memory_lines(ONE_SAMPLE_RUN, "keep-all")[0]
    assert "manages its own instances" in memory_lines(ONE_SAMPLE_RUN, None)[0]
    assert memory_lines([], "one-at-a-time") == []
