"""Planted verification bugs: the verifier (losscheck.core.verify) with one thing done wrong.

Most functions have the signature of `verify_rejection` — p [B, k+1, V] processed target
distributions (slot k is the bonus slot), drafts [B, k], q [B, k, V] or None (point mass), a
generator — and return a `BlockOutcome`; `in_sampled_rounds` makes such a bug a `Verifier` the
engine can be given. Bugs that also live in greedy rounds or in the processing of `p` are
`Verifier`s themselves (raw logits and the sampling parameters in). The line that differs from
the correct verifier is marked `# BUG:`. They reuse the correct pieces (`acceptance_probability`,
`recovery_distribution`, `verify_block`) everywhere else, so each one is lossy for exactly the
reason its docstring gives. One function here is not a bug: `widening_everything`, the correct
sampler in the form it had before it gathered the stopping slot first, kept as the reference the
current one must match draw for draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from losscheck.core.sampling import SamplingParams, process_logits, sample
from losscheck.core.verify import (
    BlockOutcome,
    Verifier,
    acceptance_probability,
    normalized,
    point_mass,
    recovery_distribution,
    verify_block,
    verify_greedy,
    verify_rejection,
)

# (p [B, k+1, V], drafts [B, k], q [B, k, V] | None, generator) -> BlockOutcome
RejectionSampler = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Generator], BlockOutcome]

# Medusa's typical-acceptance defaults (posterior_threshold ε, posterior_alpha δ).
TYPICAL_EPSILON = 0.09
TYPICAL_DELTA = 0.3


def widening_everything(
    p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator
) -> BlockOutcome:
    """Not a bug: `verify_rejection` as written before it gathered the stopping slot first (float64
    over the whole [B, k+1, V] block, the residual at every slot). The correct verifier must draw
    exactly what this draws (tests/unit/test_verify.py) and is timed against it
    (reports/bench/verify_widening.py)."""
    batch, k = drafts.shape
    p = p.double()
    q = point_mass(drafts, p.shape[-1]).double() if q is None else normalized(q)
    p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [B, k]
    q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)  # [B, k]
    u = torch.rand(batch, k, generator=generator, dtype=torch.float64, device=p.device)
    accepted = (u < acceptance_probability(p_draft, q_draft)).long().cumprod(-1).sum(-1)  # [B]
    rows = torch.arange(batch, device=p.device)
    tokens = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)  # [B, k+1]
    tokens[rows, accepted] = sample(recovery_distribution(p, q)[rows, accepted], generator)
    return BlockOutcome(accepted=accepted, tokens=tokens)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, clamp_to_support: bool = True) -> torch.Tensor:
    """Inverse-CDF draw: the first id (in id order) whose cumulative mass exceeds `u`.

    probs [B, V] (not necessarily normalised), u [B] float64 in [0, 1) → ids [B]. When `u` is at or
    beyond the total mass the draw runs off the end and lands on id V-1 — or, with
    `clamp_to_support`, on the last id of positive mass (round-off guard for normalised rows).
    """
    cumulative = probs.double().cumsum(-1)  # [B, V]
    index = (cumulative <= u[:, None]).sum(-1)  # [B]
    if clamp_to_support:
        ids = torch.arange(probs.shape[-1])
        last = torch.where(probs > 0, ids, -1).max(-1).values  # [B]
        return torch.minimum(index, last)
    return index.clamp_max(probs.shape[-1] - 1)


def _draft_probs(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None):
    """q (point mass filled in), p(x_j) and q(x_j) [B, k]."""
    if q is None:
        q = point_mass(drafts, p.shape[-1])
    k = drafts.shape[1]
    p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
    return q, p_draft, q_draft


def _emit(drafts: torch.Tensor, accepted: torch.Tensor, stop_token: torch.Tensor) -> BlockOutcome:
    """BlockOutcome with the drafts, then `stop_token` [B] (recovered or bonus) at slot `accepted`."""
    rows = torch.arange(drafts.shape[0])
    tokens = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], dim=1)  # [B, k+1]
    tokens[rows, accepted] = stop_token
    return BlockOutcome(accepted=accepted, tokens=tokens)


def _accept(keep: torch.Tensor) -> torch.Tensor:
    """[B, k] bool per-slot tests → [B] leading drafts kept."""
    return keep.long().cumprod(-1).sum(-1)


def verify_unnormalised_residual(p, drafts, q, generator) -> BlockOutcome:
    """Recovered token by inverse CDF on max(0, p - q) without dividing by its mass β = Σ max(0, p - q).

    A rejection happens with probability β, but the draw then falls past the residual's total mass
    with probability 1 - β and lands on the last id: the recovered token is V-1 almost always.
    """
    batch, k = drafts.shape
    q, p_draft, q_draft = _draft_probs(p, drafts, q)
    keep = torch.rand(batch, k, generator=generator, dtype=torch.float64) < acceptance_probability(p_draft, q_draft)
    accepted = _accept(keep)
    rows = torch.arange(batch)
    q_padded = torch.cat([q, q.new_zeros(batch, 1, q.shape[-1])], dim=1)  # bonus slot: q = 0
    residual = (p - q_padded).clamp_min(0.0)[rows, accepted]  # BUG: never normalised
    u = torch.rand(batch, generator=generator, dtype=torch.float64)
    return _emit(drafts, accepted, inverse_cdf(residual, u, clamp_to_support=False))


def verify_residual_is_p(p, drafts, q, generator) -> BlockOutcome:
    """Recovered token drawn from p itself instead of norm(max(0, p - q)).

    The accepted drafts already supply min(p, q); resampling from p adds β·p on top, so tokens
    where q > p are over-emitted by β·p - max(0, p - q).
    """
    batch, k = drafts.shape
    q, p_draft, q_draft = _draft_probs(p, drafts, q)
    keep = torch.rand(batch, k, generator=generator, dtype=torch.float64) < acceptance_probability(p_draft, q_draft)
    accepted = _accept(keep)
    stop = p[torch.arange(batch), accepted]  # BUG: p, not the residual
    return _emit(drafts, accepted, sample(stop, generator))


def verify_inverted_ratio(p, drafts, q, generator) -> BlockOutcome:
    """Acceptance probability min(1, q/p) instead of min(1, p/q) (ratio written upside down)."""
    batch, k = drafts.shape
    q, p_draft, q_draft = _draft_probs(p, drafts, q)
    u = torch.rand(batch, k, generator=generator, dtype=torch.float64)
    keep = u < acceptance_probability(q_draft, p_draft.clamp_min(1e-30))  # BUG: q / p
    accepted = _accept(keep)
    stop = recovery_distribution(p, q)[torch.arange(batch), accepted]
    return _emit(drafts, accepted, sample(stop, generator))


def verify_shared_uniform(p, drafts, q, generator) -> BlockOutcome:
    """One uniform per row for every slot's acceptance test and the recovered/bonus draw.

    The acceptance tests of a block become correlated, and — the first-order effect — a rejection
    at slot a means u >= min(1, p/q) there, so the inverse-CDF recovered draw only sees the top
    of the residual's CDF: the highest ids of the residual are over-emitted.
    """
    batch, k = drafts.shape
    q, p_draft, q_draft = _draft_probs(p, drafts, q)
    u = torch.rand(batch, generator=generator, dtype=torch.float64)  # BUG: one uniform per row
    keep = u[:, None] < acceptance_probability(p_draft, q_draft)
    accepted = _accept(keep)
    stop = recovery_distribution(p, q)[torch.arange(batch), accepted]
    return _emit(drafts, accepted, inverse_cdf(stop, u))  # BUG: the same uniform again


def verify_recovery_reuses_draft_noise(p, drafts, q, generator) -> BlockOutcome:
    """The recovered token drawn with the exponential race noise the drafter drew its draft with
    (one random stream per (seed, position) for the draft, the acceptance and the recovery: the
    shape of vLLM #54282).

    The drafter drew x = argmax q / E; given x, the other entries' noise is E_i = q_i·M + Exp(1)
    with M ~ Exp(1) (the race's minimum, memoryless): largest where q is, so the recovered draw
    argmax r / E under-weights the tokens the draft favoured. Reconstructed here from that
    conditional law, which is exactly what reusing the drafter's noise gives.
    """
    batch, k = drafts.shape
    q, p_draft, q_draft = _draft_probs(p, drafts, q)
    keep = torch.rand(batch, k, generator=generator, dtype=torch.float64) < acceptance_probability(p_draft, q_draft)
    accepted = _accept(keep)
    rows = torch.arange(batch)
    q_stop = normalized(q[rows, accepted.clamp(max=k - 1)]).float()  # [B, V] the rejected slot's q
    # the draft's own entry has no residual mass after its rejection: its noise is never read
    race_min = torch.empty(batch, 1).exponential_(generator=generator)  # [B, 1]
    reused = q_stop * race_min + torch.empty_like(q_stop).exponential_(generator=generator)  # [B, V]
    fresh = torch.empty_like(q_stop).exponential_(generator=generator)  # the bonus slot: no draft behind it
    noise = torch.where((accepted < k)[:, None], reused, fresh)  # BUG: the draft's noise, not fresh noise
    stop = recovery_distribution(p, q)[rows, accepted]
    return _emit(drafts, accepted, (stop.float() / noise).argmax(-1))


def typical_threshold(p: torch.Tensor) -> torch.Tensor:
    """Medusa's typical-acceptance threshold min(ε, δ·exp(-H(p))) per distribution; p [..., V] → [...]."""
    entropy = -(p.double() * p.double().clamp_min(1e-300).log()).sum(-1)
    return torch.minimum(torch.full_like(entropy, TYPICAL_EPSILON), TYPICAL_DELTA * torch.exp(-entropy))


def verify_typical(p, drafts, q, generator) -> BlockOutcome:
    """Medusa-style typical acceptance: keep a draft when p(x) > min(ε, δ·exp(-H(p))), whatever q
    was; at the first rejected slot emit a token drawn from p (not the residual).

    Drafts the target finds 'typical enough' pass with probability 1 instead of min(1, p/q), and
    low-probability tokens are emitted only through the resample: lossy by design.
    """
    batch, k = drafts.shape
    _, p_draft, _ = _draft_probs(p, drafts, q)
    keep = p_draft.double() > typical_threshold(p[:, :k])  # BUG: a threshold on p, not min(1, p/q)
    accepted = _accept(keep)
    stop = p[torch.arange(batch), accepted]  # BUG: p, not the residual
    return _emit(drafts, accepted, sample(stop, generator))


def verify_recovered_after_rejected(p, drafts, q, generator) -> BlockOutcome:
    """At the first rejection (slot a), the emitted token is drawn from p at slot a+1 — the target's
    distribution *after* the rejected draft — instead of the residual at slot a (off-by-one)."""
    batch, k = drafts.shape
    q, p_draft, q_draft = _draft_probs(p, drafts, q)
    keep = torch.rand(batch, k, generator=generator, dtype=torch.float64) < acceptance_probability(p_draft, q_draft)
    accepted = _accept(keep)
    rows = torch.arange(batch)
    stop = torch.where(
        (accepted < k)[:, None],
        p[rows, (accepted + 1).clamp_max(k)],  # BUG: slot a+1
        p[rows, accepted],
    )
    return _emit(drafts, accepted, sample(stop, generator))


def greedy_recovered_after_rejected(p: torch.Tensor, drafts: torch.Tensor) -> BlockOutcome:
    """Greedy form of `verify_recovered_after_rejected`: argmax of slot a+1 after a mismatch at a."""
    best = p.argmax(-1)  # [B, k+1]
    k = drafts.shape[1]
    accepted = _accept(drafts == best[:, :k])
    rows = torch.arange(drafts.shape[0])
    stop = best[rows, torch.where(accepted < k, accepted + 1, accepted)]  # BUG: slot a+1
    return _emit(drafts, accepted, stop)


def verify_bonus_from_wrong_slot(p, drafts, q, generator) -> BlockOutcome:
    """After k accepted drafts the bonus is drawn from p at the last draft's slot (p[:, k-1]) instead
    of the slot after it: the bonus is not conditioned on the last accepted draft."""
    if drafts.shape[1] == 0:  # no draft slot to take it from
        return verify_rejection(p, drafts, q, generator)
    wrong = p.clone()
    wrong[:, -1] = p[:, -2]  # BUG: slot k-1 for the bonus
    return verify_rejection(wrong, drafts, q, generator)


def _either(correct: BlockOutcome, buggy: BlockOutcome, acts: torch.Tensor) -> BlockOutcome:
    """Per row, `buggy`'s outcome where `acts` [B] bool, else `correct`'s."""
    return BlockOutcome(
        accepted=torch.where(acts, buggy.accepted, correct.accepted),
        tokens=torch.where(acts[:, None], buggy.tokens, correct.tokens),
    )


def _coupled(sampler: RejectionSampler, p, drafts, q, generator) -> tuple[BlockOutcome, BlockOutcome]:
    """The correct outcome and `sampler`'s, from the same uniforms: each exactly its own law, and
    where the bug changes only the recovered or bonus token they accept the same drafts."""
    state = generator.get_state()
    correct = verify_rejection(p, drafts, q, generator)
    generator.set_state(state)
    return correct, sampler(p, drafts, q, generator)


def on_share_of_rounds(sampler: RejectionSampler, share: float) -> RejectionSampler:
    """`sampler`'s bug on each row's round with probability `share`, independently (a bug hit by
    some rounds only: a race, a stale buffer now and then); the correct verifier elsewhere."""

    def intermittent(p, drafts, q, generator) -> BlockOutcome:
        acts = torch.rand(drafts.shape[0], generator=generator, dtype=torch.float64, device=drafts.device) < share
        correct, buggy = _coupled(sampler, p, drafts, q, generator)
        return _either(correct, buggy, acts)  # BUG: the planted bug on the rounds it hits

    intermittent.__doc__ = f"{sampler.__name__} on {share:.0%} of the rounds"
    return intermittent


def at_batch_positions(sampler: RejectionSampler, every: int) -> RejectionSampler:
    """`sampler`'s bug on the rows at batch positions 0, `every`, 2·`every`, … of each verify
    call (a kernel indexing bug that touches one row in `every`); the correct verifier elsewhere."""

    def by_position(p, drafts, q, generator) -> BlockOutcome:
        correct, buggy = _coupled(sampler, p, drafts, q, generator)
        acts = torch.arange(drafts.shape[0], device=drafts.device) % every == 0
        return _either(correct, buggy, acts)  # BUG: the planted bug on those rows

    by_position.__doc__ = f"{sampler.__name__} on one row in {every} of the batch"
    return by_position


def at_slot(sampler: RejectionSampler, slot: int) -> RejectionSampler:
    """`sampler`'s bug only on rounds whose first rejection is at draft slot `slot` (the same
    uniforms decide the drafts, so only that round's recovered token changes); exact elsewhere."""

    def one_slot(p, drafts, q, generator) -> BlockOutcome:
        correct, buggy = _coupled(sampler, p, drafts, q, generator)
        acts = (correct.accepted == slot) & (slot < drafts.shape[1])
        return _either(correct, buggy, acts)  # BUG: the planted bug at that slot

    one_slot.__doc__ = f"{sampler.__name__} at slot {slot} only"
    return one_slot


def in_sampled_rounds(sampler: RejectionSampler) -> Verifier:
    """A `Verifier` with `sampler` in place of `verify_rejection`; greedy rounds verify correctly."""

    def verifier(logits, drafts, q, params: SamplingParams, generator) -> BlockOutcome:
        if params.greedy:
            return verify_greedy(logits, drafts)
        return sampler(process_logits(logits, params), drafts, q, generator)

    verifier.__doc__ = sampler.__doc__
    return verifier


def verify_recovered_after_rejected_any(logits, drafts, q, params: SamplingParams, generator) -> BlockOutcome:
    """Both decoding modes: after a rejection at slot a the emitted token comes from slot a+1."""
    if params.greedy:
        return greedy_recovered_after_rejected(logits, drafts)
    return verify_recovered_after_rejected(process_logits(logits, params), drafts, q, generator)


def verify_temperature_on_q_only(logits, drafts, q, params: SamplingParams, generator) -> BlockOutcome:
    """The verifier's p skips the temperature the drafter's q was processed with."""
    if params.greedy:
        return verify_greedy(logits, drafts)
    p = process_logits(logits, replace(params, temperature=1.0))  # BUG: no temperature on p
    return verify_rejection(p, drafts, q, generator)


def verify_greedy_at_any_temperature(logits, drafts, q, params: SamplingParams, generator) -> BlockOutcome:
    """Greedy verification whatever the temperature (SGLang's silent fallback where a backend lacks
    the sampling kernel; mistral.rs): a draft is kept iff it is the target's argmax, and the
    recovered and bonus tokens are the argmax, so at T > 0 the output is the greedy path."""
    return verify_greedy(process_logits(logits, params), drafts)  # BUG: no rejection sampling at T > 0


def verify_truncation_on_draft_only(logits, drafts, q, params: SamplingParams, generator) -> BlockOutcome:
    """The verifier's p skips the top-k / top-p truncation the drafter's q was processed with."""
    if params.greedy:
        return verify_greedy(logits, drafts)
    p = process_logits(logits, replace(params, top_k=0, top_p=1.0))  # BUG: no top-k / top-p on p
    return verify_rejection(p, drafts, q, generator)


def verify_min_p_at_first_slot_only(logits, drafts, q, params: SamplingParams, generator) -> BlockOutcome:
    """The verifier's p gets min-p at the round's first position only (SGLang #10617: min-p not
    applied to every drafted position)."""
    if params.greedy:
        return verify_greedy(logits, drafts)
    p = process_logits(logits, params)  # [B, k+1, V]
    p[:, 1:] = process_logits(logits[:, 1:], replace(params, min_p=0.0))  # BUG: no min-p after slot 0
    return verify_rejection(p, drafts, q, generator)


def verify_bonus_counted_not_written(logits, drafts, q, params: SamplingParams, generator) -> BlockOutcome:
    """When every draft is kept the bonus is counted in the emitted length but never written: the
    row emits the buffer's placeholder id 0 instead.

    Dropping the bonus outright — committing only the k accepted drafts — would be lossless (the
    next round samples that position afresh from p); the lossy real-world form is this off-by-one
    between the count and the write.
    """
    outcome = verify_block(logits, drafts, q, params, generator)
    tokens = outcome.tokens.clone()
    k = drafts.shape[1]
    tokens[:, k] = torch.where(outcome.accepted == k, 0, tokens[:, k])  # BUG: placeholder, not the bonus
    return BlockOutcome(outcome.accepted, tokens)


def verify_rows_mixed_up(logits, drafts, q, params: SamplingParams, generator) -> BlockOutcome:
    """Rows sorted by accepted count (e.g. for a ragged commit kernel) and never unsorted: row b
    commits another row's tokens whenever rows accepted different counts."""
    outcome = verify_block(logits, drafts, q, params, generator)
    order = torch.argsort(outcome.accepted, stable=True)
    return BlockOutcome(outcome.accepted[order], outcome.tokens[order])  # BUG: no inverse permutation
