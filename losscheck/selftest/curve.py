"""A PIT cell's power curve per bug class, as its record gives it (docs/bug-classes.md).

    python -m losscheck.selftest.curve [CELL] [--mutant NAME] [--seeds N] [--seed S] [--fixed]

Runs the cell of the bundled reference set (default `A-k4-T1`) as the gate does
(`losscheck.cells.sampled.run_pit`) and prints, per bug class, what its record says: how far the
design reaches (`reach`), the ρ_min it promised (the smallest family member its tests at the last
look catch at power 0.8), how far the data ruled the family out, and the tested sample's own
curve — the smallest ρ its tests catch at power 0.99 and 0.8 at the tokens it tested. With
`--mutant` the cell runs with that planted bug; with `--seeds N` it runs N seeds and prints, per
seed, whether it passed and where it stopped (a catch rate). With `--fixed` the cell draws its
fixed-sample design in one look instead (`Profile.early_stop` off): the same tests at the same α
without the sequential stop, the baseline its power is compared with.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch


def _rho(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    from losscheck.cells.sampled import run_pit
    from losscheck.errors import UnderpoweredError
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    parser = argparse.ArgumentParser(prog="python -m losscheck.selftest.curve", description=__doc__.split("\n")[0])
    parser.add_argument("cell", nargs="?", default="A-k4-T1")
    parser.add_argument("--mutant", default=None)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=None, help="the first seed (default: the run's)")
    parser.add_argument("--fixed", action="store_true", help="draw the fixed-sample design in one look, no early stop")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    options = Options(bundled="reference", **({} if args.seed is None else {"seed": args.seed}))
    if args.fixed:
        options = dataclasses.replace(options, profile=dataclasses.replace(options.profile, early_stop=False))
    session = Session(options)
    cell = next(c for cells in session.plan.values() for c in cells if c.id == args.cell)
    first = session.options.seed
    caught = by_law = 0
    for i in range(args.seeds):
        run = session.derive(seed=first + i, **({"mutant": args.mutant} if args.mutant else {}))
        began = time.perf_counter()
        try:
            outcome = run_pit(CellContext.of(run, cell))
        except UnderpoweredError as error:
            print(f"seed {first + i}: ERROR underpowered: {error}")
            continue
        facts = outcome.facts
        looks = facts.looks
        assert looks is not None, "a PIT cell records its looks"
        caught += not outcome.passed
        failed = [r.name for r in (outcome.verdict.results if outcome.verdict else []) if not r.passed]
        # the conformance checks judge the verifier white-box; the rest judge the output's law
        by_law += any(not name.startswith("conformance.") for name in failed)
        print(
            f"seed {first + i}: {'PASS' if outcome.passed else 'FAIL ' + ', '.join(failed)}; tested "
            f"{looks.tested_tokens:,} tokens (look {looks.stopped_at} of {len(looks.tokens)}, "
            f"{'early' if looks.early else 'the last'}); design {facts.design_tokens:,}, fixed design "
            f"{facts.fixed_design_tokens:,}; {time.perf_counter() - began:.1f} s"
        )
        if i == 0:
            print("| class | reach | power at ρ = 1 | ρ_min promised | ruled out down to | ρ at 0.99 | ρ at 0.8 |")
            print("|---|---|---|---|---|---|---|")
            for name, c in (facts.bug_classes or {}).items():
                required = c.family.required_down_to if c.family else None
                ruled = c.family.ruled_out_down_to if c.family else None
                print(
                    f"| {name} | {c.reach} | {c.power:.3f} | {_rho(required)} | {_rho(ruled)} | "
                    f"{_rho(c.curve.get('0.99'))} | {_rho(c.curve.get('0.8'))} |"
                )
    if args.seeds > 1:
        print(f"caught in {caught} of {args.seeds} seeds ({by_law} by a test of the output's law, not conformance)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
