"""Shards: a plan's cells split over N machines (`--losscheck-shard=I/N`), each certified by one
run and joined by `losscheck merge`. Pure planning, no models.

Terms:

- a shard `I/N`: the share of the plan run `I` of `N` certifies (1 <= I <= N);
- a cell's cost: the plan's estimate of its seconds (`MatrixEntry.estimated_s`, from
  `losscheck.plan.cost.estimated_seconds`, rounded as the certificate records it, so the shares can
  be recomputed from any certificate of the plan);
- the assignment: longest-processing-time first (LPT). Cells in order of cost, descending, ties by
  cell id, each to the shard with the least cost so far, ties to the lowest index. Deterministic,
  so every runner and every xdist worker computes the same shares; the costliest shard exceeds the
  cheapest by at most the costliest cell's cost.

The shares are taken of the cells in the declared scope, after the alpha split over the full
matrix, so each shard tests its cells at the level of one whole run and the shards add up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from losscheck.errors import OptionError, flag
from losscheck.plan.entry import MatrixEntry

FORM = "I/N, shard I of N with 1 <= I <= N (e.g. 2/4)"


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count`, both as written (`--shard 2/4`: index 2, count 4)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 1 <= self.index <= self.count:
            raise OptionError(f"{flag('shard')}={self}: no such shard; expected {FORM}")

    def __str__(self) -> str:  # the option's value as typed, which `pytest_args` passes on
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """`--losscheck-shard` as written: `I/N`."""
    index, sep, count = text.strip().partition("/")
    if not sep or not index.strip().isdigit() or not count.strip().isdigit():
        raise OptionError(f"{flag('shard')}={text!r}: expected {FORM}")
    return Shard(int(index), int(count))


def assign(costs: Sequence[tuple[str, float]], count: int) -> tuple[tuple[str, ...], ...]:
    """Every cell's shard by LPT (see the module).

    costs: (cell id, estimated seconds) per cell of the plan in scope, ids unique, any order.
    count: N, the number of shards.
    Returns N tuples of cell ids, shard I's at position I - 1, each in the order assigned (costliest
    first); with more shards than cells, the last shards are empty.
    """
    loads = [0.0] * count  # [N] estimated seconds assigned so far
    shares: list[list[str]] = [[] for _ in range(count)]
    for cell, seconds in sorted(costs, key=lambda c: (-c[1], c[0])):
        least = min(range(count), key=lambda i: (loads[i], i))
        shares[least].append(cell)
        loads[least] += seconds
    return tuple(tuple(s) for s in shares)


def share(entries: Iterable[MatrixEntry], shard: Shard) -> tuple[str, ...]:
    """The cell ids of `shard`: its share of the planned cells `entries` (the plan in scope)."""
    return assign([(e.cell, e.estimated_s or 0.0) for e in entries], shard.count)[shard.index - 1]
