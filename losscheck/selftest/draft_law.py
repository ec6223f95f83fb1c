"""`python -m losscheck.selftest.draft_law --engine MOD:FACTORY [CELL ...]`: one-sample engine cells
of an engine-only run, each line the engine's counted first-draft acceptances and rounds against
what the round filter predicts under the declared draft law (`losscheck.cells.engine.draft_law`), the
verdict, and the drafter-side classes withdrawn. Default cells: engine-k4-T1 and engine-k4-T0.3."""

from __future__ import annotations

import argparse


def lines(engine: str, cells: list[str], seed: int) -> list[str]:
    from losscheck.cells.engine import run_engine_cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    session = Session(Options(engine=engine, seed=seed))
    planned = {c.id: c for c in session.plan["engine_cell"]}
    out = [
        f"engine {engine}, seed {seed}",
        "",
        "| cell | verdict | first drafts accepted | rounds | withdrawn |",
        "|---|---|---|---|---|",
    ]
    for cell in cells:
        if cell not in planned:
            raise SystemExit(f"no one-sample cell {cell!r}; the engine's are {', '.join(planned)}")
        facts = run_engine_cell(CellContext.of(session, planned[cell])).facts
        law = facts.draft_law
        if law is None:
            out.append(f"| {cell} | no draft model | - | - | - |")
            continue
        withdrawn = sorted(n for n, c in (facts.bug_classes or {}).items() if c.withdrawn)
        out.append(
            f"| {cell} | {law.verdict} | {law.counted_first_accepted} / {law.predicted_first_accepted:.1f} "
            f"± {law.sd_first_accepted:.1f} | {law.counted_rounds} / {law.predicted_rounds:.1f} | "
            f"{', '.join(withdrawn) or 'none'} |"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m losscheck.selftest.draft_law", description=__doc__)
    parser.add_argument("--engine", default="losscheck.engines.spec_loop:spec_loop", help="MOD:FACTORY")
    parser.add_argument("--seed", type=int, default=20261129, help="the run seed")
    parser.add_argument("cells", nargs="*", default=["engine-k4-T1", "engine-k4-T0.3"])
    args = parser.parse_args(argv)
    print("\n".join(lines(args.engine, args.cells, args.seed)))


if __name__ == "__main__":
    main()
