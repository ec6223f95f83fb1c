"""Planted serving bugs: a prefix cache and a continuous-batching scheduler that each differ from
the correct one (`losscheck.serving.prefix_cache`, `losscheck.serving.batching`) by one line marked as the bug."""

from __future__ import annotations

import torch

from losscheck.core.engine import Batch
from losscheck.core.ragged import RaggedKVCache
from losscheck.serving.batching import ContinuousBatcher
from losscheck.serving.prefix_cache import PrefixCache, block_hash


class StaleAfterRollback(PrefixCache):
    """Stores a block once its last slot is *written*, counting the pending token's slot, which
    after a rejection still holds the rejected draft's keys / values (vLLM-style caching of full
    blocks before the verifier's rollback settled)."""

    def store(
        self,
        cache: RaggedKVCache,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        rows: list[int],
        hidden: torch.Tensor | None,
    ) -> None:
        super().store(cache, tokens, valid + 1, rows, hidden)  # BUG: valid is lengths - 1, not lengths


def hash_without_last_token(parent: bytes, ids: torch.Tensor) -> bytes:
    """A block identity that leaves out part of the block: prefixes that differ only in a block's
    last token share the entry."""
    return block_hash(parent, ids[:-1])  # BUG: the whole block, ids, belongs in the hash


def partial_hash_cache(cache: PrefixCache) -> PrefixCache:
    return PrefixCache(cache.block, cache.capacity, hash_block=hash_without_last_token)


def stale_cache(cache: PrefixCache) -> PrefixCache:
    return StaleAfterRollback(cache.block, cache.capacity)


class RetiredRowLeak(ContinuousBatcher):
    """Admits a request into a finished row without resetting the row's offset: the new prompt is
    written after as many of the row's old tokens as the retired request generated, and the new
    request attends to their cache entries."""

    def capacity(self, longest: int, max_new: int) -> int:
        return super().capacity(longest, max_new) + max_new  # room for the leaked tokens

    def _place(self, batch: Batch, row: int, prompt: list[int]) -> int:
        at = int(batch.lengths[row] - batch.prompt_lengths[row])  # BUG: a fresh row starts at slot 0
        batch.tokens[row, at : at + len(prompt)] = torch.tensor(prompt, device=batch.tokens.device)
        return at + len(prompt)
