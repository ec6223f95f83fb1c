"""Where sequences end (`losscheck.cells.ends`): the exact check, and the stop-leak mutant it catches."""

from __future__ import annotations

import torch

from losscheck.cells.ends import end_problems
from losscheck.core.generation import Generation, LoopStats
from losscheck.core.sampling import SamplingParams
from tests.support import noisy_drafter, tiny_target

EOS, STOP = 1, 7


def _gen(rows: list[list[int]], budget: int = 6, **params: object) -> Generation:
    tokens = torch.zeros(len(rows), budget, dtype=torch.long)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(r) for r in rows])
    return Generation(tokens, lengths, LoopStats.empty(1), SamplingParams(stop_ids=(STOP,), **params))


def test_rows_that_end_where_they_should_have_no_problem() -> None:
    assert end_problems(_gen([[3, 4, EOS], [3, STOP], [3, 4, 5, 6, 8, 9]]), EOS) == []


def test_a_token_after_an_end_an_early_stop_and_an_overrun_are_named() -> None:
    (leak,) = end_problems(_gen([[3, STOP, 4], [3, 4, 5, 6, 8, 9]]), EOS)
    assert "1 of 2 rows emitted tokens after an end token" in leak and "row 0: 3 tokens, first end at 1" in leak
    (silent,) = end_problems(_gen([[3, 4], [3, EOS]]), EOS)
    assert "1 of 2 rows stopped before their budget with no end token (row 0: 2 tokens" in silent
    (early,) = end_problems(_gen([[3, EOS]], min_tokens=4), EOS)
    assert "ended before min_tokens=4" in early
    over = _gen([[3, 4]], budget=2)
    over.lengths[0] = 3
    assert "longer than the budget of 2 tokens" in end_problems(over, EOS)[0]


def test_the_stop_leak_mutant_is_caught_and_the_correct_rule_passes() -> None:
    from losscheck.core.engine import Engine
    from losscheck.selftest.end_bugs import stop_checked_on_last_token

    target = tiny_target()
    drafter = noisy_drafter(target, 0.05)
    prompts = [[2, 3, 4], [5, 6], [9, 10, 11]] * 8
    params = SamplingParams(stop_ids=(3, 4, 5, 6))  # frequent enough to end inside blocks of 4
    right = Engine(target, drafter, k=4).generate(prompts, 24, params, torch.Generator().manual_seed(0))
    assert end_problems(right, target.eos_id) == []
    assert int((right.lengths < 24).sum()) > 10  # the stops did end rows early
    leaky = Engine(target, drafter, k=4, ends=stop_checked_on_last_token)
    wrong = leaky.generate(prompts, 24, params, torch.Generator().manual_seed(0))
    assert any("after an end token" in p for p in end_problems(wrong, target.eos_id))


def test_the_budget_before_stop_mutant_leaks_only_where_an_end_meets_the_budget() -> None:
    from losscheck.core.engine import Engine, emit_counts
    from losscheck.selftest.end_bugs import budget_checked_before_stop

    emitted = torch.tensor([[5, STOP, 8, 9, 2], [5, STOP, 8, 9, 2]])  # [B, k+1]
    count, room = torch.tensor([5, 5]), torch.tensor([4, 9])  # row 0 fills its budget this round
    assert emit_counts(emitted, count, room, EOS, (STOP,))[0].tolist() == [2, 2]
    assert budget_checked_before_stop(emitted, count, room, EOS, (STOP,))[0].tolist() == [4, 2]

    target = tiny_target()
    drafter = noisy_drafter(target, 0.05)
    prompts = [[2, 3, 4], [5, 6], [9, 10, 11]] * 8
    params = SamplingParams(stop_ids=(3, 4, 5, 6))
    right = Engine(target, drafter, k=4).generate(prompts, 5, params, torch.Generator().manual_seed(0))
    assert end_problems(right, target.eos_id) == []
    leaky = Engine(target, drafter, k=4, ends=budget_checked_before_stop)  # a first round of 5 may fill the budget
    wrong = leaky.generate(prompts, 5, params, torch.Generator().manual_seed(0))
    assert any("after an end token" in p for p in end_problems(wrong, target.eos_id))


def test_ends_inside_a_block_are_counted_by_their_slot() -> None:
    """k = 4: an end at slots 0-3 had drafted positions after it in its round; at slot 4 (the bonus
    after four accepted drafts) it closed its block; a row cut by its budget did not end."""
    from losscheck.cells.ends import EndCounts, ends_in_blocks

    gen = _gen([[3, 4, EOS], [3, STOP], [3, 4, 5, 6, 8, 9], [3, 4, 5, 6, 8, EOS]])
    gen.stats = LoopStats.empty(4)
    assert ends_in_blocks(gen, EOS) is None  # no slots: nothing to count
    gen.slots = torch.tensor([[0, 1, 2, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 0]])
    gen.slots[3, 5] = 0  # its EOS the first token of a new round
    assert ends_in_blocks(gen, EOS) == EndCounts(3, 3, 0, 0)
    gen.slots[0, 2] = 4  # the EOS as a bonus: its block ended with it
    assert ends_in_blocks(gen, EOS) == EndCounts(3, 2, 0, 0)
