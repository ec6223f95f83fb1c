"""An engine cell's looks (`losscheck.cells.engine.looks.look_tokens`): at most `LOOKS`, from the
floor to the design's tokens, geometric, as few as keep each within `GROWTH` times the one before,
each at least `MIN_GROWTH` times it."""

from __future__ import annotations

import pytest

from losscheck.cells.engine.looks import GROWTH, LOOKS, MIN_GROWTH, REBUILT_LOOKS, look_tokens, looks_allowed


@pytest.mark.parametrize(
    ("floor", "tokens", "expected"),
    [
        (2000, 9683, (2000, 3383, 5724, 9683)),  # the bundled T1 cell's design: 4.8 times the floor
        (768, 10067, (768, 1461, 2781, 5291, 10067)),  # the text target's T 0.3 cell: 13 times, five looks
        (753, 13249, (753, 1542, 3159, 6469, 13249)),  # top-k 8's: 17.6 times, more than LOOKS would double
        (2000, 4000, (2000, 4000)),  # one doubling: two looks
        (2000, 4001, (2000, 2829, 4001)),
        (2000, 2000, (2000,)),  # at the floor: one look
        (2000, 2100, (2100,)),  # within one growth step of the floor: one look at the design
        (2000, 3200, (2000, 3200)),
        (2000, 2600, (2000, 2600)),
    ],
)
def test_looks_run_from_the_floor_to_the_design(floor, tokens, expected):
    looks = look_tokens(floor, tokens)
    assert looks == expected
    assert len(looks) <= LOOKS and looks[-1] == tokens
    assert all(b >= a * MIN_GROWTH * (1 - 1e-3) for a, b in zip(looks, looks[1:]))
    if len(looks) < LOOKS:  # room for another look: each step within GROWTH
        assert all(b <= a * GROWTH * (1 + 1e-3) for a, b in zip(looks, looks[1:]))


def test_one_look_allowed_is_the_design_alone():
    assert look_tokens(2000, 9683, limit=1) == (9683,)
    assert look_tokens(768, 10067, limit=3) == (768, 2781, 10067)  # the limit caps what GROWTH asks


def test_an_engine_rebuilt_for_each_look_allows_fewer():
    """A later look of an engine kept one instance at a time is a build (a GPU engine's minute):
    three looks there, five where both sides stay alive, one without early stopping."""
    assert (looks_allowed(rebuilt=True), looks_allowed(rebuilt=False)) == (REBUILT_LOOKS, LOOKS) == (3, 5)
    assert looks_allowed(rebuilt=False, early_stop=False) == looks_allowed(rebuilt=True, early_stop=False) == 1
