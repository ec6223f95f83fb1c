"""Sampled cells of losscheck's own loop: teacher-forced PIT on the main target (with the
verifier's conformance checks) and exact enumeration on the small-vocabulary target."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from losscheck.cells.draw import generate_rows
from losscheck.cells.outcome import CellOutcome, Phases, sampled_outcome
from losscheck.core.generation import Generation
from losscheck.core.sampling import SamplingParams, make_generator, process_logits
from losscheck.errors import LosscheckError, UnderpoweredError
from losscheck.plan.cell import Cell
from losscheck.plan.profiles import Profile, min_horizon
from losscheck.run import factory
from losscheck.run.session import Session
from losscheck.serving.axis import requests
from losscheck.stats import sample_size, sequential
from losscheck.stats.pit import pit_required_values

if TYPE_CHECKING:
    from losscheck.stats.bugclass import PowerAccumulator


def run_cell(session: Session, cell: Cell) -> CellOutcome:
    """Certify a cell of losscheck's own loop the way its mode asks."""
    from losscheck.cells.greedy import run_greedy

    run = {"greedy": run_greedy, "pit": run_pit, "exact": run_exact}[cell.mode]
    return run(session, cell)


def run_pit(session: Session, cell: Cell) -> CellOutcome:
    """Teacher-forced PIT and exact-conditional tests of the spec loop's sequences, plus the
    conformance of its verifier to standard speculative sampling (`losscheck.cells.conformance`),
    the cell's alpha split evenly over all of them.

    The tested sample is sized by power per bug class: a pilot, drawn from its own stream and
    never tested, measures from its own p and q what each test would see per token under each
    bug class (`losscheck.stats.bugclass`); the design is the tokens the costliest class within
    the profile's cap needs. The fresh sample then grows look by look towards the design and
    stops at the first look where the data rule out every class the design covers
    (`losscheck.stats.sequential`); the cell asserts, from the tested sample's own p and q, that
    the design catches every such class at the profile's power."""
    from losscheck.cells.conformance import CONFORMANCE_TESTS, Recorder, conformance_rtol
    from losscheck.cells.scoring import PitScores, measure_power
    from losscheck.stats.bugclass import PowerAccumulator
    from losscheck.stats.conditional import CONDITIONAL_TESTS
    from losscheck.stats.pit import PIT_TESTS

    profile = session.options.profile
    horizon = profile.pit_horizon(cell.k)
    prompts = [p for tier in session.prompt_tiers for p in session.prompts(tier)]
    tests = PIT_TESTS + CONDITIONAL_TESTS + CONFORMANCE_TESTS
    alpha_scored = session.per_test_alpha * (PIT_TESTS + CONDITIONAL_TESTS) / tests
    alpha_test = session.per_test_alpha / tests
    limit = sequential.max_looks(profile.min_pit_tokens, profile.max_pit_tokens)
    clock = Phases()
    server = factory.server(session, cell)
    target = session.cell_target(cell)
    tolerance = cell.precision.tolerance
    with clock("requests"):  # a warm prefix cache's first turn
        prompts = requests(server, factory.serve_context(session, cell), prompts, horizon, cell.params, "pit")
    with clock("pilot"):
        pilot_rows, pilot = generate_rows(session, cell, server, prompts, profile.pilot_sequences, horizon, "pit-pilot")
        measured = measure_power(session, target, pilot_rows, pilot, tolerance)
    with clock("design"):  # from the pilot: the sequential design, the fixed-sample one it replaces, the looks
        design, fixed = (_class_design(measured, profile, alpha_scored, alpha_test, looks) for looks in (limit, 1))
        looks, ids = _looks(measured, design, alpha_test, profile.power, limit)
    per_sequence = max(int(pilot.mask().sum()) / len(pilot_rows), 1e-9)
    engine = server.engine
    recorder = None
    if engine is not None:  # the recorder wraps the verifier in this process only
        recorder = engine.verifier = Recorder(
            engine.verifier,
            make_generator(session.options.seed, cell.id, "conformance"),
            conformance_rtol(cell.precision.tolerance if cell.precision.reduced else 0.0),
        )
    power = PowerAccumulator(misreported=measured.misreported_id)  # judged where the test looks
    scores = PitScores(session, cell.id, target, tolerance, power, measured.misreported_id)
    gens: list[Generation] = []
    drawn, stopped = 0, len(looks.tokens)
    for look, tokens in enumerate(looks.tokens, 1):
        more = max(math.ceil(tokens / per_sequence) - drawn, 1)
        with clock("generate"):
            rows, gen = generate_rows(session, cell, server, prompts, more, horizon, "pit-sample", first=drawn)
        with clock("score"):  # the teacher-forced pass, the PITs, the conditional and rule-out sums
            scores.add(rows, gen, part=f"look{look}")
        drawn += more
        gens.append(gen)
        if look < len(looks.tokens) and looks.may_stop(power.rule_out_log_e(ids)):
            stopped = look
            break
    with clock("score"):
        results, facts = scores.tests(alpha_scored, profile.pooled_tv, limit)
    with clock("conformance"):
        if recorder is not None:
            results += recorder.tests(session.per_test_alpha - alpha_scored, profile.power, limit)
    early = stopped < len(looks.tokens)
    with clock("design"):
        coverage = bug_class_coverage(design, measured, power, alpha_test, profile.power, looks, early, ids)
    require_coverage(cell, coverage, profile.power)
    gen = Generation.concat(gens)
    outcome = sampled_outcome(
        session,
        cell,
        results,
        gen,
        sequences=drawn,
        horizon=horizon,
        phases=clock.seconds,
        pilot_sequences=len(pilot_rows),
        pilot_tokens=int(pilot.mask().sum()),
        design_tokens=design.tokens,
        fixed_design_tokens=fixed.tokens,
        looks={
            "tokens": list(looks.tokens),
            "allowed": limit,
            "stopped_at": stopped,
            "tested_tokens": scores.tested_tokens,
            "early": early,
        },
        bug_classes=coverage,
        **facts,
    )
    outcome.serving_facts = server.facts()
    return outcome


def _looks(
    pilot: PowerAccumulator, design: sample_size.ClassDesign, alpha_test: float, power: float, limit: int
) -> tuple[sequential.Looks, list[int]]:
    """The looks of a cell's tested sample, and the ids of the misreporting drafter's class its
    early stops must rule out: what the design covers at `sequential.design_power`, and what it
    reaches at `sequential.PARTIAL_POWER` (the pilot's estimates, fixed before any look)."""
    level = sequential.design_power(power)
    at_design = pilot.power_at(design.tokens, alpha_test, power, limit)
    partial = [
        name
        for name, (test, _) in design.best.items()
        if name not in design.covered and at_design[name][test] >= sequential.PARTIAL_POWER
    ]
    per_id = [bug.name for bug in pilot.classes if bug.per_id]
    covered_ids = pilot.covered_ids(design.tokens, alpha_test, level)
    partial_ids = [
        v for v in pilot.covered_ids(design.tokens, alpha_test, sequential.PARTIAL_POWER) if v not in covered_ids
    ]
    keys = {v: [sequential.id_key(name, v) for name in per_id] for v in covered_ids + partial_ids}
    looks = sequential.Looks(
        sequential.look_tokens(design.floor, design.tokens, limit),
        limit,
        (*design.covered, *(k for v in covered_ids for k in keys[v])),
        (*partial, *(k for v in partial_ids for k in keys[v])),
        power,
    )
    return looks, covered_ids + partial_ids


def _class_design(
    measured: PowerAccumulator, profile: Profile, alpha_scored: float, alpha_test: float, looks: int
) -> sample_size.ClassDesign:
    """The tested tokens a PIT cell aims at from its pilot, for a cell that may stop at `looks`
    points: its tests at the power `sequential.design_power` leaves them (the profile's when the
    cell has a single look), the fixed-sample ones at their level / `looks`."""
    from losscheck.stats.bugclass import LR_BOUND
    from losscheck.stats.conditional import CONDITIONAL_TESTS
    from losscheck.stats.pit import PIT_TESTS

    level = profile.power if looks == 1 else sequential.design_power(profile.power)
    alpha_pit = alpha_scored * PIT_TESTS / (PIT_TESTS + CONDITIONAL_TESTS)
    pooled = 0
    if profile.pooled_tv is not None:
        pooled = pit_required_values(alpha_pit / looks, profile.power, profile.pooled_tv)
    return sample_size.ClassDesign.of(
        measured.tokens_needed(alpha_test, level, looks),
        LR_BOUND,
        profile.min_pit_tokens,
        profile.max_pit_tokens,
        pooled,
    )


def bug_class_coverage(
    design: sample_size.ClassDesign,
    pilot: PowerAccumulator,
    power: PowerAccumulator,
    alpha_test: float,
    level: float,
    looks: sequential.Looks,
    early: bool,
    ids: list[int],
) -> dict[str, dict[str, Any]]:
    """Per bug class: its best test and the tokens that test needs (from the tested sample's own
    p and q), its log10 rule-out e-value, whether the cell's design covered the class (the
    pilot's estimate; the rest are reported, not asserted) or reached it partly, whether the data
    ruled it out, and the cell's power against it.

    Against a class it must rule out the cell keeps the power its tests have at the last look
    less the chance it is ruled out first, β_r if covered, β_p if partly reached
    (`losscheck.stats.sequential`). The tests' power is taken from the tested sample at the tokens
    it tested when the cell ran to its last look; when it stopped early, from the pilot at the
    design's tokens — an early stop selects samples that look unlike the bugs, which biases what
    they say of the tests' power, while the pilot was drawn before any look. Any other class: the
    tests' power at the tokens tested. `ids`: the misreporting drafter's ids the early stops had
    to rule out (reported by count, with whether all were)."""
    from losscheck.stats.bugclass import LR_BOUND

    needed = power.tokens_needed(alpha_test, sequential.design_power(level), looks.limit)
    tested = max(power.steps, 1)
    at_last = (pilot if early else power).power_at(design.tokens if early else tested, alpha_test, level, looks.limit)
    at_tested = power.power_at(tested, alpha_test, level, looks.limit)
    rule_out = power.rule_out_log_e(ids)
    ruled = looks.ruled_out(rule_out)
    beta = {"covered": (1.0 - level) * sequential.RULE_OUT_SHARE, "partial": sequential.PARTIAL_BETA}
    coverage: dict[str, dict[str, Any]] = {}
    for bug in power.classes:
        name, tests = bug.name, needed[bug.name]
        test, tokens = min(((t, n) for t, n in tests.items() if t != LR_BOUND), key=lambda tn: tn[1])
        reach = "covered" if name in looks.covered else "partial" if name in looks.partial else "none"
        keys = [k for k in ruled if k == name or k.startswith(f"{name}[")]
        if reach == "none":
            cell_power = at_tested[name][test]
        else:
            last = at_last[name][design.best[name][0] if early else test]  # the pilot's best test, if early
            cell_power = max(0.0, last - beta[reach])
        log_e = rule_out.get(name)
        coverage[name] = {
            "test": test,
            "tokens_needed": tokens,
            "lr_bound_tokens": tests.get(LR_BOUND, math.inf),
            "power": cell_power,
            "covered": reach == "covered",
            "reach": reach,
            "pilot_tokens_needed": design.best[name][1],
            "rule_out_log10_e": None if log_e is None else log_e / math.log(10),
            "ruled_out": bool(keys) and all(ruled[k] for k in keys),
        }
        if bug.per_id:
            coverage[name]["ids"] = {
                "covered": sum(sequential.id_key(name, v) in looks.covered for v in ids),
                "partial": sum(sequential.id_key(name, v) in looks.partial for v in ids),
            }
    return coverage


def require_coverage(cell: Cell, coverage: dict[str, dict[str, Any]], level: float) -> None:
    """Error (never pass) when a class the design covered was not caught at `level` by the
    tested sample: the pilot underestimated what it needs."""
    short = {name: c for name, c in coverage.items() if c["covered"] and c["power"] < level}
    if short:
        listed = "; ".join(
            f"{name}: {c['test']} power {c['power']:.3f} (needs {c['tokens_needed']:.0f} tokens, "
            f"the pilot said {c['pilot_tokens_needed']:.0f})"
            for name, c in short.items()
        )
        raise UnderpoweredError(
            f"cell {cell.id}: the tested sample does not reach power {level:g} against the bug classes its "
            f"design covers — {listed}. Raise --losscheck-profile to thorough or report this as a losscheck bug."
        )


def exact_prompt(session: Session) -> list[int]:
    """The small target's longest prompt: the most context, still cheap to enumerate from."""
    return max(session.prompts("small"), key=len)


def exact_continuations(session: Session, target: str, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Every continuation of `exact_prompt` up to the profile's exact horizon and its exact target
    probability: (sequences [S, L], probabilities [S] float64), memoised per parameters."""
    from losscheck.stats.exact import enumerate_continuations

    model = session.targets[target]
    horizon = session.options.profile.exact_horizon

    @torch.inference_mode()
    def next_probs(context: torch.Tensor) -> torch.Tensor:
        logits = model.model(input_ids=context.to(model.device)).logits[:, -1]
        return process_logits(logits, params).double().cpu()

    return session.memo(
        ("exact", target, params, horizon),
        lambda: enumerate_continuations(next_probs, exact_prompt(session), horizon, model.eos_id),
    )


def exact_cell_size(session: Session, n_continuations: int) -> int:
    """Sequences an exact cell draws."""
    profile = session.options.profile
    return sample_size.exact_sequences(
        n_continuations, profile.exact_horizon, session.per_test_alpha, profile.power, profile.detect_tv
    )


def run_exact(session: Session, cell: Cell) -> CellOutcome:
    from losscheck.stats.exact import exact_tests

    profile = session.options.profile
    if profile.exact_horizon < min_horizon(cell.k):
        raise LosscheckError(
            f"exact cell {cell.id}: its horizon {profile.exact_horizon} must reach a bonus slot and a second "
            f"round (2k + 2 = {min_horizon(cell.k)}); run exact mode at a smaller k or a longer exact horizon"
        )
    target = session.targets[cell.target]
    prompt = exact_prompt(session)
    seqs, probs = exact_continuations(session, cell.target, cell.params)
    n = exact_cell_size(session, len(seqs))
    _, gen = generate_rows(
        session, cell, factory.server(session, cell), [prompt], n, profile.exact_horizon, "exact-sample"
    )
    samples = torch.where(gen.mask(), gen.tokens, target.eos_id if target.eos_id is not None else 0).cpu()
    results = exact_tests(samples, seqs, probs, session.per_test_alpha, profile.power, profile.detect_tv)
    return sampled_outcome(
        session, cell, results, gen, sequences=n, horizon=profile.exact_horizon, prompt=prompt, continuations=len(seqs)
    )
