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
from losscheck.engines.registry import EngineAxis, EngineSpec, option, register

LIVE: list[str] = []  # the instances alive now, of every variant
BUILDS: list[tuple[str, bool]] = []  # (engine name, side) of every build, in order


@dataclass(frozen=True)
class FakeOptions:
    k: int = option(4, minimum=1)
    batch: int = option(64, minimum=1, help="rows per call of the loop")
    broken: bool = option(False, help="the speculative side answers each prompt with the next prompt's rows")
    weights: str = option(
        "fp32",
        choices=("fp32", "q4", "q4-hot", "q2"),
        help="q4: the target's weights rounded to 16 levels a row (4 bits); q4-hot: and a planted bug, the "
        "speculative side sampling at 1.1 T; q2: to 4 levels (2 bits), a law the fp32 proxy does not describe",
    )


class Variant:
    """losscheck's own loop (lossless) at block length `k` and `batch` rows per call, each side a
    fresh copy of the bundled target and drafter under ONE_AT_A_TIME."""

    def __init__(self, options: FakeOptions) -> None:
        self.k, self.options = options.k, options
        self.precision = "fp32" if options.weights == "fp32" else None  # quantized: two-sample
        self.name = f"fake-axes(k={options.k}, batch={options.batch}{', broken' if options.broken else ''})"
        if options.weights != "fp32":
            self.name = self.name.replace(")", f", {options.weights})")
        self.hot = options.weights == "q4-hot"
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
        if self.options.weights != "fp32":
            quantize_rows(target.model, levels=4 if self.options.weights == "q2" else 16)
        drafter = from_path(bundled.fixtures_dir() / "drafter_a", target)
        return SpecLoopEngine(target, drafter, self.k, batch=self.options.batch)

    def _release(self, speculative: bool, instance: object) -> None:
        LIVE.remove(self.name)

    def generate(self, request: GenerationRequest):
        if self.options.broken and request.speculative:
            request = dataclasses.replace(request, prompts=request.prompts[1:] + request.prompts[:1])
        if self.hot and request.speculative and not request.params.greedy:
            hotter = dataclasses.replace(request.params, temperature=1.1 * request.params.temperature)
            request = dataclasses.replace(request, params=hotter)
        return self.instances.get(request.speculative).generate(request)  # type: ignore[attr-defined]


def quantize_rows(model, levels: int) -> None:
    """Round each weight matrix's rows to `levels` evenly spaced values over the row's range: a
    quantized target whose logits losscheck's fp32 copy does not reproduce."""
    import torch

    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
                step = (high - low).clamp_min(1e-12) / (levels - 1)
                weight.copy_(low + torch.round((weight - low) / step) * step)


def _set(key: str):
    def vary(request: EngineSpec, value):
        args = {**request.args, key: value}
        return None if args == request.args else dataclasses.replace(request, args=args)

    return vary


AXES = (
    EngineAxis("k", (2,), _set("k"), "another block length"),
    EngineAxis("batch", (7,), _set("batch"), "another batch shape: 7 rows per call"),
    EngineAxis("broken", (True,), _set("broken"), "a planted bug: rows of the wrong prompt"),
    EngineAxis("quantization", ("q4", "q4-hot", "q2"), _set("weights"), "the target's weights quantized: two-sample"),
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


def _session(scope: str, power: float = 0.99):
    """A session of the fake adapter over `scope`; `power`: its cells' design power (a test of the
    orchestration alone needs no more than a PASS, at the fewest rows)."""
    from losscheck.plan.profiles import PROFILES
    from losscheck.plan.scope import parse_scope
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    profile = dataclasses.replace(PROFILES["ci"].with_detect_tv(0.1), power=power)
    options = Options(engine="fake-axes", profile=profile, scope=parse_scope(scope))
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
    from losscheck.cells.engine import run_engine_cell
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
    session = _session("-broken,-quantization", power=0.5)
    plan = session.plan
    assert [o["cell"] for o in session.out_of_scope] == [
        "engine-k4-T1-broken-True",
        "engine-k4-T1-two-sample-quantization-q4",
        "engine-k4-T1-two-sample-quantization-q4-hot",
        "engine-k4-T1-two-sample-quantization-q2",
        "engine-k4-greedy-broken-True",
        "engine-k4-greedy-two-sample-quantization-q4",
        "engine-k4-greedy-two-sample-quantization-q4-hot",
        "engine-k4-greedy-two-sample-quantization-q2",
    ]
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
    # each variant: its pilots and greedy on side, its sample's first look, a build for each later
    # look its T 1 cell drew, then every off side; released before the next
    looks = [o.facts.looks.stopped_at for o in outcomes[::2]]  # the T 1 cells'
    variants = ["fake-axes(k=4, batch=64)", "fake-axes(k=2, batch=64)", "fake-axes(k=4, batch=7)"]
    assert [name for name, _ in BUILDS] == [v for v, n in zip(variants, looks, strict=True) for _ in range(n + 2)]
    assert [side for _, side in BUILDS] == [side for n in looks for side in [True] * (n + 1) + [False]]
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
        "engine-k4-greedy-two-sample-quantization-q4": True,
        "engine-k4-greedy-two-sample-quantization-q4-hot": True,  # its bug is in sampling
        "engine-k4-greedy-two-sample-quantization-q2": True,
    }
    broken = outcomes[cells.index(next(c for c in cells if c.variant == (("broken", True),)))]
    assert broken.divergences and "fake-axes(k=4, batch=64, broken)" == broken.facts.engine


def _quantized(session, weights: str):
    """The quantized variant's cells (T = 1, greedy), certified."""
    cells = [c for c in session.plan["engine_cell"] + session.plan["engine_greedy_cell"] if c.variant]
    cells = [c for c in cells if c.variant == (("quantization", weights),)]
    assert [(c.id, c.mode) for c in cells] == [
        (f"engine-k4-T1-two-sample-quantization-{weights}", "two-sample"),
        (f"engine-k4-greedy-two-sample-quantization-{weights}", "engine-greedy"),
    ]
    return _certify(session, cells)


@pytest.mark.usefixtures("one_thread")
def test_a_quantized_variant_is_certified_two_sample_sized_by_bug_classes_through_the_fp32_proxy():
    """The quantized target's cells are two-sample (no reference reproduces its logits) and pass:
    its speculative rows and its plain rows share one law. The T = 1 cell is sized by the
    target-side bug classes, whose effects losscheck's fp32 target (the proxy) gives, and covers
    both: the surprisal U test needs far fewer rows than the profile's TV would."""
    cells, outcomes = _quantized(_session("-broken,-k,-batch"), "q4")
    assert all(o.passed for o in outcomes), [o.message() for o in outcomes if not o.passed]
    assert {o.facts.engine for o in outcomes} == {"fake-axes(k=4, batch=64, q4)"}
    classes = outcomes[0].facts.bug_classes
    assert classes is not None and all(c.covered and c.power >= 0.99 for c in classes.values()), classes
    assert {c.test for c in classes.values()} == {"attribution.surprisal"}
    assert "attribution.surprisal" in outcomes[0].message()


@pytest.mark.usefixtures("one_thread")
def test_a_proxy_that_is_not_the_engines_law_withdraws_every_claim_by_name():
    """The q2 target (2-bit rows) is lossless two-sample, but its plain rows' surprisal under the
    fp32 proxy is far from centred: the cell PASSes claiming no class, each withdrawn with the proxy's
    z (`losscheck.cells.engine.proxy.proxy_withdrawn`), where the q4 target's keep theirs (above)."""
    cells, outcomes = _quantized(_session("-broken,-k,-batch"), "q2")
    sampled = outcomes[0]
    assert sampled.passed, sampled.message()
    classes = sampled.facts.bug_classes
    assert classes and all(not c.covered and c.withdrawn for c in classes.values()), classes
    assert all("not the proxy's law" in (c.withdrawn or "") for c in classes.values())


@pytest.mark.usefixtures("one_thread")
def test_a_planted_temperature_bug_in_a_quantized_variant_fails_where_its_design_said():
    """The q4 variant whose speculative side samples at 1.1·T: the class target_temperature_1.1,
    covered at power 0.99 by the design, is caught, by the surprisal test under the proxy."""
    cells, outcomes = _quantized(_session("-broken,-k,-batch"), "q4-hot")
    sampled = outcomes[0]
    assert not sampled.passed and outcomes[1].passed
    classes = sampled.facts.bug_classes
    assert classes is not None and classes["target_temperature_1.1"].covered
    failed = [r.name for r in sampled.verdict.results if not r.passed]
    assert "attribution.surprisal" in failed, failed


@pytest.mark.slow  # a supporting check (~20 s): why the matrix plans the quantized variant two-sample
@pytest.mark.usefixtures("one_thread")
def test_a_quantized_variant_scored_by_the_fp32_reference_is_put_down_to_the_reference():
    """Scored one-sample by losscheck's fp32 target instead, the q2 target's T = 1 rows are rejected in
    the first stage and put down to the reference: the cell's claims are its second stage's own power."""
    session = _session("-broken,-k,-batch")
    cells, _ = _quantized(session, "q2")
    one_sample = dataclasses.replace(cells[0], target="main")
    _, (scored,) = _certify(session, [one_sample])  # the q4 variant is still alive: no precision check
    found = scored.facts.attribution
    assert found is not None and found.finding == "reference", "the fp32 reference reproduces the q2 target's rows"
    claims = scored.facts.bug_classes
    assert claims and all(c.power == c.second_stage_power for c in claims.values()), claims


def test_list_prints_the_variant_cells_and_their_memory_plan():
    from losscheck.report.plan import plan_lines

    lines = plan_lines(_session("-broken,-quantization"), full=True)
    text = "\n".join(lines)
    for cell in ("engine-k2-T1", "engine-k2-greedy", "engine-k4-T1-batch-7", "engine-k4-greedy-batch-7"):
        assert f"\n{cell} " in text
    assert "engine-k4-T1-broken-True" in text and "-broken declared out" in text
    assert "  then variant k=2: 2 cells in 9 phases, 5 instances built" in text
    assert "  then variant batch=7: 2 cells in 9 phases, 5 instances built" in text
