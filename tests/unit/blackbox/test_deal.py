"""A one-sample engine cell's rows dealt to its prompts (`losscheck.cells.engine.deal`): a look
draws whole rows, every P of them one more row for each prompt, a part of the prompts in a seeded
order in between."""

from __future__ import annotations

import pytest

from losscheck.cells.engine.deal import Dealer, Hand


def test_rows_are_dealt_to_the_prompts_in_a_seeded_order_one_cycle_after_another():
    dealer = Dealer.seeded(5, seed=11)
    assert sorted(dealer.order) == list(range(5))
    (first,) = dealer.deal(2)  # a first look of two rows: the first two prompts of the order, one row each
    assert first == Hand(tuple(sorted(dealer.order[:2])), 1, (0, 0))
    second = dealer.deal(9)  # seven more: one for every prompt, then the next two of the order
    assert second[0] == Hand((0, 1, 2, 3, 4), 1, tuple(1 if i in first.prompts else 0 for i in range(5)))
    assert second[1].prompts == tuple(sorted(dealer.order[2:4])) and second[1].n == 1
    assert dealer.dealt == 9 and sum(dealer.held) == 9
    assert max(dealer.held) - min(dealer.held) <= 1  # every prompt within one row of the others
    third = dealer.deal(20)  # eleven more: two for every prompt, then the last of the order
    assert third[0].n == 2 and third[1].prompts == (dealer.order[4],)
    assert dealer.held == [4] * 5
    (fourth,) = dealer.deal(20)  # a look asks for at least one more row than the last
    assert fourth.n == 1 and len(fourth.prompts) == 1 and dealer.dealt == 21


def test_the_order_is_the_seeds_and_the_rows_each_prompt_held_mark_its_first_rows():
    assert Dealer.seeded(48, seed=3).order == Dealer.seeded(48, seed=3).order
    assert Dealer.seeded(48, seed=3).order != Dealer.seeded(48, seed=4).order
    hand = Hand((0, 2), 3, (1, 4))  # prompt 0 held one row, prompt 2 four; three more each
    # prompt-major: prompt 0's rows 1, 2, 3 and prompt 2's rows 4, 5, 6 against the first five
    assert hand.first_rows(5).tolist() == [True, True, True, True, False, False]
    with pytest.raises(ValueError, match="at least one prompt"):
        Dealer.seeded(0, seed=1)
