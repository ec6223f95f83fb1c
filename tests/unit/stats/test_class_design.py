"""How a cell's design sizes its tested sample from its classes' needs (`ClassDesign.of`): the
covered classes' largest need with the margin, and the cap when a class beyond it is reached at
the partial power, so that a cell's early stop waits for that class's rule-out instead of stopping
at the covered classes' tokens (the covered classes' promises still made at their own tokens).
Each answer is read off the needs by hand (margin 1.25, cap 1,000)."""

from __future__ import annotations

import math

from losscheck.stats.sample_size import DESIGN_MARGIN, ClassDesign

BENCH = "lr_bound"  # a benchmark, never the best test
CAP, FLOOR = 1_000, 100


def needs(**tokens: float) -> dict[str, dict[str, float]]:
    """One test per class, beside a benchmark that would always be cheapest."""
    return {name: {"pit.ks": n, BENCH: 1.0} for name, n in tokens.items()}


def test_the_covered_classes_largest_need_with_the_margin_sizes_the_design():
    design = ClassDesign.of(needs(a=200, b=600, c=5_000), BENCH, FLOOR, CAP)
    assert design.covered == ("a", "b")  # c needs 6,250 with the margin: beyond the cap
    assert design.tokens == math.ceil(600 * DESIGN_MARGIN) == 750
    assert design.best["a"] == ("pit.ks", 200) and design.reached == ()


def test_a_class_beyond_the_cap_reached_at_the_partial_power_takes_the_design_to_the_cap():
    design = ClassDesign.of(needs(a=200, b=600, c=5_000), BENCH, FLOOR, CAP, partial=needs(a=80, b=240, c=900))
    assert design.covered == ("a", "b") and design.reached == ("c",)
    assert design.tokens == CAP
    # the covered classes' family members are promised at their own tokens, not at the cap
    assert design.promising == 750


def test_a_class_the_cap_does_not_reach_even_partly_leaves_the_design_at_the_covered_need():
    design = ClassDesign.of(needs(a=200, b=600, c=5_000), BENCH, FLOOR, CAP, partial=needs(a=80, b=240, c=1_001))
    assert design.reached == () and design.tokens == design.promising == 750


def test_a_class_just_beyond_the_cap_by_its_margin_is_reached_not_covered():
    # 850 tokens: 1,063 with the margin, beyond the cap; at the partial power it needs 400
    design = ClassDesign.of(needs(a=850), BENCH, FLOOR, CAP, partial=needs(a=400))
    assert design.covered == () and design.reached == ("a",) and design.tokens == CAP


def test_a_covered_class_is_never_counted_as_reached_and_without_partial_needs_nothing_is():
    design = ClassDesign.of(needs(a=200), BENCH, FLOOR, CAP, partial=needs(a=80))
    assert design.covered == ("a",) and design.reached == () and design.tokens == 250
    plain = ClassDesign.of(needs(a=200, c=5_000), BENCH, FLOOR, CAP)
    assert plain.reached == () and plain.tokens == 250


def test_the_floor_and_the_pooled_tests_need_still_bound_the_design():
    assert ClassDesign.of(needs(a=10), BENCH, FLOOR, CAP).tokens == FLOOR
    pooled = ClassDesign.of(needs(a=10, c=5_000), BENCH, FLOOR, CAP, pooled=1_500, partial=needs(a=5, c=900))
    assert pooled.tokens == 1_500 and pooled.floor == 1_500  # the pooled tests' need is above the cap
