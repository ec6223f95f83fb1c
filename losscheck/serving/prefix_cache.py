"""A block-hashed KV prefix cache: requests that share a prefix reuse its keys and values.

A row's committed tokens are cut into blocks of `block` tokens. A block is known by its chain
hash: sha256 of the previous block's hash and the block's token ids, so equal hashes mean equal
whole prefixes (vLLM's automatic prefix caching works the same way). A block is stored as soon as
every position in it holds valid keys / values. By the engine's invariant (`losscheck.core.engine`) a
row's target cache holds its first `lengths - 1` committed tokens, so block j is complete once
`(j + 1) * block <= lengths - 1`: slots written by a score pass but not verified, and the pending
token's slot (which still holds a rejected draft's keys after a rollback), are never stored.

A new request looks up its prompt's blocks in order and stops at the first miss; the hits are
copied into its cache row and only the rest of the prompt is prefilled. At most `capacity` blocks
are kept; the least recently used one is evicted first. Each block holds every layer's keys and
values and, for drafters that read them, the target's states at its positions.

A target with recurrent layers (`losscheck.core.recurrent`) cannot resume from keys and values:
each block also holds the rows' recurrent state after its last token, taken from the checkpoints
of the forward that read across that point before the engine rolls the row back (the engine
stores before it keeps). A hit resumes from the state of its last block; where a block has no
state (its boundary was never seen), the hit ends at the last block that has one and the rest of
the prompt is prefilled (`CacheStats.state_fallbacks`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from losscheck.core.ragged import RaggedKVCache, ragged_cache  # noqa: F401  (where the cache's users find it)
from losscheck.core.recurrent import RaggedStateCache, RowState
from losscheck.core.sampling import SamplingParams
from losscheck.errors import LosscheckError
from losscheck.jsonrecord import Scalar
from losscheck.serving.axis import Axis, Call, Facts, Prompts, ServeContext, Server, Wrapped

BLOCK = 16  # tokens per block, vLLM's default
CAPACITY = 4096  # blocks kept
COLD_CAPACITY = 64  # blocks kept by a cold cell's cache: it fills and evicts while the cell runs


def block_hash(parent: bytes, ids: torch.Tensor) -> bytes:
    """The chain hash of a block: its parent's hash and all its token ids `[block]`."""
    return hashlib.sha256(parent + ids.cpu().numpy().astype("<i8").tobytes()).digest()


@dataclass
class Block:
    keys: dict[int, torch.Tensor]  # layer -> [H_kv, block, D]
    values: dict[int, torch.Tensor]  # layer -> [H_kv, block, D]
    hidden: torch.Tensor | None  # [block, W] the target's states, when the engine keeps them
    state: RowState | None = None  # a hybrid target's recurrent state after the block's last token


@dataclass
class CacheStats:
    """Blocks looked up by new requests, found, stored and evicted."""

    lookups: int = 0
    hits: int = 0
    stored: int = 0
    evictions: int = 0
    state_fallbacks: int = 0  # hits cut back to the last block holding a recurrent state
    state_resumed: int = 0  # requests that resumed a hybrid target's recurrent state from a block

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def to_dict(self) -> dict[str, Scalar]:
        return {**self.__dict__, "hit_rate": self.hit_rate}


class PrefixCache:
    """Blocks of keys / values by chain hash, shared by every request an engine runs.

    `hash_block` is the block identity (`block_hash`; the mutant catalogue plants a wrong one).
    """

    def __init__(
        self,
        block: int = BLOCK,
        capacity: int = CAPACITY,
        hash_block: Callable[[bytes, torch.Tensor], bytes] = block_hash,
    ) -> None:
        if block < 1 or capacity < 1:
            raise LosscheckError(f"prefix cache needs block >= 1 and capacity >= 1 blocks, got {block} and {capacity}")
        self.block = block
        self.capacity = capacity
        self.hash_block = hash_block
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.stats = CacheStats()
        self._chains: list[list[bytes]] = []  # per row: the hashes of its blocks stored or found so far

    def reset(self, rows: int) -> None:
        """A new batch of `rows` rows: no row has blocks yet (stored blocks stay)."""
        self._chains = [[] for _ in range(rows)]

    @torch.inference_mode()
    def load(
        self,
        cache: RaggedKVCache,
        tokens: torch.Tensor,
        readable: torch.Tensor,
        rows: list[int],
        hidden: torch.Tensor | None,
    ) -> torch.Tensor:
        """Copy the longest stored prefix of each row of `rows` into its cache row → matched
        tokens [len(rows)], a multiple of `block` and at most `readable`.

        tokens [B, capacity] the rows' committed ids; readable [B] how many of them the request
        needs in the cache (its prompt but the pending last token); hidden [B, capacity, W] or None.
        """
        matched = []
        wanted = (readable // self.block).tolist()  # [B] complete blocks each row needs
        for b in rows:
            chain = self._chains[b] = []
            for j in range(wanted[b]):
                at = slice(j * self.block, (j + 1) * self.block)
                key = self.hash_block(chain[-1] if chain else b"", tokens[b, at])
                self.stats.lookups += 1
                found = self.blocks.get(key)
                if found is None:
                    self.stats.lookups += wanted[b] - j - 1  # the rest are misses too
                    break
                self.stats.hits += 1
                self.blocks.move_to_end(key)
                for layer, keys in found.keys.items():
                    cache.allocate(layer, keys, found.values[layer])
                    cache.keys[layer][b, :, at] = keys
                    cache.values[layer][b, :, at] = found.values[layer]
                if hidden is not None and found.hidden is not None:
                    hidden[b, at] = found.hidden
                chain.append(key)
            if isinstance(cache, RaggedStateCache):
                self._resume(cache, b, chain)
            matched.append(len(chain) * self.block)
        return torch.tensor(matched, dtype=torch.long, device=tokens.device)

    def _resume(self, cache: RaggedStateCache, row: int, chain: list[bytes]) -> None:
        """Row `row`'s recurrent state from the last block of `chain` that holds one; the chain cut
        back to it (the blocks after it are prefilled again)."""
        kept = len(chain)
        while kept and self.blocks[chain[kept - 1]].state is None:
            kept -= 1
        if kept < len(chain):
            self.stats.state_fallbacks += 1
            del chain[kept:]
        if kept:
            state = self.blocks[chain[-1]].state
            assert state is not None
            cache.set_state(row, state, kept * self.block)
            self.stats.state_resumed += 1

    @torch.inference_mode()
    def store(
        self,
        cache: RaggedKVCache,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        rows: list[int],
        hidden: torch.Tensor | None,
    ) -> None:
        """Store every block of `rows` that is complete within the first `valid [B]` tokens and
        not stored yet (see the module docstring for why `valid` is `lengths - 1`)."""
        complete = (valid // self.block).tolist()  # [B] blocks each row has complete
        for b in rows:
            chain = self._chains[b]
            for j in range(len(chain), complete[b]):
                at = slice(j * self.block, (j + 1) * self.block)
                key = self.hash_block(chain[-1] if chain else b"", tokens[b, at])
                chain.append(key)
                if key in self.blocks:
                    self.blocks.move_to_end(key)
                    continue
                self.blocks[key] = Block(
                    {layer: keys[b, :, at].clone() for layer, keys in cache.keys.items()},
                    {layer: values[b, :, at].clone() for layer, values in cache.values.items()},
                    None if hidden is None else hidden[b, at].clone(),
                    self.block_state(cache, b, (j + 1) * self.block),
                )
                self.stats.stored += 1
                if len(self.blocks) > self.capacity:
                    self.blocks.popitem(last=False)
                    self.stats.evictions += 1

    def block_state(self, cache: RaggedKVCache, row: int, tokens: int) -> RowState | None:
        """The recurrent state a block ending after `tokens` tokens of `row` holds (None: a KV
        cache, or a boundary the last forward did not read across)."""
        return cache.state_after(row, tokens) if isinstance(cache, RaggedStateCache) else None


def second_turn(
    prompts: list[list[int]], outputs: list[list[int]], block: int, vocab: int, room: int
) -> list[list[int]]:
    """A warm cell's requests after a first turn of `prompts` that generated `outputs`: each prompt
    continued by its output (a conversation's next turn: every complete block of it was stored by
    the first turn), then for each a sibling that differs from it in one token only, the last of
    its last complete block, so a block identity that ignores any part of a block reuses a wrong
    entry. Each request keeps at most `room` tokens; a sibling needs one complete block."""
    turns = [(prompt + output)[:room] for prompt, output in zip(prompts, outputs)]
    siblings = []
    for turn in turns:
        last = (len(turn) - 1) // block * block - 1  # the last token of the last block it reads
        if last >= 0:
            siblings.append(turn[:last] + [(turn[last] + 1) % vocab] + turn[last + 1 :])
    return turns + siblings


# --- the serving axis ----------------------------------------------------------------------------
AXIS_NAME = "prefix"


@runtime_checkable
class PlantsPrefixCache(Protocol):
    """A planted bug that replaces the cell's prefix cache (`losscheck.run.plant.Plant`)."""

    @property
    def prefix_cache(self) -> Callable[[PrefixCache], PrefixCache] | None:
        """The cell's prefix cache -> a planted one; None leaves it as it is."""
        ...


class PrefixCached(Wrapped):
    """The cell's engine with a prefix cache (cold: empty and small, so it evicts as it fills;
    warm: large, and filled by a first turn before the measured requests, `_second_turn`)."""

    def __init__(self, state: str, inner: Server, context: ServeContext) -> None:
        super().__init__(inner)
        if inner.engine is None:
            raise LosscheckError("the prefix cache is a cache of the engine in this process; this cell has none")
        cache = PrefixCache(capacity=COLD_CAPACITY if state == "cold" else CAPACITY)
        planted = context.plant.prefix_cache if isinstance(context.plant, PlantsPrefixCache) else None
        self.cache = planted(cache) if planted is not None else cache
        inner.engine.prefix_cache = self.cache

    def facts(self) -> Facts:
        cache, stats = self.cache, self.cache.stats
        summary = (
            f"prefix cache (block {cache.block}, {cache.capacity} blocks): hit rate {stats.hit_rate:.1%} "
            f"({stats.hits}/{stats.lookups} blocks looked up), {stats.stored} stored, {stats.evictions} evicted"
        )
        if stats.state_resumed or stats.state_fallbacks:
            summary += f"; {stats.state_resumed} recurrent states resumed, {stats.state_fallbacks} hits cut back"
        facts = {"block": cache.block, "capacity": cache.capacity, **stats.to_dict(), "summary": summary}
        return {**self.inner.facts(), AXIS_NAME: facts}


def _second_turn(
    state: str,
    server: Server,
    context: ServeContext,
    prompts: Prompts,
    max_new_tokens: int,
    params: SamplingParams,
    stream: object,
) -> Prompts:
    """A warm cell measures the second turn (`second_turn`) after a first turn of `prompts`
    through the cell's whole server, which fills the cache."""
    if state != "warm":
        return prompts
    assert server.engine is not None and server.engine.prefix_cache is not None
    target = server.engine.target
    (first,) = server.generate([Call(prompts, context.greedy_max_new, params, (context.cell_id, "first-turn", stream))])
    outputs = [first.row(i) for i in range(len(prompts))]
    room = target.max_positions - max_new_tokens
    return second_turn(prompts, outputs, server.engine.prefix_cache.block, target.vocab_size, room)


AXIS = Axis(
    name=AXIS_NAME,
    off="off",
    values=("cold", "warm"),
    suffix=lambda state: f"prefix-{state}",
    serve=PrefixCached,
    requests=_second_turn,
    order=2,
    doc="a block-hashed KV prefix cache in the engine: cold (empty, evicting) or warm (a first turn filled it)",
)
