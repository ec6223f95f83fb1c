"""Verification of one drafted block: pure tensor functions, no state.

Terms (Leviathan et al. 2023; Chen et al. 2023), for a block of `k` drafted tokens:

- *accepted*: the leading drafts the verifier keeps. Greedy: a draft is kept while it equals the
  target's argmax. Sampling: draft `x_j` is kept with probability `min(1, p_j(x_j) / q_j(x_j))`.
- *recovered*: at the first rejected slot `a`, a token drawn from the residual
  `norm(max(0, p_a - q_a))`; this is what makes the output distributed exactly as `p`.
- *bonus*: when all `k` drafts are kept, a token drawn from `p_k`, the target's distribution at
  the position after the block (the `k+1`-th scored position).

A round therefore emits `accepted + 1` tokens. A point-mass drafter (`q is None`) proposed each
draft with probability 1; the verifier must use that point mass, not some softmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from losscheck.core.sampling import SamplingParams, process_logits, sample
from losscheck.errors import LosscheckError


@dataclass(frozen=True)
class BlockOutcome:
    """What verification decided for one drafted block, per row."""

    accepted: torch.Tensor  # [B] long, drafts kept (0..k)
    tokens: torch.Tensor  # [B, k+1] long; tokens[b, :accepted[b]+1] are emitted, the rest is junk


def verify_greedy(p: torch.Tensor, drafts: torch.Tensor) -> BlockOutcome:
    """Greedy verification. `p [B, k+1, V]` target scores (logits or probs), `drafts [B, k]`."""
    best = p.argmax(-1)  # [B, k+1]
    k = drafts.shape[1]
    accepted = (drafts == best[:, :k]).long().cumprod(-1).sum(-1)  # [B]
    rows = torch.arange(drafts.shape[0], device=drafts.device)
    tokens = torch.cat([drafts, best[:, k:]], dim=1)  # [B, k+1]
    tokens[rows, accepted] = best[rows, accepted]  # recovered (= target argmax) or bonus
    return BlockOutcome(accepted=accepted, tokens=tokens)


def point_mass(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`q [B, k, V]` of a deterministic drafter: one-hot at each drafted token."""
    return torch.zeros(*drafts.shape, vocab_size, device=drafts.device).scatter_(-1, drafts[..., None], 1.0)


def normalized(q: torch.Tensor) -> torch.Tensor:
    """`q [..., V]` as float64 rows that sum to 1 (rows have positive mass by validation)."""
    q = q.double()
    return q / q.sum(-1, keepdim=True)


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """`min(1, p(x) / q(x))` for each draft; p_draft, q_draft [B, k] (q > 0 by validation)."""
    return (p_draft.double() / q_draft.double()).clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`norm(max(0, p - q))` over the last axis: p, q [..., V] → [..., V]. Where the residual has
    no mass (p == q up to round-off, where a rejection has probability 0), p itself."""
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)


def recovery_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Distribution of the token emitted at each slot if verification stops there.

    p: [B, k+1, V], q: [B, k, V] → [B, k+1, V]: `norm(max(0, p_j - q_j))` for the recovered token
    at slot j < k, and `p_k` for the bonus token.
    """
    q_padded = torch.cat([q, q.new_zeros(q.shape[0], 1, q.shape[-1])], dim=1)  # bonus slot: q = 0
    return residual_distribution(p, q_padded)


def verify_rejection(
    p: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator,
) -> BlockOutcome:
    """Speculative rejection sampling for a batch of blocks.

    p: [B, k+1, V] target distributions after logits processing; slot k is the bonus slot.
    drafts: [B, k] drafted ids.
    q: [B, k, V] the distributions the drafts were drawn from, or None for a point mass.
    generator: source of the `B*k` acceptance uniforms and the recovered/bonus draws.
    """
    batch, k = drafts.shape
    rows = torch.arange(batch, device=p.device)
    # In float64, with q renormalised: a drafter's q may sum to 1 ± 1e-3 (validation allows that
    # for fp16 drafters) and its sampler drew in proportion to it, so q / sum(q) is the law the
    # drafts came from; the raw q would make the acceptance ratio and the residual lossy by as much.
    # Only the drafted entries and the one slot each row stops at are widened to float64 (the
    # same values as widening everything first, at a fraction of the work on a large vocabulary).
    p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1).double()  # [B, k]
    if q is None:
        q_draft = torch.ones_like(p_draft)
    else:
        mass = q.sum(-1, dtype=torch.float64)  # [B, k]
        q_draft = q.gather(-1, drafts[..., None]).squeeze(-1).double() / mass  # [B, k]
    u = torch.rand(batch, k, generator=generator, dtype=torch.float64, device=p.device)
    keep = u < acceptance_probability(p_draft, q_draft)  # [B, k]
    accepted = keep.long().cumprod(-1).sum(-1)  # [B]

    p_stop = p[rows, accepted].double()  # [B, V]
    q_stop = torch.zeros_like(p_stop)  # [B, V]; stays 0 for a row that stops at the bonus slot
    if k:
        slot = accepted.clamp(max=k - 1)  # [B]
        if q is None:
            q_stop.scatter_(-1, drafts[rows, slot][:, None], 1.0)
        else:
            q_stop = q[rows, slot].double() / mass[rows, slot][:, None]
        q_stop = torch.where((accepted < k)[:, None], q_stop, 0.0)
    tokens = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)  # [B, k+1]
    tokens[rows, accepted] = sample(residual_distribution(p_stop, q_stop), generator)
    return BlockOutcome(accepted=accepted, tokens=tokens)


# The verifier the engine is given: (raw target logits [B, k+1, V], drafts [B, k], q [B, k, V] or
# None, the request's sampling parameters, generator) -> BlockOutcome.
Verifier = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", SamplingParams, torch.Generator], BlockOutcome]


def checked_outcome(outcome: object, verifier: Verifier, batch: int, k: int) -> BlockOutcome:
    """`outcome` if it is a well-formed `BlockOutcome` for `batch` rows and `k` drafts, else a
    `LosscheckError` naming the verifier and what it returned."""
    name = getattr(verifier, "__qualname__", None) or type(verifier).__qualname__  # never repr: it may hold tensors
    if not isinstance(outcome, BlockOutcome):
        raise LosscheckError(f"verifier {name} returned {type(outcome).__name__}, not a losscheck.BlockOutcome")
    shapes = (tuple(outcome.accepted.shape), tuple(outcome.tokens.shape))
    if shapes != ((batch,), (batch, k + 1)):
        raise LosscheckError(
            f"verifier {name} returned accepted {shapes[0]} and tokens {shapes[1]}; expected ({batch},) and "
            f"({batch}, {k + 1}) for {batch} rows of {k} drafts"
        )
    if batch and (int(outcome.accepted.min()) < 0 or int(outcome.accepted.max()) > k):
        raise LosscheckError(f"verifier {name} accepted counts outside [0, {k}]")
    return outcome


def capped(
    outcome: BlockOutcome,
    counts: torch.Tensor,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
) -> BlockOutcome:
    """`outcome` of a block whose row b proposed only its first `counts [B]` drafts (the rest
    padding): at most `counts` kept, and a row that kept all of its drafts emits at slot `counts`
    the target's own token there (argmax, or a draw from p), the bonus token of its shorter block.

    Exact for any exact verifier: the drafts before `counts` were decided as in a block of
    `counts`; the padding's verdicts are dropped, and the bonus is drawn afresh from p (B draws
    every sampled round, whatever the counts, so the random stream does not depend on them).
    logits: [B, k+1, V] the target's scores as the verifier was given them.
    """
    rows = torch.arange(counts.shape[0], device=counts.device)
    at = logits[rows, counts]  # [B, V] the target's scores after each row's last proposed draft
    bonus = at.argmax(-1) if params.greedy else sample(process_logits(at, params), generator)  # [B]
    full = outcome.accepted >= counts  # [B] kept every proposed draft
    tokens = outcome.tokens.clone()
    tokens[rows, counts] = torch.where(full, bonus, tokens[rows, counts])
    return BlockOutcome(accepted=torch.minimum(outcome.accepted, counts), tokens=tokens)


def verify_block(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator,
) -> BlockOutcome:
    """The correct `Verifier`: greedy verification at temperature 0, otherwise rejection sampling
    against the target's logits processed exactly as the drafter's `q` was."""
    if params.greedy:
        return verify_greedy(logits, drafts)
    return verify_rejection(process_logits(logits, params), drafts, q, generator)
