"""A run's plan as text, before it starts: the cells in its scope with their kinds and estimated
seconds (`losscheck.plan.cost`), the cells its declared scope leaves out, and the time it should
take (`losscheck certify --list`, and the lines `losscheck certify` prints first)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from losscheck.plan.entry import MatrixEntry
from losscheck.run.options import Options

if TYPE_CHECKING:
    from losscheck.plan.cell import Cell
    from losscheck.run.session import Session


def planned(session: Session) -> tuple[list[MatrixEntry], list[dict[str, str]]]:
    """(matrix entries in scope, each with its `estimated_s` scaled to the run's target; cells out
    of scope), planned the way the run plans them: the drafters are built (their declared block
    lengths and widths make the matrix) against the target's weightless skeleton, and no cell runs."""
    from losscheck import bundled
    from losscheck.plan import matrix
    from losscheck.plan.cost import target_scale
    from losscheck.plan.modes import Mode

    target = session.options.target or bundled.target_path()
    config = json.loads((Path(target).expanduser() / "config.json").read_text())
    entries = [
        dataclasses.replace(e, estimated_s=round((e.estimated_s or 0.0) * target_scale(config, Mode(e.mode)), 1))
        for e in matrix.entries(session.plan)
    ]
    return entries, session.out_of_scope


def plan_lines(options: Options | Session, full: bool, workers: int = 1) -> list[str]:
    """The plan of a run (its options, or its session): with `full`, one line per cell, else the
    counts by kind; then the estimate. A shard's plan is its share of the cells in scope."""
    from losscheck.run.session import Session

    session = options if isinstance(options, Session) else Session(options, skeleton=True)
    entries, out = planned(session)
    lines = []
    shard = session.options.shard
    if shard is not None:
        from losscheck.plan import matrix
        from losscheck.plan.shard import share

        mine = set(share(matrix.entries(session.plan), shard))  # on the estimates every shard reads
        lines.append(f"shard {shard}: {len(mine)} of the {len(entries)} cells in scope, the other shards the rest")
        entries = [e for e in entries if e.cell in mine]
    if full:
        width = max([len(e.cell) for e in entries] + [4])
        lines.append(f"{'cell':<{width}}  {'kind':<13}  {'tier':<5}  est. s")
        for e in entries:
            tier = "slow" if e.slow else "quick"
            lines.append(f"{e.cell:<{width}}  {e.mode:<13}  {tier:<5}  {e.estimated_s or 0.0:.0f}")
        lines += [f"{e['cell']:<{width}}  out of scope: {e['reason']}" for e in out]
        lines += memory_plan(session, {e.cell for e in entries})
    kinds = ", ".join(f"{n} {kind}" for kind, n in Counter(e.mode for e in entries).items())
    lines.append(f"plan: {len(entries)} cells ({kinds or 'none'}); {len(out)} out of the declared scope")
    lines.append(estimate_line(sum(e.estimated_s or 0.0 for e in entries), workers))
    return lines


def memory_plan(session: Session, in_scope: set[str]) -> list[str]:
    """The memory plan of the run's black-box engine cells in scope (`losscheck.plan.memory`), by
    the engine's instance policy; nothing without an engine."""
    from losscheck.engines.pool import instances_of
    from losscheck.plan.cell import ENGINE
    from losscheck.plan.memory import memory_lines, variant_line

    cells = [c for found in session.plan.values() for c in found if c.drafter == ENGINE and c.id in in_scope]
    if not cells:
        return []
    instances = instances_of(session.blackbox)
    policy = None if instances is None else instances.policy.value
    # the cells of each engine variant run together, one variant alive at a time (`Session.engine_for`)
    groups: dict[tuple[tuple[str, int | str], ...], list[Cell]] = {}
    for c in cells:
        groups.setdefault(c.variant, []).append(c)
    # the engine cells read the reference target (greedy margins too, where on and off diverge)
    first = next(iter(groups.values()))
    lines = memory_lines([(c.mode, True) for c in first], policy)
    if policy == "one-at-a-time":
        for variant, found in list(groups.items())[1:]:
            named = ", ".join(f"{name}={value}" for name, value in variant)
            lines.append(variant_line(named, [(c.mode, True) for c in found]))
    return lines


def estimate_line(cell_seconds: float, workers: int) -> str:
    wall = cell_seconds / max(workers, 1)
    return (
        f"estimated: {cell_seconds:.0f} cell-seconds, ~{_duration(wall)} on {max(workers, 1)} worker(s) "
        "(a rough figure for a 2-core CPU, scaled by the target's size; the progress lines refine it)"
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
