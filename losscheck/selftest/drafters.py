"""Planted drafter bugs: a family-A drafter whose draft step samples from one distribution and
reports another as its `q`.

The verifier is only lossless if `Proposal.probs` is the distribution each draft was *actually*
drawn from. Each step function below returns `(token [B], reported q [B, V] | None)` from the
drafter's raw logits (via the family-A `draw` hook); the reported q differs from the
sampling law in one realistic way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from losscheck.core.contract import DraftContext, Drafter
from losscheck.core.sampling import process_logits, sample
from losscheck.drafters.autoregressive import AutoregressiveDrafter
from losscheck.errors import LosscheckError

# (raw drafter logits [B, V], context) -> (tokens [B], the q [B, V] reported for them)
DraftStep = Callable[[torch.Tensor, DraftContext], tuple[torch.Tensor, torch.Tensor]]

TRUNCATION_WIDTH = 4  # top-w candidates the truncating drafter samples from


def untempered_report(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples from q at the request's temperature, reports q at temperature 1."""
    q = process_logits(logits, ctx.params)
    if ctx.params.greedy:
        return q.argmax(-1), q
    reported = process_logits(logits, replace(ctx.params, temperature=1.0))  # BUG: temperature left out
    return sample(q, ctx.generator), reported


def argmax_with_softmax_report(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts the argmax (a deterministic path), reports the softmax instead of the point mass."""
    q = process_logits(logits, ctx.params)
    return q.argmax(-1), q  # BUG: a point mass (probs None) is what was drawn from


def top_w_with_full_report(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples among its top-w candidates (renormalised), reports the untruncated softmax."""
    q = process_logits(logits, ctx.params)
    if ctx.params.greedy:
        return q.argmax(-1), q
    kth = q.topk(min(TRUNCATION_WIDTH, q.shape[-1]), dim=-1).values[..., -1:]
    candidates = torch.where(q >= kth, q, 0.0)
    return sample(candidates / candidates.sum(-1, keepdim=True), ctx.generator), q  # BUG: full q


class MisreportingDrafter(AutoregressiveDrafter):
    """A family-A drafter (sharing the wrapped drafter's model) whose per-slot `draw` is `step`;
    drafting, state and rollback are inherited unchanged."""

    def __init__(self, inner: AutoregressiveDrafter, step: DraftStep, tag: str) -> None:
        super().__init__(inner.lm.model, name=f"{inner.name}+{tag}")
        self.block_lengths = inner.block_lengths
        self.step = step

    def draw(self, logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        return self.step(logits, ctx)


def misreporting(step: DraftStep, tag: str, mutant: str) -> Callable[[Drafter], MisreportingDrafter]:
    """The drafter wrapper of mutant `mutant`: a family-A drafter drafting with `step`."""

    def wrap(drafter: Drafter) -> MisreportingDrafter:
        if not isinstance(drafter, AutoregressiveDrafter):
            raise LosscheckError(
                f"mutant {mutant!r} plants its bug in a family-A (autoregressive) drafter; drafter "
                f"{drafter.name!r} is a {type(drafter).__name__}. Run it on the bundled drafters' A / self cells."
            )
        return MisreportingDrafter(drafter, step, tag)

    return wrap
