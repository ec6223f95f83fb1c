"""A rough cost of each cell, to run the costliest first: under pytest-xdist a long cell started
last leaves the other workers idle at the end.

Relative units, fitted by eye to measured cell times on a 2-core CPU (a base PIT cell of family A
is ~26 s; reduced precision ~4x, CPU torch emulating bf16 / fp16; scoring grows with the block
length). Only the order of cells depends on it, never a result.
"""

from __future__ import annotations

from losscheck.plan.cell import Cell

BASE_PIT = 26.0
GREEDY = 2.0
EXACT = 8.0
ENGINE = 30.0


def estimated_seconds(cell: Cell) -> float:
    mode = cell.mode
    if mode in ("greedy", "engine-greedy"):
        base = GREEDY * (1 + cell.k / 8)
    elif mode == "exact":
        base = EXACT
    elif mode == "pit":
        base = BASE_PIT * (cell.k + 1) / 5 if cell.k > 4 else BASE_PIT
    else:
        base = ENGINE
    if cell.precision.reduced:
        base *= 4
    return base * (1 + len(cell.serving))
