"""The public contract: what a drafter author or engine author writes against.

`Proposal` is what a drafter returns, `DraftContext` what it is given, `Drafter` and `Target` the
two protocols the engine drives. Everything else in losscheck is internal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from losscheck.errors import DrafterOutputError
from losscheck.sampling import SamplingParams

PROB_SUM_TOLERANCE = 1e-3  # |sum(q) - 1| allowed per row; fp16 drafters need this much


@dataclass(frozen=True)
class Proposal:
    """A drafted block.

    tokens: [B, k] long, the drafted ids.
    probs: [B, k, V] float, `probs[b, j]` is the distribution `q_j` that `tokens[b, j]` was
        actually drawn from (conditioned on the drafts before it, after the request's logits
        processing, restricted and renormalised to the candidates when the drafter truncates);
        None when the drafter chose deterministically (argmax, path search), i.e. a point mass.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftContext:
    """Everything a drafter may condition on for one round.

    tokens: [B, T] long, committed ids (prompt + emitted), right-padded; row b is valid for
        positions < lengths[b]. The last valid token is the one the target has not scored yet.
    lengths: [B] long, committed length of each row.
    hidden: [B, T, H] the target's last-layer hidden states, `hidden[b, t]` after reading token t
        (it predicted token t+1); valid for t < lengths[b] - 1. None unless the drafter asks for
        it with `uses_hidden = True`.
    k: block length to propose.
    width: transition / candidate truncation width for drafters that have one (None = full).
    params: the request's sampling parameters; apply them with `losscheck.sampling.process_logits`
        so `q` is processed exactly as the target's `p`.
    generator: the only randomness a drafter may use (seeded from the run seed).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    hidden: torch.Tensor | None
    k: int
    width: int | None
    params: SamplingParams
    generator: torch.Generator


@runtime_checkable
class Drafter(Protocol):
    """A speculative drafter.

    Attributes declare which matrix knobs apply: `block_lengths` the k it supports, `widths` its
    transition widths (empty when it has none), `uses_hidden` whether it reads target features.
    """

    name: str
    block_lengths: tuple[int, ...]
    widths: tuple[int | None, ...]
    uses_hidden: bool

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
class Target(Protocol):
    """The model being accelerated, with a per-row (ragged) KV cache.

    `forward` reads `tokens [B, m]` into cache slots `start[b] .. start[b]+m-1` of each row and
    returns `(logits [B, m, V], hidden [B, m, H])`; query i of row b attends to slots
    `<= start[b] + i`. The caller owns the lengths, so rolling back is passing a smaller `start`.
    Every tensor the engine hands it or builds for it lives on `device`.
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
    for name, tensor in (("tokens", tokens), ("probs", probs)):
        if device is not None and isinstance(tensor, torch.Tensor) and tensor.device != device:
            raise fail(f"{name} is on {tensor.device}, the target's device is {device}")
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab):
        raise fail(f"token ids span [{int(tokens.min())}, {int(tokens.max())}], outside the vocabulary")
    tokens = tokens.long()
    if probs is None:
        return Proposal(tokens, None)
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        raise fail("probs must be a floating-point tensor or None")
    if tuple(probs.shape) != (batch, k, vocab):
        raise fail(f"probs has shape {tuple(probs.shape)}")
    probs = probs.float()
    if not torch.isfinite(probs).all():
        raise fail("probs contains NaN or inf")
    if (probs < 0).any():
        raise fail(f"probs has negative entries (min {float(probs.min()):.3g})")
    worst = float((probs.sum(-1) - 1).abs().max()) if probs.numel() else 0.0
    if worst > PROB_SUM_TOLERANCE:
        raise fail(f"probs rows do not sum to 1 (worst |sum - 1| = {worst:.3g})")
    if (probs.gather(-1, tokens[..., None]) <= 0).any():
        raise fail("a drafted token has zero probability under its own q")
    return Proposal(tokens, probs)
