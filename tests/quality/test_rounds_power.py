"""The round filter's stated power, checked by simulation on a Markov-chain engine whose rows'
first token comes from the prefill (vLLM's, llama.cpp's and OpenVINO's alignment): for the
residual and the bonus bug, under sampled and under argmax drafts, a pilot from the buggy loop
sizes a cell at α 1e-3 and power 0.9 (`RoundsPower.tokens_needed`), and 50 cells of that many
rows, drawn from the buggy loop's exact law (enumerated branch by branch), must reject at least
37 times: P(X <= 36 | n = 50, p = 0.9) = 2.9e-4, so a stated power of 0.9 that held would fail
this test with probability under 1e-3. Fixed seeds. The filter states power at the drift's
95% lower bound (`RoundsPower.drift`). Measured (2026-12-06): residual 50 and 48 of 50 (sampled,
argmax drafts; 114 and 152 rows), bonus 48 of 50 (sampled; 3,267 rows) and 50 of 50 under argmax
drafts (200,114 rows). Before the bound, the last was sized from the point estimate (the 400-row
pilot's 7.2e-5 per token, where 40,000 rows say 4.6e-5): 44,333 rows, and 35 of 50 caught. With
the increment's variance at its upper bound too (2026-12-07): 114, 153, 3,476 and 259,564 rows,
caught 50, 49, 49 and 50 of 50.

A cell FAILs only when its second stage, on fresh rows, confirms (`losscheck.cells.engine.attribution`):
its power is checked the same way, the paired sign-flip test of the rows' log-LR at ρ = 1
between rows of the buggy loop and rows of p, at the rows `RoundsPower.row_shift` says give power 0.9. The two stages
draw independent rows, so a cell's chance to FAIL is the product of the two checked powers."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from losscheck.stats.hidden_rounds import RoundsSample, rounds_test
from losscheck.stats.second_stage import sign_flip_test
from tests.unit.stats.test_hidden_rounds import K, L, V, forced, loop_law, tables

CELLS, POWER, ALPHA = 50, 0.9, 1e-3
FLOOR = int(stats.binom.ppf(1e-3, CELLS, POWER))  # 37: fewer catches have probability < 1e-3 at power 0.9


def _score(P: torch.Tensor, Q: torch.Tensor, rows: torch.Tensor) -> RoundsSample:
    everywhere = torch.ones(rows.shape, dtype=torch.bool)
    sample = RoundsSample(K, "prefill")
    sample.update(forced(rows, P), forced(rows, Q), rows, everywhere, everywhere)
    return sample


@pytest.mark.slow  # 50 cells a configuration; the argmax-drafts bonus cell is 200,114 rows (~10 min)
@pytest.mark.parametrize(
    ("bug", "greedy"),
    [
        ("residual_is_p", False),
        ("residual_is_p", True),
        ("bonus_from_previous_slot", False),
        ("bonus_from_previous_slot", True),
    ],
    ids=["residual-sampled", "residual-argmax", "bonus-sampled", "bonus-argmax"],
)
def test_a_bug_is_caught_at_the_power_the_filter_states_with_prefill_alignment(bug, greedy):
    P, Q = tables(4)
    if greedy:
        Q = torch.nn.functional.one_hot(Q.argmax(-1), V).double()
    law = loop_law(P, Q, bug, first="prefill")
    outputs = torch.tensor(list(law))  # [outputs, L]
    weights = torch.tensor(list(law.values()), dtype=torch.float64)
    g = torch.Generator().manual_seed(17)

    def draw(n: int) -> torch.Tensor:
        return outputs[torch.multinomial(weights, n, True, generator=g)]

    needed = _score(P, Q, draw(400)).power.tokens_needed(bug, ALPHA, POWER)
    assert math.isfinite(needed), (bug, greedy)
    rows = math.ceil(needed / L)
    caught = sum(not rounds_test(_score(P, Q, draw(rows)), bug, ALPHA, POWER).passed for _ in range(CELLS))
    assert FLOOR == 37 and stats.binom.cdf(FLOOR - 1, CELLS, POWER) < 1e-3
    assert caught >= FLOOR, (bug, greedy, caught, rows)


@pytest.mark.parametrize(
    ("bug", "greedy"),
    [
        ("residual_is_p", False),
        ("residual_is_p", True),
        pytest.param("bonus_from_previous_slot", False, marks=pytest.mark.slow),  # 9,467 rows a side, ~40 s
    ],
    ids=["residual-sampled", "residual-argmax", "bonus-sampled"],
)
def test_a_second_stage_confirms_at_the_power_its_plan_states(bug, greedy):
    """A 400-row pilot of the buggy loop sizes the second stage at α 1e-3 and power 0.9
    (`RoundsPower.row_shift`); 50 second stages of that many rows a side, the buggy loop's
    against p's (the speculation-off side), must confirm at least 37 times (the one-sided
    sign-flip test of the rows' log-LR at ρ = 1, as `attribution` runs it). Measured (2026-12-07, this
    seed, drawn after the test's design was fixed): 206, 274 and 8,461 rows a side, caught 46, 48
    and 50 of 50. The bonus bug under argmax drafts
    is left out: its second stage needs ~680,000 rows a side here (50 cells: hours)."""
    P, Q = tables(4)
    if greedy:
        Q = torch.nn.functional.one_hot(Q.argmax(-1), V).double()
    laws = {side: loop_law(P, Q, name, first="prefill") for side, name in (("on", bug), ("off", None))}
    g = torch.Generator().manual_seed(20261213)

    def draw(side: str, n: int) -> torch.Tensor:
        outputs = torch.tensor(list(laws[side]))
        weights = torch.tensor(list(laws[side].values()), dtype=torch.float64)
        return outputs[torch.multinomial(weights, n, True, generator=g)]

    rows = _score(P, Q, draw("on", 400)).power.row_shift(bug).rows_needed(ALPHA, POWER)
    assert math.isfinite(rows), (bug, greedy)
    caught = 0
    for _ in range(CELLS):
        on, off = (_score(P, Q, draw(side, int(rows))).row_scores(bug) for side in ("on", "off"))
        caught += sign_flip_test(on, off)[1] <= ALPHA
    assert caught >= FLOOR, (bug, greedy, caught, rows)
