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

from collections.abc import Mapping
from typing import Any

from losscheck.plan.cell import Cell
from losscheck.plan.modes import MODES


def _weights(config: Mapping[str, Any]) -> int:
    """Multiply-adds per token of a decoder of this config.json: its layers and its LM head."""
    hidden = int(config.get("hidden_size") or 64)
    inner = int(config.get("intermediate_size") or 4 * hidden)
    layers = int(config.get("num_hidden_layers") or 1)
    return layers * (4 * hidden * hidden + 3 * hidden * inner) + int(config.get("vocab_size") or 64) * hidden


def target_scale(config: Mapping[str, Any]) -> float:
    """How much slower than the bundled target a target of this config.json runs, by its weights
    (at least 1: the bundled target's cost is mostly Python overhead, not arithmetic)."""
    import json

    from losscheck import bundled

    reference = json.loads((bundled.target_path() / "config.json").read_text())
    return max(1.0, _weights(config) / _weights(reference))


def estimated_seconds(cell: Cell) -> float:
    base = MODES[cell.mode].seconds(cell.k)
    if cell.precision.reduced:
        base *= 4
    return base * (1 + len(cell.serving))
