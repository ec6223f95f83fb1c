"""The public contract: what a drafter author or engine author writes against.

`Proposal` is what a drafter returns, `DraftContext` what it is given, `Drafter` and `Target` the
two protocols the engine drives. Everything else in losscheck is internal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from losscheck.core.history import History, adjust_logits
from losscheck.core.sampling import SamplingParams, process_logits
from losscheck.errors import DrafterOutputError, LosscheckError

PROB_SUM_TOLERANCE = 1e-3  # |sum(q) - 1| allowed per row; fp16 drafters need this much


@dataclass(frozen=True)
class Proposal:
    """A drafted block.

    tokens: [B, k] long, the drafted ids.
    probs: [B, k, V] float, `probs[b, j]` is the distribution `q_j` that `tokens[b, j]` was
        actually drawn from (conditioned on the drafts before it, after the request's logits
        processing, restricted and renormalised to the candidates when the drafter truncates);
        None when the drafter chose deterministically (argmax, path search), i.e. a point mass.
        With `vocab_map`, `probs` is [B, k, V_d] over the drafter's own vocabulary.
    vocab_map: [V_d] long or None, for a drafter whose vocabulary is a subset of the target's
        (EAGLE-3's `d2t`): `vocab_map[i]` is the target id of draft id i, distinct and in
        [0, V). `validate_proposal` spreads `probs` onto the target's vocabulary through it, zero
        at every target id the drafter cannot propose. `tokens` are target ids either way.
    counts: [B] long or None, for a drafter that proposes fewer than k tokens for some rows (an
        n-gram drafter with no match proposes none): row b's first `counts[b]` drafts are
        proposed, the rest of its `tokens` (and `probs`) are padding that is never kept, and a
        row that keeps all its drafts gets the target's token after them. None: all k, every row.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    vocab_map: torch.Tensor | None = None
    counts: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftContext:
    """Everything a drafter may condition on for one round.

    tokens: [B, T] long, committed ids (prompt + emitted), right-padded; row b is valid for
        positions < lengths[b]. The last valid token is the one the target has not scored yet.
    lengths: [B] long, committed length of each row.
    hidden: [B, T, n·H] the target's hidden states of the n layers the drafter asks for
        (`uses_hidden`), concatenated in the order asked; `hidden[b, t]` after reading token t (it
        predicted token t+1); valid for t < lengths[b] - 1. `uses_hidden = True` is the last
        layer alone ([B, T, H]); None when the drafter reads no target features.
    k: block length to propose.
    width: transition / candidate truncation width for drafters that have one (None = full).
    params: the request's sampling parameters; apply them with `process` (or, when they read no
        history, `losscheck.core.sampling.process_logits`) so `q` is processed exactly as the
        target's `p`.
    generator: the only randomness a drafter may use (seeded from the run seed).
    prompt_lengths: [B] long, how many of each row's committed tokens are prompt (penalties
        count the output apart); None: all of them are output, as far as a drafter can tell.
    eos_id: the target's EOS id (masked under `params.min_tokens`).
    drafted: [B, j] long, this round's drafts before the slot being drafted (None: slot 0); a
        drafter that drafts slot by slot passes `dataclasses.replace(ctx, drafted=...)` on.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    hidden: torch.Tensor | None
    k: int
    width: int | None
    params: SamplingParams
    generator: torch.Generator
    prompt_lengths: torch.Tensor | None = None
    eos_id: int | None = None
    drafted: torch.Tensor | None = None

    def process(self, logits: torch.Tensor, drafted: torch.Tensor | None = None) -> torch.Tensor:
        """The request's full processing of the drafter's `logits [B, V]` for the slot after
        `drafted [B, j]` (this round's drafts so far, default `self.drafted`): the history steps
        reading the committed tokens and `drafted` (`losscheck.core.history`), then temperature,
        min-p, top-k and top-p → q [B, V], as the target's p at that slot is processed."""
        if self.params.reads_history:
            drafted = drafted if drafted is not None else self.drafted
            drafted = drafted if drafted is not None else self.tokens[:, :0]
            prompt = self.prompt_lengths if self.prompt_lengths is not None else torch.zeros_like(self.lengths)
            seen = History(self.tokens, self.lengths, prompt, self.eos_id).extended(drafted)
            logits = adjust_logits(logits[:, None], self.params, seen, drafted[:, :0])[:, 0]
        return process_logits(logits, self.params)


@runtime_checkable
class Drafter(Protocol):
    """A speculative drafter.

    Attributes declare which matrix knobs apply: `block_lengths` the k it supports, `widths` its
    transition widths (empty when it has none), `uses_hidden` which target features it reads:
    False none, True the last layer's, or a tuple of layer ids (`hidden_layers` says what an id
    means), e.g. EAGLE-3's low / middle / high layers.

    Optional: a drafter whose checkpoint configures its own acceptance rule carries it as
    `verifier` (a `losscheck.core.verify.Verifier`, which the engine then runs instead of exact
    verification) and `acceptance_rule` (one line naming the setting, quoted by failing cells).
    """

    # Read-only to the engine, so a drafter may declare narrower types (`uses_hidden = False`,
    # `block_lengths = (1, 2, 4)`) or compute them as properties.
    @property
    def name(self) -> str: ...
    @property
    def block_lengths(self) -> tuple[int, ...]: ...
    @property
    def widths(self) -> tuple[int | None, ...]: ...
    @property
    def uses_hidden(self) -> bool | tuple[int, ...]: ...

    def reset(self, batch_size: int, capacity: int) -> None:
        """Start a new batch of `batch_size` rows of at most `capacity` tokens; drop all state."""

    def propose(self, ctx: DraftContext) -> Proposal:
        """Draft `ctx.k` tokens for every row."""

    def commit(self, accepted: torch.Tensor) -> None:
        """`accepted [B]`: how many of the last proposal's drafts each row kept (0..k).

        The row's committed length grew by `accepted + 1`; roll back any state built on the
        rejected drafts.
        """


@runtime_checkable
class ForgetsRows(Protocol):
    """A drafter continuous batching can serve: new requests take the finished rows of a running
    batch, so a drafter with per-row state drops those rows' state (a drafter with none does
    nothing). Continuous batching refuses a drafter without it."""

    def forget_rows(self, rows: torch.Tensor) -> None:
        """Drop the state of `rows` [n] (long), as `reset` does for every row."""


@runtime_checkable
class AdmitsRows(Protocol):
    """Optional, beside `ForgetsRows`: a drafter that reads a new request's committed tokens when
    the request is admitted rather than at its next `propose`."""

    def admit_rows(self, tokens: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> None:
        """`rows` [n] now hold new requests: row b's committed tokens are `tokens[b, :lengths[b]]`
        (`tokens` [B, capacity], `lengths` [B]); forget their old state and read the new."""


@runtime_checkable
class Target(Protocol):
    """The model being accelerated, with a per-row (ragged) KV cache.

    `forward` reads `tokens [B, m]` into cache slots `start[b] .. start[b]+m-1` of each row and
    returns `(logits [B, m, V], hidden [B, m, H])`; query i of row b attends to slots
    `<= start[b] + i`. The caller owns the lengths, so rolling back is passing a smaller `start`.
    Every tensor the engine hands it or builds for it lives on `device`.

    `forward(tokens, start, layers=ids)` — asked only for drafters that name layer ids — returns
    the states of those layers concatenated, `hidden [B, m, len(ids)·H]`; layer id i is the
    residual stream entering decoder layer i (0: the embeddings), `num_layers` the final
    (normed) state, as Hugging Face's `output_hidden_states` numbers them.
    """

    name: str
    vocab_size: int
    hidden_size: int
    eos_id: int | None
    max_positions: int
    identity: dict[str, str]
    device: torch.device

    def reset(self, batch_size: int, capacity: int) -> None: ...

    def forward(self, tokens: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class StatefulTarget(Target, Protocol):
    """A `Target` with recurrent layers (a hybrid model: attention beside gated delta nets, Mamba-2
    or short convolutions), whose state a smaller `start` cannot roll back. After every forward
    the engine calls `keep(counts [n])`: each row the forward read keeps the state after its
    first `counts` tokens (0: the state before the forward). A forward from slot 0 starts a row
    from zeros. `stateful` False: `keep` is never called (an attention-only model). Optional:
    `expect(counts [n])` before a forward whose rows will keep at least that many tokens
    (`expect_rows`), so that the states before them need not be recorded."""

    stateful: bool

    def keep(self, counts: torch.Tensor) -> None: ...


def expect_rows(target: Target, counts: torch.Tensor) -> None:
    """Before a forward whose rows will keep at least `counts` [n] tokens each (a prefill: each
    row's own length): a `StatefulTarget` with an `expect` method records only the states a `keep`
    may then ask for. Nothing for any other target; a hint, never needed for exactness."""
    expect = getattr(target, "expect", None)
    if isinstance(target, StatefulTarget) and target.stateful and expect is not None:
        expect(counts)


def keep_rows(target: Target, counts: torch.Tensor) -> None:
    """After a forward whose rows read past what they keep (padding, rejected drafts): each row
    keeps its first `counts` [n] tokens — `target.keep` for a `StatefulTarget`, nothing for a KV
    cache, whose next `start` rolls it back."""
    if isinstance(target, StatefulTarget) and target.stateful:
        target.keep(counts)


def hidden_layers(drafter: Drafter, target: Target) -> tuple[int, ...] | None:
    """The target layer ids `drafter` reads (`uses_hidden`), checked against `target`; None when it
    reads none. `True` is the last layer, which every `Target` returns without being asked."""
    asked = drafter.uses_hidden
    if asked is False:
        return None
    depth = getattr(target, "num_layers", None)
    if asked is True:
        return None if depth is None else (int(depth),)
    layers = tuple(int(i) for i in asked)
    if depth is None:
        raise LosscheckError(
            f"drafter {drafter.name!r} reads target layers {list(layers)}, but target "
            f"{target.name!r} declares no num_layers and cannot return chosen layers; use "
            "losscheck.HFTarget or implement forward(tokens, start, layers=...)"
        )
    if not layers or len(set(layers)) != len(layers) or min(layers) < 0 or max(layers) > depth:
        raise LosscheckError(
            f"drafter {drafter.name!r} asks for target layers {list(layers)}; target {target.name!r} "
            f"has layer ids 0..{depth} (the embeddings .. the final state) and each id may appear once"
        )
    return layers


def validate_proposal(
    proposal: object, drafter: str, batch: int, k: int, vocab: int, device: torch.device | None = None
) -> Proposal:
    """Check a drafter's output (on the target's `device`, when given) and return it; raise
    `DrafterOutputError` naming the problem."""

    def fail(problem: str) -> DrafterOutputError:
        return DrafterOutputError(
            f"drafter {drafter!r} returned a malformed Proposal: {problem}. "
            f"Expected tokens LongTensor [{batch}, {k}] with ids in [0, {vocab}) and probs None "
            f"or a float tensor [{batch}, {k}, {vocab}] of distributions (>= 0, rows sum to 1) "
            "giving each drafted token positive probability."
        )

    if not isinstance(proposal, Proposal):
        raise fail(f"got {type(proposal).__name__}, not losscheck.Proposal")
    tokens, probs = proposal.tokens, proposal.probs
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
        raise fail(f"tokens must be an integer tensor, got {getattr(tokens, 'dtype', type(tokens))}")
    if tuple(tokens.shape) != (batch, k):
        raise fail(f"tokens has shape {tuple(tokens.shape)}")
    for name, tensor in (("tokens", tokens), ("probs", probs), ("counts", proposal.counts)):
        if device is not None and isinstance(tensor, torch.Tensor) and tensor.device != device:
            raise fail(f"{name} is on {tensor.device}, the target's device is {device}")
    tokens = tokens.long()
    counts = _counts(proposal.counts, batch, k, fail)
    if probs is None:
        if tokens.numel() and not _in_vocab(tokens, vocab):
            raise fail(_ids_problem(tokens))
        return Proposal(tokens, None, counts=counts)
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        raise fail("probs must be a floating-point tensor or None")
    if proposal.vocab_map is not None:
        probs = _spread(probs, proposal.vocab_map, batch, k, vocab, fail)
    if tuple(probs.shape) != (batch, k, vocab):
        raise fail(f"probs has shape {tuple(probs.shape)}")
    probs = probs.float()
    if counts is not None and tokens.numel():  # the padding's q: a point mass, whatever was there
        padding = torch.arange(k, device=tokens.device)[None, :] >= counts[:, None]  # [B, k]
        if _in_vocab(tokens, vocab):
            mass = torch.zeros_like(probs).scatter_(-1, tokens[..., None], 1.0)
            probs = torch.where(padding[..., None], mass, probs)
    if tokens.numel() and not _plausible(tokens, probs, vocab):
        raise fail(_problem(tokens, probs, vocab))
    return Proposal(tokens, probs, counts=counts)


def _counts(counts: object, batch: int, k: int, fail: Callable[[str], DrafterOutputError]) -> torch.Tensor | None:
    """A proposal's `counts` as a long tensor [batch] in [0, k], or None."""
    if counts is None:
        return None
    if not isinstance(counts, torch.Tensor) or counts.dtype not in (torch.int64, torch.int32):
        raise fail(f"counts must be an integer tensor [{batch}] or None, got {getattr(counts, 'dtype', type(counts))}")
    if tuple(counts.shape) != (batch,):
        raise fail(f"counts has shape {tuple(counts.shape)}, expected ({batch},)")
    if batch and (int(counts.min()) < 0 or int(counts.max()) > k):
        raise fail(f"counts span [{int(counts.min())}, {int(counts.max())}], outside [0, {k}]")
    return counts.long()


def _in_vocab(tokens: torch.Tensor, vocab: int) -> bool:
    """tokens [B, k] (non-empty) all in [0, vocab)."""
    low, high = torch.aminmax(tokens)
    return 0 <= low.item() and high.item() < vocab


def _plausible(tokens: torch.Tensor, probs: torch.Tensor, vocab: int) -> bool:
    """Every check of a drafted block in as few tensor ops as possible (this runs every round;
    on a small model the ops' dispatch is most of the engine's own time): tokens [B, k]
    (non-empty) in the vocabulary, probs [B, k, V] non-negative with rows summing to 1 within
    `PROB_SUM_TOLERANCE`, each drafted token positive under its q. A NaN entry fails every
    comparison its row's sum enters, an inf one the sum's bounds, so neither passes."""
    if not _in_vocab(tokens, vocab):
        return False
    low, high = torch.aminmax(probs.sum(-1))  # row sums
    return (
        probs.amin().item() >= 0
        and 1 - PROB_SUM_TOLERANCE <= low.item()
        and high.item() <= 1 + PROB_SUM_TOLERANCE
        and probs.gather(-1, tokens[..., None]).amin().item() > 0
    )


def _ids_problem(tokens: torch.Tensor) -> str:
    return f"token ids span [{int(tokens.min())}, {int(tokens.max())}], outside the vocabulary"


def _problem(tokens: torch.Tensor, probs: torch.Tensor, vocab: int) -> str:
    """What is wrong with a block `_plausible` refused, checked one property at a time."""
    if not _in_vocab(tokens, vocab):
        return _ids_problem(tokens)
    if not torch.isfinite(probs).all():
        return "probs contains NaN or inf"
    if (probs < 0).any():
        return f"probs has negative entries (min {float(probs.min()):.3g})"
    worst = float((probs.sum(-1) - 1).abs().max())
    if worst > PROB_SUM_TOLERANCE:
        return f"probs rows do not sum to 1 (worst |sum - 1| = {worst:.3g})"
    return "a drafted token has zero probability under its own q"


def target_probs(proposal: Proposal, vocab: int) -> torch.Tensor | None:
    """`proposal.probs` on the target's vocabulary, [B, k, V] (None for a point mass): spread
    through `vocab_map` when the drafter drafts over a sub-vocabulary. For wrappers that mix
    another distribution into a drafter's `q`."""
    if proposal.probs is None or proposal.vocab_map is None:
        return proposal.probs
    batch, k = proposal.tokens.shape

    def fail(problem: str) -> DrafterOutputError:
        return DrafterOutputError(f"a Proposal's vocab_map cannot be applied: {problem}")

    return _spread(proposal.probs, proposal.vocab_map, batch, k, vocab, fail)


def _spread(
    probs: torch.Tensor, vocab_map: object, batch: int, k: int, vocab: int, fail: Callable[[str], DrafterOutputError]
) -> torch.Tensor:
    """probs [B, k, V_d] over a draft vocabulary → [B, k, V] over the target's, zero where the
    drafter has no token; `vocab_map [V_d]` must be distinct target ids (else two draft ids would
    share one target id and `q` there would be ambiguous)."""
    if (
        not isinstance(vocab_map, torch.Tensor)
        or vocab_map.dtype not in (torch.int64, torch.int32)
        or vocab_map.dim() != 1
    ):
        raise fail(
            f"vocab_map must be a 1-D integer tensor of target ids, got {getattr(vocab_map, 'shape', type(vocab_map))}"
        )
    size = vocab_map.shape[0]
    if size == 0 or size > vocab or int(vocab_map.min()) < 0 or int(vocab_map.max()) >= vocab:
        raise fail(f"vocab_map of {size} ids must map into the target's vocabulary [0, {vocab})")
    if int(vocab_map.unique().numel()) != size:
        raise fail("vocab_map maps two draft ids to the same target id")
    if tuple(probs.shape) != (batch, k, size):
        raise fail(
            f"probs has shape {tuple(probs.shape)}; with vocab_map it is [{batch}, {k}, {size}] (the draft vocabulary)"
        )
    spread = probs.new_zeros(batch, k, vocab)
    return spread.index_copy_(-1, vocab_map.to(probs.device).long(), probs)
