"""What each cell costs, roughly: to run the costliest first (under pytest-xdist a long cell
started last leaves the other workers idle at the end) and to show a run's time estimate before
it starts.

Seconds on one worker of a 2-core CPU for the bundled target, fitted to the main job's
certificate of 2026-12-01 (a base PIT cell of family A ~3.5 s, a greedy cell ~1.2 s, an exact cell
~3 s; reduced precision ~4x, CPU torch emulating bf16 / fp16) and, for black-box engines, to
Hugging Face assisted generation (one row per call: ~300 s a sampled cell, ~80 s the greedy
one). `target_scale` scales them for another target by its size. Only the order of cells and
the estimate shown depend on it, never a result; the progress lines extrapolate from the cells
that finished.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
# vocabulary however small the layers are: black-box one-sample cells of Hugging Face assisted
# generation took ~300 s on the bundled 64-token target and 2,300-4,000 s on the 8,192-token text
# target of about the same weights (2026-12-02, 2-core CPU), about 1 + V / 1,000 times as long.
# One target fitted: a rough figure, as every estimate here.
VOCAB_COST_TOKENS = 1000


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


def estimated_seconds(cell: Cell) -> float:
    base = MODES[cell.mode].seconds(cell.k)
    if cell.precision.reduced:
        base *= 4
    return base * (1 + len(cell.serving))


def runs_elsewhere(cell: Cell) -> bool:
    """Whether the cell's engine runs in processes of its own (a split run's ranks)."""
    return any(serving_axes.axis(name).runs_elsewhere for name, _ in cell.serving)


def run_order(cells: Sequence[Cell]) -> list[int]:
    """The order a run takes `cells` in, as indices: costliest first (under pytest-xdist a long
    cell started last leaves the other workers idle); the cells of each black-box engine variant
    together (it is built once and released before the next); within a variant, the cells that
    run elsewhere first and together. Their ranks fork from one forkserver per process, which
    imports torch and transformers (~4 s), and xdist hands each worker a first chunk of
    consecutive items (8 of the main job's 70): one worker starts it, not each. Deterministic,
    so that every xdist worker collects the same order."""
    costliest = sorted(range(len(cells)), key=lambda i: -estimated_seconds(cells[i]))
    variants: dict[tuple[tuple[str, int | str], ...], int] = {}
    for i in costliest:
        variants.setdefault(cells[i].variant, len(variants))
    return sorted(costliest, key=lambda i: (variants[cells[i].variant], not runs_elsewhere(cells[i])))
