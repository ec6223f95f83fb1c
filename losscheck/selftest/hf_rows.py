"""`python -m losscheck.selftest.hf_rows`: the rows a one-sample black-box cell needs to catch the
planted Hugging Face residual bug (`losscheck.selftest.hf`: the recovered token drawn from p) with
the bundled assistant as it is.

Hugging Face assisted generation at k = 4 with a constant schedule, its assistant sampling at
T = 1, runs the standard speculative loop on the same target and drafter as losscheck's own
A-k4-T1 cell; so the exact per-step laws of that cell's own p and q (`losscheck.stats.bugclass`)
give the power of the black-box cell's tests, which see no q.
"""

from __future__ import annotations

import math


def main(sequences: int = 1024) -> None:
    from losscheck.cells.draw import generate_rows
    from losscheck.cells.scoring import measure_power
    from losscheck.core.sampling import SamplingParams
    from losscheck.plan.cell import Cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session
    from losscheck.stats import registry

    session = Session(Options(engine="losscheck.engines.hf:hf_assisted"))
    alpha_test = registry.split(session.per_test_alpha, registry.PIT, registry.CONDITIONAL).per_test
    cell = Cell("A", 4, SamplingParams(temperature=1.0))
    ctx = CellContext.of(session, cell)
    rows, gen = generate_rows(ctx, ctx.served()[0], ctx.all_prompts(), sequences, 16, "hf-rows")
    needed = measure_power(ctx, ctx.target, rows, gen, 0.0).tokens_needed(alpha_test, 0.99)
    per_row = int(gen.mask().sum()) / len(rows)
    print(f"per-cell alpha {session.per_test_alpha:.3g}, per test {alpha_test:.3g}; tokens per row {per_row:.2f}")
    for test, tokens in needed["residual_is_p"].items():
        rows_needed = tokens / per_row if math.isfinite(tokens) else math.inf
        print(f"{test:22s} tokens {tokens:12.0f}  rows {rows_needed:10.0f}")


if __name__ == "__main__":
    main()
