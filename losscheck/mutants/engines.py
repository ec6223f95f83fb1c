"""The mutant engines: `Engine` subclasses that plant one realistic losslessness bug each.

The first docstring line of each class names the real bug class it models. Every mutant leaves
the drafter-less baseline (k = 0) exactly plain decoding — the greedy gate compares against that
baseline, so a mutant that also broke it would be compared against itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from losscheck.contract import Drafter, Proposal, Target
from losscheck.engine import Engine, Generation
from losscheck.mutants import drafters as planted
from losscheck.mutants import verifiers as bugs
from losscheck.sampling import SamplingParams, process_logits
from losscheck.verify import Verdict, verify_rejection


class _SamplingVerifyMutant(Engine):
    """Base: the rejection sampler is replaced by `planted(p, drafts, q, gen)`; greedy verification
    and the baseline are untouched."""

    planted: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Generator], Verdict]

    def verify(self, logits: torch.Tensor, proposal: Proposal, params: SamplingParams, gen: torch.Generator) -> Verdict:
        if self.drafter is None or params.greedy:
            return super().verify(logits, proposal, params, gen)
        return self.planted(process_logits(logits, params), proposal.tokens, proposal.probs, gen)


class UnnormalisedResidual(_SamplingVerifyMutant):
    """Residual not normalised: inverse-CDF on max(0, p - q), so the missing mass lands on the last id."""

    planted = staticmethod(bugs.verify_unnormalised_residual)


class ResidualIsP(_SamplingVerifyMutant):
    """Wrong residual: the recovered token is drawn from p instead of norm(max(0, p - q))."""

    planted = staticmethod(bugs.verify_residual_is_p)


class InvertedRatio(_SamplingVerifyMutant):
    """Acceptance ratio inverted: drafts kept with probability min(1, q/p)."""

    planted = staticmethod(bugs.verify_inverted_ratio)


class SharedUniform(_SamplingVerifyMutant):
    """Correlated uniforms: one uniform per row reused across slots and for the recovered draw.

    What a per-request generator re-seeded at every slot produces: each slot's first draw, and the
    recovered/bonus draw, is the same number.
    """

    planted = staticmethod(bugs.verify_shared_uniform)


class TypicalAcceptance(_SamplingVerifyMutant):
    """Lossy typical acceptance (Medusa-style): keep drafts with p(x) > min(ε, δ·e^-H), resample from p."""

    planted = staticmethod(bugs.verify_typical)


class RecoveredAfterRejected(Engine):
    """Token emitted after the rejected slot: the replacement is drawn conditioned on the rejected draft."""

    def verify(self, logits, proposal, params, gen):
        if self.drafter is None:
            return super().verify(logits, proposal, params, gen)
        if params.greedy:
            return bugs.greedy_recovered_after_rejected(logits, proposal.tokens)
        return bugs.verify_recovered_after_rejected(process_logits(logits, params), proposal.tokens, proposal.probs, gen)


class BonusFromWrongSlot(Engine):
    """Bonus token sampled from the wrong slot: p at the last draft's position instead of the one after it."""

    def verify(self, logits, proposal, params, gen):
        if self.drafter is None or params.greedy or proposal.tokens.shape[1] == 0:
            return super().verify(logits, proposal, params, gen)
        p = bugs.bonus_from_last_draft_slot(process_logits(logits, params))
        return verify_rejection(p, proposal.tokens, proposal.probs, gen)


class TemperatureOnQOnly(Engine):
    """Processors applied to q but not p: the verifier's target distribution skips the temperature."""

    def verify(self, logits, proposal, params, gen):
        if self.drafter is None or params.greedy:
            return super().verify(logits, proposal, params, gen)
        p = process_logits(logits, replace(params, temperature=1.0))  # BUG: no temperature on p
        return verify_rejection(p, proposal.tokens, proposal.probs, gen)


class TruncationOnDraftOnly(Engine):
    """vLLM-style: top-k / top-p applied to the draft side only (the target's p left untruncated)."""

    def verify(self, logits, proposal, params, gen):
        if self.drafter is None or params.greedy:
            return super().verify(logits, proposal, params, gen)
        p = process_logits(logits, replace(params, top_k=0, top_p=1.0))  # BUG: no top-k / top-p on p
        return verify_rejection(p, proposal.tokens, proposal.probs, gen)


class _MisreportingMutant(Engine):
    """Base: the drafter is wrapped so that its reported q differs from its sampling law."""

    step: planted.DraftStep
    tag = ""
    mutant = ""

    def __init__(self, target: Target, drafter: Drafter | None = None, k: int = 4, width: int | None = None) -> None:
        if drafter is not None:
            drafter = planted.misreporting(drafter, type(self).step, self.tag, self.mutant)
        super().__init__(target, drafter, k, width)


class TemperatureOnPOnly(_MisreportingMutant):
    """Processors applied to p but not q: the drafter samples at temperature T but reports its q at T = 1."""

    step = staticmethod(planted.untempered_report)
    tag, mutant = "q-at-T1", "temperature_p_only"


class GreedyDraftSoftmaxQ(_MisreportingMutant):
    """Greedy draft verified with the drafter's softmax as q instead of the point mass."""

    step = staticmethod(planted.argmax_with_softmax_report)
    tag, mutant = "argmax-softmax-q", "greedy_draft_softmax_q"


class TruncatedCandidatesFullQ(_MisreportingMutant):
    """Top-w truncated candidates reported with the untruncated q (w = 4)."""

    step = staticmethod(planted.top_w_with_full_report)
    tag, mutant = "top4-full-q", "truncated_candidates_full_q"


class BonusCountedNotWritten(Engine):
    """Bonus token dropped: counted in the emitted length but never written (placeholder id leaks out).

    Dropping the bonus outright — committing only the k accepted drafts — is lossless: the next round
    samples that position afresh from p. The lossy real-world form is the off-by-one between the
    count and the write, which emits the buffer's placeholder (id 0) where the bonus belongs.
    """

    def verify(self, logits, proposal, params, gen):
        verdict = super().verify(logits, proposal, params, gen)
        if self.drafter is None:
            return verdict
        return bugs.leave_bonus_unwritten(verdict, proposal.tokens.shape[1])


class RowsMixedUp(Engine):
    """Batch rows mixed up when they accept different counts (sorted for a ragged commit, never unsorted)."""

    def verify(self, logits, proposal, params, gen):
        verdict = super().verify(logits, proposal, params, gen)
        if self.drafter is None:
            return verdict
        return bugs.rows_sorted_by_acceptance(verdict)


class _GrownTarget:
    """The target with `extra` more cache slots per row than the engine asks for."""

    def __init__(self, target: Target, extra: int) -> None:
        self._target = target
        self.extra = extra

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)

    def reset(self, batch_size: int, capacity: int) -> None:
        self._target.reset(batch_size, capacity + self.extra)

    def forward(self, tokens, start, positions=None):
        return self._target.forward(tokens, start, positions)


class StaleCache(Engine):
    """Target KV cache not rolled back after a rejection: the next round appends after the rejected drafts.

    Like a Hugging Face loop that forgets to crop its DynamicCache: every round's k+1 entries stay,
    the rejected drafts' keys/values remain visible, and positions (= cache slots) drift with them.
    """

    def __init__(self, target: Target, drafter: Drafter | None = None, k: int = 4, width: int | None = None) -> None:
        super().__init__(target, drafter, k, width)
        self._plain_target = target
        self._written: torch.Tensor | None = None  # [B] end of each row's cache writes

    def generate(self, prompts, max_new_tokens, params, generator) -> Generation:
        if self.drafter is None:
            return super().generate(prompts, max_new_tokens, params, generator)
        # Each round can leave up to k stale entries; give the cache room for all of them.
        self.target = _GrownTarget(self._plain_target, max_new_tokens * self.k)
        self._written = None
        return super().generate(prompts, max_new_tokens, params, generator)

    def cache_start(self, lengths: torch.Tensor) -> torch.Tensor:
        if self.drafter is None or self._written is None:
            return super().cache_start(lengths)
        return self._written  # BUG: should be lengths - 1 (roll back to the committed tokens)

    def positions(self, start: torch.Tensor, width: int) -> torch.Tensor | None:
        if self.drafter is not None:
            self._written = start + width
        return None


class BatchMaxPositions(Engine):
    """Position ids wrong after a ragged batched rollback: one batch-wide step counter (the max) for every row."""

    def generate(self, prompts, max_new_tokens, params, generator) -> Generation:
        self._prompt_lengths = torch.tensor([len(p) for p in prompts])
        return super().generate(prompts, max_new_tokens, params, generator)

    def positions(self, start: torch.Tensor, width: int) -> torch.Tensor | None:
        if self.drafter is None:
            return None
        generated = start + 1 - self._prompt_lengths  # [B] tokens each row has committed
        # BUG: rows advance by their own accepted counts, the counter by the batch's largest
        first = self._prompt_lengths - 1 + generated.max()
        return first[:, None] + torch.arange(width)

