"""Recurrent state beside the ragged KV cache: hybrid targets (attention + gated delta net, Mamba-2
or short-convolution layers) in the speculative loop.

A recurrent layer cannot be rolled back by passing a smaller `start`: its state after a round has
read every scored token, the rejected drafts included. So every forward keeps a *checkpoint per
position* — each row's conv window and recurrent state after each of the `m` tokens it read —
and `keep(counts)` restores row b to the state after the first `counts[b]` of them (0: the state
before the forward). Until `keep` is called the state is the one after all `m` tokens, as a KV
cache holds all `m` slots. Invariant, per row b: the state holds exactly the tokens `[0, held[b])`;
a forward from `start[b] = 0` starts from zeros (a reused batch slot never inherits its previous
request's state).

Transformers' linear-attention layers read and write their states through a small cache API
(`get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`,
`get_recurrent_states_to_keep`, `is_recording_past`, `increase_count`); `RaggedStateCache` serves
it. Recording is always on, so a layer hands back its conv inputs in full and its recurrent state
after each of the last `m` positions instead of the last one only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from losscheck.core.ragged import RaggedKVCache
from losscheck.errors import TargetError

# transformers' cache layer classes by what they hold; a model whose layers map to anything else
# is refused by name (the loop would roll it back wrong). A sliding window keeps every slot in the
# ragged cache: its rollback is the KV cache's.
ATTENTION_LAYERS = frozenset({"DynamicLayer", "StaticLayer", "DynamicSlidingWindowLayer"})
RECURRENT_LAYERS = frozenset({"LinearAttentionLayer"})
BOTH_LAYERS = frozenset({"LinearAttentionAndFullAttentionLayer"})
NO_CACHE_LAYERS = frozenset({"DummyLayer"})  # an MLP-only block (Nemotron-H): nothing to roll back


def layer_kinds(config: Any) -> tuple[str, ...]:
    """Per decoder layer of a Hugging Face config: "attention" (or no cache at all), "recurrent" or
    "both", read off the cache layers transformers would build for it; `TargetError` naming a layer
    type the loop cannot roll back (indexed or compressed attention, …), or a transformers too old
    to serve recurrent layers the API the loop rolls them back through."""
    import transformers
    from transformers import cache_utils

    if not hasattr(cache_utils, "get_layer_types_and_kwargs"):  # before the layer-typed caches
        return ("attention",) * int(getattr(config, "num_hidden_layers", 0))
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    types, _ = get_layer_types_and_kwargs(text)
    kinds = []
    for i, kind in enumerate(types):
        name = DYNAMIC_LAYER_TYPE_MAPPING[kind].__name__
        if name in ATTENTION_LAYERS or name in NO_CACHE_LAYERS:
            kinds.append("attention")
        elif name in RECURRENT_LAYERS:
            kinds.append("recurrent")
        elif name in BOTH_LAYERS:
            kinds.append("both")
        else:
            raise TargetError(
                f"layer {i} of {getattr(config, 'model_type', 'the model')!r} is of type {kind!r} "
                f"(transformers' {name}), which the loop cannot roll back per row; supported: full "
                "attention, and recurrent layers (gated delta net, Mamba-2, short convolution)"
            )
    if any(kind != "attention" for kind in kinds) and not hasattr(cache_utils.Cache, "get_recurrent_states_to_keep"):
        raise TargetError(
            f"{getattr(config, 'model_type', 'the model')!r} has recurrent layers, and transformers "
            f"{transformers.__version__} predates the cache API the loop rolls them back through "
            "(Cache.get_recurrent_states_to_keep, get_conv_state): install a newer transformers"
        )
    return tuple(kinds)


def has_state(kinds: tuple[str, ...]) -> bool:
    """Layers of these `layer_kinds` hold recurrent state (the loop must `keep` after a forward)."""
    return any(kind != "attention" for kind in kinds)


def cache_for(kinds: tuple[str, ...]) -> Callable[[int, int], RaggedKVCache]:
    """The ragged cache for a model of these `layer_kinds`: `RaggedStateCache` when it has state."""
    return functools.partial(RaggedStateCache, kinds=kinds) if has_state(kinds) else RaggedKVCache


@dataclass
class _States:
    """One recurrent layer's state slot `state_idx`, with the checkpoints of the last forward."""

    conv: torch.Tensor | None = None  # [B, C, K] the last K conv inputs each row read
    conv_read: torch.Tensor | None = None  # [B, C, K + m] the window before the forward, then its m inputs
    recurrent: torch.Tensor | None = None  # [B, ...] the recurrent state
    history: list[torch.Tensor] = field(default_factory=list)  # m+1 states [B, ...]: before, after each token


# one row's state: (layer, state index) -> (conv window [C, K], recurrent state [...]), each or None
RowState = dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor | None]]


@dataclass(frozen=True)
class Checkpoint:
    """Every row's recurrent state at one point (`RaggedStateCache.checkpoint`)."""

    held: torch.Tensor  # [B] tokens each row's state holds
    states: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor | None]]  # (conv, recurrent)


class RaggedStateCache(RaggedKVCache):
    """`RaggedKVCache` plus per-row recurrent states with a checkpoint per position of the last
    forward (see the module docstring)."""

    stateful = True

    def __init__(self, batch_size: int, capacity: int, kinds: tuple[str, ...]) -> None:
        super().__init__(batch_size, capacity)
        self.kinds = kinds
        self.states: dict[tuple[int, int], _States] = {}
        self.held = torch.zeros(batch_size, dtype=torch.long)  # [B] tokens each row's state holds
        self.width = 0  # m, tokens the last forward read per row
        self.read_rows: torch.Tensor | None = None  # [n] the rows it read, when not all (`put_rows`)
        self._fresh: torch.Tensor | None = None  # [B] bool, rows starting from slot 0 this forward
        self.expected: int | None = None  # the next forward's rows keep at least this many tokens (`expect`)
        self.recorded = 0  # positions of the last forward whose states were recorded: its last ones

    # -- the engine's side ------------------------------------------------------------------------

    def begin(self, start: torch.Tensor, width: int) -> None:
        """Before a forward of `width` tokens per row at slots `start` [B]: rows at slot 0 start
        from zeros; the others from their current state."""
        self.width = width
        self.read_rows = None
        self._fresh = (start == 0).to(self.held.device)
        self.held = torch.where(self._fresh, 0, self.held) + width
        # the states after tokens expected .. width (the one before the forward is always there)
        self.recorded = width if self.expected is None else min(width, max(1, width - self.expected + 1))
        self.expected = None

    def expect(self, counts: torch.Tensor) -> None:
        """The next forward's rows will keep at least `counts` [n] tokens each: only the states at
        the positions a `keep` may then ask for are recorded (the layers run their fast chunked
        path over the rest). A prefill knows its counts (each row's own length) before it runs."""
        self.expected = int(counts.min()) if len(counts) else None

    def keep(self, counts: torch.Tensor) -> None:
        """Roll each row the last forward read back to its state after the first `counts` of the
        forward's tokens: counts [n] for the rows it read (`read_rows`; every row: n = B), 0 the
        state before the forward."""
        self.restore(self.checkpoint(counts))
        for slot in self.states.values():
            slot.conv_read, slot.history = None, []

    def checkpoint(self, counts: torch.Tensor) -> Checkpoint:
        """A copy of every row's state as `keep(counts)` would leave it, the cache unchanged."""
        counts = counts.to(self.held.device).clamp(0, self.width)
        rows = torch.arange(len(self.held)) if self.read_rows is None else self.read_rows.to(self.held.device)
        held = self.held.clone()
        held[rows] = held[rows] - self.width + counts
        states: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for key, slot in self.states.items():
            conv, recurrent = slot.conv, slot.recurrent
            if slot.conv_read is not None and conv is not None:
                size = conv.shape[-1]
                at = counts[:, None, None].to(conv.device) + torch.arange(size, device=conv.device)  # [n, 1, K]
                kept = slot.conv_read.gather(2, at.expand(-1, conv.shape[1], -1))  # [n, C, K]
                conv = conv.index_copy(0, rows.to(conv.device), kept)
            if slot.history and recurrent is not None:
                stacked = torch.stack(slot.history)  # [m+1, n, ...]
                at = self._history_index(counts).to(stacked.device)
                kept = stacked[at, torch.arange(stacked.shape[1], device=stacked.device)]
                recurrent = recurrent.index_copy(0, rows.to(recurrent.device), kept)
            states[key] = (None if conv is None else conv.clone(), None if recurrent is None else recurrent.clone())
        return Checkpoint(held, states)

    def _history_index(self, counts: torch.Tensor) -> torch.Tensor:
        """[n] where in a layer's recorded states (`_States.history`: the state before the forward,
        then after each of its last `max(recorded, 1)` tokens) the state after `counts` [n] is."""
        skipped = self.width - max(self.recorded, 1)  # leading positions with no recorded state
        if bool(((counts > 0) & (counts <= skipped)).any()):
            raise TargetError(
                f"a row kept {int(counts[(counts > 0) & (counts <= skipped)].min())} tokens of a forward that "
                f"recorded the states of its last {max(self.recorded, 1)} of {self.width} only (`expect` said more)"
            )
        return torch.where(counts > 0, counts - skipped, 0)

    def _recorded_at(self, count: int) -> int | None:
        """Where the state after `count` of the last forward's tokens is in its recorded states
        (None: not recorded)."""
        skipped = self.width - max(self.recorded, 1)
        return 0 if count == 0 else count - skipped if count > skipped else None

    def restore(self, checkpoint: Checkpoint) -> None:
        """Every row back to `checkpoint` (taken from this cache)."""
        self.held = checkpoint.held.clone()
        for key, (conv, recurrent) in checkpoint.states.items():
            slot = self.states.setdefault(key, _States())
            slot.conv = None if conv is None else conv.clone()
            slot.recurrent = None if recurrent is None else recurrent.clone()

    # -- one row's state at a block boundary (a prefix cache's checkpoints) -----------------------

    def state_after(self, row: int, tokens: int) -> RowState | None:
        """Row `row`'s state after its first `tokens` tokens, if the last forward read across that
        point (before `keep`: its checkpoints are still there) or the row holds exactly that many;
        None where the state there was never seen."""
        held, width = int(self.held[row]), self.width
        if self.read_rows is None:
            at: int | None = row
        else:
            found = (self.read_rows == row).nonzero()
            at = int(found[0, 0]) if len(found) else None
        count = tokens - (held - width)
        out: RowState = {}
        for key, slot in self.states.items():
            checkpoints = at is not None and (bool(slot.history) or slot.conv_read is not None)
            if checkpoints and 0 <= count <= width:  # the last forward read across that point
                assert at is not None
                conv = None
                if slot.conv_read is not None and slot.conv is not None:
                    conv = slot.conv_read[at, :, count : count + slot.conv.shape[-1]].clone()
                index = self._recorded_at(count)
                if slot.history and index is None:
                    return None  # a state the forward did not record (a replay cache's)
                recurrent = slot.history[index][at].clone() if slot.history and index is not None else None
            elif not checkpoints and tokens == held:
                conv = None if slot.conv is None else slot.conv[row].clone()
                recurrent = None if slot.recurrent is None else slot.recurrent[row].clone()
            else:
                return None
            out[key] = (conv, recurrent)
        return out

    def set_state(self, row: int, state: RowState, tokens: int) -> None:
        """Row `row` resumes from `state`, the state after `tokens` tokens (a prefix-cache hit)."""
        for key, (conv, recurrent) in state.items():
            slot = self.states.setdefault(key, _States())
            slot.conv = _put_row(slot.conv, row, conv, len(self.held))
            slot.recurrent = _put_row(slot.recurrent, row, recurrent, len(self.held))
        self.held[row] = tokens

    # -- the layers' side (transformers' cache API for linear attention) --------------------------

    def _slot(self, layer_idx: int, state_idx: int) -> _States:
        if self.kinds[layer_idx] == "attention":
            raise TargetError(f"layer {layer_idx} asked for a recurrent state, but its config declares attention")
        return self.states.setdefault((layer_idx, state_idx), _States())

    def _rows_fresh(self, state: torch.Tensor) -> torch.Tensor:
        """`state` [B, ...] with the rows that start at slot 0 zeroed."""
        assert self._fresh is not None, "RaggedStateCache.begin() runs before every forward"
        keep = ~self._fresh.to(state.device)
        return state * keep.view(-1, *([1] * (state.dim() - 1))).to(state.dtype)

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # conv inputs and recurrent states come back per position

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return self.recorded

    def increase_count(self, layer_idx: int, state_idx: int) -> None:
        """Token counts are `held`, kept by `begin` and `keep`."""

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        slot = self._slot(layer_idx, state_idx)
        return None if slot.conv is None else self._rows_fresh(slot.conv)

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """conv_states [B, C, m] the forward's conv inputs → [B, C, K + m] with each row's previous
        window (zeros for a fresh row) in front, what the causal convolution reads."""
        slot = self._slot(layer_idx, state_idx)
        if slot.conv is None:
            size = conv_kernel_size or conv_states.shape[-1]
            slot.conv = conv_states.new_zeros(*conv_states.shape[:-1], size)
        window = self._rows_fresh(slot.conv)
        slot.conv_read = torch.cat([window, conv_states.to(window.dtype)], dim=-1)
        slot.conv = slot.conv_read[..., -window.shape[-1] :]
        return slot.conv_read

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        slot = self._slot(layer_idx, state_idx)
        return None if slot.recurrent is None else self._rows_fresh(slot.recurrent)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor | list[torch.Tensor], layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """The layer's state after each of the forward's m tokens (a list), or after its last one
        alone (a tensor: a one-token forward)."""
        slot = self._slot(layer_idx, state_idx)
        after = [recurrent_states] if isinstance(recurrent_states, torch.Tensor) else list(recurrent_states)
        if len(after) != max(self.recorded, 1):  # none recorded: the state after the last token alone
            raise TargetError(
                f"layer {layer_idx} returned {len(after)} recurrent states for a forward of {self.width} "
                f"tokens asked to record {self.recorded}; the loop needs them to roll back (a layer that "
                "ignores get_recurrent_states_to_keep)"
            )
        before = torch.zeros_like(after[0]) if slot.recurrent is None else self._rows_fresh(slot.recurrent)
        slot.history = [before, *after]
        slot.recurrent = after[-1]
        return slot.recurrent

    # -- rows moved between caches (a prefill of some rows, or of distinct rows copied to many) ---

    def rows(self, rows: torch.Tensor, capacity: int) -> RaggedStateCache:
        """A cache of `rows` [n] alone, with their recurrent states (keys and values not copied)."""
        sub = type(self)(len(rows), capacity, self.kinds)
        at = rows.to(self.held.device)
        sub.held = self.held[at].clone()
        sub.expected = self.expected  # a lower bound for any of the rows (a shared prefill's)
        for key, slot in self.states.items():
            sub.states[key] = _States(
                conv=None if slot.conv is None else slot.conv[at].clone(),
                recurrent=None if slot.recurrent is None else slot.recurrent[at].clone(),
            )
        return sub

    def put_rows(self, rows: torch.Tensor, sub: RaggedKVCache, source: torch.Tensor | None = None) -> None:
        """Row `rows[i]` [n] takes row `source[i]` (default i) of `sub` (made by `rows`), a cache
        that just ran a forward: its state, and its checkpoints, so that the next `keep` (with n
        counts) applies to these rows and no other."""
        assert isinstance(sub, RaggedStateCache), "put_rows takes a cache made by rows()"
        source = torch.arange(len(rows)) if source is None else source
        at = rows.to(self.held.device)
        self.width, self.read_rows, self.recorded = sub.width, at, sub.recorded
        self.expected = None
        self.held[at] = sub.held[source.to(sub.held.device)]
        for key, part in sub.states.items():
            slot = self.states.setdefault(key, _States())
            slot.conv = _scatter_rows(slot.conv, at, part.conv, source, len(self.held))
            slot.recurrent = _scatter_rows(slot.recurrent, at, part.recurrent, source, len(self.held))
            slot.conv_read = None if part.conv_read is None else part.conv_read[source.to(part.conv_read.device)]
            slot.history = [state[source.to(state.device)] for state in part.history]


def _put_row(into: torch.Tensor | None, row: int, value: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """`into` [B, ...] with row `row` set to `value` [...] (zeros elsewhere where `into` is None)."""
    if value is None:
        return into
    base = value.new_zeros(batch, *value.shape) if into is None else into
    base[row] = value.to(base.dtype)
    return base


def _scatter_rows(
    into: torch.Tensor | None, rows: torch.Tensor, part: torch.Tensor | None, source: torch.Tensor, batch: int
) -> torch.Tensor | None:
    """`into` [B, ...] with row `rows[i]` replaced by `part[source[i]]` (zeros where `into` is None)."""
    if part is None:
        return into
    base = part.new_zeros(batch, *part.shape[1:]) if into is None else into.clone()
    return base.index_copy(0, rows.to(base.device), part[source.to(part.device)].to(base.dtype))
