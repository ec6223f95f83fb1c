"""A one-sample engine cell's looks and stop rule: its tested sample grows look by look and stops
at the first look where the data rule out every bug class its design reaches, as a PIT cell's
does (`losscheck.cells.sequential_design`, `losscheck.stats.sequential`).

The classes are of two kinds, each with its own rule-out e-values, both valid at any stopping
time under the member they rule out:

- the target-side classes (`buglaws.TARGET_SIDE`), from the tested sample's p alone
  (`PowerAccumulator.rule_out_log_e`), their looks and family members planned as a PIT cell
  plans them (`losscheck.stats.design.design_looks`);
- with the engine's draft model, the verifier's classes (`losscheck.stats.hidden_rounds`), from
  the round filter's predictive law of each member (`RoundsSample.rule_out_log_e`), their
  members on the filter's grid (`hidden_rounds.MEMBERS`).

Looks: at most `LOOKS`, spaced geometrically from the floor to the design's tokens, each at most
double the one before (`GROWTH`, `look_tokens`), at the whole rows a look draws (`on_rows`), dealt
to the prompts in a seeded order (`losscheck.cells.engine.deal`): a look below one row a prompt
reads a part of them. Where the pilot predicts that some member an early stop needs cannot be ruled
out before the last look (`EngineLooks.late`, `sequential.may_rule_out`: a class whose drift is too
small, or rule-outs that stop early in most rows, at cut-offs with no sure token), the cell is
sized and drawn in one look instead: its fixed-sample tests at α, every test at the first stage's
power. Each look is an engine draw and a scoring phase, and an engine kept one instance at a time
(`losscheck.plan.memory`) is built again for each: wider looks than a PIT cell's
(`sequential.LOOK_GROWTH`), and a smaller Bonferroni divisor for the fixed-sample tests. The
design's tokens are sized at the 0.99 quantile, several times what a lossless engine needs before
its rule-outs pass: with three looks (until 2026-12-07), a cell whose rule-outs passed just after
the middle one read the whole design.

Level: the e-value tests (the rounds tests, and those the registry marks `anytime`) hold at any
stopping time; every other test is judged at α / `LOOKS` (the looks allowed, fixed before any
draw). Power: a covered class keeps the profile's power, its tests sized at
`sequential.design_power` for the last look and ruled out at β_r before an early stop: β / 2, or
less where the pilot predicts its rule-out e-value passes the first look by far
(`sequential.rule_out_beta`), so that the tested sample confirms 1 - β + β_r at the last look.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from losscheck.stats import sequential
from losscheck.stats.bugclass import PowerAccumulator
from losscheck.stats.design import design_looks
from losscheck.stats.hidden_rounds import MEMBERS, RoundsPower, RoundsSample
from losscheck.stats.sample_size import DESIGN_MARGIN, ClassDesign

LOOKS = 5  # an engine cell's looks at most: the floor, up to three between, the design's tokens
# where each later look builds the engine again (`Policy.ONE_AT_A_TIME`: a GPU's memory holds one
# instance, and a build costs more than the tokens a closer look saves): the floor, one between, the design
REBUILT_LOOKS = 3
GROWTH = 2.0  # a look tests at most this many times the tokens of the one before, where `LOOKS` allow
MIN_GROWTH = 1.25  # a look tests at least this many times the tokens of the one before


def looks_allowed(rebuilt: bool, early_stop: bool = True) -> int:
    """The looks an engine cell allows, fixed before the tested draw (its fixed-sample tests'
    divisor): `REBUILT_LOOKS` where each later look `rebuilt` the engine, else `LOOKS`; one
    without `early_stop` (or where the pilot names members `EngineLooks.late`)."""
    return (REBUILT_LOOKS if rebuilt else LOOKS) if early_stop else 1


def look_tokens(floor: int, tokens: int, limit: int = LOOKS) -> tuple[int, ...]:
    """The tested tokens of an engine cell's looks, spaced geometrically from `floor` to the
    design's `tokens`: as few as keep each within `GROWTH` times the one before, at most `limit`,
    each at least `MIN_GROWTH` times the one before (one look when the design is at or below the
    floor). The first is at least the design over `GROWTH` to the power `LOOKS` - 1: a floor far
    below a large design does not stretch its looks beyond `GROWTH` apart."""
    floor = max(floor, math.floor(tokens / GROWTH ** (LOOKS - 1)))
    if tokens > floor:  # the looks that keep each step within GROWTH (a float's ceil: 1e-9 of slack)
        limit = min(limit, 1 + math.ceil(math.log(tokens / floor) / math.log(GROWTH) - 1e-9))
    while limit > 1 and tokens < floor * MIN_GROWTH ** (limit - 1):
        limit -= 1
    if tokens <= floor or limit == 1:
        return (max(tokens, 1),)
    ratio = (tokens / floor) ** (1 / (limit - 1))
    inner = sorted({round(floor * ratio**i) for i in range(limit - 1)})
    return (*inner, tokens)


@dataclass(frozen=True)
class EngineLooks:
    """What an engine cell's pilot fixes of its looks.

    looks:      the tested tokens of each look and the member keys an early stop must rule out
    grid:       per target-side class, the members whose rule-out e-values the tested sample keeps
    design:     the class design the last look reaches (its tokens, what it covers)
    rounds:     the verifier classes judged through the draft model, in the design
    alpha_test: one test's share of the cell's α
    power:      the profile's power
    """

    looks: sequential.Looks
    grid: dict[str, tuple[float, ...]]
    design: ClassDesign
    rounds: tuple[str, ...]
    alpha_test: float
    power: float
    # the member keys the pilot predicts no look before the last rules out (`sequential.may_rule_out`)
    late: tuple[str, ...] = ()

    @classmethod
    def plan(
        cls,
        design: ClassDesign,
        pilot: PowerAccumulator,
        pilot_rounds: RoundsPower | None,
        rate: float,
        judged: tuple[str, ...],
        alpha_test: float,
        power: float,
        limit: int,
        per_row: float = 0.0,
    ) -> EngineLooks:
        """From the pilot's target-side sums `pilot`, its rounds power sums `pilot_rounds` (None
        without a draft model) with `rate` rounds-scored tokens per tested token, and the verifier
        classes the cell `judged`: at most `limit` looks from the design's floor up to its tokens,
        each at whole rows (`per_row` tested tokens a row; 0: as planned; `on_rows`); each covered
        member's β_r fixed from what the pilot predicts of its rule-out at the first look
        (`sequential.rule_out_beta`)."""
        target = {c.name for c in pilot.classes}
        target_design = dataclasses.replace(
            design,
            best={n: b for n, b in design.best.items() if n in target},
            covered=tuple(n for n in design.covered if n in target),
        )
        looks, _, grid = design_looks(pilot, target_design, alpha_test, power, limit)
        rounds = tuple(n for n in design.best if n in judged and pilot_rounds is not None)
        covered, partial, promised = list(looks.covered), list(looks.partial), list(looks.promised)
        if pilot_rounds is not None:
            keys = _rounds_keys(design, pilot_rounds, rate, rounds, alpha_test, power)
            covered, partial, promised = covered + keys[0], partial + keys[1], promised + keys[2]
        looks = dataclasses.replace(looks, covered=tuple(covered), partial=tuple(partial), promised=tuple(promised))
        tokens = on_rows(look_tokens(design.floor, design.tokens, limit), per_row)
        # a β_r, and a member's chance of being ruled out early, matter only with looks before the last
        early = len(tokens) > 1
        rates = {key: _rule_out_rate(key, pilot, pilot_rounds, rate) for key in (*covered, *partial) if early}
        betas = {key: sequential.rule_out_beta(power, _times(rates[key], tokens[0])) for key in covered if early}
        looks = dataclasses.replace(looks, tokens=tokens, betas=betas)
        late = tuple(
            key
            for key, threshold in looks.thresholds().items()
            if early and not sequential.may_rule_out(_times(rates[key], tokens[-2]), threshold)
        )
        return cls(looks, grid, design, rounds, alpha_test, power, late)

    @property
    def partly(self) -> frozenset[str]:
        """The classes the design does not cover whose catalogue point an early stop must still
        rule out: reached at `sequential.PARTIAL_POWER` or more at the last look (the design's
        margin can leave a class just beyond the cap that its looks treat as covered)."""
        points = (_member(key) for key in (*self.looks.covered, *self.looks.partial))
        return frozenset(name for name, rho in points if rho == 1.0 and name not in self.design.covered)

    def short(self, power: PowerAccumulator, rounds: RoundsPower | None) -> list[str]:
        """The promised member keys whose power, from the engine's own p and q at the design's
        tokens (`power` and `rounds`: the power sums of the rows read so far, `confirming`), falls
        below the promise: 1 - β + β_r (`sequential.Looks.promise`) where the design covers the
        member, `sequential.PARTIAL_POWER` where it reaches it partly."""
        tokens = self.design.tokens
        out = []
        for key in self.looks.promised:
            name, rho = _member(key)
            strong = key in self.looks.covered
            promise = self.looks.promise(key) if strong else sequential.PARTIAL_POWER
            if name in self.rounds:
                if rounds is None or rounds.tokens == 0 or power.steps == 0:
                    out.append(key)
                    continue
                # the rows' own rate, on the rows both power sums read
                scored = tokens * rounds.tokens / power.steps
                have = rounds.power(name, _on_grid(rho), scored, self.alpha_test)
            else:
                have = power.best_power(name, tokens, self.alpha_test, self.looks.limit, rho)
            if have < promise:
                out.append(key)
        return out

    def family_bound(self, power: PowerAccumulator, rounds: RoundsPower | None) -> tuple[str, float] | None:
        """Wald's bound for the early stop's promise: of the member keys an early stop must rule
        out, the one whose rule-out Wald's SPRT needs the most tested tokens for under H0 (its
        threshold over its growth per token, overshoot neglected), from the engine's own p and q
        (`power`, `rounds`: `confirming`), with those tokens. No stop needing every key ruled out
        can expect fewer: a lower bound from the keys the sums can evaluate. None with one look
        (no early stop), or where a key's rule-out never grows."""
        rate = rounds.tokens / power.steps if rounds is not None and power.steps else 0.0
        largest: tuple[str, float] | None = None
        for key, threshold in self.looks.thresholds().items() if len(self.looks.tokens) > 1 else ():
            growth = _rule_out_rate(key, power, rounds, rate)
            if growth is None:
                continue
            if growth <= 0:
                return None
            if largest is None or threshold / growth > largest[1]:
                largest = (key, threshold / growth)
        return largest

    def ruled_out(self, power: PowerAccumulator, rounds: RoundsSample | None) -> dict[str, bool]:
        """Per class the looks name, whether every member an early stop needs is ruled out."""
        rule_out: dict[str, float | None] = dict(power.rule_out_log_e())
        if rounds is not None:
            rule_out |= rounds.rule_out_log_e()
        out: dict[str, bool] = {}
        for key, done in self.looks.ruled_out(rule_out).items():
            name = _member(key)[0]
            out[name] = out.get(name, True) and done
        return out


def on_rows(tokens: tuple[int, ...], per_row: float) -> tuple[int, ...]:
    """The looks `tokens` as a cell draws them, at whole rows (`per_row` tested tokens a row): each
    at the rows that reach it, at least one more than the look before. A look's tokens are its
    rows' rounded down, so that the rows it asks for (tokens / `per_row`, rounded up) are its rows
    exactly, and its record says what was drawn."""
    if per_row <= 0:
        return tokens
    rows: list[int] = []
    for t in tokens:
        rows.append(max(math.ceil(t / per_row - 1e-9), rows[-1] + 1 if rows else 1))
    return tuple(max(1, math.floor(r * per_row)) for r in rows)


def _rule_out_rate(key: str, pilot: PowerAccumulator, pilot_rounds: RoundsPower | None, rate: float) -> float | None:
    """The growth per tested token under H0 of a member key's log rule-out e-value, as the pilot
    predicts it: a target-side class's from its sums, a verifier class's from the filter's (per
    scored token, times `rate`); None for a per-id key or a class the pilot cannot evaluate."""
    name, rho = _member(key)
    if name in {c.name for c in pilot.classes}:
        return pilot.rule_out_rate(name, rho)
    if pilot_rounds is not None and name in pilot_rounds.classes:
        per_scored = pilot_rounds.rule_out_rate(name, _on_grid(rho))
        return None if per_scored is None else per_scored * rate
    return None


def _times(rate: float | None, tokens: int) -> float | None:
    """A log e-value's predicted growth over `tokens` (None where its rate is unknown)."""
    return None if rate is None else rate * tokens


def _rounds_keys(
    design: ClassDesign,
    pilot: RoundsPower,
    rate: float,
    names: tuple[str, ...],
    alpha_test: float,
    power: float,
) -> tuple[list[str], list[str], list[str]]:
    """The verifier classes' member keys an early stop must rule out, as `design_looks` chooses
    them for the target side: each class's floor ρ_min is the smallest member on the filter's
    grid its rounds test catches at `sequential.PARTIAL_POWER` within the design's promising
    tokens (`ClassDesign.promising`) less two margins (or 1, where it reaches only the catalogue
    point at the full design); the members from 1 down to it and the one below are ruled out at
    β_r where the test has `sequential.design_power` at the promising tokens less one margin (and
    at the catalogue point of a covered class), else at β_p. Returns (covered, partial, promised)
    keys."""
    level = sequential.design_power(power)
    promised_tokens = design.promising / DESIGN_MARGIN * rate
    floor_tokens = promised_tokens / DESIGN_MARGIN
    covered: list[str] = []
    partial: list[str] = []
    kept: list[str] = []
    for name in names:
        rho_min = pilot.smallest_rho(name, floor_tokens, alpha_test, sequential.PARTIAL_POWER)
        if rho_min is None:
            if pilot.power(name, 1.0, design.tokens * rate, alpha_test) < sequential.PARTIAL_POWER:
                continue
            rho_min = 1.0
        for rho in sequential.required(MEMBERS, rho_min):
            key = sequential.member_key(name, rho)
            strong = (rho == 1.0 and name in design.covered) or pilot.power(
                name, rho, promised_tokens, alpha_test
            ) >= level
            (covered if strong else partial).append(key)
            if strong or pilot.power(name, rho, floor_tokens, alpha_test) >= sequential.PARTIAL_POWER:
                kept.append(key)
    return covered, partial, kept


def _member(key: str) -> tuple[str, float]:
    """A member key's class and ρ (`sequential.member_key`)."""
    name, _, rho = key.partition("@")
    return name, float(rho) if rho else 1.0


def _on_grid(rho: float) -> float:
    """The member of the filter's grid a member key's (rounded) ρ names."""
    return min(MEMBERS, key=lambda m: abs(m - rho))
