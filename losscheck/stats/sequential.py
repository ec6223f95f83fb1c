"""Sequential stopping of a PIT cell: the tested sample grows look by look, and a passing cell
stops at the first look where every member of every bug-class family its design reaches is
ruled out by the data.

Terms:

- *looks*: the tested-token counts n_1 < … < n_m the cell may stop at, fixed before the tested
  sample is drawn — the profile's floor, growing by `LOOK_GROWTH`, up to the design's tokens
  (`look_tokens`). A profile allows at most `max_looks(floor, cap)` of them.
- *family* of a class c with exact law p'_{c,t} at every step t (`losscheck.stats.buglaws`): the
  mixtures p_ρ = (1 - ρ)·p + ρ·p'_c, 0 < ρ <= 1 — the bug at a fraction ρ of its magnitude, or
  acting on each token with probability ρ; ρ = 1 is the catalogue point. A design promises the
  members down to ρ_min, where its tests at the last look have power `PARTIAL_POWER`; an early
  stop must rule out the members of `family(ρ_min)` (`required`).
- *rule-out e-value* of member ρ: R_{c,ρ} = Π_t p_t(x_t) / p_{ρ,t}(x_t) over the tested tokens.
  Under p_ρ it is a non-negative supermartingale of mean at most 1 (E_{p_ρ}[p / p_ρ] <= 1), so by
  Ville's inequality P(R_{c,ρ} ever reaches 1/β) <= β; each factor is at most 1 / (1 - ρ). A
  member is *ruled out* once log R_{c,ρ} >= log(1/β): β_r where the design's tests have power
  `design_power` against it, β_p = `PARTIAL_BETA` where they have `PARTIAL_POWER` or more.

Level: the e-values only decide when to stop; every fixed-sample test (the χ², KS and uniformity
tests) is judged at α / m (Bonferroni over the m looks a profile allows) and the e-value tests
hold at any stopping time, so the cell's false-alarm rate stays within its budget whichever look
it stops at.

Power: under member ρ the cell misses it only if R_{c,ρ} crossed 1/β first (probability <= β) or
the tests at n_m missed it; each member is judged under its own law, so requiring all of them
needs no multiplicity correction. The design gives each covered member's best test power
1 - β/2 at n_m, and β_r = β/2: power 1 - β, the profile's, whichever look the cell stops at; a
partly reached member keeps its fixed-design power less β_p. A bug between two members is held
by the member below it: in the local limit log R_{c,ρ} under p_{ρ*} drifts by ρ·χ²·(ρ/2 - ρ*)
per token with variance ρ²·χ², so it crosses log(1/β) with probability β^(2ρ*/ρ - 1) <= β for
ρ* >= ρ. It rests on what the power table already assumes: the emitted token's law at each step
is the bug's given everything before it (the bug changes the token's law, not the steps).

β_r per member: Ville's bound holds for any threshold fixed before the tested sample is drawn,
so a cell may fix each covered member's β_r from its pilot (`rule_out_beta`): where the pilot
says the member's rule-out e-value passes the first look by far, a smaller β_r costs nothing
under H0 and leaves the last look's tests 1 - β + β_r to reach instead of 1 - β/2.

Cost under H0: log R_{c,ρ} grows by KL(p‖p_ρ) ≈ ρ²·χ²(p'‖p) / 2 per token; a cell stops as soon as
its slowest required member — one at its class's ρ_min — is ruled out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from losscheck.errors import LosscheckError
from losscheck.stats._checks import check_open_unit

LOOK_GROWTH = 1.5  # each look tests this many times the tokens of the one before
RULE_OUT_SHARE = 0.5  # the part of β (1 - power) spent on ruling classes out; the rest at n_m
# A class or id the design reaches only partly (its tests' power at the last look at least
# PARTIAL_POWER, short of the design's) must be ruled out at β_p = PARTIAL_BETA before an early
# stop: the stop then keeps all but β_p of the power a fixed-sample design had against it.
PARTIAL_POWER = 0.8
PARTIAL_BETA = 0.1
# A covered member's threshold from its pilot (`rule_out_beta`): this many standard deviations
# below the log e-value the pilot predicts at the first look (under H0 its variance is about twice
# its mean, in the local limit), and β_r at least the default's / RULE_OUT_SHRINK.
RULE_OUT_Z = 2.5
RULE_OUT_SHRINK = 100.0
# Consecutive members of a family a cell rules out differ by this factor in ρ (`family`).
GRID_RATIO = math.sqrt(2)


def look_tokens(floor: int, tokens: int, limit: int) -> tuple[int, ...]:
    """The tested-token counts of the looks: `floor`, doubling, then `tokens` (the design's), at
    most `limit` looks (the earliest dropped). A design at or below the floor has one look."""
    if floor < 1 or tokens < 1 or limit < 1:
        raise LosscheckError(f"look_tokens needs floor, tokens and limit >= 1, got {floor}, {tokens}, {limit}")
    looks = []
    n = floor
    while n < tokens:
        looks.append(n)
        n = math.ceil(n * LOOK_GROWTH)
    looks.append(tokens)
    return tuple(looks[-limit:])


def max_looks(floor: int, cap: int) -> int:
    """The most looks a profile with this floor and cap ever takes: its fixed-sample tests'
    Bonferroni divisor, fixed before any sample is drawn."""
    return len(look_tokens(floor, max(floor, cap), limit=10**6))


def design_power(power: float) -> float:
    """The power the tests must have at the last look so that the cell keeps `power`."""
    check_open_unit("power", power)
    return 1.0 - (1.0 - power) * (1.0 - RULE_OUT_SHARE)


def rule_out_threshold(power: float) -> float:
    """log(1/β_r): the log rule-out e-value at which a class is ruled out."""
    check_open_unit("power", power)
    return -math.log((1.0 - power) * RULE_OUT_SHARE)


def rule_out_beta(power: float, predicted_log_e: float | None) -> float:
    """β_r of a covered member whose rule-out log e-value at the first look a pilot predicts
    (None: no prediction): its threshold log(1/β_r) `RULE_OUT_Z` standard deviations below the
    prediction μ (μ - z·√(2μ)), between the default's (`rule_out_threshold`) and
    log(`RULE_OUT_SHRINK`) above it. Under H0 a member the prediction holds for is ruled out at
    the first look either way; the β_r it does not spend goes to the last look's tests (their
    promise is 1 - β + β_r)."""
    low = rule_out_threshold(power)
    if predicted_log_e is None or math.isnan(predicted_log_e) or predicted_log_e <= 0:
        return math.exp(-low)
    high = low + math.log(RULE_OUT_SHRINK)
    if math.isinf(predicted_log_e):
        return math.exp(-high)
    below = predicted_log_e - RULE_OUT_Z * math.sqrt(2 * predicted_log_e)
    return math.exp(-min(max(below, low), high))


def may_rule_out(predicted_log_e: float | None, threshold: float) -> bool:
    """Whether a rule-out log e-value a pilot predicts at a look (None: no prediction) may reach
    `threshold` there: its prediction μ `RULE_OUT_Z` standard deviations up (μ + z·√(2μ)) does.
    A member this says no to is, under H0, still short of its threshold at that look in all but
    a small share of runs."""
    if predicted_log_e is None or math.isnan(predicted_log_e) or predicted_log_e <= 0:
        return False
    return predicted_log_e + RULE_OUT_Z * math.sqrt(2 * predicted_log_e) >= threshold


def id_key(name: str, v: int) -> str:
    """The rule-out key of a per-id class at id `v`."""
    return f"{name}[{v}]"


def member_key(key: str, rho: float) -> str:
    """The rule-out key of member ρ of a class's (or `id_key`'s) family; the catalogue point
    ρ = 1 keeps the plain key."""
    return key if rho == 1.0 else f"{key}@{rho:.4g}"


def family(rho_min: float) -> tuple[float, ...]:
    """The members a cell rules out to stop early, for a family the design catches down to
    `rho_min`: ρ_min·`GRID_RATIO`^i below 1, and the catalogue point 1 (largest first)."""
    if not 0 < rho_min <= 1:
        raise LosscheckError(f"family needs 0 < rho_min <= 1, got {rho_min}")
    members = [1.0]
    count = math.floor(math.log(1 / rho_min) / math.log(GRID_RATIO) + 1e-9)
    members += [rho_min * GRID_RATIO**i for i in range(count, -1, -1) if rho_min * GRID_RATIO**i < 1 - 1e-9]
    return tuple(members)


def required(members: tuple[float, ...], rho_min: float) -> tuple[float, ...]:
    """The members of a family an early stop must rule out for a key the design promises down to
    `rho_min`: those at or above it, and the largest below it (so that every ρ >= ρ_min has a
    member at or below it that is ruled out)."""
    above = tuple(r for r in members if r >= rho_min * (1 - 1e-9))
    below = [r for r in members if r < rho_min * (1 - 1e-9)]
    on_floor = any(abs(r - rho_min) <= 1e-9 * rho_min for r in above)
    return above + ((max(below),) if below and not on_floor else ())


@dataclass(frozen=True)
class Looks:
    """A sequential cell's plan: where it may stop and what lets it stop.

    tokens:   tested tokens at each look, increasing, from the floor (the profile's, or the pooled
              tests' requirement when the profile sets a pooled TV) to the design's
    limit:    the looks the profile allows (the fixed-sample tests' divisor, >= len(tokens))
    covered:  the classes (or `id_key`s) the design covers: ruled out at β_r to stop early
    partial:  those it reaches only partly: ruled out at β_p = `PARTIAL_BETA`
    power:    the profile's power (1 - β)
    promised: the keys whose power the design promises with a margin, which the tested sample
              must confirm (the rest are ruled out to stop, a cost, and not asserted)
    betas:    the covered keys whose β_r a pilot fixed (`rule_out_beta`); the rest at the default
    """

    tokens: tuple[int, ...]
    limit: int
    covered: tuple[str, ...]
    partial: tuple[str, ...]
    power: float
    promised: tuple[str, ...] = ()
    betas: Mapping[str, float] = field(default_factory=dict)

    def beta(self, key: str) -> float:
        """β_r of a covered key: the chance the data rule it out wrongly."""
        return self.betas.get(key, (1.0 - self.power) * RULE_OUT_SHARE)

    def promise(self, key: str) -> float:
        """The power a covered key's tests must have at the last look so that it keeps the
        profile's: 1 - β + β_r (`design_power` at the default β_r)."""
        return self.power + self.beta(key)

    def thresholds(self) -> dict[str, float]:
        """Per class or id key that must be ruled out, the log e-value that does it."""
        partial = -math.log(PARTIAL_BETA)
        return {**dict.fromkeys(self.partial, partial), **{key: -math.log(self.beta(key)) for key in self.covered}}

    def ruled_out(self, rule_out: Mapping[str, float | None]) -> dict[str, bool]:
        """Per class or id key that must be ruled out: whether these log e-values rule it out
        (None: the cell cannot evaluate it, so it is never ruled out)."""
        return {
            key: (e := rule_out.get(key)) is not None and e >= threshold for key, threshold in self.thresholds().items()
        }

    def may_stop(self, rule_out: Mapping[str, float | None]) -> bool:
        """Whether a passing cell, at a look, stops with these log rule-out e-values."""
        return all(self.ruled_out(rule_out).values())
