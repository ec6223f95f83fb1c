"""A Hugging Face causal LM driven with a per-row (ragged) KV cache.

Batched speculative decoding leaves rows at different lengths after every round. Instead of
re-padding, each row keeps its own write offset into a fixed buffer: a forward pass writes its
`m` new keys/values at slots `start[b] .. start[b]+m-1` and attends through an explicit 4-D mask
to slots `<= start[b] + i`. Rolling a row back is just passing a smaller `start` next time;
stale slots past it are masked out and later overwritten.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from losscheck.errors import LosscheckError


class RaggedKVCache:
    """Per-layer key/value buffers `[B, H_kv, capacity, D]` written at per-row offsets.

    Implements the one method Hugging Face attention layers call on a cache, `update`.
    """

    stateful = False  # a cache with recurrent state per row (`losscheck.core.recurrent`) says True

    def __init__(self, batch_size: int, capacity: int) -> None:
        self.batch_size = batch_size
        self.capacity = capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.slots: torch.Tensor | None = None  # [B, m] write slots of the current forward
        self.visible = 0  # slots [0, visible) are read by the current forward

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key, value: [B, H_kv, m, D]
        if layer_idx not in self.keys:
            shape = (self.batch_size, key.shape[1], self.capacity, key.shape[3])
            self.keys[layer_idx] = key.new_zeros(shape)
            self.values[layer_idx] = value.new_zeros(shape)
        assert self.slots is not None
        index = self.slots[:, None, :, None].expand_as(key)
        self.keys[layer_idx].scatter_(2, index, key)
        self.values[layer_idx].scatter_(2, index, value)
        return (
            self.keys[layer_idx][:, :, : self.visible],
            self.values[layer_idx][:, :, : self.visible],
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.visible

    # A KV cache rolls back by slots alone; a cache with recurrent state
    # (`losscheck.core.recurrent.RaggedStateCache`) overrides these.
    def begin(self, start: torch.Tensor, width: int) -> None:
        """Before a forward of `width` tokens per row at slots `start` [B]."""

    def keep(self, counts: torch.Tensor) -> None:
        """After a forward: each row keeps the first `counts` [n] of its tokens (the rest are
        overwritten by the next forward)."""

    def checkpoint(self, counts: torch.Tensor) -> object | None:
        """The state `keep(counts)` would leave, to `restore` later; None: slots roll back alone."""
        return None

    def restore(self, checkpoint: Any) -> None:
        """Back to a `checkpoint` of this cache."""

    def rows(self, rows: torch.Tensor, capacity: int) -> RaggedKVCache:
        """An empty cache of `capacity` slots for `rows` [n] alone (keys and values not copied)."""
        return type(self)(len(rows), capacity)

    def put_rows(self, rows: torch.Tensor, sub: RaggedKVCache, source: torch.Tensor | None = None) -> None:
        """Take what `sub` holds beyond keys and values for `rows` [n] (row `source[i]` of `sub`)."""

    def move(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy every layer's entries at slots `source [B, m]` to slots `dest [B, m]` (all read
        before any is written): a drafted tree's kept path packed behind its pending token."""
        with torch.inference_mode():  # the buffers are inference tensors (made inside a forward)
            self._move(source, dest)

    def _move(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        for layer, keys in self.keys.items():  # [B, H_kv, capacity, D]
            for buffer in (keys, self.values[layer]):
                at = source[:, None, :, None].expand(-1, buffer.shape[1], -1, buffer.shape[3])
                buffer.scatter_(2, dest[:, None, :, None].expand_as(at), buffer.gather(2, at))

    def allocate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The buffers of `layer` shaped for entries like `key`, `value` [H_kv, m, D] (the prefix
        cache writes blocks before the first forward would allocate them)."""
        if layer not in self.keys:
            self.keys[layer] = key.new_zeros(self.batch_size, key.shape[0], self.capacity, key.shape[2])
            self.values[layer] = value.new_zeros(self.batch_size, value.shape[0], self.capacity, value.shape[2])


@dataclass(frozen=True)
class TreeBlock:
    """How a forward's tokens sit in a drafted tree's block of `M` slots from `start` (slot 0 the
    pending token, slot i+1 node i): token j is written at block slot `offsets[j]`, has rotary
    position `start + depths[j]`, and reads the block slots `sees[j]` marks (its ancestors and
    itself; `losscheck.core.tree.TreeTopology.ancestry` rows)."""

    offsets: torch.Tensor  # [m] long
    depths: torch.Tensor  # [m] long
    sees: torch.Tensor  # [m, M] bool


def _cache_keyword(model: torch.nn.Module) -> str:
    """transformers 5 renamed `past_key_values` to `cache`; accept either."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class RaggedLM:
    """Wraps a `*ForCausalLM` module; see the module docstring for the cache layout."""

    def __init__(self, model: torch.nn.Module, new_cache: Callable[[int, int], RaggedKVCache] = RaggedKVCache) -> None:
        """`new_cache(batch_size, capacity)`: the cache each batch gets (one with recurrent state
        for a hybrid model, `losscheck.core.recurrent.cache_for`)."""
        self.model = model.eval()
        self.new_cache = new_cache
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self._cache_kw = _cache_keyword(model)
        self.cache: RaggedKVCache | None = None
        self.passes = 0  # forward passes run, and the token positions they computed (a cost report)
        self.tokens = 0

    def reset(self, batch_size: int, capacity: int) -> None:
        self.cache = self.new_cache(batch_size, capacity)

    @torch.inference_mode()  # the states are inference tensors, made inside `forward`
    def keep(self, counts: torch.Tensor) -> None:
        """Each row the last forward read keeps the first `counts` [n] of its tokens: a no-op for
        keys and values (the next forward's `start` rolls them back), a restore of the
        checkpointed recurrent state for a hybrid model."""
        if self.cache is not None:
            self.cache.keep(counts)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        positions: torch.Tensor | None = None,
        layers: tuple[int, ...] | None = None,
        tree: TreeBlock | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, m], start [B] → logits [B, m, V] (float32), hidden [B, m, H].

        `positions [B, m]` are the rotary positions when they differ from the cache slots
        `start + i` (an engine that keeps padding in its cache would pass them). `layers`: return
        those entries of `output_hidden_states` (0 the embeddings, i the output of decoder layer
        i) concatenated, [B, m, len(layers)·H], instead of the last one. `tree`: the tokens are
        nodes of a drafted tree, written and attended as it says (`TreeBlock`).
        """
        cache = self.cache
        if cache is None or cache.batch_size != tokens.shape[0]:
            raise RuntimeError("RaggedLM.forward called before reset() for this batch size")
        if tree is not None:
            if positions is not None:
                raise LosscheckError("RaggedLM.forward: a tree block's positions are its depths; pass no positions")
            return self._tree_forward(tokens, start, tree, layers)
        if positions is None and tokens.shape[0] > 1 and not bool(start.any()):
            distinct, inverse = torch.unique(tokens, dim=0, return_inverse=True)
            if len(distinct) < tokens.shape[0]:
                return self._shared(distinct, inverse, layers)
        self.passes += 1
        self.tokens += tokens.numel()
        m = tokens.shape[1]
        slots = start[:, None] + torch.arange(m, device=tokens.device)  # [B, m]
        visible = int(slots.max()) + 1
        if visible > cache.capacity:
            raise RuntimeError(f"ragged cache overflow: need {visible} slots, capacity {cache.capacity}")
        cache.slots, cache.visible = slots, visible
        cache.begin(start, m)
        allowed = torch.arange(visible, device=tokens.device)[None, None, :] <= slots[:, :, None]  # [B, m, S]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=tokens.device).masked_fill(
            ~allowed, torch.finfo(self.dtype).min
        )[:, None]  # [B, 1, m, S] additive
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=slots if positions is None else positions,
            use_cache=True,
            output_hidden_states=True,
            **{self._cache_kw: cache},
        )
        if layers is None:
            return out.logits.float(), out.hidden_states[-1]
        return out.logits.float(), torch.cat([out.hidden_states[i] for i in layers], dim=-1)

    def _tree_forward(
        self, tokens: torch.Tensor, start: torch.Tensor, tree: TreeBlock, layers: tuple[int, ...] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` of tree nodes: token i at slot `start + tree.offsets[i]`, rotary position
        `start + tree.depths[i]`, attending to every slot before `start` and to the block's slots
        `tree.sees[i]` marks (its ancestors and itself)."""
        cache = self.cache
        assert cache is not None
        if cache.stateful:
            raise LosscheckError(
                "a drafted tree is scored in one pass with tree attention, which a target with recurrent layers "
                "cannot take (its state runs along one sequence); certify trees on an attention-only target"
            )
        self.passes += 1
        self.tokens += tokens.numel()
        device = tokens.device
        offsets, depths, sees = (
            tree.offsets.to(device),
            tree.depths.to(device),
            tree.sees.to(device),
        )  # [m], [m], [m, M]
        slots = start[:, None] + offsets[None, :]  # [B, m]
        visible = int(start.max()) + sees.shape[1]
        if visible > cache.capacity:
            raise RuntimeError(f"ragged cache overflow: need {visible} slots, capacity {cache.capacity}")
        cache.slots, cache.visible = slots, visible
        cache.begin(start, tokens.shape[1])
        relative = torch.arange(visible, device=device)[None, :] - start[:, None]  # [B, S] slot - start
        in_block = (relative >= 0) & (relative < sees.shape[1])  # [B, S]
        allowed = (relative < 0)[:, None, :] | (
            in_block[:, None, :] & sees[:, relative.clamp(0, sees.shape[1] - 1)].permute(1, 0, 2)
        )  # [B, m, S]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=device).masked_fill(
            ~allowed, torch.finfo(self.dtype).min
        )[:, None]  # [B, 1, m, S] additive
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=start[:, None] + depths[None, :],
            use_cache=True,
            output_hidden_states=True,
            **{self._cache_kw: cache},
        )
        if layers is None:
            return out.logits.float(), out.hidden_states[-1]
        return out.logits.float(), torch.cat([out.hidden_states[i] for i in layers], dim=-1)

    def _shared(
        self, distinct: torch.Tensor, inverse: torch.Tensor, layers: tuple[int, ...] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` from slot 0 of rows of which only `distinct` [u, m] differ (row b is
        `distinct[inverse[b]]`): each distinct row computed once, into a cache of its own, and
        copied to every row that repeats it. A prefill of a cell's rows, which cycle over a few
        prompts, costs the prompts', not the rows'."""
        main = self.cache
        assert main is not None
        m = distinct.shape[1]
        # every row reads from slot 0 here, so which main row seeds each distinct one is immaterial
        self.cache = main.rows(inverse.new_zeros(len(distinct)), main.capacity)
        try:
            logits, hidden = self.forward(
                distinct, torch.zeros(len(distinct), dtype=torch.long, device=distinct.device), layers=layers
            )
            for layer, keys in self.cache.keys.items():  # [u, H_kv, capacity, D]
                values = self.cache.values[layer]
                main.allocate(layer, keys[0], values[0])
                main.keys[layer][:, :, :m] = keys[inverse, :, :m]
                main.values[layer][:, :, :m] = values[inverse, :, :m]
            rows = torch.arange(len(inverse), device=inverse.device)
            main.put_rows(rows, self.cache, source=inverse)
        finally:
            self.cache = main
        main.slots = torch.arange(m, device=distinct.device).expand(len(inverse), m)
        main.visible = m
        return logits[inverse], hidden[inverse]


def forward_rows(
    lm: RaggedLM, rows: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, layers: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lm.forward` of cache rows `rows` [n] alone, leaving the other rows untouched: `tokens`
    [n, m] at slots `start` [n] onwards. One pass over the n rows into a cache of their own
    (seeded with their slots before `start`), copied back: a serving engine prefills only what it
    admits, and a pass over the whole batch would cost B / n times as much. Needs `lm`'s cache
    allocated. → (logits [n, m, V], hidden [n, m, H])."""
    main = lm.cache
    assert main is not None and main.keys, "forward_rows needs the batch's cache allocated"
    seeded = int(start.max())
    lm.cache = main.rows(rows, seeded + tokens.shape[1])
    try:
        with torch.inference_mode():  # the buffers are inference tensors (made inside lm.forward)
            for layer, keys in main.keys.items():
                lm.cache.allocate(layer, keys[0, :, :1], main.values[layer][0, :, :1])
                lm.cache.keys[layer][:, :, :seeded] = keys[rows, :, :seeded]
                lm.cache.values[layer][:, :, :seeded] = main.values[layer][rows, :, :seeded]
        out = lm.forward(tokens, start, layers=layers)
        with torch.inference_mode():
            for layer, keys in lm.cache.keys.items():  # [n, H_kv, seeded + m, D] each
                main.keys[layer][rows, :, : keys.shape[2]] = keys
                main.values[layer][rows, :, : keys.shape[2]] = lm.cache.values[layer]
            main.put_rows(rows, lm.cache)
    finally:
        lm.cache = main
    return out


def ragged_cache(target: Any) -> RaggedKVCache:
    """The ragged KV cache of `target` (an `HFTarget`, or a wrapper exposing its `lm`)."""
    cache = getattr(getattr(target, "lm", None), "cache", None)
    if not isinstance(cache, RaggedKVCache):
        raise LosscheckError(
            f"the prefix cache copies key / value blocks of the target's ragged cache; target "
            f"{getattr(target, 'name', type(target).__name__)!r} has none (use losscheck.HFTarget)"
        )
    return cache
