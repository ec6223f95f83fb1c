"""`python -m losscheck.selftest.engine_calibration [--cells N] [--cell-alpha A] [--seed S]`: the
false-alarm rate of black-box one-sample cells on a lossless engine, both stages counted.

The engine is losscheck's own loop behind the black-box interface (`losscheck.engines.spec_loop`:
the bundled target, family A's drafter at k = 4, its draft model given), so it is lossless by
construction and its reference is exact. N cells cycle over the engine's five sampled cells, each
with its own run seed (S, S + 1, ...), at the cell α `A`. Counted: first-stage rejections (any
test of the cell at or below its level), FAILs (both stages rejected), second-stage findings,
cells that withdrew a class their tested sample fell short of (never a failure), and errors,
which count as outcomes: an error is a failure outside α.
Each count must lie within the binomial bound: at most the (1 - 1e-3) quantile of Binomial(N, A)
— a count above it has probability below 1e-3 for a calibrated cell (the first stage is a
Bonferroni split, so its rate is at most A; a FAIL needs both stages, so its rate is at most A).
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass

BOUND_MISS = 1e-3  # the binomial bound's own false-alarm probability


@dataclass(frozen=True)
class Calibration:
    cells: int
    cell_alpha: float
    first_stage_rejections: int
    fails: int
    findings: dict[str, int]  # second-stage findings: "speculation" / "reference"
    withdrawn: int  # cells that withdrew a class (their tested sample short of the design's power)
    errors: int  # cells that raised: each one is counted with the FAILs
    bound: int  # the binomial bound each count must stay within
    seconds: float

    @property
    def within(self) -> bool:
        return self.first_stage_rejections <= self.bound and self.fails + self.errors <= self.bound


def calibrate(cells: int, cell_alpha: float, seed: int) -> Calibration:
    import time

    from scipy import stats

    from losscheck.cells.engine import run_engine_cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    start = time.perf_counter()
    from losscheck.errors import LosscheckError

    first = fails = withdrawn = errors = 0
    findings: Counter[str] = Counter()
    for i in range(cells):
        # one session per seed; the engine-only run's α is split over its five sampled cells
        session = Session(Options(engine="losscheck.engines.spec_loop:spec_loop", seed=seed + i, alpha=5 * cell_alpha))
        sampled = session.plan["engine_cell"]
        cell = sampled[i % len(sampled)]
        ctx = CellContext.of(session, cell)
        assert abs(ctx.alpha - cell_alpha) <= 1e-12 * cell_alpha, (ctx.alpha, cell_alpha)
        try:
            outcome = run_engine_cell(ctx)
        except LosscheckError as error:  # an error is an outcome outside α, counted
            errors += 1
            print(f"cell {i}: error: {error}", flush=True)
            continue
        withdrawn += any(c.withdrawn is not None for c in (outcome.facts.bug_classes or {}).values())
        attribution = outcome.facts.attribution
        first += attribution is not None
        fails += not outcome.passed
        if attribution is not None:
            findings[attribution.finding] += 1
    bound = int(stats.binom.ppf(1 - BOUND_MISS, cells, cell_alpha))
    seconds = time.perf_counter() - start
    return Calibration(cells, cell_alpha, first, fails, dict(findings), withdrawn, errors, bound, seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m losscheck.selftest.engine_calibration", description=__doc__)
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--cell-alpha", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=20261204)
    args = parser.parse_args(argv)
    c = calibrate(args.cells, args.cell_alpha, args.seed)
    print(
        f"{c.cells} lossless engine cells at cell alpha {c.cell_alpha:g} "
        f"(seeds {args.seed}..{args.seed + c.cells - 1}): "
        f"first stage rejected {c.first_stage_rejections}, FAIL {c.fails} (second stage: {c.findings or 'never run'}), "
        f"errors {c.errors}, a class withdrawn in {c.withdrawn}; "
        f"binomial bound {c.bound} (expected at most {c.cells * c.cell_alpha:g}); "
        f"{'within' if c.within else 'OUTSIDE'} the bound; {c.seconds:.0f} s"
    )
    raise SystemExit(0 if c.within else 1)


if __name__ == "__main__":
    main()
