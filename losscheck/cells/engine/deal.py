"""A one-sample engine cell's rows dealt to its prompts.

A look draws whole rows, not whole rows a prompt: row r of the cell's sample continues prompt
`order[r mod P]`, the prompts in an order seeded by the run and the cell (fixed before any draw).
A look short of one row a prompt so reads a part of the prompts, a seeded one, and every P rows
read each prompt once more. Each look's rows are at most two requests: every prompt's equal share
and one more row for a contiguous run of the order (`Dealer.deal`).

Level does not depend on which prompts a look reads (every test's and rule-out's law is
conditional on the prompts); the power sums estimate per-token moments, which the rows of any
prompts estimate (`one_sample.confirming` pools the pilot's, one row of every prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class Hand(NamedTuple):
    """Rows a look asks for in one request: `n` rows for each of `prompts` (indices, in order),
    each prompt holding `before` rows of the sample already."""

    prompts: tuple[int, ...]
    n: int
    before: tuple[int, ...]

    def first_rows(self, rows: int) -> torch.Tensor:
        """[len(prompts) · n] bool, prompt-major: the rows among each prompt's first `rows`."""
        held = torch.tensor(self.before, dtype=torch.long)[:, None] + torch.arange(self.n)  # [m, n]
        return (held < rows).flatten()


@dataclass
class Dealer:
    """The cell's rows dealt to `order` (prompt indices) cyclically: `dealt` rows so far, `held`
    rows per prompt."""

    order: tuple[int, ...]
    dealt: int = 0
    held: list[int] = field(default_factory=list)

    @classmethod
    def seeded(cls, prompts: int, seed: int) -> Dealer:
        """A dealer over `prompts` prompts in the order `seed` draws."""
        if prompts < 1:
            raise ValueError(f"Dealer needs at least one prompt, got {prompts}")
        order = torch.randperm(prompts, generator=torch.Generator().manual_seed(seed)).tolist()
        return cls(tuple(order), 0, [0] * prompts)

    def deal(self, rows: int) -> list[Hand]:
        """The hands that take the sample to `rows` rows in all (at least one more than dealt):
        every prompt's equal share, then one more row for the next prompts of the order."""
        rows = max(rows, self.dealt + 1)
        count = len(self.order)
        each, rest = divmod(rows - self.dealt, count)
        hands = []
        if each:
            everyone = tuple(range(count))
            hands.append(Hand(everyone, each, tuple(self.held)))
            for i in everyone:
                self.held[i] += each
        if rest:
            some = tuple(sorted(self.order[(self.dealt + j) % count] for j in range(rest)))
            hands.append(Hand(some, 1, tuple(self.held[i] for i in some)))
            for i in some:
                self.held[i] += 1
        self.dealt = rows
        return hands
