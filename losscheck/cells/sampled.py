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
from losscheck.errors import LosscheckError, UnderpoweredError, flag
from losscheck.plan.cell import Cell
from losscheck.plan.profiles import Profile, min_horizon
from losscheck.run import factory
from losscheck.run.session import Session
from losscheck.serving.axis import requests
from losscheck.stats import registry, sample_size, sequential
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
    (`losscheck.stats.sequential`) and the tested sample's own p and q confirm that the design
    catches every class and member it promised at its power; at the last look, the cell errors
    unless the tested sample confirms it."""
    from losscheck.cells.conformance import Recorder, conformance_rtol
    from losscheck.cells.scoring import PitScores, measure_power
    from losscheck.stats.bugclass import PowerAccumulator

    profile = session.options.profile
    horizon = profile.pit_horizon(cell.k)
    prompts = [p for tier in session.prompt_tiers for p in session.prompts(tier)]
    budget = registry.split(session.per_test_alpha, "pit", "conditional", "conformance")
    alpha_scored, alpha_test = budget.share("pit", "conditional"), budget.per_test
    limit = sequential.max_looks(profile.min_pit_tokens, profile.max_pit_tokens) if profile.early_stop else 1
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
        looks, ids, grid = _looks(measured, design, alpha_test, profile.power, limit)
    per_sequence = max(int(pilot.mask().sum()) / len(pilot_rows), 1e-9)
    engine = server.engine
    recorder = None
    if engine is not None:  # the recorder wraps the verifier in this process only
        recorder = engine.verifier = Recorder(
            engine.verifier,
            make_generator(session.options.seed, cell.id, "conformance"),
            conformance_rtol(cell.precision.tolerance if cell.precision.reduced else 0.0),
        )
    power = PowerAccumulator(misreported=measured.misreported_id, grid=grid)  # judged where the test looks
    scores = PitScores(session, cell.id, target, tolerance, power, measured.misreported_id)
    gens: list[Generation] = []
    drawn, stopped, unconfirmed = 0, len(looks.tokens), []
    coverage = None
    for look, tokens in enumerate(looks.tokens, 1):
        more = max(math.ceil(tokens / per_sequence) - drawn, 1)
        with clock("generate"):
            rows, gen = generate_rows(session, cell, server, prompts, more, horizon, "pit-sample", first=drawn)
        with clock("score"):  # the teacher-forced pass, the PITs, the conditional and rule-out sums
            scores.add(rows, gen, part=f"look{look}")
        drawn += more
        gens.append(gen)
        if look < len(looks.tokens) and looks.may_stop(power.rule_out_log_e(ids)):
            # the data rule every member out; the stop also needs the tested sample's own p and q
            # to keep the design's promise (else it goes on: a stricter stop loses no power or level)
            with clock("design"):
                coverage = bug_class_coverage(design, measured, power, alpha_test, profile.power, looks, True, ids)
            if not shortfall(coverage, profile.power):
                stopped = look
                break
            unconfirmed.append(look)
    with clock("score"):
        results, facts = scores.tests(alpha_scored, profile.pooled_tv, limit)
    with clock("conformance"):
        if recorder is not None:
            results += recorder.tests(budget.share("conformance"), profile.power, limit)
    early = stopped < len(looks.tokens)
    if not early:
        with clock("design"):
            coverage = bug_class_coverage(design, measured, power, alpha_test, profile.power, looks, False, ids)
    assert coverage is not None
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
            "unconfirmed": unconfirmed,
        },
        bug_classes=coverage,
        **facts,
    )
    outcome.serving_facts = server.facts()
    return outcome


def _looks(
    pilot: PowerAccumulator, design: sample_size.ClassDesign, alpha_test: float, power: float, limit: int
) -> tuple[sequential.Looks, list[int], dict[str, tuple[float, ...]]]:
    """The looks of a cell's tested sample, the ids of the misreporting drafter's class its early
    stops must rule out, and each class's family members ρ whose rule-out e-values the tested
    sample keeps — all from the pilot, fixed before any look.

    A class's family is its mixtures (1 - ρ)·p + ρ·p' (`losscheck.stats.sequential`). Its floor
    ρ_min is the smallest member whose best test has power `sequential.PARTIAL_POWER` at the
    design's tokens less `DESIGN_MARGIN` twice: the design *promises* the members down to it, and
    the tested sample must confirm each promise at the design's tokens (`bug_class_coverage`) —
    the pilot's estimate of a small member's effect is noisier than of the catalogue point, which
    the covered classes are sized for with one margin. An early stop rules out every member of
    `sequential.family(ρ_min)`: at β_r the catalogue point of a covered class and every member
    whose tests have power `sequential.design_power` at the design's tokens less one margin, at
    β_p the rest. A class the design reaches at power 0.8 at its full tokens only (not promised)
    must still be ruled out at its catalogue point, at β_p. So must every id of the misreporting
    drafter's class whose count test has power 0.8 at the design's tokens less one margin (not
    confirmed by the tested sample): the ids share one family (the smallest ρ_min of its ids and
    of its aimed id), each ruled out down to its own ρ_min and the member below it."""
    level = sequential.design_power(power)
    promised = design.tokens / sample_size.DESIGN_MARGIN
    floor_tokens = promised / sample_size.DESIGN_MARGIN
    covered: list[str] = []
    partial: list[str] = []
    kept: list[str] = []
    floors: dict[str, float] = {}
    for name in design.best:
        rho_min = pilot.smallest_rho(name, floor_tokens, alpha_test, sequential.PARTIAL_POWER, limit)
        if rho_min is not None:
            floors[name] = rho_min
        elif pilot.best_power(name, design.tokens, alpha_test, limit) >= sequential.PARTIAL_POWER:
            floors[name] = 1.0  # reached at its catalogue point only, at the full design
    per_id = [bug.name for bug in pilot.classes if bug.per_id]
    id_floors = {}
    for v in pilot.covered_ids(promised, alpha_test, sequential.PARTIAL_POWER):
        id_floors[v] = _id_rho_min(pilot, v, promised, alpha_test)
    grid = {name: sequential.family(rho) for name, rho in floors.items() if name not in per_id}
    for name in per_id:
        lowest = min([*id_floors.values(), *([floors[name]] if name in floors else [])], default=None)
        if lowest is not None:
            grid[name] = sequential.family(lowest)

    for name, rho_min in floors.items():
        for rho in sequential.required(grid[name], rho_min):
            key = sequential.member_key(name, rho)
            strong = (rho == 1.0 and name in design.covered) or pilot.best_power(
                name, promised, alpha_test, limit, rho
            ) >= level
            (covered if strong else partial).append(key)
            if strong or pilot.best_power(name, floor_tokens, alpha_test, limit, rho) >= sequential.PARTIAL_POWER:
                kept.append(key)
    for name in per_id:
        for v, rho_min in id_floors.items():
            for rho in sequential.required(grid[name], rho_min):
                strong = pilot.count_power(v, promised, alpha_test, rho) >= level
                (covered if strong else partial).append(sequential.member_key(sequential.id_key(name, v), rho))
    looks = sequential.Looks(
        sequential.look_tokens(design.floor, design.tokens, limit),
        limit,
        tuple(covered),
        tuple(partial),
        power,
        promised=tuple(kept),
    )
    return looks, sorted(id_floors), grid


def _id_rho_min(pilot: PowerAccumulator, v: int, tokens: float, alpha_test: float) -> float:
    """The smallest ρ (to 2%) at which the count test catches id `v`'s misreport at
    `sequential.PARTIAL_POWER` within `tokens` (it does at ρ = 1)."""
    from losscheck.stats.bugclass import RHO_FLOOR

    def caught(rho: float) -> bool:
        return pilot.count_power(v, tokens, alpha_test, rho) >= sequential.PARTIAL_POWER

    if caught(RHO_FLOOR):
        return RHO_FLOOR
    low, high = math.log(RHO_FLOOR), 0.0
    while high - low > 0.02:
        mid = (low + high) / 2
        low, high = (low, mid) if caught(math.exp(mid)) else (mid, high)
    return math.exp(high)


def _class_design(
    measured: PowerAccumulator, profile: Profile, alpha_scored: float, alpha_test: float, looks: int
) -> sample_size.ClassDesign:
    """The tested tokens a PIT cell aims at from its pilot, for a cell that may stop at `looks`
    points: its tests at the power `sequential.design_power` leaves them (the profile's when the
    cell has a single look), the fixed-sample ones at their level / `looks`."""
    from losscheck.stats.bugclass import LR_BOUND

    level = profile.power if looks == 1 else sequential.design_power(profile.power)
    alpha_pit = registry.split(alpha_scored, "pit", "conditional").share("pit")
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
    p and q), its log10 rule-out e-value at the catalogue point, whether the cell's design
    covered the class (the pilot's estimate) or reached it partly, whether the data ruled out
    every member of its family an early stop needed, down to which ρ, the cell's power against
    it, and its power curve.

    Against a member it must rule out the cell keeps the power its tests have at the last look
    less the chance the member is ruled out first, β_r if covered, β_p if partly reached
    (`losscheck.stats.sequential`). The tests' power is the tested sample's own (its p and q):
    at the tokens it tested when it ran to its last look, at the design's tokens when it stopped
    early. `short` lists the members whose promise the tested sample does not keep: the design
    promised them power `sequential.design_power` (covered) or `sequential.PARTIAL_POWER`
    (partial) at its tokens. `curve`: the smallest member ρ its tests catch at power 0.99 and
    0.8 at the tokens it tested (its stopping n). `ids`: the misreporting drafter's ids the early
    stops had to rule out (reported by count, with whether all were)."""
    from losscheck.stats.bugclass import LR_BOUND

    needed = power.tokens_needed(alpha_test, sequential.design_power(level), looks.limit)
    tested = max(power.steps, 1)
    at_last = design.tokens if early else tested
    # at an early look, the power the tested sample's own p and q give at the design's tokens:
    # the cell stops there only if that keeps the design's promise (`shortfall`)
    checked = design.tokens if early else tested
    rule_out = power.rule_out_log_e(ids)
    ruled = looks.ruled_out(rule_out)
    thresholds = looks.thresholds()
    beta = {True: (1.0 - level) * sequential.RULE_OUT_SHARE, False: sequential.PARTIAL_BETA}
    promise = {True: sequential.design_power(level), False: sequential.PARTIAL_POWER}
    coverage: dict[str, dict[str, Any]] = {}
    for bug in power.classes:
        name, tests = bug.name, needed[bug.name]
        test, tokens = min(((t, n) for t, n in tests.items() if t != LR_BOUND), key=lambda tn: tn[1])
        reach = "covered" if name in looks.covered else "partial" if name in looks.partial else "none"
        keys = [k for k in ruled if k == name or k.startswith((f"{name}[", f"{name}@"))]
        members = {rho: sequential.member_key(name, rho) for rho in power.members(name)}
        required = {rho: key for rho, key in members.items() if key in ruled}
        short = []
        for rho, key in required.items():
            if key not in looks.promised:
                continue
            strong = key in looks.covered
            have = power.best_power(name, checked, alpha_test, looks.limit, rho)
            if have < promise[strong]:
                short.append({"rho": rho, "power": have, "promised": promise[strong]})
        cell_power = power.best_power(name, at_last if reach != "none" else tested, alpha_test, looks.limit)
        checked_power = power.best_power(name, checked if reach != "none" else tested, alpha_test, looks.limit)
        if reach != "none":
            cell_power = max(0.0, cell_power - beta[reach == "covered"])
            checked_power = max(0.0, checked_power - beta[reach == "covered"])
        down_to = None
        for rho in sorted(required, reverse=True):  # the members ruled out from ρ = 1 down
            if not ruled[required[rho]]:
                break
            down_to = rho
        log_e = rule_out.get(name)
        coverage[name] = {
            "test": test,
            "tokens_needed": tokens,
            "lr_bound_tokens": tests.get(LR_BOUND, math.inf),
            "power": cell_power,
            "power_checked": checked_power,
            "covered": reach == "covered",
            "reach": reach,
            "pilot_tokens_needed": design.best[name][1],
            "rule_out_log10_e": None if log_e is None else log_e / math.log(10),
            "ruled_out": bool(keys) and all(ruled[k] for k in keys),
            "family": {
                "required_down_to": min(required, default=None),
                "ruled_out_down_to": down_to,
                "members": [
                    {"rho": rho, "beta": math.exp(-thresholds[key]), "ruled_out": ruled[key]}
                    for rho, key in required.items()
                ],
            },
            "curve": {
                f"{p:g}": power.smallest_rho(name, tested, alpha_test, p, looks.limit)
                for p in (level, sequential.PARTIAL_POWER)
            },
            "short": short,
        }
        if bug.per_id:
            id_keys = [k for k in ruled if k.startswith(f"{name}[")]
            coverage[name]["ids"] = {
                "covered": sum(sequential.id_key(name, v) in looks.covered for v in ids),
                "partial": sum(sequential.id_key(name, v) in looks.partial for v in ids),
                "members": len(id_keys),
                "ruled_out": sum(ruled[k] for k in id_keys),
            }
    return coverage


def shortfall(coverage: dict[str, dict[str, Any]], level: float) -> dict[str, dict[str, Any]]:
    """The classes of `bug_class_coverage` whose promise the tested sample does not keep: covered
    and caught below `level`, or short of a family member's promised power."""
    return {
        name: c
        for name, c in coverage.items()
        if (c["covered"] and c.get("power_checked", c["power"]) < level) or c.get("short")
    }


def require_coverage(cell: Cell, coverage: dict[str, dict[str, Any]], level: float) -> None:
    """Error (never pass) when the tested sample, from its own p and q, does not keep what the
    design promised: a covered class caught at `level`, and every member of a family an early
    stop had to rule out caught at the power the design gave it — the pilot underestimated what
    the cell needs."""
    short = shortfall(coverage, level)
    if short:
        listed = "; ".join(
            f"{name}: {c['test']} power {c['power']:.3f} (needs {c['tokens_needed']:.0f} tokens, "
            f"the pilot said {c['pilot_tokens_needed']:.0f})"
            + "".join(f", at ρ = {m['rho']:.3g} power {m['power']:.3f} < {m['promised']:g}" for m in c.get("short", []))
            for name, c in short.items()
        )
        raise UnderpoweredError(
            f"cell {cell.id}: the tested sample does not reach the power its design promised against the bug "
            f"classes it covers — {listed}. Raise {flag('profile')} to thorough or report this as a losscheck bug."
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
