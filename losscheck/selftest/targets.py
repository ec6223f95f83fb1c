"""Planted cache and position bugs: wrappers around a target that mis-handle the engine's
rollback. The engine asks for the right cache slots; the wrapper does what a buggy engine would.

Both wrappers honour a forward that starts every row at slot 0 — the prompt's prefill, or the first
round of one-token prompts — and keep their record of the rows from the next forward on, so the
first scored block of a request is always read correctly, as in the engines they model.
"""

from __future__ import annotations

from typing import Any

import torch

from losscheck.core.contract import Target
from losscheck.core.target import HFTarget
from losscheck.errors import LosscheckError


class _Wrapped:
    """Everything but `reset` and `forward` is the wrapped target's."""

    def __init__(self, target: Target) -> None:
        self.inner = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class StaleCache(_Wrapped):
    """Target KV cache not rolled back after a rejection: the next round appends after the rejected drafts.

    Like a Hugging Face loop that forgets to crop its DynamicCache: every round's k+1 entries stay,
    the rejected drafts' keys/values remain visible, and positions (= cache slots) drift with them.
    """

    def __init__(self, target: Target, k: int) -> None:
        super().__init__(target)
        self.k = k
        self.written: torch.Tensor | None = None  # [B] end of each row's last write

    def reset(self, batch_size: int, capacity: int) -> None:
        # Each round may leave k stale slots; at most one round per committed token.
        self.inner.reset(batch_size, capacity * (self.k + 1))
        self.written = None

    def forward(self, tokens: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if bool((start == 0).all()):
            self.written = None
        elif self.written is None:
            self.written = start
        start = self.written if self.written is not None else start  # BUG: should be the engine's start
        out = self.inner.forward(tokens, start)
        if self.written is not None:
            self.written = start + tokens.shape[1]
        return out


class BatchMaxPositions(_Wrapped):
    """Position ids wrong after a ragged batched rollback: one batch-wide step counter (the max) for every row.

    Rows advance their cache slots by their own accepted counts, but the rotary positions of every
    row advance by the batch's largest step.
    """

    def __init__(self, target: Target, k: int) -> None:
        if not isinstance(target, HFTarget):
            raise LosscheckError(
                f"mutant batch_max_positions sets rotary positions, which needs a Hugging Face target "
                f"(losscheck.HFTarget); got {type(target).__name__}"
            )
        super().__init__(target)
        self.inner: HFTarget = target
        self.origin: torch.Tensor | None = None  # [B] first scored slot of each row

    def reset(self, batch_size: int, capacity: int) -> None:
        self.inner.reset(batch_size, capacity)
        self.origin = None

    def forward(self, tokens: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if bool((start == 0).all()):
            self.origin = None
            return self.inner.forward(tokens, start)
        if self.origin is None:
            self.origin = start
        first = self.origin + (start - self.origin).max()  # BUG: the batch's progress, not the row's
        positions = first[:, None] + torch.arange(tokens.shape[1])
        return self.inner.checked(self.inner.lm.forward(tokens, start, positions))
