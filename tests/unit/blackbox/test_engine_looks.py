"""An engine cell's looks (`losscheck.cells.engine.looks.look_tokens`): at most `LOOKS`, from the
floor to the design's tokens, geometric, each at least `MIN_GROWTH` times the one before."""

from __future__ import annotations

import pytest

from losscheck.cells.engine.looks import LOOKS, MIN_GROWTH, look_tokens


@pytest.mark.parametrize(
    ("floor", "tokens", "expected"),
    [
        (2000, 9683, (2000, 4401, 9683)),  # the bundled T1 cell's design: floor, geometric middle, design
        (2000, 2000, (2000,)),  # at the floor: one look
        (2000, 2100, (2100,)),  # within one growth step of the floor: one look at the design
        (2000, 3200, (2000, 2530, 3200)),
        (2000, 2600, (2000, 2600)),  # room for two looks, not three
    ],
)
def test_looks_run_from_the_floor_to_the_design(floor, tokens, expected):
    looks = look_tokens(floor, tokens)
    assert looks == expected
    assert len(looks) <= LOOKS and looks[-1] == tokens
    assert all(b >= a * MIN_GROWTH * (1 - 1e-3) for a, b in zip(looks, looks[1:]))


def test_one_look_allowed_is_the_design_alone():
    assert look_tokens(2000, 9683, limit=1) == (9683,)
