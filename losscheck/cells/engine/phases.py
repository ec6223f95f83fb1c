"""Black-box engine cells drawn side by side: every waiting speculative draw of every cell, then the
plain side, in phases (`losscheck.plan.memory`), so that an engine that keeps one instance alive
at a time (`losscheck.engines.pool.Policy.ONE_AT_A_TIME`) builds each side as few times as the
cells' dependencies allow instead of twice per cell.

A cell is written as a generator (`EngineDraws`): it yields the requests of one round, receives
their samples (validated, in the order asked; a request with `logprobs` set is answered by two
tensors, its ids and then their reported log-probabilities), scores them and yields the next round, and returns
its `CellOutcome`, whose record gets the cell's phase timings (each engine call under its
request's purpose and side, the cell's own scoring between them). Every request's seed is the
cell's own (its id, side and purpose), so the order in which the run draws them changes no sample
and no verdict.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from losscheck.engines import (
    BlackBoxEngine,
    GenerationRequest,
    ReportsLogprobs,
    ReportsTopLogprobs,
    checked_logprobs,
    checked_samples,
    checked_top_logprobs,
    engine_counters,
)
from losscheck.plan.memory import PLAIN, SPECULATIVE, next_side

if TYPE_CHECKING:
    import torch

    from losscheck.cells.outcome import CellOutcome
    from losscheck.engines.counters import EngineCounters

EngineDraws = Generator[tuple[GenerationRequest, ...], tuple["torch.Tensor", ...], "CellOutcome"]


@dataclass
class _Cell:
    """One cell's generator, the round it waits on and what has come back."""

    steps: EngineDraws
    requests: tuple[GenerationRequest, ...] = ()
    answers: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    counted: EngineCounters | None = None  # the engine's counts of this cell's speculative calls
    unreadable: bool = False  # a speculative call whose counts the engine did not give
    result: CellOutcome | Exception | None = None
    clock: dict[str, float] = field(default_factory=dict)  # wall seconds per phase of the cell

    def timed(self, phase: str, seconds: float) -> None:
        self.clock[phase] = self.clock.get(phase, 0.0) + seconds

    def waiting(self) -> set[bool]:
        return {r.speculative for i, r in enumerate(self.requests) if i not in self.answers}

    def resume(self, answers: tuple[torch.Tensor, ...] | None = None) -> None:
        start = time.perf_counter()
        try:
            self.requests = next(self.steps) if answers is None else self.steps.send(answers)
            self.answers = {}
        except StopIteration as stop:
            self.result = stop.value
        except Exception as exc:  # the cell's own failure, raised again by its test
            self.result = exc
        finally:
            self.timed("scoring", time.perf_counter() - start)

    def count(self, before: EngineCounters | None, after: EngineCounters | None) -> None:
        if after is None:
            self.unreadable = True
            return
        call = after.since(before) if before is not None else after
        self.counted = call if self.counted is None else self.counted.plus(call)


@dataclass
class DrawnCells:
    """What `draw_side_by_side` returns: per cell id its outcome (or the exception it raised), and
    the engine phases it ran in order (`SPECULATIVE` / `PLAIN`, each with its request count)."""

    results: dict[str, CellOutcome | Exception]
    phases: list[tuple[str, int]]


def draw_side_by_side(
    engine: BlackBoxEngine,
    cells: dict[str, EngineDraws],
    vocab_size: int,
    eos: int,
    before_engine: Callable[[], None] = lambda: None,
) -> DrawnCells:
    """Run `cells` (id -> generator, in run order) to their outcomes, drawing side by side:
    `next_side` picks the side, every waiting request of that side is answered (cell by cell,
    in order), then every cell whose round is answered resumes (and scores). `before_engine` runs
    before each engine phase (a one-at-a-time run releases the reference target there). Each
    outcome carries the engine's counts of its own speculative calls."""
    states = {cell_id: _Cell(steps) for cell_id, steps in cells.items()}
    for state in states.values():
        state.resume()
    phases: list[tuple[str, int]] = []
    while live := [s for s in states.values() if s.result is None]:
        side = next_side(s.waiting() for s in live)
        asked = [
            (s, i, r) for s in live for i, r in enumerate(s.requests) if r.speculative is side and i not in s.answers
        ]
        if asked:
            before_engine()
            phases.append((SPECULATIVE if side else PLAIN, len(asked)))
        for state, i, request in asked:
            if state.result is not None:  # an earlier request of the cell failed
                continue
            start = time.perf_counter()
            try:
                before = engine_counters(engine) if side else None
                out = _answer(engine, request, vocab_size, eos)
                if side:
                    state.count(before, engine_counters(engine))
            except Exception as exc:
                state.result = exc
                continue
            finally:
                state.timed(
                    f"generate {request.purpose or 'sample'} ({'on' if side else 'off'})", time.perf_counter() - start
                )
            state.answers[i] = out
        for state in live:
            if state.result is None and not state.waiting():
                state.resume(tuple(t for i in range(len(state.requests)) for t in state.answers[i]))
    results: dict[str, CellOutcome | Exception] = {}
    for cell_id, state in states.items():
        result = state.result
        assert result is not None
        if not isinstance(result, Exception):
            counted = state.counted if not state.unreadable else None
            clock = {**(result.facts.phases or {}), **{k: round(v, 3) for k, v in state.clock.items()}}
            result.facts = dataclasses.replace(
                result.facts, engine_counters=counted or result.facts.engine_counters, phases=clock
            )
        results[cell_id] = result
    return DrawnCells(results, phases)


def _answer(engine: BlackBoxEngine, request: GenerationRequest, vocab_size: int, eos: int) -> tuple[torch.Tensor, ...]:
    """The validated answer to `request`: its ids, and their logprobs when it asks for them (and
    the top ids and theirs when it asks for those)."""
    if not request.logprobs:
        return (checked_samples(engine, engine.generate(request), request, vocab_size, eos),)
    if request.top_logprobs:
        if not isinstance(engine, ReportsTopLogprobs):
            raise TypeError(
                f"engine {engine.name!r} reports no top logprobs: a cell asked for them (a bug in the cell)"
            )
        tokens, logprobs, ids, values = engine.generate_top_logprobs(request)
        top = checked_top_logprobs(engine, ids, values, request, vocab_size)
        return (
            checked_samples(engine, tokens, request, vocab_size, eos),
            checked_logprobs(engine, logprobs, request),
            *top,
        )
    if not isinstance(engine, ReportsLogprobs):
        raise TypeError(f"engine {engine.name!r} reports no logprobs: a cell asked for them (a bug in the cell)")
    tokens, logprobs = engine.generate_logprobs(request)
    return checked_samples(engine, tokens, request, vocab_size, eos), checked_logprobs(engine, logprobs, request)
