"""Stress drafters: honest drafters derived from any drafter, which reject more often in a
direction that exposes verifier bugs.

Why: a verifier bug distorts the output only in rounds that reject (the residual, the acceptance
ratio, the uniforms that decide). With a drafter that accepts ~97% per slot those rounds are rare,
and a pooled PIT test needs ~10^7 tokens to see a wrong residual. Random noise added to the drafts
does not help (it rejects, but the residual it leaves is close to p); a drafter whose q leans away
from p in one direction does: the residual `norm(max(0, p - q))` then carries a large, structured
part of p, and a verifier that gets it wrong moves the output by a large total variation.

Every wrapper reports exactly the law it drew each draft from, so speculative sampling stays exact
and the gate must pass it; only acceptance falls.

- `Tempered(inner, factor)`: the inner drafter drafts at the request's temperature times `factor`
  (its q, before truncation, is q^(1/factor) renormalised); top-k / top-p apply at that
  temperature. A drafter that ignores the temperature it is given stays itself (honest, no stress).
- `ArgmaxDrafts(inner)`: the inner drafter's greedy drafts (temperature 0), point masses
  (`probs = None`) as the contract has a deterministic drafter report them.
- `Mixture(inner, eps)`: each slot's draft is replaced, with probability `eps`, by a token drawn
  uniformly from the vocabulary; q = (1 - eps)·q_inner + eps/V, with q_inner the inner's reported q
  (a point mass where it reported none). This stresses drafters that are point masses already.

Latent randomness. After a replacement the inner drafter conditions its later slots on its own
draft, not on the token put in its place, and its q then depends on randomness the output does not
show. That is still exact: speculative sampling needs, for each slot, that the draft was drawn from
the reported q given everything that decided it (the drafter's state, its own earlier draws). Given
that state, the accept-or-residual step emits p's token; p does not depend on the state, so
averaging over the state leaves p. The inner drafter is told the true accepted counts, so its
later state may hold its own draft where another token was committed: a worse drafter, never a
dishonest one.
"""

from __future__ import annotations

import dataclasses

import torch

from losscheck.core.contract import DraftContext, Drafter, Proposal, target_probs
from losscheck.core.verify import point_mass
from losscheck.errors import OptionError


class _Wrapper:
    """Delegates the protocol to `inner`; subclasses change `propose`."""

    label = ""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.__wrapped__ = inner  # the per-row state is the inner drafter's (`inspect.unwrap`)
        self.name = f"{inner.name}+{self.label}"
        self.block_lengths = tuple(inner.block_lengths)
        self.widths = tuple(inner.widths)
        self.uses_hidden = inner.uses_hidden

    def reset(self, batch_size: int, capacity: int) -> None:
        self.inner.reset(batch_size, capacity)

    def commit(self, accepted: torch.Tensor) -> None:
        self.inner.commit(accepted)


class Tempered(_Wrapper):
    def __init__(self, inner: Drafter, factor: float) -> None:
        if not factor > 0:
            raise OptionError(f"a tempered stress drafter needs a factor > 0, got {factor!r}")
        self.factor = factor
        self.label = f"tempered{factor:g}"
        super().__init__(inner)

    def propose(self, ctx: DraftContext) -> Proposal:
        params = dataclasses.replace(ctx.params, temperature=ctx.params.temperature * self.factor)
        return self.inner.propose(dataclasses.replace(ctx, params=params))


class ArgmaxDrafts(_Wrapper):
    label = "argmax"

    def propose(self, ctx: DraftContext) -> Proposal:
        # As reported: the contract's point mass (None) for a drafter that drafts deterministically
        # at temperature 0; one that still samples reports the q it sampled from.
        params = dataclasses.replace(ctx.params, temperature=0.0)
        return self.inner.propose(dataclasses.replace(ctx, params=params))


class Mixture(_Wrapper):
    def __init__(self, inner: Drafter, eps: float, vocab_size: int) -> None:
        if not 0 < eps < 1:
            raise OptionError(f"a mixture stress drafter needs 0 < eps < 1, got {eps!r}")
        self.eps, self.vocab_size = eps, vocab_size
        self.label = f"mix{eps:g}"
        super().__init__(inner)

    def propose(self, ctx: DraftContext) -> Proposal:
        proposal = self.inner.propose(ctx)
        tokens = proposal.tokens  # [B, k]
        inner_q = target_probs(proposal, self.vocab_size)  # [B, k, V], spread from a draft sub-vocabulary
        inner_q = point_mass(tokens, self.vocab_size) if inner_q is None else inner_q
        replace = torch.rand(tokens.shape, generator=ctx.generator, device=tokens.device) < self.eps  # [B, k]
        uniform = torch.randint(self.vocab_size, tokens.shape, generator=ctx.generator, device=tokens.device)
        q = (1 - self.eps) * inner_q.float() + self.eps / self.vocab_size  # [B, k, V]
        return Proposal(torch.where(replace, uniform, tokens), q, counts=proposal.counts)


def stressed(inner: Drafter, variant: str, vocab_size: int) -> Drafter:
    """The stress drafter `variant` ("tempered<factor>", "argmax" or "mix<eps>", as the matrix's
    `STRESS_VARIANTS` name them) around `inner`."""
    if variant == "argmax":
        return ArgmaxDrafts(inner)
    if variant.startswith("tempered"):
        return Tempered(inner, float(variant.removeprefix("tempered")))
    if variant.startswith("mix"):
        return Mixture(inner, float(variant.removeprefix("mix")), vocab_size)
    raise OptionError(f"unknown stress variant {variant!r}; use tempered<factor>, argmax or mix<eps>")
