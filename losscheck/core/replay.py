"""Rollback by replay: the honest alternative to a checkpoint per position (`losscheck.core.recurrent`).

`ReplayStateCache` records no per-position recurrent state: a forward of m tokens runs the layers'
fast chunked path and hands back its last state alone, so a row holds two states per layer (before
and after the forward) instead of m + 1. A row that keeps all of a forward's tokens or none is
restored from those two; `ReplayLM.keep` rolls every other row back to the state before the
forward and replays its kept tokens, one token a forward (the row's keys and values are written
again, to the same slots, with the same values up to round-off). The conv windows are the
forward's own inputs, kept whatever the variant: restoring them replays nothing.

What it costs (docs/hybrid-targets.md): up to max(kept) extra one-token forwards after every
forward with a partial keep — k + 1 after a round of a k-block, a prompt's length after a ragged
prefill — for 2 states per recurrent layer per row in place of m + 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from losscheck.core.ragged import RaggedLM, forward_rows
from losscheck.core.recurrent import RaggedStateCache
from losscheck.errors import TargetError

if TYPE_CHECKING:
    from losscheck.core.target import HFTarget


class ReplayStateCache(RaggedStateCache):
    """`RaggedStateCache` recording no state inside a forward: the one before it and the one
    after its last token are all a row has (a keep of part of a forward is refused; `ReplayLM`
    replays it instead)."""

    def begin(self, start: torch.Tensor, width: int) -> None:
        super().begin(start, width)
        self.recorded = 0  # the layers' chunked path: the last state alone


class ReplayLM(RaggedLM):
    """A `RaggedLM` whose `keep` replays the kept tokens of rows that keep part of a forward."""

    def __init__(self, model: torch.nn.Module, kinds: tuple[str, ...]) -> None:
        super().__init__(model, lambda rows, capacity: ReplayStateCache(rows, capacity, kinds))
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # the last forward's (tokens, start)
        self.replays = 0  # one-token forwards run to roll back (a cost report)

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(tokens, start, *args, **kwargs)
        self._last = (tokens, start)  # after the call: an inner forward (a shared prefill) set it first
        return out

    @torch.inference_mode()
    def keep(self, counts: torch.Tensor) -> None:
        cache = self.cache
        if not isinstance(cache, ReplayStateCache) or self._last is None:
            return super().keep(counts)
        tokens, start = self._last  # [n, m], [n] of the rows the forward read
        width = tokens.shape[1]
        counts = counts.to(start.device)
        if not bool(((counts > 0) & (counts < width)).any()):
            return cache.keep(counts)
        rows = cache.read_rows  # None: every row
        cache.keep(torch.zeros_like(counts))  # every row read back to before the forward
        for i in range(int(counts.max())):
            step = tokens[:, i : i + 1], start + i
            if rows is None:
                self.forward(*step)
            else:
                forward_rows(self, rows, *step)
            self.replays += 1
            cache.keep((counts > i).long())
        self._last = None


def replayed(target: HFTarget) -> HFTarget:
    """A copy of the hybrid `target` (same weights) that rolls back by replay."""
    if not target.stateful:
        raise TargetError(f"target {target.name!r} has no recurrent state to roll back by replay")
    return target.with_lm(ReplayLM(target.model, target.kinds))
