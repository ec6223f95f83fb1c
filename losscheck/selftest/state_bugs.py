"""Planted recurrent-state bugs of hybrid targets: caches that roll a row's state back, and prefix
caches that resume it, the way shipped engines did. Each differs from the correct class
(`losscheck.core.recurrent.RaggedStateCache`, `losscheck.serving.prefix_cache.PrefixCache`) in one
method, marked as the bug. Plain decoding (one token a forward, all of it kept) is unaffected by every one
of them, as in the engines they model: only the speculative path reads a wrong state. Like
`losscheck.selftest.targets`, the rollback bugs leave a prefill (every row from slot 0) alone:
an engine prefills each prompt exactly, without the padding a batched prefill here reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from losscheck.core.contract import DraftContext, Drafter, Proposal, Target
from losscheck.core.ragged import RaggedKVCache
from losscheck.core.recurrent import Checkpoint, RaggedStateCache, RowState
from losscheck.core.target import HFTarget
from losscheck.serving.prefix_cache import PrefixCache


class NotRolledBack(RaggedStateCache):
    """State never rolled back after a rejection: the rejected drafts stay in every recurrent
    layer's state (a non-trimmable cache in a loop that trims the KV cache only)."""

    def keep(self, counts: torch.Tensor) -> None:
        if not _prefill(self):
            counts = torch.full_like(counts, self.width)  # the bug: every token kept
        super().keep(counts)


class OneOff(RaggedStateCache):
    """Rolled back one position late: the state after `counts + 1` tokens (the first rejected
    draft, or the pending token read twice), as an index that forgets the pending token's slot."""

    def checkpoint(self, counts: torch.Tensor) -> Checkpoint:
        if not _prefill(self):
            counts = counts + 1  # the bug: one position past what was kept
        return super().checkpoint(counts)


class SlotNotZeroed(RaggedStateCache):
    """A batch slot reused by a new request keeps its previous request's state: the row starts
    from the old state instead of zeros (continuous batching with state slots)."""

    def begin(self, start: torch.Tensor, width: int) -> None:
        super().begin(start, width)
        self._fresh = torch.zeros_like(start, dtype=torch.bool)  # the bug: nothing starts fresh


class PrefixHitZeroesConv(PrefixCache):
    """A prefix-cache hit resumes the recurrent state with every conv window zeroed (a radix-cache
    hit that restores the SSM state but not the short convolution's)."""

    def _resume(self, cache: RaggedStateCache, row: int, chain: list[bytes]) -> None:
        super()._resume(cache, row, chain)
        for slot in cache.states.values():
            if chain and slot.conv is not None:
                slot.conv[row] = 0  # the bug: the conv window is not restored


class PrefixStateAfterRound(PrefixCache):
    """A block's state checkpoint is the row's state after the whole scored block, rejected drafts
    included, not at the block's boundary (a state manager that ignores the dropped draft block)."""

    def block_state(self, cache: RaggedKVCache, row: int, tokens: int) -> RowState | None:
        if not isinstance(cache, RaggedStateCache):
            return None
        return cache.state_after(row, int(cache.held[row]))  # the bug: wherever the forward ended


class PrefixStateOneEarly(PrefixCache):
    """A block's checkpoint is the state one token before the block's boundary, where the keys and
    values resume after it (a checkpoint published at a boundary the attention layers do not
    resume from)."""

    def block_state(self, cache: RaggedKVCache, row: int, tokens: int) -> RowState | None:
        return super().block_state(cache, row, tokens - 1)  # the bug: one token early


class _Delegate:
    """Everything not defined here is `inner`'s."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.__wrapped__ = inner  # `inspect.unwrap` finds the drafter's per-row state

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ZeroDraftStale:
    """A row that proposed no draft this round keeps the recurrent state it had before the round:
    its step took the engine's no-speculation path, which reads the state from a slot the
    speculative path no longer writes (a stale slot, the shape of vLLM #40738 / SGLang #26351 for
    n-gram drafting on hybrid models). Rows with drafts are rolled back correctly.

    Planted as a pair (`wrap_drafter`, `wrap_target`) sharing the round's `Proposal.counts`."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None  # [B] this round's drafts per row, until `keep` reads them

    def wrap_drafter(self, drafter: Drafter) -> Drafter:
        owner = self

        class Watched(_Delegate):
            def propose(self, ctx: DraftContext) -> Proposal:
                proposal: Proposal = self.inner.propose(ctx)
                owner.counts = proposal.counts
                return proposal

        return Watched(drafter)  # a Drafter by delegation

    def wrap_target(self, target: Target, k: int) -> Target:
        owner = self

        class Stale(_Delegate):
            def keep(self, counts: torch.Tensor) -> None:
                drafted, owner.counts = owner.counts, None  # a prefill's keep comes with none
                if drafted is not None and len(drafted) == len(counts):
                    counts = torch.where(drafted.to(counts.device) == 0, 0, counts)  # the bug: no draft, stale
                self.inner.keep(counts)

        return Stale(target)  # a Target by delegation


PREFIX_BUGS: dict[str, type[PrefixCache]] = {
    "prefix_hit_zeroes_conv": PrefixHitZeroesConv,
    "prefix_state_after_round": PrefixStateAfterRound,
    "prefix_state_one_early": PrefixStateOneEarly,
}


def _prefill(cache: RaggedStateCache) -> bool:
    """The last forward started every row it read at slot 0."""
    return cache._fresh is not None and bool(cache._fresh.all())


STATE_BUGS: dict[str, type[RaggedStateCache]] = {
    "state_not_rolled_back": NotRolledBack,
    "state_rollback_one_off": OneOff,
    "state_slot_not_zeroed": SlotNotZeroed,
}


def plant(target: HFTarget, bug: str) -> Callable[[int, int], RaggedStateCache]:
    """Make `target` (a hybrid one) build the cache of `bug` from its next `reset` on; → the
    correct factory, to put back (`target.lm.new_cache = correct`)."""
    correct = target.lm.new_cache
    if not target.stateful:
        raise ValueError(f"{bug} is a recurrent-state bug; target {target.name!r} has no recurrent layers")
    cls, kinds = STATE_BUGS[bug], target.kinds
    target.lm.new_cache = lambda rows, capacity: cls(rows, capacity, kinds)
    return correct  # type: ignore[return-value]
