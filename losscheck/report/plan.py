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
    from losscheck.engines.hardware import Hardware, Sizing
    from losscheck.plan.cell import Cell
    from losscheck.run.session import Session


def planned(session: Session) -> tuple[list[MatrixEntry], list[dict[str, str]]]:
    """(matrix entries in scope, each with its `estimated_s` scaled to the run's target; cells out
    of scope), planned the way the run plans them: the drafters are built (their declared block
    lengths and widths make the matrix) against the target's weightless skeleton, and no cell runs."""
    from losscheck.plan import matrix
    from losscheck.plan.cost import target_config, target_scale
    from losscheck.plan.modes import Mode

    config = target_config(session.options.target)
    entries = [
        dataclasses.replace(e, estimated_s=round((e.estimated_s or 0.0) * target_scale(config, Mode(e.mode)), 1))
        for e in matrix.entries(session.plan)
    ]
    return entries, session.out_of_scope


def plan_lines(options: Options | Session, full: bool, workers: int = 1, hardware: Hardware | None = None) -> list[str]:
    """The plan of a run (its options, or its session): with `full`, one line per cell, else the
    counts by kind; then the estimate. A shard's plan is its share of the cells in scope. With
    `hardware` (`--plan-for`), the engine cells' memory plan is the one that hardware gets."""
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
        lines += memory_plan(session, {e.cell for e in entries}, hardware)
    kinds = ", ".join(f"{n} {kind}" for kind, n in Counter(e.mode for e in entries).items())
    lines.append(f"plan: {len(entries)} cells ({kinds or 'none'}); {len(out)} out of the declared scope")
    lines.append(estimate_line(sum(e.estimated_s or 0.0 for e in entries), workers))
    return lines


def memory_plan(session: Session, in_scope: set[str], hardware: Hardware | None = None) -> list[str]:
    """The memory plan of the run's black-box engine cells in scope (`losscheck.plan.memory`), by
    the engine's instance policy, or by the policy `hardware` gets (`losscheck.engines.hardware`);
    nothing without an engine."""
    from losscheck.engines.pool import instances_of
    from losscheck.plan.cell import ENGINE
    from losscheck.plan.memory import memory_lines, variant_line

    cells = [c for found in session.plan.values() for c in found if c.drafter == ENGINE and c.id in in_scope]
    if not cells:
        return []
    if hardware is not None:
        return hardware_plan(session, cells, hardware)
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


def hardware_plan(session: Session, cells: list[Cell], hardware: Hardware) -> list[str]:
    """The engine cells' plan on `hardware`: sizes, the policy it gets, memory per phase, and the
    variants that need more devices than it has (out of scope there, with the reason)."""
    from losscheck.engines.hardware import devices_needed, fit
    from losscheck.plan.memory import TARGET, phases
    from losscheck.plan.scope import hint

    plan = fit(hardware, engine_sizing(session, hardware))
    lines = plan.lines()
    fits = [c for c in cells if all(devices_needed(a, v) <= hardware.devices for a, v in c.variant)]
    if plan.policy == "one-at-a-time":
        for i, (variant, group) in enumerate(_by_variant(fits).items()):
            found = phases([(c.mode, True) for c in group])
            if i == 0:
                for n, phase in enumerate(found, 1):
                    gib = plan.phase_gib(phase.alive == TARGET)
                    lines.append(f"  phase {n}: {phase.alive:<18} {gib:6.1f} GiB  {phase.line()}")
                continue
            named = ", ".join(f"{a}={v}" for a, v in variant)
            ranks = max([plan.sizing.tensor_parallel, *(devices_needed(a, v) for a, v in variant)])
            instance = dataclasses.replace(plan.sizing, tensor_parallel=ranks).instance_gib()
            lines.append(
                f"  then variant {named}: {len(group)} cells in {len(found)} phases, each instance "
                f"{instance:.1f} GiB a device"
            )
    else:
        total = 2 * plan.sizing.instance_gib() + plan.sizing.reference_gib()
        lines.append(f"  every phase: both instances and the reference alive, {total:.1f} GiB")
    for variant, group in _by_variant([c for c in cells if c not in fits]).items():
        axis, value = next((a, v) for a, v in variant if devices_needed(a, v) > hardware.devices)
        lines.append(
            f"  out of scope on {hardware.label}: {axis}={value} ({', '.join(c.id for c in group)}) needs "
            f"{devices_needed(axis, value)} devices, {hardware.devices} given; {hint(axis)}"
        )
    return lines


def _by_variant(cells: list[Cell]) -> dict[tuple[tuple[str, int | str], ...], list[Cell]]:
    groups: dict[tuple[tuple[str, int | str], ...], list[Cell]] = {}
    for c in cells:
        groups.setdefault(c.variant, []).append(c)
    return groups


def engine_sizing(session: Session, hardware: Hardware) -> Sizing:
    """What the run's engine holds, sized from config.json files (no weights read): the target, the
    draft model a speculative config or `--assistant` names where it is a local directory, the
    engine's precision (its target's declared dtype where losscheck scores nothing), and the
    reference's (where a two-sample cell scores through the proxy: fp32 where it fits `hardware`,
    `losscheck.engines.hardware.chosen_proxy`)."""
    from losscheck.engines.hardware import Sizing, chosen_proxy, declared_precision, parameters, parameters_of
    from losscheck.plan.modes import Mode
    from losscheck.run.loading import engine_models

    options = session.options
    target, draft, tp = engine_models(options)
    config = json.loads((Path(target) / "config.json").read_text())
    engine = session.blackbox
    declared = declared_precision(config)
    precision = engine.precision if engine is not None and engine.precision is not None else declared
    two_sample = any(c.mode is Mode.TWO_SAMPLE for found in session.plan.values() for c in found)
    reference = chosen_proxy(options.proxy_precision, target, draft, tp, hardware) if two_sample else precision
    return Sizing(parameters(config), parameters_of(draft), precision, reference, tp)


def estimate_line(cell_seconds: float, workers: int) -> str:
    wall = cell_seconds / max(workers, 1)
    return (
        f"estimated: {cell_seconds:.0f} cell-seconds, ~{_duration(wall)} on {max(workers, 1)} worker(s) "
        "(a rough figure for a 2-core CPU, scaled by the target's size; the progress lines refine it)"
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
