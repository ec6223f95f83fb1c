"""The matrix plan (`losscheck.plan.matrix.plan`) and its tiers (`losscheck.plan.tiers`): the rules
CI depends on, checked on drafters that only declare their knobs (no models)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from losscheck.cells.record import CellRecord, RunFacts
from losscheck.core.precision import Precision
from losscheck.plan import matrix, tiers
from losscheck.plan.cell import ORACLE, Cell
from losscheck.serving import axis as serving_axes
from losscheck.serving.axis import Axis, Wrapped, serving

FP32, BF16 = Precision(), Precision("bf16", "bf16")


def drafter(ks=(1, 2, 4, 8), widths=()):
    return SimpleNamespace(block_lengths=tuple(ks), widths=tuple(widths))


def user_plan(precisions=(FP32,), engine=None):
    drafters = {"main": {"user": drafter(), ORACLE: drafter(range(1, 17))}}
    return matrix.plan(drafters, None, engine, precisions, frozenset({"user"}))


def ids(cells):
    return [c.id for c in cells]


def bundled_plan(which):
    """The plan of bundled set `which` on drafters declaring the bundled families' knobs, with
    the default options."""
    from losscheck.drafters.parallel import PATH_WIDTHS
    from losscheck.plan import bundled_sets
    from losscheck.run.options import Options

    knobs = {"A": drafter((1, 2, 4, 8, 16)), "E": drafter(range(1, 17), PATH_WIDTHS)}
    main = {name: knobs.get(name, drafter(range(1, 9))) for name in bundled_sets.families(which)}
    drafters = {"main": {**main, ORACLE: drafter((1, 2, 4, 8, 16))}, "small": {"A": drafter(), ORACLE: drafter()}}
    return matrix.plan(drafters, which, None, Options().precisions, frozenset({"A"}))


def test_cell_ids_are_unique_and_every_declared_k_has_a_greedy_cell():
    plan = user_plan((FP32, BF16))
    every = [c.id for arg in matrix.CELL_ARGS for c in plan[arg]]
    assert len(every) == len(set(every))
    assert {c.k for c in plan[matrix.GREEDY_CELL] if c.drafter == "user" and not c.serving} == {1, 2, 4, 8}
    assert {c.k for c in plan[matrix.GREEDY_CELL] if c.drafter == ORACLE} == set(range(1, 17))


def test_statistical_tests_count_every_statistical_cell_of_the_full_plan():
    plan = user_plan((FP32, BF16))
    assert matrix.statistical_tests(plan) == len(plan[matrix.PIT_CELL]) + len(plan[matrix.EXACT_CELL])
    assert len(matrix.entries(plan)) == sum(len(plan[arg]) for arg in matrix.CELL_ARGS)


def test_the_reference_set_is_a_whole_and_es_width_axis():
    """The main job's set: every cell family A and the oracle have in the set of every bundled
    drafter but the grammar cell (it needs xgrammar, `losscheck[grammar]`), and of family E (the
    one with a transition cache) the greedy cell at each declared width and the T=1 cells at its
    sampled widths, each full width included, nothing else."""
    reference, everything = bundled_plan("reference"), bundled_plan("all")
    assert [c.id for c in everything[matrix.PIT_CELL] if c.params.grammar is not None] == ["A-k4-T1-regex9c2771"]
    for arg in matrix.CELL_ARGS:
        kept = [
            (c.id, c.slow)
            for c in everything[arg]
            if c.drafter != "E" and c.drafter in ("A", ORACLE) and c.params.grammar is None
        ]
        assert [(c.id, c.slow) for c in reference[arg] if c.drafter != "E"] == kept, arg
    e_cells = [(c.id, c.slow) for arg in matrix.CELL_ARGS for c in reference[arg] if c.drafter == "E"]
    assert e_cells == [
        ("E-k4-greedy", False),
        ("E-k4-greedy-w1", False),
        ("E-k4-greedy-w2", False),
        ("E-k4-greedy-w4", False),
        ("E-k4-greedy-w16", False),
        ("E-k4-T1", True),
        ("E-k4-T1-w1", True),
        ("E-k4-T1-w4", True),
    ]
    counts = {arg: len(reference[arg]) for arg in matrix.CELL_ARGS}
    assert counts == {**dict.fromkeys(matrix.CELL_ARGS, 0), "greedy_cell": 27, "sampling_cell": 37, "exact_cell": 6}
    assert matrix.statistical_tests(reference) == 43


def test_the_bundled_sets_are_the_options_choices_and_each_family_has_a_loader():
    from losscheck.plan import bundled_sets
    from losscheck.run import drafters, options

    assert tuple(bundled_sets.SETS) == options.BUNDLED
    assert set(bundled_sets.families("all")) == set(drafters.LOADERS) >= set(bundled_sets.families("reference"))


def test_each_serving_axis_value_alone_is_a_quick_greedy_cell_and_a_slow_sampled_one():
    plan = user_plan()
    for axis in serving_axes.axes():
        for value in axis.values:
            along = serving(**{axis.name: value})
            greedy = [c for c in plan[matrix.GREEDY_CELL] if c.serving == along and c.drafter == "user"]
            sampled = [c for c in plan[matrix.PIT_CELL] if c.serving == along and c.drafter == "user"]
            assert [c.slow for c in greedy] == [False], (axis.name, value, ids(greedy))
            assert [c.slow for c in sampled] == [True], (axis.name, value, ids(sampled))
    assert not [c for arg in matrix.CELL_ARGS for c in plan[arg] if c.drafter == ORACLE and c.serving]


def test_pairs_of_axes_and_an_axis_in_reduced_precision_are_slow_tier_cells():
    plan = user_plan((FP32, BF16))
    pairs = [c for arg in matrix.CELL_ARGS for c in plan[arg] if len(c.serving) > 1]
    assert sorted(ids(pairs)) == sorted(
        f"user-k4-{mode}-{pair}"
        for mode in ("greedy", "T1")
        for pair in ("prefix-warm-cb", "prefix-warm-gaps3", "cb-gaps3")
    )
    reduced = [c for c in plan[matrix.GREEDY_CELL] if c.serving and c.precision == BF16]
    assert ids(reduced) == ["user-k4-greedy-bf16-tp2"]
    assert all(c.slow for c in pairs + reduced)


def test_the_tier_rules_say_why_and_each_moves_a_cell():
    context = tiers.TierContext(FP32, {"A": 4, "B": 4}, frozenset({"B"}))
    cases = {
        Cell("A", 4, tiers.EDGE_VARIANTS[0]): "edge sampling",
        Cell("A", 4, matrix.SAMPLING_VARIANTS[0], precision=BF16): "reduced-precision",
        Cell("A", 8, matrix.SAMPLING_VARIANTS[0]): "other block lengths",
        Cell("B", 4, matrix.SAMPLING_VARIANTS[0]): "bundled parallel",
        Cell("A", 3, matrix.GREEDY): "outside 1, 2, 4, 8, 16",
        Cell("A", 4, matrix.SAMPLING_VARIANTS[0], serving=serving(prefix="cold")): "serving axes",
    }
    for cell, reason in cases.items():
        found = tiers.slow_reasons(cell, context)
        assert len(found) == 1 and reason in found[0], (cell.id, found)
    assert tiers.slow_reasons(Cell("A", 4, matrix.SAMPLING_VARIANTS[0]), context) == []
    assert tiers.slow_reasons(Cell("A", 4, matrix.GREEDY, serving=serving(split=2)), context) == []
    assert len(tiers.SLOW_TIER) == len(cases)  # a rule no case exercises would be untested


def test_black_box_engine_cells_are_never_slow():
    engine = SimpleNamespace(k=3, precision="bf16")
    plan = user_plan((FP32, BF16), engine)
    cells = plan[matrix.ENGINE_CELL] + plan[matrix.ENGINE_GREEDY_CELL]
    assert cells and not [c for c in cells if c.slow]


def test_serving_refuses_unknown_axes_and_drops_base_values():
    assert serving(prefix="off", batching="continuous") == (("batching", "continuous"),)
    with pytest.raises(Exception, match="no serving axis 'speed'"):
        serving(speed=2)
    with pytest.raises(Exception, match="'split' cannot be combined with \\['prefix'\\]"):
        serving(split=2, prefix="warm")  # a split run's ranks run the engine without a prefix cache


class Reversed(Wrapped):
    """A toy axis for the test below: serves each call's rows in reverse order (which must not
    change any request's output) and restores the order."""

    def __init__(self, value, inner, context):
        super().__init__(inner)

    def generate(self, calls):
        import dataclasses

        from losscheck.core.generation import Generation

        flipped = [dataclasses.replace(c, prompts=c.prompts[::-1]) for c in calls]
        out = []
        for gen in self.inner.generate(flipped):
            order = list(range(len(gen.tokens)))[::-1]
            slots = None if gen.slots is None else gen.slots[order]
            out.append(Generation(gen.tokens[order], gen.lengths[order], gen.stats, gen.params, slots=slots))
        return out

    def facts(self):
        return {**self.inner.facts(), "order": {"summary": "rows served in reverse order"}}


TOY = Axis("order", "forward", ("reversed",), lambda v: "rev", Reversed, order=9, doc="rows served in reverse order")


def test_a_new_axis_is_one_registration(monkeypatch, session):
    """What adding an axis takes: an `Axis` in a module of `losscheck.serving` (here patched into
    the registry). The plan, ids, tiers, serving and record follow with no other change."""
    from losscheck.cells.greedy import run_greedy
    from losscheck.run.context import CellContext

    registered = serving_axes.axes()
    monkeypatch.setattr(serving_axes, "axes", lambda: (*registered, TOY))
    plan = user_plan()
    new = [c for arg in matrix.CELL_ARGS for c in plan[arg] if c.axis("order") == "reversed"]
    assert [(c.id, c.slow) for c in new] == [("user-k4-greedy-rev", False), ("user-k4-T1-rev", True)]
    cell = Cell("A", 4, matrix.GREEDY, serving=serving(order="reversed"))
    # a session of its own: the shared one must not cache a plan made while the toy axis is registered
    outcome = run_greedy(CellContext.of(session.derive(), cell))
    assert outcome.passed, outcome.message()
    record = outcome.to_record(RunFacts("test_greedy.py::test_greedy_equals_baseline[A-k4-greedy-rev]", "passed"))
    assert record.cell == "A-k4-greedy-rev" and record.serving["order"] == "reversed"
    assert record.serving_facts["order"]["summary"] == "rows served in reverse order"
    assert CellRecord.from_json(json.loads(json.dumps(record.to_json()))) == record


def test_costly_cells_are_estimated_costlier():
    """The run order (costliest first, `losscheck.plan.cost`) puts reduced-precision and long-block
    sampled cells before the base ones, and greedy cells last."""
    from losscheck.plan.cost import estimated_seconds

    order = [
        Cell("A", 4, matrix.SAMPLING_VARIANTS[0], precision=BF16),
        Cell("A", 16, matrix.SAMPLING_VARIANTS[0]),
        Cell("A", 4, matrix.SAMPLING_VARIANTS[0], serving=serving(prefix="warm")),
        Cell("A", 4, matrix.SAMPLING_VARIANTS[0]),
        Cell("A", 4, matrix.SAMPLING_VARIANTS[0], target="small"),
        Cell("A", 4, matrix.GREEDY),
    ]
    costs = [estimated_seconds(c) for c in order]
    assert costs == sorted(costs, reverse=True) and len(set(costs)) == len(costs), costs


def test_the_split_cells_lead_the_run_order_one_after_another():
    """`run_order` on the main job's plan: costliest first, except that the split cells (whose
    ranks fork from one forkserver per process) come first and together, so that the first
    worker's first xdist chunk holds them all."""
    from losscheck.plan.cost import estimated_seconds, run_order, runs_elsewhere

    plan = bundled_plan("reference")
    cells = [c for arg in matrix.CELL_ARGS for c in plan[arg]]
    order = [cells[i] for i in run_order(cells)]
    split = [runs_elsewhere(c) for c in order]
    assert sorted(order, key=lambda c: c.id) == sorted(cells, key=lambda c: c.id)  # each cell once
    assert 2 <= sum(split) <= 8 and split == sorted(split, reverse=True), [c.id for c in order][:10]
    assert all("tp2" in c.id for c in order[: sum(split)])
    rest = [estimated_seconds(c) for c in order[sum(split) :]]
    assert rest == sorted(rest, reverse=True)


def test_a_large_vocabulary_scales_the_estimate_of_sampled_cells_only():
    """The 8,192-token text target weighs about what the bundled target does, yet its black-box
    one-sample cells without a cut-off took 36-103 s (HF assisted generation, 2026-12-07) where the
    bundled target's take a few seconds: sampled cells scale by 1 + V / 3,500, greedy ones by
    weights alone."""
    import json

    from losscheck import bundled
    from losscheck.plan.cost import target_scale
    from losscheck.plan.modes import MODES, Mode

    text = json.loads((bundled.fixtures_dir() / "text_target" / "config.json").read_text())
    reference = json.loads((bundled.target_path() / "config.json").read_text())
    assert target_scale(text, Mode.ENGINE_GREEDY) == target_scale(text, Mode.GREEDY) == 1.0
    one_sample = target_scale(text, Mode.ONE_SAMPLE) * MODES[Mode.ONE_SAMPLE].base_seconds
    assert 36 < one_sample < 103, one_sample
    assert target_scale(reference, Mode.ONE_SAMPLE) == target_scale(reference, Mode.PIT) == 1.0


def test_the_others_set_and_the_reference_set_split_the_whole_bundled_matrix():
    """The main job certifies "reference", CI's test step the quick gate of "others": together
    every cell of "all", none twice."""
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    ids = {
        which: [c.id for cells in Session(Options(bundled=which), skeleton=True).plan.values() for c in cells]
        for which in ("reference", "others", "all")
    }
    assert len(set(ids["others"])) == len(ids["others"]) and not set(ids["reference"]) & set(ids["others"])
    assert sorted(ids["reference"] + ids["others"]) == sorted(ids["all"])


def test_a_runs_own_sampling_parameters_add_one_quick_cell_each_on_the_base_cell():
    """`--losscheck-sampling`: one PIT cell per asked parameter set on the drafter's base cell (the
    oracle's plan unchanged), one more sampled cell for an engine; one already planned is not
    planned twice."""
    from losscheck.plan.sampling_spec import parse_sampling

    asked = [parse_sampling("repetition_penalty=1.2 min_p=0.05"), parse_sampling("repetition_penalty=1.5")]
    drafters = {"main": {"user": drafter(), ORACLE: drafter(range(1, 17))}}
    base = matrix.plan(drafters, None, None, (FP32,), frozenset({"user"}))
    plan = matrix.plan(drafters, None, None, (FP32,), frozenset({"user"}), sampling=asked)
    added = [c for c in plan[matrix.PIT_CELL] if c not in base[matrix.PIT_CELL]]
    assert [(c.id, c.slow) for c in added] == [("user-k4-T1-minp0.05-rep1.2", False)]  # rep1.5 is planned already
    engine = SimpleNamespace(k=3, precision=None)
    sampled, _ = matrix.engine_cells(engine, (), False, asked)
    assert ids(sampled)[-2:] == ["engine-k3-T1-minp0.05-rep1.2-two-sample", "engine-k3-T1-rep1.5-two-sample"]
