"""One GPU's memory: an engine that keeps one instance alive at a time (`Policy.ONE_AT_A_TIME`) is
certified end to end through the real engine cells, its sides drawn side by side
(`losscheck.cells.engine.phases`), with a fake whose build fails while another instance or
losscheck's reference target is alive, and whose builds follow the memory plan `--list` prints."""

from __future__ import annotations

import dataclasses

import pytest

from losscheck import bundled
from losscheck.engines import EngineCounters, GenerationRequest
from losscheck.engines.pool import Instances, Policy

BUILDS: list[bool] = []  # the sides the fake built, in order (reset by the fixture)


class OneAtATime:
    """losscheck's own loop (lossless) behind an `Instances` under ONE_AT_A_TIME: each side is a
    fresh copy of the bundled target and drafter, as a GPU engine loads its weights per instance."""

    precision = "fp32"

    def __init__(self, models_loaded) -> None:
        self.k, self.name = 4, "one-at-a-time(spec-loop, k=4)"
        self.models_loaded = models_loaded  # -> the reference targets losscheck holds now
        self.instances: Instances[bool, object] = Instances(self._build, Policy.ONE_AT_A_TIME)
        self.counted = EngineCounters(drafts=0, drafted=0, accepted=0, accepted_per_position=(0,) * 4, emitted=0)

    def _build(self, speculative: bool):
        from losscheck.core.target import HFTarget
        from losscheck.engines.spec_loop import spec_loop

        if self.instances.alive():
            raise AssertionError(f"built the {speculative} side with {self.instances.alive()} alive")
        if self.models_loaded():
            raise AssertionError(f"built an instance with the reference target {self.models_loaded()} loaded")
        BUILDS.append(speculative)
        return spec_loop(HFTarget.from_pretrained(bundled.target_path()))

    def generate(self, request: GenerationRequest):
        engine = self.instances.get(request.speculative)
        before = engine.counters()
        out = engine.generate(request)
        self.counted = self.counted.plus(engine.counters().since(before))  # kept across rebuilds
        return out

    def counters(self) -> EngineCounters:
        return self.counted


def one_at_a_time_engine(target):
    """`--losscheck-engine=tests.cells.blackbox.test_one_at_a_time:one_at_a_time_engine`."""
    return OneAtATime(lambda: ())


def _session(alongside: bool, some: bool = False):
    """An engine-only run of the fake at a detectable TV of 0.1 (small samples); `alongside`: the
    plugin's order, the engine cells drawn side by side, else each cell alone; `some`: the first
    sampled cell and the greedy one only."""
    from losscheck.plan.profiles import PROFILES
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    options = Options(
        engine="tests.cells.blackbox.test_one_at_a_time:one_at_a_time_engine",
        profile=PROFILES["ci"].with_detect_tv(0.1),
    )
    session = Session(options)
    engine = session.blackbox
    assert isinstance(engine, OneAtATime)
    engine.models_loaded = session.models.loaded
    load = session.models.target

    def target(name, dtype):  # the reference target never loads beside an engine instance
        assert not engine.instances.alive(), f"the reference target loaded with {engine.instances.alive()} alive"
        return load(name, dtype)

    session.models.target = target  # type: ignore[method-assign]
    cells = [c for arg in ("engine_cell", "engine_greedy_cell") for c in session.plan[arg]]
    if some:
        cells = [cells[0], cells[-1]]
    if alongside:
        session.engine_cells = tuple(cells)
    return session, cells


def _certify(alongside: bool, some: bool = False):
    from losscheck.cells.engine import run_engine_cell
    from losscheck.run.context import CellContext

    BUILDS.clear()
    session, cells = _session(alongside, some)
    outcomes = [run_engine_cell(CellContext.of(session, cell)) for cell in cells]
    return session, cells, outcomes, list(BUILDS)


@pytest.mark.usefixtures("one_thread")
def test_a_one_at_a_time_engine_is_certified_side_by_side_within_its_memory_plan():
    from losscheck.plan import memory

    session, cells, outcomes, builds = _certify(alongside=True)
    assert all(o.passed for o in outcomes), [o.message() for o in outcomes if not o.passed]
    assert {c.mode for c in cells} == {"one-sample", "engine-greedy"} and len(cells) == 6
    # speculative: pilots and the greedy cell's on side; speculative: samples' first looks, then one
    # build per later look any cell took (drawn side by side); plain: the greedy off side. No first
    # stage rejected, so no attribution rows: the plan's worst case has one more of each side.
    later = max(o.facts.looks.stopped_at for o in outcomes if o.facts.looks) - 1
    assert builds == [True, True, *[True] * later, False]
    assert later == 1  # the top-k cell's design reaches target_temperature_1.1 at its cap: ruled out at look 2
    # a class reached partly has its second stage sized for it too (drawn only after a rejection)
    from losscheck.stats.second_stage import stage_one_power, stage_two_power

    partial = [
        (o.cell.id, n, c) for o in outcomes for n, c in (o.facts.bug_classes or {}).items() if c.reach == "partial"
    ]
    assert partial, "no class reached partly: the top-k cell's design changed"
    assert all(c.second_stage_power >= stage_two_power(session.options.profile.power) for _, _, c in partial), partial
    assert all(o.facts.attribution is None for o in outcomes)
    # β_r of each covered member the looks rule out, fixed from the pilot: at most the default, at
    # least the default / RULE_OUT_SHRINK; the claims are the tests' power less it
    from losscheck.stats import sequential

    default = (1 - stage_one_power(session.options.profile.power)) * sequential.RULE_OUT_SHARE
    betas = [
        b
        for o in outcomes
        if o.facts.looks and len(o.facts.looks.tokens) > 1
        for b in o.facts.looks.rule_out_betas.values()
    ]
    assert betas and all(
        default / sequential.RULE_OUT_SHRINK * (1 - 1e-9) <= b <= default * (1 + 1e-9) for b in betas
    ), betas
    assert min(betas) < default / 10  # some rule-outs pass the first look by far: their β_r is the pilot's
    plan = memory.phases([(c.mode, True) for c in cells])
    engine_phases = [p.alive for p in plan if p.alive != memory.TARGET]
    assert engine_phases == [memory.SPECULATIVE] * 4 + [memory.PLAIN]
    assert memory.memory_lines([(c.mode, True) for c in cells], "one-at-a-time")[-1].startswith(
        "  engine instances built: 5; scoring phases: 4"
    )
    assert len(builds) <= 5
    # every cell still has its own counts of the engine's speculative calls
    assert all(o.facts.engine_counters is not None and o.facts.engine_counters.drafts > 0 for o in outcomes)


@pytest.mark.slow  # a supporting check (~15 s): the quick tier keeps the certificate end to end
@pytest.mark.usefixtures("one_thread")
def test_drawn_side_by_side_or_cell_by_cell_the_samples_and_verdicts_are_the_same():
    """The order of the draws changes no seed: the same p-values either way, at more builds."""
    _, cells, together, builds_together = _certify(alongside=True, some=True)
    _, _, alone, builds_alone = _certify(alongside=False, some=True)
    assert [c.mode for c in cells] == ["one-sample", "engine-greedy"]
    assert [o.verdict for o in together] == [o.verdict for o in alone]
    assert [o.divergences for o in together] == [o.divergences for o in alone]
    untimed = [[dataclasses.replace(o.facts, phases=None) for o in run] for run in (together, alone)]
    assert untimed[0] == untimed[1]  # all but the wall-clock phases
    # alone, the one-sample cell builds 2 (pilot, the reference target, sample), the greedy cell 2
    assert builds_alone == [True, True, True, False] and builds_together == [True, True, False]


class Device:
    """A simulated accelerator of `budget` units: each thing placed on it holds its units, and one
    that would pass the budget refuses to be built (as a CUDA allocation past the device would)."""

    def __init__(self, budget: int) -> None:
        self.budget, self.held, self.peak = budget, {}, 0

    def take(self, what: str, units: int) -> None:
        if what in self.held:
            return
        if sum(self.held.values()) + units > self.budget:
            raise MemoryError(f"{what} ({units} units) does not fit beside {self.held} on {self.budget}")
        self.held[what] = units
        self.peak = max(self.peak, sum(self.held.values()))

    def give(self, what: str) -> None:
        self.held.pop(what, None)


# an instance, the reference target and the draft model: any instance beside anything else passes
# the budget, the reference and the draft model together fit
INSTANCE, REFERENCE, DRAFT, BUDGET = 6, 5, 3, 8


class WithDraftModel(OneAtATime):
    """`OneAtATime` on a simulated `Device`, with drafter A as the draft model losscheck
    teacher-forces (so its one-sample cells judge the verifier's classes): its forward runs only
    while it is on the device."""

    device = Device(BUDGET)

    def __init__(self, models_loaded) -> None:
        super().__init__(models_loaded)
        self.instances.release = lambda side, _: self.device.give(f"instance {side}")
        self.draft_forwards = 0

    def _build(self, speculative: bool):
        self.device.take(f"instance {speculative}", INSTANCE)
        return super()._build(speculative)

    def draft_model(self):
        from losscheck.core.target import load_causal_lm

        model = load_causal_lm(bundled.fixtures_dir() / "drafter_a")

        def on_device(module, args) -> None:
            assert "draft model" in self.device.held, "the draft model ran while off the device"
            self.draft_forwards += 1

        model.register_forward_pre_hook(on_device)
        return model


def _on_device(session, engine: WithDraftModel) -> None:
    """The run's reference target and draft model take and give the simulated device's memory."""
    models, device = session.models, engine.device
    load, release, place, park = models.target, models.release, models.place_drafts, models.park_drafts

    def target(name, dtype):
        device.take("reference", REFERENCE)
        return load(name, dtype)

    def released(name):
        release(name)
        device.give("reference")

    def placed():
        if models._drafts:
            device.take("draft model", DRAFT)
        place()

    def parked():
        park()
        if not models.loaded():  # what losscheck still holds on the device keeps its units
            device.give("draft model")

    models.target, models.release, models.place_drafts, models.park_drafts = target, released, placed, parked


def test_an_engine_reference_and_draft_model_on_one_device_are_certified_within_its_budget(monkeypatch):
    """Must-show (issue 57): an engine instance, the reference target and the engine's draft model
    each refuse to be built past a simulated device's budget, and the engine is certified end to
    end, the verifier's classes judged through the draft model; kept on the device beside the
    instances, the draft model refuses the next build."""
    from losscheck.cells.engine import run_engine_cell
    from losscheck.plan.profiles import PROFILES
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    def certify(session):
        engine = session.blackbox
        engine.models_loaded = lambda: ()  # the device's budget is the check here
        _on_device(session, engine)
        cells = [c for arg in ("engine_cell", "engine_greedy_cell") for c in session.plan[arg]]
        cells = [cells[0], cells[-1]]
        session.engine_cells = tuple(cells)
        return engine, [run_engine_cell(CellContext.of(session, cell)) for cell in cells]

    def session():
        WithDraftModel.device = Device(BUDGET)
        options = Options(
            engine="tests.cells.blackbox.test_one_at_a_time:with_draft_model",
            profile=PROFILES["ci"].with_detect_tv(0.1),
        )
        return Session(options)

    engine, outcomes = certify(session())
    assert all(o.passed for o in outcomes), [o.message() for o in outcomes]
    from losscheck.stats.hidden_rounds import CLASSES

    sampled = outcomes[0].facts
    assert sampled.draft_law is not None and sampled.draft_law.verdict == "consistent"
    judged = {c.name for c in CLASSES} & set(sampled.bug_classes or {})
    assert judged and all(sampled.bug_classes[name].covered for name in judged), sampled.bug_classes
    assert engine.draft_forwards > 0 and engine.device.peak <= BUDGET

    from losscheck.run.models import Models

    monkeypatch.setattr(Models, "park_drafts", lambda self: None)  # the draft model stays beside the instances
    with pytest.raises(MemoryError, match=r"instance True \(6 units\) does not fit beside \{'draft model': 3\}"):
        certify(session())


def with_draft_model(target):
    """`--losscheck-engine=tests.cells.blackbox.test_one_at_a_time:with_draft_model`."""
    return WithDraftModel(lambda: ())
