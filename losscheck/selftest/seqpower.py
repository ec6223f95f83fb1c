"""Power of a sequential PIT cell against bugs between the catalogue's points, beside the fixed
design it replaces (docs/bug-classes.md).

    python -m losscheck.selftest.seqpower [--replicates R] [--seed S]

On the Markov chain of `losscheck.selftest.bugtable` (V = 64, k = 4, acceptance about 0.88), a
pilot of honest rows sizes a cell of the ci profile with the object `losscheck.cells.sampled.run_pit`
runs (`losscheck.cells.sequential_design.SequentialDesign`): the sequential design, its looks,
each bug class's family members to rule out, and the fixed-sample design of one look. The tested
rows are honest prefixes; in each replicate their tokens are redrawn from a bug's law at those
steps (the power model's own assumption: the bug changes the token, not the steps). The
replicate then runs the design's looks and stop rule as the cell does: at each look the rule-out
e-values of every member the design requires; at the first look where all are ruled out and the
tested sample keeps the design's promises it stops, and the cell's PIT and exact-conditional
tests (`pit_tests`, `conditional_tests`, at the cell's levels, the χ² ones at share / looks) run
on the tokens tested so far. The fixed design runs the same tests at its tokens at one look.
Power: the share of replicates where some test rejects.

Bugs: every class's catalogue point and its family members at ρ_min (the smallest member the
design promises) — exact members, each token from (1 - ρ)·p + ρ·p' — and the issue's rows between
the points: stale q on 30% and 50% of the rounds and the bonus from the previous slot on 10% of
the rounds (each round independently), top-p 0.97 one side, one id misreported 1.5× and 2× (at
the pilot's id).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from losscheck.cells.sequential_design import SequentialDesign
from losscheck.plan.profiles import PROFILES
from losscheck.selftest import bugtable
from losscheck.stats import registry
from losscheck.stats.buglaws import BY_NAME, Step, chunk_steps, mismatched_law, tilted, top_p

CELL_ALPHA = bugtable.CELL_ALPHA  # one cell's per-test α share of the gate
PROFILE = PROFILES["ci"]  # the tested tokens' floor and cap, the power, the pooled TV
PILOT_ROWS = 256


@dataclass(frozen=True)
class Bug:
    """A bug for the table: the law of each step's token (`law(step)` [m, V]) and, for a bug on
    a share of the rounds, that share (each round independently); 1: every step."""

    name: str
    law: Callable[[Step], torch.Tensor]
    rounds: float = 1.0


def _mixture(name: str, rho: float) -> Bug:
    bug = BY_NAME[name]
    return Bug(f"{name} ρ = {rho:.2f}", lambda step: (1 - rho) * step.p + rho * bug.law(step))


def _misreport(factor: float) -> Callable[[Step], torch.Tensor]:
    def law(step: Step) -> torch.Tensor:
        assert step.misreported is not None
        drawn = tilted(step.q, step.misreported, factor)
        return torch.where(step.drafted, mismatched_law(step.p, drawn, step.q), step.p)

    return law


def _top_p(top: float) -> Callable[[Step], torch.Tensor]:
    def law(step: Step) -> torch.Tensor:
        return torch.where(step.drafted, mismatched_law(step.p, top_p(step.q, top), step.q), step.p)

    return law


def between_points() -> list[Bug]:
    """The issue's rows: bugs smaller than, or acting on part of the rounds of, catalogue points."""
    return [
        Bug("stale q on 30% of rounds", BY_NAME["stale_q"].law, 0.3),
        Bug("stale q on 50% of rounds", BY_NAME["stale_q"].law, 0.5),
        Bug("bonus from the previous slot on 10% of rounds", BY_NAME["bonus_from_previous_slot"].law, 0.1),
        Bug("top-p 0.97 one side", _top_p(0.97)),
        Bug("one id misreported 1.5x", _misreport(1.5)),
        Bug("one id misreported 2x", _misreport(2.0)),
    ]


def cell_budget() -> registry.Split:
    """A PIT cell's α split over its three families of tests, as `cells.sampled.run_pit` splits it."""
    import losscheck.cells.conformance  # noqa: F401  (registers the conformance family)

    return registry.split(CELL_ALPHA, registry.PIT, registry.CONDITIONAL, registry.CONFORMANCE)


def plan(chain: bugtable.Chain, seed: int) -> SequentialDesign:
    """The cell's designs from a pilot of honest rows."""
    pilot = bugtable.accumulate(chain, bugtable.simulate(chain, PILOT_ROWS, seed))
    return SequentialDesign.plan(pilot, PROFILE, cell_budget())


@dataclass(frozen=True)
class Tables:
    """The tested rows' steps: p, q [N, L, V], the exact previous-round q, slots and rounds [N, L]."""

    p: torch.Tensor
    q: torch.Tensor
    q_prev: torch.Tensor
    slots: torch.Tensor
    rounds: torch.Tensor  # [N, L] a distinct id per (row, round)

    @classmethod
    def of(cls, chain: bugtable.Chain, steps: bugtable.Steps) -> Tables:
        drafted = (steps.slots < bugtable.K)[..., None]
        rows, length = steps.slots.shape
        rounds = (steps.slots == 0).long().cumsum(1) + torch.arange(rows)[:, None] * (length + 1)
        return cls(
            p=chain.p[steps.before],
            q=torch.where(drafted, chain.q[steps.before], 0.0),
            q_prev=torch.where(drafted & (steps.stale >= 0)[..., None], chain.q[steps.stale.clamp_min(0)], 0.0),
            slots=steps.slots,
            rounds=rounds,
        )


def draw(tables: Tables, bug: Bug | None, misreported: int | None, g: torch.Generator) -> torch.Tensor:
    """[N, L] tokens at the tested steps: from p (None: honest), or from the bug's law on each of
    its rounds (every round when `bug.rounds` is 1)."""
    every = torch.ones(tables.slots.shape, dtype=torch.bool)
    step = chunk_steps(
        tables.p, tables.q, tables.slots, bugtable.K, every, "seqpower", q_prev=tables.q_prev, misreported=misreported
    )
    honest = torch.multinomial(step.p, 1, generator=g).squeeze(-1)
    if bug is None:
        return honest.view(tables.slots.shape)
    buggy = torch.multinomial(bug.law(step).clamp_min(0.0), 1, generator=g).squeeze(-1)
    if bug.rounds < 1:
        hit = torch.rand(int(tables.rounds.max()) + 1, generator=g) < bug.rounds
        buggy = torch.where(hit[tables.rounds.reshape(-1)], buggy, honest)
    return buggy.view(tables.slots.shape)


def _rejects(
    tables: Tables, tokens: torch.Tensor, rows: int, looks: int, misreported: int | None, power: float, seed: int
) -> bool:
    """Whether the cell's PIT and exact-conditional tests reject on the first `rows` rows."""
    from losscheck.stats.conditional import ConditionalValues, conditional_tests
    from losscheck.stats.pit import pit_tests, randomized_pit

    g = torch.Generator().manual_seed(seed)
    part = slice(0, rows)
    p, q, slots, x = tables.p[part], tables.q[part], tables.slots[part], tokens[part]
    v, v_order, spare = (torch.rand(x.shape, generator=g, dtype=torch.float64) for _ in range(3))
    tested = torch.ones(x.shape, dtype=torch.bool)
    budget = cell_budget()
    alpha_scored = budget.share(registry.PIT, registry.CONDITIONAL)
    alpha_pit = budget.share(registry.PIT)
    u = randomized_pit(p, x, v)
    results = pit_tests(u, tested, alpha_pit / looks, power, None, 10, slots=slots, spare=spare)
    values = ConditionalValues.from_chunk(
        p, q, x, v_order, tested, slots=slots, k=bugtable.K, misreported_id=misreported
    )
    results += conditional_tests(values, alpha_scored - alpha_pit, power, looks)
    return not all(r.passed for r in results)


def replicate(plan_: SequentialDesign, tables: Tables, bug: Bug | None, seed: int) -> tuple[bool, bool, int]:
    """One replicate: (the sequential cell rejects, the fixed design rejects, tokens the
    sequential cell tested)."""
    g = torch.Generator().manual_seed(seed)
    misreported = plan_.pilot.misreported_id
    tokens = draw(tables, bug, misreported, g)
    length = tables.slots.shape[1]
    acc = plan_.tested()
    done = 0

    def grow(_look: int, n: int) -> None:
        nonlocal done
        rows = min(math.ceil(n / length), len(tokens))
        part = slice(done, rows)
        tested = torch.ones(tokens[part].shape, dtype=torch.bool)
        acc.update(tables.p[part], tables.q[part], tokens[part], tables.slots[part], bugtable.K, tested)
        done = rows

    plan_.run(acc, grow)
    sequential_rejects = _rejects(tables, tokens, done, plan_.limit, misreported, plan_.power, seed + 1)
    fixed_rows = min(math.ceil(plan_.fixed.tokens / length), len(tokens))
    fixed_rejects = _rejects(tables, tokens, fixed_rows, 1, misreported, plan_.power, seed + 2)
    return sequential_rejects, fixed_rejects, done * length


def bugs(plan_: SequentialDesign) -> list[Bug]:
    """Each class's catalogue point and its member at ρ_min (when the design promises one below 1),
    then the rows between the points."""
    out = []
    for name in plan_.design.best:
        out.append(Bug(name, BY_NAME[name].law))
        if plan_.grid.get(name, (1.0,))[-1] < 1 and not BY_NAME[name].per_id:
            out.append(_mixture(name, plan_.grid[name][-1]))
    return out + between_points()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m losscheck.selftest.seqpower", description=__doc__.split("\n")[0])
    parser.add_argument("--replicates", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--acceptance", type=float, default=bugtable.ACCEPTANCES[0])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    began = time.perf_counter()
    chain = bugtable.make_chain(args.acceptance, seed=args.seed)
    plan_ = plan(chain, args.seed + 1)
    rows = math.ceil(max(plan_.design.tokens, plan_.fixed.tokens) / bugtable.LENGTH)
    tables = Tables.of(chain, bugtable.simulate(chain, rows, args.seed + 2))
    print(
        f"V = {bugtable.VOCAB}, k = {bugtable.K}, acceptance {args.acceptance}, seed {args.seed}, "
        f"{args.replicates} replicates; per-test α {cell_budget().per_test:.3g}, power {plan_.power}; "
        f"sequential design {plan_.design.tokens} tokens (looks {list(plan_.looks.tokens)}), "
        f"fixed design {plan_.fixed.tokens}; members to rule out: {len(plan_.looks.covered)} at β_r, "
        f"{len(plan_.looks.partial)} at β_p; misreported id {plan_.pilot.misreported_id}"
    )
    print("| bug | power, sequential | power, fixed design | sequential tokens (mean) |")
    print("|---|---|---|---|")
    for bug in [None, *bugs(plan_)]:
        runs = [replicate(plan_, tables, bug, args.seed * 100_000 + 10 * r) for r in range(args.replicates)]
        seq = sum(r[0] for r in runs) / len(runs)
        fixed = sum(r[1] for r in runs) / len(runs)
        tokens = sum(r[2] for r in runs) / len(runs)
        name = "none (H0)" if bug is None else bug.name
        print(f"| {name} | {seq:.2f} | {fixed:.2f} | {tokens:,.0f} |", flush=True)
    print(f"({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
