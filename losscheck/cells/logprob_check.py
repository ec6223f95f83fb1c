"""Reported log-probabilities against a teacher-forced pass: exact up to the precision's bound.

An engine that reports each token's log-probability (`Generation.logprobs`) must report log p(x),
the target's processed law at the token's position — what the cell's teacher-forced pass computes
anyway. Each logit off by up to the precision's tolerance τ before the temperature T moves a
log-probability by at most 2τ/T (`losscheck.stats.streams.precision_slack`); float32 softmax and
log add `ROUNDING`. Positions whose cut-off implementations may draw differently (`ambiguous`) are
left out: their renormalised law depends on the set kept. Not a statistical test: any deviation
past the bound is a problem of the cell, with the worst named.

An engine that reports the N most probable ids at each position (`top_ids`, `top_logprobs`) is held
to the same law there: each reported value within the bound of log p at its id, and each reported id
among the N most probable up to the bound (log p of it at least log p of the N-th most probable,
less the bound: near-ties may swap), no id twice. A position with any of these wrong is off.
"""

from __future__ import annotations

import dataclasses
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
    top: int = 0  # N of the reported top ids, 0: none reported
    top_checked: int = 0  # positions whose top N were compared
    top_off: int = 0  # of them, with a value past the bound, an id outside the top N or an id twice
    top_worst: float = 0.0  # nats, the worst value's deviation

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

    def observe_top(self, ids: torch.Tensor, values: torch.Tensor, read: torch.Tensor, p: torch.Tensor) -> None:
        """One chunk of reported top ids [c, L, N] and their log-probabilities [c, L, N], read
        [c, L] bool the positions compared, p [c, L, V] the teacher-forced law."""
        ids, values, read = ids.to(p.device), values.to(p.device).double(), read.to(p.device)
        self.top = ids.shape[-1]
        logp = p.double().log()  # [c, L, V]
        reference = logp.gather(-1, ids)  # [c, L, N]
        both_impossible = (values == -math.inf) & (reference == -math.inf)
        gap = torch.where(both_impossible, 0.0, (values - reference).abs().nan_to_num(math.inf))  # [c, L, N]
        nth = logp.topk(self.top, dim=-1).values[..., -1:]  # [c, L, 1] the N-th most probable's log p
        outside = reference < nth - self.bound  # [c, L, N] an id below the top N beyond round-off
        ordered = ids.sort(-1).values
        twice = (ordered[..., 1:] == ordered[..., :-1]).any(-1)  # [c, L]
        off = read & ((gap > self.bound).any(-1) | outside.any(-1) | twice)
        self.top_checked += int(read.sum())
        self.top_off += int(off.sum())
        if gap.numel():
            self.top_worst = max(self.top_worst, float(torch.where(read[..., None], gap, 0.0).max()))

    def facts(self) -> SampleFacts:
        """What the certificate keeps (nothing when no token was compared)."""
        if not self.checked:
            return SampleFacts()
        facts = SampleFacts(
            logprobs_checked=self.checked, logprobs_off=self.off, logprob_worst=self.worst, logprob_bound=self.bound
        )
        if not self.top_checked:
            return facts
        return dataclasses.replace(
            facts,
            top_logprobs=self.top,
            top_logprobs_checked=self.top_checked,
            top_logprobs_off=self.top_off,
            top_logprob_worst=self.top_worst,
        )


def logprob_problems(facts: SampleFacts) -> list[str]:
    """The cell's problems when reported log-probabilities left the bound (empty: none, or none checked)."""
    problems = []
    if facts.logprobs_off:
        problems.append(
            f"logprobs: {facts.logprobs_off} of {facts.logprobs_checked} reported log-probabilities differ from the "
            f"teacher-forced target's by more than {facts.logprob_bound:.2g} nats (worst {facts.logprob_worst:.3g}); "
            "each token's logprob must be log p(x) under the target's processed law at its own position"
        )
    if facts.top_logprobs_off:
        problems.append(
            f"logprobs: at {facts.top_logprobs_off} of {facts.top_logprobs_checked} positions the reported top "
            f"{facts.top_logprobs} ids are not the target's most probable or their log-probabilities differ by more "
            f"than {facts.logprob_bound:.2g} nats (worst value {facts.top_logprob_worst:.3g}); each position's top N "
            "must be the N most probable ids of the target's processed law there"
        )
    return problems
