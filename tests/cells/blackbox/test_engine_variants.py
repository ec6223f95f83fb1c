"""An engine certified over its axes (`losscheck.engines.registry.EngineAxis`), end to end through
the real engine cells: a registered fake adapter whose variants (another block length, another
batch shape) are built when their cells run, one variant alive at a time — its build fails while
an instance of any variant, or losscheck's reference target, is alive — each variant's cells drawn
side by side; and a variant that breaks losslessness fails its own cells only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from losscheck import bundled
from losscheck.engines import GenerationRequest
from losscheck.engines.named import ADAPTERS
from losscheck.engines.pool import Instances, Policy
from losscheck.engines.registry import EngineAxis, EngineRequest, option, register

LIVE: list[str] = []  # the instances alive now, of every variant
BUILDS: list[tuple[str, bool]] = []  # (engine name, side) of every build, in order


@dataclass(frozen=True)
class FakeOptions:
    k: int = option(4, minimum=1)
    batch: int = option(64, minimum=1, help="rows per call of the loop")
    broken: bool = option(False, help="the speculative side answers each prompt with the next prompt's rows")


class Variant:
    """losscheck's own loop (lossless) at block length `k` and `batch` rows per call, each side a
    fresh copy of the bundled target and drafter under ONE_AT_A_TIME."""

    precision = "fp32"

    def __init__(self, options: FakeOptions) -> None:
        self.k, self.options = options.k, options
        self.name = f"fake-axes(k={options.k}, batch={options.batch}{', broken' if options.broken else ''})"
        self.models_loaded = lambda: ()
        self.instances: Instances[bool, object] = Instances(self._build, Policy.ONE_AT_A_TIME, self._release)

    def _build(self, speculative: bool):
        from losscheck.core.target import HFTarget
        from losscheck.drafters.autoregressive import from_path
        from losscheck.engines.spec_loop import SpecLoopEngine

        if LIVE:
            raise AssertionError(f"built {self.name} ({speculative}) with {LIVE} alive")
        if self.models_loaded():
            raise AssertionError(f"built {self.name} with the reference target {self.models_loaded()} loaded")
        LIVE.append(self.name)
        BUILDS.append((self.name, speculative))
        target = HFTarget.from_pretrained(bundled.target_path())
        drafter = from_path(bundled.fixtures_dir() / "drafter_a", target)
        return SpecLoopEngine(target, drafter, self.k, batch=self.options.batch)

    def _release(self, speculative: bool, instance: object) -> None:
        LIVE.remove(self.name)

    def generate(self, request: GenerationRequest):
        if self.options.broken and request.speculative:
            request = dataclasses.replace(request, prompts=request.prompts[1:] + request.prompts[:1])
        return self.instances.get(request.speculative).generate(request)  # type: ignore[attr-defined]


def _set(key: str):
    def vary(request: EngineRequest, value):
        args = {**request.args, key: value}
        return None if args == request.args else dataclasses.replace(request, args=args)

    return vary


AXES = (
    EngineAxis("k", (2,), _set("k"), "another block length"),
    EngineAxis("batch", (7,), _set("batch"), "another batch shape: 7 rows per call"),
    EngineAxis("broken", (True,), _set("broken"), "a planted bug: rows of the wrong prompt"),
)


@pytest.fixture(autouse=True, scope="module")
def fake_axes_adapter():
    """The adapter "fake-axes", registered for this module's tests only (the registry is the
    process's: left registered, it would show in every later listing of adapters)."""
    register(
        "fake-axes",
        "losscheck's loop with axes (tests)",
        options=FakeOptions,
        inputs=lambda request, name: None,
        build=lambda target, request, options: Variant(options),
        axes=AXES,
    )
    yield
    del ADAPTERS["fake-axes"]


def _session(scope: str):
    from losscheck.plan.profiles import PROFILES
    from losscheck.plan.scope import parse_scope
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    options = Options(engine="fake-axes", profile=PROFILES["ci"].with_detect_tv(0.1), scope=parse_scope(scope))
    session = Session(options)
    load, build = session.models.target, session._build_variant

    def target(name, dtype):  # the reference target never loads beside an engine instance
        assert not LIVE, f"the reference target loaded with {LIVE} alive"
        return load(name, dtype)

    def variant(cell):
        engine = build(cell)
        engine.models_loaded = session.models.loaded  # type: ignore[attr-defined]
        return engine

    session.models.target = target  # type: ignore[method-assign]
    session._build_variant = variant  # type: ignore[method-assign]
    session.blackbox.models_loaded = session.models.loaded  # type: ignore[union-attr]
    return session


def _certify(session, cells):
    from losscheck.cells.blackbox import run_engine_cell
    from losscheck.run.context import CellContext

    LIVE.clear()
    BUILDS.clear()
    # the plugin's order: the cells of each variant together (`pytest_collection_modifyitems`)
    rank: dict[object, int] = {}
    for cell in cells:
        rank.setdefault(cell.variant, len(rank))
    cells = sorted(cells, key=lambda c: rank[c.variant])
    session.engine_cells = tuple(cells)
    return cells, [run_engine_cell(CellContext.of(session, cell)) for cell in cells]


@pytest.mark.usefixtures("one_thread")
def test_an_engine_is_certified_over_its_axes_one_variant_alive_at_a_time():
    session = _session("-broken")
    plan = session.plan
    assert [o["cell"] for o in session.out_of_scope] == ["engine-k4-T1-broken-True", "engine-k4-greedy-broken-True"]
    every = plan["engine_cell"] + plan["engine_greedy_cell"]
    # the base cells of the sampling parameters beyond T = 1 are the plain engine certificate's
    cells, outcomes = _certify(session, [c for c in every if c.variant or c.id in ("engine-k4-T1", "engine-k4-greedy")])
    assert [c.id for c in cells] == [
        "engine-k4-T1",
        "engine-k4-greedy",
        "engine-k2-T1",
        "engine-k2-greedy",
        "engine-k4-T1-batch-7",
        "engine-k4-greedy-batch-7",
    ]
    assert all(o.passed for o in outcomes), [o.message() for o in outcomes if not o.passed]
    # each variant: its pilots and greedy on side, its samples, then every off side; released before the next
    names = [name for name, _ in BUILDS]
    assert (
        names == ["fake-axes(k=4, batch=64)"] * 3 + ["fake-axes(k=2, batch=64)"] * 3 + ["fake-axes(k=4, batch=7)"] * 3
    )
    assert [side for _, side in BUILDS] == [True, True, False] * 3
    # each cell's facts name the variant that drew it, at its block length
    assert [(o.facts.engine, o.facts.engine_k) for o in outcomes[2:4]] == [("fake-axes(k=2, batch=64)", 2)] * 2
    from losscheck.cells.record import RunFacts

    records = [o.to_record(RunFacts(nodeid=c.id, outcome="passed")) for c, o in zip(cells, outcomes, strict=True)]
    assert [r.engine_axes for r in records] == [{}, {}, {"k": 2}, {"k": 2}, {"batch": 7}, {"batch": 7}]


@pytest.mark.slow  # a supporting check (~15 s): the quick tier keeps the certificate end to end
@pytest.mark.usefixtures("one_thread")
def test_a_variant_that_breaks_losslessness_fails_its_own_cells_only():
    session = _session("engine-greedy")
    cells, outcomes = _certify(session, session.plan["engine_greedy_cell"])
    verdicts = {c.id: o.passed for c, o in zip(cells, outcomes, strict=True)}
    assert verdicts == {
        "engine-k4-greedy": True,
        "engine-k2-greedy": True,
        "engine-k4-greedy-batch-7": True,
        "engine-k4-greedy-broken-True": False,
    }
    broken = outcomes[cells.index(next(c for c in cells if c.variant == (("broken", True),)))]
    assert broken.divergences and "fake-axes(k=4, batch=64, broken)" == broken.facts.engine


def test_list_prints_the_variant_cells_and_their_memory_plan():
    from losscheck.report.plan import plan_lines

    lines = plan_lines(_session("-broken"), full=True)
    text = "\n".join(lines)
    for cell in ("engine-k2-T1", "engine-k2-greedy", "engine-k4-T1-batch-7", "engine-k4-greedy-batch-7"):
        assert f"\n{cell} " in text
    assert "engine-k4-T1-broken-True" in text and "-broken declared out" in text
    assert "  then variant k=2: 2 cells in 7 phases, 4 instances built" in text
    assert "  then variant batch=7: 2 cells in 7 phases, 4 instances built" in text
