"""Reported log-probabilities against a teacher-forced pass: exact up to the precision's bound.

An engine that reports each token's log-probability (`Generation.logprobs`) must report log p(x),
the target's processed law at the token's position — what the cell's teacher-forced pass computes
anyway. Each logit off by up to the precision's tolerance τ before the temperature T moves a
log-probability by at most 2τ/T (`losscheck.stats.streams.precision_slack`); float32 softmax and
log add `ROUNDING`. Positions whose cut-off implementations may draw differently (`ambiguous`) are
left out: their renormalised law depends on the set kept. Not a statistical test: any deviation
past the bound is a problem of the cell, with the worst named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from losscheck.cells.record import SampleFacts

ROUNDING = 1e-5  # nats: two float32 softmaxes and a log over the bundled vocabularies


@dataclass
class LogprobCheck:
    """The worst deviation of the reported log-probabilities of a sample, part by part."""

    tolerance: float  # the target's logit tolerance τ
    temperature: float = 1.0
    checked: int = 0  # tokens compared
    off: int = 0  # of them, past the bound
    worst: float = 0.0  # nats

    @property
    def bound(self) -> float:
        return 2 * self.tolerance / self.temperature + ROUNDING

    def observe(self, reported: torch.Tensor, tokens: torch.Tensor, read: torch.Tensor, p: torch.Tensor) -> None:
        """One chunk: reported [c, L] log-probabilities of tokens [c, L], read [c, L] bool the
        positions compared, p [c, L, V] the teacher-forced law."""
        reference = p.gather(-1, tokens[..., None].to(p.device)).squeeze(-1).double().log()  # [c, L]
        reported, read = reported.to(p.device).double(), read.to(p.device)
        gap = torch.where(read, (reported - reference).abs().nan_to_num(math.inf), 0.0)  # [c, L]
        self.checked += int(read.sum())
        self.off += int((gap > self.bound).sum())
        if gap.numel():
            self.worst = max(self.worst, float(gap.max()))

    def facts(self) -> SampleFacts:
        """What the certificate keeps (nothing when no token was compared)."""
        if not self.checked:
            return SampleFacts()
        return SampleFacts(
            logprobs_checked=self.checked, logprobs_off=self.off, logprob_worst=self.worst, logprob_bound=self.bound
        )


def logprob_problems(facts: SampleFacts) -> list[str]:
    """The cell's problem when reported log-probabilities left the bound (empty: none, or none checked)."""
    if not facts.logprobs_off:
        return []
    return [
        f"logprobs: {facts.logprobs_off} of {facts.logprobs_checked} reported log-probabilities differ from the "
        f"teacher-forced target's by more than {facts.logprob_bound:.2g} nats (worst {facts.logprob_worst:.3g}); "
        "each token's logprob must be log p(x) under the target's processed law at its own position"
    ]
