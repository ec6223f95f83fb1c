"""What each cell costs, roughly: to run the costliest first (under pytest-xdist a long cell
started last leaves the other workers idle at the end) and to show a run's time estimate before
it starts.

Seconds on one worker of a 2-core CPU for the bundled target, fitted to the main job's
certificate of 2026-12-01 (a base PIT cell of family A ~3.5 s, a greedy cell ~1.2 s, an exact cell
~3 s; reduced precision ~4x, CPU torch emulating bf16 / fp16) and, for black-box engines, to
Hugging Face assisted generation (~20 s a sampled cell on the bundled target; the greedy one
23-29 s on the text target, 2026-12-07). `target_scale` scales them for another target by its
size. Only the order of cells and the estimate shown depend on it, never a result; the progress
lines extrapolate from the cells that finished.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from losscheck.plan.cell import Cell
from losscheck.plan.modes import MODES, Mode
from losscheck.serving import axis as serving_axes


def _weights(config: Mapping[str, Any]) -> int:
    """Multiply-adds per token of a decoder of this config.json: its layers and its LM head."""
    hidden = int(config.get("hidden_size") or 64)
    inner = int(config.get("intermediate_size") or 4 * hidden)
    layers = int(config.get("num_hidden_layers") or 1)
    return layers * (4 * hidden * hidden + 3 * hidden * inner) + int(config.get("vocab_size") or 64) * hidden


# A sampled cell draws, processes and scores every token over the whole vocabulary (softmax, the
# top-k / top-p sort, the sampler, the teacher-forced PIT and its cut-off), work that grows with the
# vocabulary however small the layers are. Fitted on 2026-12-07 (2-core CPU) to Hugging Face
# assisted generation's cut-off-free one-sample cells on the 8,192-token text target of about the
# bundled target's weights: 36-103 s (mean 64, nine cells over three runs), against the 20 s of
# `MODES` for a bundled one, 1 + V / 3,500 times as long. One target fitted: a rough figure, as
# every estimate here (on 2026-12-02, before class-sized cells, 1 + V / 1,000 fitted).
VOCAB_COST_TOKENS = 3500


def target_scale(config: Mapping[str, Any], mode: Mode) -> float:
    """How much slower than on the bundled target a cell of `mode` runs on a target of this
    config.json: by its weights (at least 1: the bundled target's cost is mostly Python overhead,
    not arithmetic) and, for a sampled cell, by its vocabulary."""
    import json

    from losscheck import bundled

    reference = json.loads((bundled.target_path() / "config.json").read_text())
    scale = max(1.0, _weights(config) / _weights(reference))
    if MODES[mode].statistical:
        vocab, reference_vocab = (int(c.get("vocab_size") or 64) for c in (config, reference))
        scale *= max(1.0, (1 + vocab / VOCAB_COST_TOKENS) / (1 + reference_vocab / VOCAB_COST_TOKENS))
    return scale


# A black-box sampled cell with a top-p cut-off took 173-181 s on the text target against 25-91 s
# for the others (Hugging Face assisted generation, five looks, 2026-12-07, two seeds): its scores
# sort the vocabulary, and its rule-outs then read only the positions whose cut-off every
# implementation draws alike, so it ran to its last look. Reading every position through bounds
# (2026-12-07, night, a slower day), it took 189 s against 38-124 s: still about three times. A
# top-k cell costs about what a cut-off-free one does since the five looks (61-104 s).
ENGINE_CUTOFF_COST = 3.0


def target_config(target: str | None) -> dict[str, Any]:
    """The config.json of the target at `target` (a model directory; None: the bundled target)."""
    import json
    from pathlib import Path

    from losscheck import bundled

    return dict(json.loads((Path(target or bundled.target_path()).expanduser() / "config.json").read_text()))


def seconds_on(target: str | None) -> Callable[[Cell], float]:
    """`estimated_seconds` scaled to the target at `target` (`target_config`) by `target_scale`."""
    config = target_config(target)
    return lambda cell: estimated_seconds(cell) * target_scale(config, cell.mode)


def estimated_seconds(cell: Cell) -> float:
    base = MODES[cell.mode].seconds(cell.k)
    if cell.precision.reduced:
        base *= 4
    facts = MODES[cell.mode]
    if facts.engine and facts.statistical and cell.params.top_p < 1:
        base *= ENGINE_CUTOFF_COST
    return base * (1 + len(cell.serving))


def runs_elsewhere(cell: Cell) -> bool:
    """Whether the cell's engine runs in processes of its own (a split run's ranks)."""
    return any(serving_axes.axis(name).runs_elsewhere for name, _ in cell.serving)


def run_order(
    cells: Sequence[Cell], seconds: Callable[[Cell], float] = estimated_seconds, workers: int = 1, chunk: int = 1
) -> list[int]:
    """The order a run takes `cells` in, as indices: costliest by `seconds` first (under
    pytest-xdist a long cell started last leaves the other workers idle); the cells of each
    black-box engine variant together (it is built once and released before the next); within a
    variant, the cells that run elsewhere first and together. Their ranks fork from one
    forkserver per process, which imports torch and transformers (~4 s): one worker starts it,
    not each. Then `dealt` over `workers` first chunks of `chunk` items. Deterministic, so that
    every xdist worker collects the same order."""
    costliest = sorted(range(len(cells)), key=lambda i: -seconds(cells[i]))
    variants: dict[tuple[tuple[str, int | str], ...], int] = {}
    for i in costliest:
        variants.setdefault(cells[i].variant, len(variants))
    order = sorted(costliest, key=lambda i: (variants[cells[i].variant], not runs_elsewhere(cells[i])))
    split = [i for i in order if runs_elsewhere(cells[i])]
    units = [split] * bool(split) + [[i] for i in order if not runs_elsewhere(cells[i])]
    return dealt(units, workers, chunk)


def dealt(units: Sequence[Sequence[int]], workers: int, chunk: int) -> list[int]:
    """`units` (items that run one after another on one worker), in order, dealt into `workers`
    first chunks of `chunk` items each (pytest-xdist's `load` scheduling gives worker w the items
    [w·chunk, (w + 1)·chunk) first) in snake order — workers 0 to w - 1, then w - 1 to 0, and so
    on — the rest after them in order: each worker's chunk starts with one of the costliest units
    instead of the first worker's holding them all, and the worker holding the costliest takes the
    cheapest of the next round behind it (dealt in turn, it took the costliest of every round).
    A unit goes to the next worker in that order with room for it; one that fits no chunk's room
    ends the dealing, and where that leaves a chunk before the last one short (its worker's items
    would shift), the units stay as they are."""
    chunks: list[list[int]] = [[] for _ in range(workers)]
    snake = [w for r in range(chunk) for w in (range(workers) if r % 2 == 0 else reversed(range(workers)))]
    at, rest = 0, list(units)
    while rest and workers > 1:
        turns = [*range(at, len(snake)), *range(at)]
        room = [i for i in turns if len(chunks[snake[i]]) + len(rest[0]) <= chunk]
        if not room:
            break
        chunks[snake[room[0]]] += rest.pop(0)
        at = (room[0] + 1) % len(snake)
    if any(len(c) < chunk for c in chunks[:-1]):  # a chunk left short would shift the next ones
        return [i for unit in units for i in unit]
    return [i for c in chunks for i in c] + [i for unit in rest for i in unit]
