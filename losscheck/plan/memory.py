"""The memory plan of a black-box engine run: which of the engine's instances (speculation on,
speculation off) and losscheck's reference copy of its target are alive in each phase.

Terms:
- *round*: one step of an engine cell, the draws it asks of each side and then what it scores
  with the reference target (`ROUNDS`); a cell's next round depends on what the last one scored
  (a one-sample cell's pilot sizes its sample);
- *phase*: the run's cells' draws of one side, or the scoring between them (`Phase`).

The run draws the cells side by side (`losscheck.cells.engine.phases`): while any cell waits for
a speculative draw, every waiting speculative draw is answered; only when every cell waits for
the plain side is it answered (`next_side`); then every cell whose draws are all answered
scores. A one-sample run is then speculative engine phases (pilots; the sample's first look;
each later look its stop rule asks for, `losscheck.cells.engine.looks`) with their scoring
phases, and, for the cells whose first stage rejected, a speculative and a plain phase of
attribution rows scored last; a two-sample run a plain phase (pilots), its scoring, then a
speculative and a plain phase whose rows the proxy scores (`losscheck.cells.engine.proxy`).
Under `Policy.ONE_AT_A_TIME` each phase holds one thing: the engine instance of its side, or the
reference target. Torch-free: `losscheck certify --list` prints it (`memory_lines`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from losscheck.plan.modes import Mode

SPECULATIVE, PLAIN, TARGET = "speculative engine", "plain engine", "reference target"


@dataclass(frozen=True)
class Round:
    """What an engine cell draws in one round (by purpose; None: nothing from that side) and what
    the reference target scores once both sides have answered (None: nothing)."""

    speculative: str | None
    plain: str | None
    scores: str | None

    def sides(self) -> set[bool]:
        """The sides this round draws from (True: speculative)."""
        return {side for side, what in ((True, self.speculative), (False, self.plain)) if what is not None}


def rounds(mode: Mode, scorable: bool) -> tuple[Round, ...]:
    """The rounds of an engine cell of `mode`; `scorable`: losscheck loads the engine's target."""
    if mode is Mode.ENGINE_GREEDY:
        margins = "greedy margins (where on and off diverge)" if scorable else None
        return (Round("greedy (on)", "greedy (off)", margins),)
    if mode is Mode.ONE_SAMPLE:
        attribution = "one-sample attribution (after a rejection only)"
        return (
            Round("one-sample pilot", None, "one-sample pilot (sizes the sample)"),
            Round("one-sample sample, first look", None, "one-sample PIT and stop rule"),
            Round(
                "one-sample sample, each later look (until the stop rule holds)",
                None,
                "one-sample PIT and stop rule (each later look)",
            ),
            Round(attribution, attribution, "one-sample attribution (both sides' row scores)"),
        )
    if mode is Mode.TWO_SAMPLE:  # scored by losscheck's fp32 copy of the target, the proxy, whatever `scorable`
        return (
            Round(None, "two-sample pilot", "two-sample pilot (the proxy sizes the sample)"),
            Round("two-sample (on)", "two-sample (off)", "two-sample surprisal (both sides) and coverage"),
        )
    raise ValueError(f"{mode} is not a black-box engine's mode")


def next_side(waiting: Iterable[set[bool]]) -> bool:
    """The side drawn next, given the sides each unfinished cell waits for: speculative while any
    cell waits for it, so that the plain side is built once, after every speculative draw that
    does not wait for it."""
    return any(True in sides for sides in waiting)


@dataclass(frozen=True)
class Phase:
    """One phase: what is alive (`SPECULATIVE`, `PLAIN` or `TARGET`) and what it does, purpose -> cells."""

    alive: str
    work: tuple[tuple[str, int], ...]

    def line(self) -> str:
        return ", ".join(f"{n} x {what}" for what, n in self.work)


def phases(cells: Sequence[tuple[Mode, bool]]) -> list[Phase]:
    """The phases of a run of engine cells, each (mode, scorable), drawn side by side."""
    plans = [rounds(mode, scorable) for mode, scorable in cells]
    step = [0] * len(plans)
    waiting = [plan[0].sides() for plan in plans]
    out: list[Phase] = []
    while any(s < len(p) for s, p in zip(step, plans, strict=True)):
        live = [i for i, p in enumerate(plans) if step[i] < len(p)]
        side = next_side(waiting[i] for i in live)
        drawn: Counter[str] = Counter()
        for i in live:
            if side in waiting[i]:
                waiting[i].discard(side)
                round_ = plans[i][step[i]]
                drawn[str(round_.speculative if side else round_.plain)] += 1
        out.append(Phase(SPECULATIVE if side else PLAIN, tuple(drawn.items())))
        scored: Counter[str] = Counter()
        for i in live:
            if not waiting[i]:
                what = plans[i][step[i]].scores
                if what is not None:
                    scored[what] += 1
                step[i] += 1
                waiting[i] = plans[i][step[i]].sides() if step[i] < len(plans[i]) else set()
        if scored:
            out.append(Phase(TARGET, tuple(scored.items())))
    return out


def memory_lines(cells: Sequence[tuple[Mode, bool]], policy: str | None) -> list[str]:
    """The memory plan as text. `policy`: the engine's `losscheck.engines.pool.Policy` value
    ("one-at-a-time": one line per phase, what is alive in it and what it does; "keep-all": the
    cells drawn one by one, everything alive together), None for an engine that manages its own."""
    if not cells:
        return []
    if policy is None:
        return [
            "memory plan: the engine manages its own instances; losscheck's reference target stays loaded "
            "beside them, the cells drawn one by one"
        ]
    if policy != "one-at-a-time":
        return [
            "memory plan (keep-all): the speculative and the plain engine instance, each built on first use, and "
            "the reference target stay alive together, the cells drawn one by one (one GPU: "
            "--engine-arg losscheck_instances=one-at-a-time)"
        ]
    found = phases(cells)
    lines = [
        "memory plan (one-at-a-time: one engine instance or the reference target alive in each phase; in "
        "process, -n 0: xdist workers draw each cell alone):"
    ]
    for n, phase in enumerate(found, 1):
        verb = "scores" if phase.alive == TARGET else "draws"
        lines.append(f"  phase {n}: {phase.alive:<18}  {verb} {phase.line()}")
    builds = instance_builds(found)
    lines.append(
        f"  engine instances built: {builds}; scoring phases: {sum(p.alive == TARGET for p in found)} (the reference "
        "target is also loaded before phase 1, to build the adapter, and released before the first instance; "
        "an engine's draft model, teacher-forced for the verifier's classes, is loaded as its adapter says: "
        "vLLM's on the CPU, outside every phase's accelerator memory)"
    )
    return lines


def instance_builds(found: Sequence[Phase]) -> int:
    """Engine instances built over `found` (a phase of the side just drawn builds none)."""
    return sum(p.alive != TARGET for p in found) - _repeats(found)


def variant_line(variant: str, cells: Sequence[tuple[Mode, bool]]) -> str:
    """One line for the cells of an engine variant (`losscheck.engines.registry.EngineAxis`), drawn
    after every instance of the variant before it is released."""
    found = phases(cells)
    return (
        f"  then variant {variant}: {len(cells)} cells in {len(found)} phases, {instance_builds(found)} instances "
        "built (the previous variant's released first)"
    )


def _repeats(found: Sequence[Phase]) -> int:
    """Engine phases that follow a phase of the same side (its instance is still alive: no build)."""
    return sum(p.alive != TARGET and n > 0 and found[n - 1].alive == p.alive for n, p in enumerate(found))
