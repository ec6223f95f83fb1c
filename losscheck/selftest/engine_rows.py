"""`python -m losscheck.selftest.engine_rows [--sequences N] [--seed S]`: the tokens each bug class
needs, white-box against black-box with the engine's draft model, on the same samples.

For each of the five sampled engine cells (family A's drafter on the bundled target, k = 4), one
sample of losscheck's own loop is scored twice at one per-test α (an engine-only run's cell α split
over the `pit`, `conditional` and `rounds` families) and power 0.99:

- *white-box*: the loop's own q and slots (`losscheck.stats.bugclass`), the best test per class;
- *engine*: the tokens alone, as a black box reports them: the target-side classes through the
  same accumulator without q or slots, the verifier's classes through the round filter over the
  teacher-forced draft model (`losscheck.stats.hidden_rounds`).

Prints a Markdown table (tokens; rows of 16 in parentheses). Both columns are pilot-style
estimates from one sample's own laws, not catches; `losscheck.selftest.engines` plants the bugs.
"""

from __future__ import annotations

import argparse
import math

# the engine's five sampled cells: (label, temperature, top-k, top-p)
PARAMS = (
    ("T1", 1.0, 0, 1.0),
    ("T0.3", 0.3, 0, 1.0),
    ("T1.5", 1.5, 0, 1.0),
    ("topk8", 1.0, 8, 1.0),
    ("topp0.9", 1.0, 0, 0.9),
)


def rows_table(sequences: int, seed: int) -> list[str]:
    from losscheck.cells.draw import generate_rows
    from losscheck.cells.engine.rounds import RoundsScoring, as_target
    from losscheck.cells.scoring import measure_power
    from losscheck.core.generation import Generation, LoopStats
    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.spec_loop import spec_loop
    from losscheck.plan.cell import Cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session
    from losscheck.stats import registry
    from losscheck.stats.buglaws import TARGET_SIDE
    from losscheck.stats.hidden_rounds import CLASSES

    session = Session(Options(engine="losscheck.engines.spec_loop:spec_loop", seed=seed))
    split = registry.split(session.per_test_alpha, registry.PIT, registry.CONDITIONAL, registry.ROUNDS)
    alpha, level = split.per_test, 0.99
    lines = [
        f"per-cell α {session.per_test_alpha:.3g}, per test {alpha:.3g}, power {level:g}; {sequences} sequences "
        f"of 16 tokens per cell, seed {seed}",
        "",
        "| cell | class | white-box: best test | tokens | engine: test | tokens | engine / white-box |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, temperature, top_k, top_p in PARAMS:
        cell = Cell("A", 4, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        ctx = CellContext.of(session, cell)
        rows, gen = generate_rows(ctx, ctx.served()[0], ctx.all_prompts(), sequences, 16, "engine-rows")
        white = measure_power(ctx, ctx.target, rows, gen, 0.0).tokens_needed(alpha, level)
        blind = Generation(gen.tokens, gen.lengths, LoopStats.empty(4), gen.params)
        model = spec_loop(ctx.target).draft_model()
        assert model is not None  # drafter A is autoregressive
        rounds = RoundsScoring(as_target(model, "drafter A"), 4)  # processed q, as the loop draws it
        engine = measure_power(ctx, ctx.target, rows, blind, 0.0, rounds).tokens_needed(alpha, level)
        per_row = int(gen.mask().sum()) / len(rows)
        scored = rounds.sample.tokens / max(int(gen.mask().sum()), 1)  # the filter's share of the tokens
        for name in [b.name for b in TARGET_SIDE] + [c.name for c in CLASSES]:
            # a q-contract class has no white-box test: the loop's verifier is judged by its conformance
            w_test, w_tokens = _best(white[name]) if name in white else ("conformance", math.nan)
            if name in {c.name for c in CLASSES}:
                e_test, e_tokens = f"rounds.{name}", rounds.sample.power.tokens_needed(name, alpha, level) / scored
            else:
                e_test, e_tokens = _best(engine[name])
            ratio = e_tokens / w_tokens if math.isfinite(e_tokens) and math.isfinite(w_tokens) else math.nan
            lines.append(
                f"| A-k4-{label} | `{name}` | `{w_test}` | {_fmt(w_tokens, per_row)} | `{e_test}` | "
                f"{_fmt(e_tokens, per_row)} | {ratio:.2f} |"
            )
    return lines


def _best(tests: dict[str, float]) -> tuple[str, float]:
    from losscheck.stats.bugclass import LR_BOUND

    return min(((t, n) for t, n in tests.items() if t != LR_BOUND), key=lambda tn: tn[1])


def _fmt(tokens: float, per_row: float) -> str:
    return "never" if not math.isfinite(tokens) else f"{tokens:,.0f} ({tokens / per_row:,.0f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m losscheck.selftest.engine_rows", description=__doc__)
    parser.add_argument("--sequences", type=int, default=1024, help="rows drawn per cell")
    parser.add_argument("--seed", type=int, default=20261204, help="the run seed")
    args = parser.parse_args(argv)
    print("\n".join(rows_table(args.sequences, args.seed)))


if __name__ == "__main__":
    main()
