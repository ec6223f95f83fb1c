"""`losscheck mutants`: run the gate against the catalogue and write the catch table."""

from __future__ import annotations

import time
from pathlib import Path

from losscheck.run.options import Options
from losscheck.run.session import Session
from losscheck.selftest import catalogue, get_mutant, state_catalogue
from losscheck.selftest.catch import CatchMeta, gate_session, markdown, run_control, run_mutant, write_table


def run(out: Path, options: Options, names: list[str], all_cells: bool, stress: bool = True) -> int:
    """Catch table under `out` (catch_table.md / .json); exit status 0 only when every mutant is
    caught and the unmodified engine passes every cell that caught one. `stress` False leaves the
    stress cells out. Without `names`: the catalogue of the main target, the recurrent-state
    mutants for a hybrid one."""
    base = Session(options)
    stateful = bool(getattr(base.target("main"), "stateful", False))
    mutants = [get_mutant(n) for n in names] if names else list(state_catalogue() if stateful else catalogue())
    started = time.perf_counter()
    reports = []
    for mutant in mutants:
        report = run_mutant(base, mutant, all_cells, stress)
        reports.append(report)
        print(report.message(), flush=True)
    catching = {r.catch.cell for r in reports if r.catch is not None}
    session = gate_session(base, None)
    planned = {c.id: c for m in mutants for c in m.cells(session.plan, options.profile, stress)}
    control = run_control(base, [c for c in planned.values() if c.id in catching])
    seconds = round(time.perf_counter() - started, 1)
    meta = CatchMeta(
        options.seed,
        options.profile.name,
        options.alpha,
        session.per_test_alpha,
        session.n_statistical,
        all_cells,
        stress,
        seconds,
    )
    md, js = write_table(reports, control, meta, out)
    print()
    print(markdown(reports, control, meta))
    print(f"wrote {md} and {js} in {seconds:.0f} s")
    return 0 if all(r.caught for r in reports) and not any(c.failed or c.error for c in control) else 1
