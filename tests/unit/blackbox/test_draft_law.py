"""The draft law checked against an engine's own counters (`losscheck.cells.engine.draft_law`,
`losscheck.stats.hidden_rounds.Acceptance`): on Markov-table engines (V 6, k 3, 10 tokens a row)
the filter's predicted rounds and first-draft acceptances match the loop's own counts within their
stated noise; a drafter whose argmax a bias flips is told apart; and the record withdraws the
drafter-side classes by name only on a mismatch."""

from __future__ import annotations

import math

import pytest
import torch

from losscheck.cells.engine.draft_law import TOLERANCE, Z, checked, predicted
from losscheck.cells.record import BugClassRecord, SampleFacts
from losscheck.engines.counters import EngineCounters
from losscheck.stats.hidden_rounds import Acceptance, RoundsSample

V, K, L = 6, 3, 10


def tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.unit.stats.test_hidden_rounds import tables as markov_tables

    return markov_tables(seed, V)


def loop(P: torch.Tensor, Q: torch.Tensor, n: int, g: torch.Generator, first: str) -> tuple[torch.Tensor, int, int]:
    """n rows of the correct loop drafting from Q (row V: after the prompt): the rows, and its own
    counts of rounds and of rounds whose first draft was accepted."""
    rows, rounds, first_accepted = torch.empty(n, L, dtype=torch.long), 0, 0

    def draw(law: torch.Tensor) -> int:
        return int(torch.multinomial(law, 1, generator=g))

    for i in range(n):
        out = [draw(P[V])] if first == "prefill" else []
        while len(out) < L:
            rounds += 1
            before = out[-1] if out else V
            drafts, c = [], before
            for _ in range(K):
                c = draw(Q[c])
                drafts.append(c)
            c, whole = before, True
            for j, d in enumerate(drafts):
                p, q = P[c], Q[c]
                if float(torch.rand(1, generator=g, dtype=torch.float64)) < min(1.0, float(p[d] / q[d])):
                    out.append(d)
                    first_accepted += j == 0
                    c = d
                    if len(out) >= L:
                        whole = False
                        break
                else:
                    residual = (p - q).clamp_min(0)
                    out.append(draw(residual / residual.sum()))
                    whole = False
                    break
            if whole and len(out) < L:
                out.append(draw(P[c]))
        rows[i] = torch.tensor(out[:L])
    return rows, rounds, first_accepted


def predict(P: torch.Tensor, Q: torch.Tensor, rows: torch.Tensor, first: str) -> Acceptance:
    before = torch.cat([torch.full((len(rows), 1), V), rows[:, :-1]], 1)
    sample = RoundsSample(K, first)  # type: ignore[arg-type]
    everywhere = torch.ones(rows.shape, dtype=torch.bool)
    sample.update(P[before], Q[before], rows, everywhere, everywhere)
    return sample.acceptance


@pytest.mark.parametrize("first", ["round", "prefill"])
def test_the_predicted_counts_match_an_honest_loops_own(first):
    """12 engines of 200 rows each: every z of the first-draft acceptances within ±3 (their sd
    measured 0.6-0.7 over 60 such runs), the rounds within ±4, and so inside the check's rule."""
    g = torch.Generator().manual_seed(20261205)
    for seed in range(12):
        P, Q = tables(seed)
        rows, rounds, first_accepted = loop(P, Q, 200, g, first)
        a = predict(P, Q, rows, first)
        z = (first_accepted - a.first_accepted) / math.sqrt(a.first_var)
        assert abs(z) <= 3, (seed, first_accepted, a.first_accepted, z)
        assert abs(rounds - a.rounds) <= 4 * math.sqrt(a.rounds_var) + 1, (seed, rounds, a.rounds)


def test_argmax_drafts_are_predicted_exactly_and_a_flipped_argmax_is_not():
    """Under argmax drafts the filter knows every slot: the counts match to the unit; a drafter
    whose argmax a logit bias moves on some contexts accepts at another rate, beyond the rule."""
    g = torch.Generator().manual_seed(7)
    P, Q = tables(4)
    declared = torch.nn.functional.one_hot(Q.argmax(-1), V).double()
    rows, rounds, first_accepted = loop(P, declared, 200, g, "round")
    a = predict(P, declared, rows, "round")
    assert (first_accepted, rounds) == (round(a.first_accepted), round(a.rounds))
    biased = Q.log()
    biased[:, 0] += 1.0
    flipped = torch.nn.functional.one_hot(biased.argmax(-1), V).double()
    assert bool((flipped != declared).any())
    rows, rounds, first_accepted = loop(P, flipped, 200, g, "round")
    a = predict(P, declared, rows, "round")
    assert abs(first_accepted - a.first_accepted) > Z * math.sqrt(a.first_var) + TOLERANCE * a.first_accepted


def _facts(counted: EngineCounters | None) -> SampleFacts:
    record = predicted(Acceptance(rounds=1000.0, rounds_var=50.0, first_accepted=800.0, first_var=100.0))
    classes = {
        name: BugClassRecord(test=f"rounds.{name}", tokens_needed=10.0, power=0.999, covered=True)
        for name in ("residual_is_p", "bonus_from_previous_slot")
    }
    classes["target_temperature_1.1"] = BugClassRecord("pit.surprisal", 10.0, 0.999, True)
    return SampleFacts(bug_classes=classes, engine_counters=counted, draft_law=record)


def test_a_mismatch_withdraws_the_drafter_side_classes_by_name_and_nothing_else():
    allowed = Z * 10 + TOLERANCE * 800  # 80
    fine = checked(_facts(EngineCounters(drafts=990, accepted_per_position=(800 + 79, 700))))
    assert fine.draft_law is not None and fine.draft_law.verdict == "consistent"
    assert fine.bug_classes is not None and all(c.withdrawn is None for c in fine.bug_classes.values())
    off = checked(_facts(EngineCounters(drafts=990, accepted_per_position=(800 - int(allowed) - 1, 600))))
    assert off.draft_law is not None and off.draft_law.verdict == "inconsistent"
    assert off.draft_law.counted_first_accepted == 719 and off.draft_law.counted_rounds == 990
    classes = off.bug_classes
    assert classes is not None
    assert {n for n, c in classes.items() if c.withdrawn} == {"residual_is_p", "bonus_from_previous_slot"}
    assert not classes["residual_is_p"].covered and "accepted 719 first drafts" in (
        classes["residual_is_p"].withdrawn or ""
    )
    assert classes["target_temperature_1.1"].covered
    assert checked(off) == off  # judged once


def test_an_engine_without_per_position_counts_is_not_checked_and_keeps_its_claims():
    for counters in (None, EngineCounters(drafts=10, accepted=30)):
        facts = checked(_facts(counters))
        assert facts.draft_law is not None and facts.draft_law.verdict.startswith("not checked")
        assert facts.bug_classes is not None and all(c.withdrawn is None for c in facts.bug_classes.values())


def test_a_cell_that_rejected_h0_is_not_checked_its_bug_moves_the_counts_too():
    facts = checked(_facts(EngineCounters(drafts=990, accepted_per_position=(100, 50))), rejected=True)
    assert facts.draft_law is not None and facts.draft_law.verdict.startswith("not checked: the cell rejected H0")
    assert facts.bug_classes is not None and all(c.withdrawn is None for c in facts.bug_classes.values())
