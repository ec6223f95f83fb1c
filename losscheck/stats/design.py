"""A sequential PIT cell's design statistics, from its pilot and its tested sample: the looks and
the family members an early stop must rule out (`design_looks`), and what the tested sample's
own p and q confirm of the design's promises (`bug_class_coverage`).

Model-free: everything is read from `PowerAccumulator`s (`losscheck.stats.bugclass`), the design
(`losscheck.stats.sample_size.ClassDesign`) and the stopping rule (`losscheck.stats.sequential`).
"""

from __future__ import annotations

import math

from losscheck.stats import sample_size, sequential
from losscheck.stats.bugclass import LR_BOUND, RHO_FLOOR, PowerAccumulator


def design_looks(
    pilot: PowerAccumulator, design: sample_size.ClassDesign, alpha_test: float, power: float, limit: int
) -> tuple[sequential.Looks, list[int], dict[str, tuple[float, ...]]]:
    """The looks of a cell's tested sample, the ids of the misreporting drafter's class its early
    stops must rule out, and each class's family members ρ whose rule-out e-values the tested
    sample keeps — all from the pilot, fixed before any look.

    A class's family is its mixtures (1 - ρ)·p + ρ·p' (`losscheck.stats.sequential`). Its floor
    ρ_min is the smallest member whose best test has power `sequential.PARTIAL_POWER` at the
    design's promising tokens (`ClassDesign.promising`: the covered classes', not the cap a class
    reached partly takes the last look to) less `DESIGN_MARGIN` twice: the design *promises* the
    members down to it, and the tested sample must confirm each promise at the design's tokens
    (`bug_class_coverage`) —
    the pilot's estimate of a small member's effect is noisier than of the catalogue point, which
    the covered classes are sized for with one margin. An early stop rules out every member of
    `sequential.family(ρ_min)`: at β_r the catalogue point of a covered class and every member
    whose tests have power `sequential.design_power` at the promising tokens less one margin, at
    β_p the rest. A class the design reaches at power 0.8 at its full tokens only (not promised)
    must still be ruled out at its catalogue point, at β_p. So must every id of the misreporting
    drafter's class whose count test has power 0.8 at the promising tokens less one margin (not
    confirmed by the tested sample): the ids share one family (the smallest ρ_min of its ids and
    of its aimed id), each ruled out down to its own ρ_min and the member below it."""
    level = sequential.design_power(power)
    promised = design.promising / sample_size.DESIGN_MARGIN
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

    def caught(rho: float) -> bool:
        return pilot.count_power(v, tokens, alpha_test, rho) >= sequential.PARTIAL_POWER

    if caught(RHO_FLOOR):
        return RHO_FLOOR
    low, high = math.log(RHO_FLOOR), 0.0
    while high - low > 0.02:
        mid = (low + high) / 2
        low, high = (low, mid) if caught(math.exp(mid)) else (mid, high)
    return math.exp(high)


def bug_class_coverage(
    design: sample_size.ClassDesign,
    pilot: PowerAccumulator,
    power: PowerAccumulator,
    alpha_test: float,
    level: float,
    looks: sequential.Looks,
    early: bool,
    ids: list[int],
) -> dict[str, dict[str, object]]:
    """Per bug class, in the JSON form `losscheck.cells.record.BugClassRecord` reads: its best
    test and the tokens that test needs (from the tested sample's own p and q), its log10
    rule-out e-value at the catalogue point, whether the cell's design covered the class (the
    pilot's estimate) or reached it partly, whether the data ruled out every member of its family
    an early stop needed, down to which ρ, the cell's power against it, and its power curve.

    Against a member it must rule out the cell keeps the power its tests have at the last look
    less the chance the member is ruled out first, β_r if covered, β_p if partly reached
    (`losscheck.stats.sequential`). The tests' power is the tested sample's own (its p and q):
    at the tokens it tested when it ran to its last look, at the design's tokens when it stopped
    early. `short` lists the members whose promise the tested sample does not keep: the design
    promised them power `sequential.design_power` (covered) or `sequential.PARTIAL_POWER`
    (partial) at its tokens. `curve`: the smallest member ρ its tests catch at power 0.99 and
    0.8 at the tokens it tested (its stopping n). `ids`: the misreporting drafter's ids the early
    stops had to rule out (reported by count, with whether all were)."""
    needed = power.tokens_needed(alpha_test, sequential.design_power(level), looks.limit)
    tested = max(power.steps, 1)
    at_last = design.tokens if early else tested
    # at an early look, the power the tested sample's own p and q give at the design's tokens:
    # the cell stops there only if that keeps the design's promise (`losscheck.cells.sequential_design.shortfall`)
    checked = design.tokens if early else tested
    rule_out = power.rule_out_log_e(ids)
    ruled = looks.ruled_out(rule_out)
    thresholds = looks.thresholds()
    beta = {True: (1.0 - level) * sequential.RULE_OUT_SHARE, False: sequential.PARTIAL_BETA}
    promise = {True: sequential.design_power(level), False: sequential.PARTIAL_POWER}
    coverage: dict[str, dict[str, object]] = {}
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
