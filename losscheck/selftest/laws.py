"""Exact law of the first generated token under a mutant, for predicted power.

The first token of a generation comes from the first verification slot: the drafter proposes
x ~ s (the law it really samples from), the verifier keeps it with probability accept(x), and
otherwise emits a token from recover(x). With exact target and drafter logits at the prompt
that law is a finite sum over x — no sampling. A lossless verifier gives exactly p.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from losscheck.core.sampling import SamplingParams, process_logits
from losscheck.selftest import verifiers as bugs
from losscheck.selftest.drafters import TRUNCATION_WIDTH, one_id_underreported_q


@dataclass(frozen=True)
class FirstSlot:
    """Exact inputs of the first slot at one prompt."""

    params: SamplingParams
    target_logits: torch.Tensor  # [V] the target's raw logits after the prompt
    drafter_logits: torch.Tensor  # [V] the drafter's raw logits after the prompt
    next_logits: torch.Tensor  # [V, V] the target's raw logits after prompt + x (row x)

    def p(self, params: SamplingParams | None = None) -> torch.Tensor:
        """[V] float64 target distribution (the request's processing unless `params` is given)."""
        return _float64(process_logits(self.target_logits, params or self.params))

    def q(self, params: SamplingParams | None = None) -> torch.Tensor:
        return _float64(process_logits(self.drafter_logits, params or self.params))


def _float64(probs: torch.Tensor) -> torch.Tensor:
    """`process_logits` works in float32; renormalise in float64 so laws sum to 1 to 1e-12."""
    probs = probs.double()
    return probs / probs.sum(-1, keepdim=True)


def first_token_law(sampled: torch.Tensor, accept: torch.Tensor, recover: torch.Tensor) -> torch.Tensor:
    """sampled [V] law of the draft, accept [V] P(keep | x), recover [V] or [V, V] (row x: law of
    the emitted token after rejecting x) → [V] law of the first emitted token."""
    if recover.dim() == 1:
        recover = recover.expand(len(sampled), -1)
    return sampled * accept + ((sampled * (1 - accept))[:, None] * recover).sum(0)


def ratio(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p/q) elementwise, 1 where q = 0 (never drafted)."""
    return torch.where(q > 0, (p / q.clamp_min(1e-300)).clamp(max=1.0), torch.ones_like(p))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), p where the residual is empty."""
    r = (p - q).clamp_min(0.0)
    return r / r.sum() if r.sum() > 0 else p


def correct(slot: FirstSlot) -> torch.Tensor:
    p, q = slot.p(), slot.q()
    return first_token_law(q, ratio(p, q), residual(p, q))


def on_share(law: Callable[[FirstSlot], torch.Tensor], share: float) -> Callable[[FirstSlot], torch.Tensor]:
    """The first token's law of a bug with first-token law `law` that hits each round with
    probability `share`: the mixture (1 - share)·p + share·law."""

    def mixed(slot: FirstSlot) -> torch.Tensor:
        return (1 - share) * correct(slot) + share * law(slot)

    return mixed


def unnormalised_residual(slot: FirstSlot) -> torch.Tensor:
    p, q = slot.p(), slot.q()
    r = (p - q).clamp_min(0.0)
    r[-1] += 1.0 - r.sum()  # the inverse-CDF draw runs past the residual's mass onto the last id
    return first_token_law(q, ratio(p, q), r)


def residual_is_p(slot: FirstSlot) -> torch.Tensor:
    p, q = slot.p(), slot.q()
    return first_token_law(q, ratio(p, q), p)


def inverted_ratio(slot: FirstSlot) -> torch.Tensor:
    p, q = slot.p(), slot.q()
    return first_token_law(q, ratio(q, p), residual(p, q))


def shared_uniform(slot: FirstSlot) -> torch.Tensor:
    """Rejecting x means u ~ U(a(x), 1); the recovered id is the inverse CDF of the residual at u."""
    p, q = slot.p(), slot.q()
    accept = ratio(p, q)  # [V]
    stop = residual(p, q)
    cdf = stop.cumsum(0)
    cdf[torch.nonzero(stop > 0).max() :] = 1.0  # the draw is clamped to the support
    low = torch.cat([cdf.new_zeros(1), cdf[:-1]])  # [V] id y is drawn for u in [low_y, cdf_y)
    overlap = (cdf[None, :] - torch.maximum(low[None, :], accept[:, None])).clamp_min(0.0)  # [V x, V y]
    width = (1 - accept)[:, None]
    recover = torch.where(width > 0, overlap / width.clamp_min(1e-300), 0.0)
    return first_token_law(q, accept, recover)


def typical(slot: FirstSlot) -> torch.Tensor:
    p, q = slot.p(), slot.q()
    accept = (p > bugs.typical_threshold(p)).double()
    return first_token_law(q, accept, p)


def recovered_after_rejected(slot: FirstSlot) -> torch.Tensor:
    p, q = slot.p(), slot.q()
    after = _float64(process_logits(slot.next_logits, slot.params))  # [V, V]: row x = p(. | prompt, x)
    return first_token_law(q, ratio(p, q), after)


def temperature_q_only(slot: FirstSlot) -> torch.Tensor:
    p, q = slot.p(replace(slot.params, temperature=1.0)), slot.q()
    return first_token_law(q, ratio(p, q), residual(p, q))


def greedy_at_any_temperature(slot: FirstSlot) -> torch.Tensor:
    """The first token is the target's argmax (the first id of its largest probability)."""
    p = slot.p()
    return torch.zeros_like(p).scatter_(0, p.argmax()[None], 1.0)


def truncation_draft_only(slot: FirstSlot) -> torch.Tensor:
    p, q = slot.p(replace(slot.params, top_k=0, top_p=1.0)), slot.q()
    return first_token_law(q, ratio(p, q), residual(p, q))


def misreported(slot: FirstSlot, sampled: torch.Tensor, reported: torch.Tensor) -> torch.Tensor:
    """A correct verifier fed a q (`reported`) that is not the drafter's sampling law (`sampled`)."""
    p = slot.p()
    return first_token_law(sampled, ratio(p, reported), residual(p, reported))


def temperature_p_only(slot: FirstSlot) -> torch.Tensor:
    return misreported(slot, slot.q(), slot.q(replace(slot.params, temperature=1.0)))


def greedy_draft_softmax_q(slot: FirstSlot) -> torch.Tensor:
    q = slot.q()
    return misreported(slot, torch.nn.functional.one_hot(q.argmax(), len(q)).double(), q)


def truncated_candidates_full_q(slot: FirstSlot) -> torch.Tensor:
    q = slot.q()
    kth = q.topk(min(TRUNCATION_WIDTH, len(q))).values[-1]
    candidates = torch.where(q >= kth, q, 0.0)
    return misreported(slot, candidates / candidates.sum(), q)


def one_id_underreported(slot: FirstSlot) -> torch.Tensor:
    q = slot.q()
    return misreported(slot, q, one_id_underreported_q(q))


def one_id_underreported_by(factor: float) -> Callable[[FirstSlot], torch.Tensor]:
    """The first token's law of `one_id_underreported` at misreport `factor`."""

    def law(slot: FirstSlot) -> torch.Tensor:
        q = slot.q()
        return misreported(slot, q, one_id_underreported_q(q, factor))

    return law
