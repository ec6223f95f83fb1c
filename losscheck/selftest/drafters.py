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

from losscheck.core.contract import DraftContext, Drafter, Proposal
from losscheck.core.sampling import process_logits, sample
from losscheck.drafters.autoregressive import AutoregressiveDrafter
from losscheck.errors import LosscheckError

# (raw drafter logits [B, V], context) -> (tokens [B], the q [B, V] reported for them)
DraftStep = Callable[[torch.Tensor, DraftContext], tuple[torch.Tensor, torch.Tensor]]

TRUNCATION_WIDTH = 4  # top-w candidates the truncating drafter samples from
# The id the misreporting drafter under-reports: a frequent token of the bundled target's T = 1
# outputs (about 3.6% of them), so that the bug acts at most prefixes.
MISREPORTED_ID = 30
MISREPORT_FACTOR = 3.0  # the id is drawn this many times as often as reported


def untempered_report(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples from q at the request's temperature, reports q at temperature 1."""
    q = ctx.process(logits)
    if ctx.params.greedy:
        return q.argmax(-1), q
    reported = replace(ctx, params=replace(ctx.params, temperature=1.0)).process(logits)  # BUG: temperature left out
    return sample(q, ctx.generator), reported


def argmax_with_softmax_report(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts the argmax (a deterministic path), reports the softmax instead of the point mass."""
    q = ctx.process(logits)
    return q.argmax(-1), q  # BUG: a point mass (probs None) is what was drawn from


def top_w_with_full_report(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples among its top-w candidates (renormalised), reports the untruncated softmax."""
    q = ctx.process(logits)
    if ctx.params.greedy:
        return q.argmax(-1), q
    kth = q.topk(min(TRUNCATION_WIDTH, q.shape[-1]), dim=-1).values[..., -1:]
    candidates = torch.where(q >= kth, q, 0.0)
    return sample(candidates / candidates.sum(-1, keepdim=True), ctx.generator), q  # BUG: full q


def honest(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples from q and reports it (family A's own draw step)."""
    q = ctx.process(logits)
    return (q.argmax(-1) if ctx.params.greedy else sample(q, ctx.generator)), q


def one_id_underreported(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples from q, reports `MISREPORTED_ID` at a third of its probability (renormalised): a
    drafter whose reported probabilities of one token are off, as a stale or mis-indexed
    vocabulary mapping makes them."""
    q = ctx.process(logits)
    if ctx.params.greedy:
        return q.argmax(-1), q
    reported = q.clone()
    reported[:, MISREPORTED_ID] /= MISREPORT_FACTOR  # BUG: not the probability it was drawn with
    return sample(q, ctx.generator), reported / reported.sum(-1, keepdim=True)


def one_id_underreported_q(q: torch.Tensor, factor: float = MISREPORT_FACTOR) -> torch.Tensor:
    """The q [..., V] `one_id_underreported` reports for a sampling law q (`factor`: the mutant's
    misreport, `MISREPORT_FACTOR` by default)."""
    reported = q.clone()
    reported[..., MISREPORTED_ID] /= factor
    return reported / reported.sum(-1, keepdim=True)


def one_id_underreported_by(factor: float) -> DraftStep:
    """`one_id_underreported` with the id reported at 1 / `factor` of its probability: the same
    bug at a smaller magnitude (a factor between 1, no bug, and `MISREPORT_FACTOR`)."""

    def draw(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        q = ctx.process(logits)
        if ctx.params.greedy:
            return q.argmax(-1), q
        return sample(q, ctx.generator), one_id_underreported_q(q, factor)  # BUG: not the q drawn from

    return draw


def history_left_out_of_report(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples from q processed with the request's history (penalties, bias, bans, min tokens),
    reports q processed without it: transformers #47932's draft q taken from logits other than
    those it samples from."""
    q = ctx.process(logits)
    if ctx.params.greedy:
        return q.argmax(-1), q
    return sample(q, ctx.generator), process_logits(logits, ctx.params)  # BUG: not the q drawn from


def history_ignored_honestly(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples from q processed *without* the request's history and reports that q: a worse
    drafter, not a lossy one (the verifier corrects any q it is told truthfully)."""
    q = process_logits(logits, ctx.params)
    return (q.argmax(-1) if ctx.params.greedy else sample(q, ctx.generator)), q


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


class StaleQDrafter(MisreportingDrafter):
    """A family-A drafter that reports, for each slot, the q of the same slot in the previous
    round (a probabilities buffer not refreshed after the round that filled it), while drafting
    from the current one. Where the stale q gives a draft probability 0, the current q is kept,
    so the proposal stays well-formed and the bug acts everywhere else. With `share` < 1 the
    buffer is stale on that share of each row's rounds only (independently; drawn from the
    round's generator after the drafts), as a race that loses now and then would leave it."""

    def __init__(self, inner: AutoregressiveDrafter, share: float = 1.0) -> None:
        super().__init__(inner, honest, "stale-q" if share == 1.0 else f"stale-q-{share:g}")
        self._previous: torch.Tensor | None = None  # [B, k, V] the last round's reported q
        self.share = share

    def reset(self, batch_size: int, capacity: int) -> None:
        super().reset(batch_size, capacity)
        self._previous = None

    def propose(self, ctx: DraftContext) -> Proposal:
        proposal = super().propose(ctx)
        current, previous = proposal.probs, self._previous
        self._previous = current
        if current is None or previous is None or previous.shape != current.shape:
            return proposal
        stale = previous.gather(-1, proposal.tokens[..., None]) > 0  # [B, k, 1]
        if self.share < 1.0:
            hits = torch.rand(stale.shape[0], generator=ctx.generator, device=ctx.generator.device) < self.share  # [B]
            stale = stale & hits.to(stale.device)[:, None, None]
        return Proposal(proposal.tokens, torch.where(stale, previous, current))  # BUG: last round's q


def stale_q(drafter: Drafter, share: float = 1.0) -> StaleQDrafter:
    """The drafter wrapper of mutant `stale_q` (on `share` of the rounds: `stale_q_on_30pct_of_rounds`)."""
    if not isinstance(drafter, AutoregressiveDrafter):
        raise LosscheckError(
            f"mutant 'stale_q' plants its bug in a family-A (autoregressive) drafter; drafter "
            f"{drafter.name!r} is a {type(drafter).__name__}. Run it on the bundled drafters' A / self cells."
        )
    return StaleQDrafter(drafter, share)
