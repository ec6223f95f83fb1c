"""Verifier bug classes judged on an engine that reports only its tokens: each class's law of every
emitted token, exact given the tokens before it, by a forward filter over the hidden slot.

Terms (as `losscheck.core.verify`): a round drafts k tokens from q and verifies them against p. A
*draft slot* j < k emits the draft when it is accepted (the round goes on to slot j + 1), else the
*recovered* token, which ends the round; slot k emits the *bonus* token from p and ends it. A
black-box engine reports the emitted tokens alone, so the slot of each is hidden. With the drafter
the engine runs loaded, q at every position is known: an accepted draft is the emitted token, so
the drafter's context for the next slot is the emitted prefix, and teacher-forcing it over the
emitted tokens gives each slot's q.

At a draft slot the emitted token x and whether the round goes on split as

    accepted  a(x) = min(p, q)(x)   round goes on          recovered  r(x) = max(0, p - q)(x)   round ends

with a + r = p; at the bonus slot b(x) = p(x). A class replaces some of a, r, b (`RoundClass`);
its member ρ mixes them, (1 - ρ)·H0 + ρ·class, the bug at a fraction ρ of the draft slots or
bonus slots. The filter keeps the belief π_t(j) = P(slot j at t | x_<t) under the member and gives
its predictive law P'(x_t | x_<t) = Σ_{j<k} π_t(j)·(a' + r')_t(x_t) + π_t(k)·b'_t(x_t). Under H0
every term is p_t(x_t), so the likelihood ratio Π_t P'(x_t | x_<t) / p_t(x_t) is a test martingale
whatever q is (a q unlike the engine's only costs power), and a fixed-weight mixture over members
is one too: by Ville's inequality the test rejects at level α whenever the mixture reaches 1 / α,
at any stopping time (`rounds_test`, registered as family `ROUNDS`). Positions the caller does
not score move the belief and contribute no factor. At a cut-off that implementations may draw
differently (`losscheck.cells.scoring`) the caller passes p_S, the law conditioned on the tokens S
every one of them keeps, and scores a drawn token in S only: under H0 a token in S has law p_S
whatever else the engine keeps, and each member's law restricted to S sums to at most 1, so the
factor 1[x ∈ S]·P'(x)/p_S(x) + 1[x ∉ S] keeps mean at most 1. A member's rule-out e-value (the
looks' early stop) runs the other way, Π p / P'_ρ under the member, and needs P'_ρ exact or
larger: there every part of the round is bounded over the kept sets the cut-off allows
(`round_bounds`), over a numerator that is a law.

Power (`RoundsPower`): per member, the log-LR increment's mean and second moment under P' at each
scored position (its law over the whole vocabulary, the belief from the filter along the observed
tokens), averaged; the sum over n tokens taken as Gaussian, P(Σ ≥ log(G / α)), or caught outright
by a token outside p's support. The mean drift and the outside mass are taken at their lower
`DRIFT_CONFIDENCE` bounds, rows as independent clusters: a bug that acts on rare slots (a bonus
bug under argmax drafts) puts its effect in few rows, and a pilot's point estimate then sizes a
cell too small. Like `losscheck.stats.bugclass`, it assumes the bug changes the emitted token's
law, not which prefixes the run visits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal, NamedTuple

import torch
from scipy import stats

from losscheck.errors import LosscheckError
from losscheck.stats.buglaws import TOP_P, top_p
from losscheck.stats.effects import WaldSize, wald_size
from losscheck.stats.registry import OTHER_Q, ROUNDS, SAMPLED_DRAFTS, StatTest, register
from losscheck.stats.result import TestResult
from losscheck.stats.second_stage import RowShift, SupportShift, clustered_shift
from losscheck.stats.sequential import family, member_key

RHO_MIN = 1 / 8  # the smallest member of each family the mixture e-value spends weight on
MEMBERS = family(RHO_MIN)  # (1, 0.707, 0.5, ..., 0.125): equal weights
TINY = 1e-300
TINY32 = 1e-38
# Power is stated at the per-token drift's one-sided lower bound at this confidence (`RoundsPower.drift`)
DRIFT_CONFIDENCE = 0.95
_DRIFT_Z = float(stats.norm.ppf(DRIFT_CONFIDENCE))

# (p, q, o) [..., V] -> [..., V]: the target's law, the q the draft is drawn from, and the draft
# model's *other* q (its raw law where q is processed: `RoundsSample.update`), which only the
# q-contract classes read
Law = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _accept(p: torch.Tensor, q: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return torch.minimum(p, q)


def _recover(p: torch.Tensor, q: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return (p - q).clamp_min(0.0)


def _recover_from_p(p: torch.Tensor, q: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return (1 - torch.minimum(p, q).sum(-1, keepdim=True)).clamp_min(0.0) * p


def _accept_drawn_verified(drawn: torch.Tensor, p: torch.Tensor, verified: torch.Tensor) -> torch.Tensor:
    """A draft drawn from `drawn`, accepted with min(1, p / `verified`) (1 where `verified` is 0:
    p / 0 is infinite)."""
    ratio = torch.where(verified > 0, (p / verified.clamp_min(TINY)).clamp(max=1.0), 1.0)  # [..., V]
    return drawn * ratio


def _recover_rejected(accepted: torch.Tensor, p: torch.Tensor, verified: torch.Tensor) -> torch.Tensor:
    """The mass `accepted` [..., V] leaves, recovered from norm(max(0, p - `verified`))."""
    kept = accepted.sum(-1, keepdim=True)  # [..., 1]
    residual = (p - verified).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return (1 - kept).clamp_min(0.0) * torch.where(mass > 1e-12, residual / mass.clamp_min(TINY), p)


# (p, q, o) -> (the law a draft is drawn from, the q the verifier accepts and recovers with)
DrawnVerified = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _top_p_draws(p: torch.Tensor, q: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return top_p(q, TOP_P), q


def _verified_with_other(p: torch.Tensor, q: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q, o


def _drawn_from_other(p: torch.Tensor, q: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return o, q


def _recover_bound(lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return (hi - q).clamp_min(0.0)  # max(0, p - q) grows with p


def _recover_from_p_bound(lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return (1 - torch.minimum(lo, q).sum(-1, keepdim=True)).clamp_min(0.0) * hi


def _recover_rejected_bound(
    drawn: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, verified: torch.Tensor
) -> torch.Tensor:
    """At least `_recover_rejected` for every p with lo <= p <= hi: the rejected mass at its
    largest (the accepted at lo), times the residual's share at its largest (its mass at lo: every
    p above lo has at least that residual mass; 1 where that mass may be 0)."""
    rejected = (1 - _accept_drawn_verified(drawn, lo, verified).sum(-1, keepdim=True)).clamp_min(0.0)
    mass = (lo - verified).clamp_min(0.0).sum(-1, keepdim=True)
    share = ((hi - verified).clamp_min(0.0) / mass.clamp_min(TINY)).clamp(max=1.0)
    return rejected * torch.where(mass > 1e-12, share, 1.0)


def _bonus(p: torch.Tensor, p_prev: torch.Tensor) -> torch.Tensor:
    return p


def _bonus_from_previous(p: torch.Tensor, p_prev: torch.Tensor) -> torch.Tensor:
    return torch.where(p_prev.sum(-1, keepdim=True) > 0, p_prev, p)


@dataclass(frozen=True)
class RoundClass:
    """A bug class as the parts of a round it changes: `accept(p, q, o)`, `recover(p, q, o)` and
    `bonus(p, p_prev)`, each [..., V], or, for a class whose draft is drawn from one law and
    verified with another, `drawn_verified(p, q, o)`, the two laws (each read once: a top-p law
    sorts the vocabulary). A class of the catalogue (`losscheck.stats.buglaws`, same name), or a
    q-contract class (`reads_other`), which engines alone are judged on: the loop's drafters
    report the q they drew from, and its conformance tests judge its verifier directly."""

    name: str
    accept: Law = _accept
    recover: Law = _recover
    bonus: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _bonus
    reads_other: bool = False  # its law reads the draft model's other q (a cell without one: not run)
    drawn_verified: DrawnVerified | None = None  # where set, accept and recover follow from it
    # (lo, hi, q, o) -> at least `recover` for every p between lo and hi (`bounds`)
    recover_bound: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = _recover_bound

    def bounds(
        self, lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor, hi_prev: torch.Tensor, o: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The class's accepted, recovered and bonus laws [..., V], each at least its value for
        every target law p with lo <= p <= hi (and a previous one at most `hi_prev`): accepting
        and the bonus grow with p, the recovered part is bounded by `recover_bound` (or, for a
        drawn-and-verified class, `_recover_rejected_bound`). The laws a draft is drawn from and
        verified with read q and o, not p."""
        if self.drawn_verified is None:
            return self.accept(hi, q, o), self.recover_bound(lo, hi, q, o), self.bonus(hi, hi_prev)
        drawn, verified = self.drawn_verified(hi, q, o)
        accept = _accept_drawn_verified(drawn, hi, verified)
        return accept, _recover_rejected_bound(drawn, lo, hi, verified), self.bonus(hi, hi_prev)


CLASSES: tuple[RoundClass, ...] = (
    RoundClass("residual_is_p", recover=_recover_from_p, recover_bound=_recover_from_p_bound),
    RoundClass("bonus_from_previous_slot", bonus=_bonus_from_previous),
    RoundClass("top_p_one_side", drawn_verified=_top_p_draws),
    # the q contract (transformers #47932: DFlash, MTP and assisted candidates drawn from processed
    # logits, the raw ones returned as q; DeepSpec #31: drafted in bf16, q taken in fp32)
    RoundClass("q_raw_in_verify", drawn_verified=_verified_with_other, reads_other=True),
    RoundClass("q_raw_in_draft", drawn_verified=_drawn_from_other, reads_other=True),
)
# what each q-contract class is (the certificate's and docs' words)
Q_CONTRACT = {
    "q_raw_in_verify": "the draft is drawn from the draft model's processed q, the verifier accepts and recovers "
    "with its raw q (transformers #47932)",
    "q_raw_in_draft": "the draft is drawn from the draft model's raw q, the verifier uses the processed one",
}
BY_NAME = {c.name: c for c in CLASSES}
# the catalogue's classes no filter makes exact on an engine's tokens, and why (the certificate says so)
NOT_JUDGED = {
    "stale_q": "its law reads the previous round's q for the slot, which depends on drafts the engine threw away",
    "drafter_misreports_one_id": "its law needs the over-drawn id fixed before the tested sample (a pilot's "
    "choice), which engine cells do not make",
    "draft_noise_reused": "no filter for it yet: at the 0.88 acceptance of the bug-class table it needs 102k tokens "
    "in the loop's own cells (`python -m losscheck.selftest.bugtable`), beyond an engine cell's size",
}


FirstToken = Literal["round", "prefill"]
"""Where an engine's first generated token comes from: its first round (slot 0, drafted and
verified: losscheck's loop, Hugging Face assisted generation) or the prefill's own sample of p
(vLLM, llama.cpp, OpenVINO GenAI), after which the first round starts. An adapter says it as
`first_token`; the round filter otherwise mixes both."""
FIRST_TOKEN: tuple[FirstToken, ...] = ("round", "prefill")


class RoundParts(NamedTuple):
    """The probabilities of the emitted tokens under each class's members: [n, L, C, G] each
    (C classes, G members), and p's [n, L]."""

    accept: torch.Tensor
    recover: torch.Tensor
    bonus: torch.Tensor
    p: torch.Tensor


class ClassLaws(NamedTuple):
    """A class's round at every position, [..., V] each: the law of a draft slot's emitted token
    when the class acts there (its accepted + recovered parts), that law's accepted part, and the
    bonus slot's law. Member ρ mixes each with the correct one: (1 - ρ)·H0 + ρ·class."""

    draft: torch.Tensor
    accept: torch.Tensor
    bonus: torch.Tensor


def class_laws(
    cls: RoundClass, p: torch.Tensor, q: torch.Tensor, p_prev: torch.Tensor, other: torch.Tensor | None = None
) -> ClassLaws:
    """`cls` at every position, from p, q, p_prev and the draft model's other q [..., V] (float64;
    None: q itself, under which a q-contract class is the correct round)."""
    o = q if other is None else other
    if cls.drawn_verified is None:
        accept, recover = cls.accept(p, q, o), cls.recover(p, q, o)
    else:
        drawn, verified = cls.drawn_verified(p, q, o)
        accept = _accept_drawn_verified(drawn, p, verified)
        recover = _recover_rejected(accept, p, verified)
    return ClassLaws(accept + recover, accept, cls.bonus(p, p_prev))


def round_parts(
    p: torch.Tensor,
    q: torch.Tensor,
    tokens: torch.Tensor,
    classes: tuple[RoundClass, ...] = CLASSES,
    other: torch.Tensor | None = None,
) -> RoundParts:
    """Gather every class's member laws at the emitted `tokens` [n, L], from the target's p, the
    drafter's q and its other q (`class_laws`) [n, L, V] (float64, rows summing to 1)
    teacher-forced over the same tokens."""
    p_prev = torch.cat([torch.zeros_like(p[:, :1]), p[:, :-1]], dim=1)  # [n, L, V], zeros at t = 0
    at = tokens[..., None].clamp(0, p.shape[-1] - 1)  # [n, L, 1]
    p_x, accept_h0 = _gather(p, at), _gather(torch.minimum(p, q), at)
    per_class = []
    for cls in classes:
        laws = class_laws(cls, p, q, p_prev, other)
        per_class.append((laws.accept, laws.draft - laws.accept, laws.bonus))
    return _mixed(per_class, (accept_h0, p_x - accept_h0, p_x), p_x, at)


def _gather(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """x [n, L, V] at the ids `at` [n, L, 1] → [n, L]."""
    return x.gather(-1, at).squeeze(-1)


def _mixed(
    per_class: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    h0: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    numerator: torch.Tensor,
    at: torch.Tensor,
) -> RoundParts:
    """Each class's (accepted, recovered, bonus) law [n, L, V] at the ids `at` [n, L, 1], mixed
    with H0's parts `h0` (each [n, L], at those ids) over the members: ρ·class + (1 - ρ)·H0, as
    `RoundParts` whose `p` is `numerator` [n, L]."""
    rho = torch.tensor(MEMBERS, dtype=torch.float64, device=numerator.device)  # [G]
    parts: list[list[torch.Tensor]] = [[], [], []]
    for laws in per_class:
        for part, law, null in zip(parts, laws, h0, strict=True):
            part.append(rho * _gather(law, at)[..., None] + (1 - rho) * null[..., None])  # [n, L, G]
    accept, recover, bonus = (torch.stack(part, -2) for part in parts)  # [n, L, C, G]
    return RoundParts(accept, recover, bonus, numerator)


def kept_bounds(p: torch.Tensor, wide: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds lo <= p_K <= hi [n, L, V] on the law of every kept set K an implementation of an
    ambiguous cut-off may keep, S ⊆ K ⊆ S ∪ U: `p` [n, L, V] the law on the sure tokens S (p_S,
    `losscheck.cells.scoring.cutoff_law`), `wide` the law before the cut-off on S ∪ U
    (`widest_law`; equal to p where the cut-off is not ambiguous, and then lo = hi = p). With w
    that law, p_K(x) = w(x) / w(K) on K: at most w(x) / w(S) for x in S and w(x) / (w(S) + w(x))
    for x in U (K at its smallest), at least w(x) / w(S ∪ U) for x in S, and 0 for x in U."""
    sure = p > 0
    mass = (wide * sure).sum(-1, keepdim=True)  # [n, L, 1] w(S) / w(S ∪ U)
    lo = wide * sure
    hi = torch.where(sure, wide / mass.clamp_min(TINY), wide / (mass + wide).clamp_min(TINY))
    exact = (wide == p).all(-1, keepdim=True)  # [n, L, 1] not ambiguous
    return torch.where(exact, p, lo), torch.where(exact, p, hi)


def round_bounds(
    p: torch.Tensor,
    wide: torch.Tensor,
    q: torch.Tensor,
    tokens: torch.Tensor,
    classes: tuple[RoundClass, ...] = CLASSES,
    other: torch.Tensor | None = None,
    exact: RoundParts | None = None,
) -> RoundParts:
    """`round_parts` for a rule-out e-value where the cut-off is ambiguous: each part the largest
    any kept set gives it (`kept_bounds`, `RoundClass.bounds`), so that the filter's product is at
    least each member's law of the row whatever the engine kept; and `wide` at the emitted token
    as its numerator, a law that sums to 1 (p_S would give a token in U no mass). `p`, `wide`, q,
    `other` [n, L, V] float64; `tokens` [n, L]. Only the positions a bound changes are computed
    (the ambiguous ones and, for a bonus that reads the previous p, each one after them); the
    others are `round_parts`' (`exact`, where the caller has them, for these classes)."""
    exact = round_parts(p, q, tokens, classes, other) if exact is None else exact
    ambiguous = (wide != p).any(-1)  # [n, L]
    touched = ambiguous | torch.cat([torch.zeros_like(ambiguous[:, :1]), ambiguous[:, :-1]], dim=1)
    if not bool(touched.any()):
        return exact
    lo, hi = kept_bounds(p, wide)
    hi_prev = torch.cat([torch.zeros_like(hi[:, :1]), hi[:, :-1]], dim=1)
    o = q if other is None else other
    lo, hi, hi_prev, q_t, o_t, wide_t = (x[touched] for x in (lo, hi, hi_prev, q, o, wide))  # [m, V]
    at = tokens[touched][:, None].clamp(0, p.shape[-1] - 1)  # [m, 1]
    h0 = (_gather(torch.minimum(hi, q_t), at), _gather((hi - q_t).clamp_min(0.0), at), _gather(hi, at))
    per_class = [cls.bounds(lo, hi, q_t, hi_prev, o_t) for cls in classes]
    bounded = _mixed(per_class, h0, _gather(wide_t, at), at)  # [m, C, G] parts, [m] numerator
    out = [part.clone() for part in exact]
    for whole, part in zip(out, bounded, strict=True):
        whole[touched] = part
    return RoundParts(*out)


class Filtered(NamedTuple):
    """The forward filter's output: per row the log-LR of every member, [n, C, G]; the belief in
    the bonus slot and in slot 0 (a round's first draft) before each position, [n, L, C, G]."""

    log_lr: torch.Tensor
    bonus_belief: torch.Tensor
    first_belief: torch.Tensor


def filter_rounds(
    parts: RoundParts,
    k: int,
    generated: torch.Tensor,
    scored: torch.Tensor,
    first: FirstToken | None = "round",
) -> Filtered:
    """Run the slot filter along each row (`generated` [n, L]: positions the engine emitted;
    `scored` [n, L] ⊆ generated: those whose factor counts). Block length `k` >= 1. Where a row's
    first token comes from (`first`, `FirstToken`): "round", the first round's slot 0; "prefill",
    the prefill's sample of p (as a bonus slot: every class draws it from p, and the first round
    starts after it); None (the engine does not say): either, half and half. Fed `round_bounds`,
    the product of its factors' denominators is at least the member's law of the row's scored
    prefix (every part is, and the filter's recursion only adds and multiplies them)."""
    if k < 1:
        raise LosscheckError(f"the round filter needs a block length k >= 1, got {k}")
    if first not in (*FIRST_TOKEN, None):
        raise LosscheckError(f"the round filter's first token comes from one of {FIRST_TOKEN} (or None), got {first!r}")
    n, length, c, g = parts.accept.shape
    belief = torch.zeros(n, c, g, k + 1, dtype=torch.float64, device=parts.accept.device)
    start = {"round": {0: 1.0}, "prefill": {k: 1.0}, None: {0: 0.5, k: 0.5}}[first]
    for slot, weight in start.items():
        belief[..., slot] = weight
    log_lr = torch.zeros(n, c, g, dtype=torch.float64, device=belief.device)
    bonus_belief = torch.zeros(n, length, c, g, dtype=torch.float64, device=belief.device)
    first_belief = torch.zeros_like(bonus_belief)
    for t in range(length):
        accept, recover, bonus = parts.accept[:, t], parts.recover[:, t], parts.bonus[:, t]  # [n, C, G]
        draft, last = belief[..., :k].sum(-1), belief[..., k]  # [n, C, G]
        bonus_belief[:, t], first_belief[:, t] = last, belief[..., 0]
        predicted = draft * (accept + recover) + last * bonus  # [n, C, G]
        factor = predicted.clamp_min(TINY).log() - parts.p[:, t, None, None].clamp_min(TINY).log()
        step = torch.where(predicted > 0, factor, -math.inf)
        log_lr += torch.where(scored[:, t, None, None], step, 0.0)
        after = torch.cat([(draft * recover + last * bonus)[..., None], belief[..., :k] * accept[..., None]], -1)
        total = after.sum(-1, keepdim=True)
        after = torch.where(total > 0, after / total.clamp_min(TINY), _start(belief))  # an impossible token: restart
        belief = torch.where(generated[:, t, None, None, None], after, belief)
    return Filtered(log_lr, bonus_belief, first_belief)


def bounded_positions(generated: torch.Tensor, no_sure: torch.Tensor | None) -> torch.Tensor:
    """The `generated` positions [n, L] a rule-out e-value reads (`RoundsSample.rule_out_log_e`):
    every one before its row's first position where no token is surely kept (`no_sure` [n, L];
    None: none), where `kept_bounds` would bound nothing (the row stops there, a stopping time,
    and its prefix's e-value keeps its mean). Every read position needs a factor, a token the
    cut-off may have dropped included: a filter fed the sure tokens' law p_S at an ambiguous
    position, and read after it, gave the bonus bug's rule-out e-value an infinite mean under
    that bug where the engine kept one token more (`tests/unit/stats`)."""
    if no_sure is None:
        return generated.clone()
    return generated & (no_sure.to(torch.int32).cumsum(-1) == 0)


def _start(belief: torch.Tensor) -> torch.Tensor:
    fresh = torch.zeros_like(belief)
    fresh[..., 0] = 1.0
    return fresh


def _per_class() -> torch.Tensor:
    """[C] zeros: one sum per class."""
    return torch.zeros(len(CLASSES), dtype=torch.float64)


def _per_member() -> torch.Tensor:
    """[C, G] zeros: one sum per class and member."""
    return torch.zeros(len(CLASSES), len(MEMBERS), dtype=torch.float64)


def _sum(a: Any, b: Any) -> Any:
    """Two samples' sums of one field (a tuple, the classes, is the same in both)."""
    return a if isinstance(a, tuple) else a + b


@dataclass
class RoundsPower:
    """Per class and member, sums over scored positions of the log-LR increment's mean, second
    moment and mass outside p's support under the member's predictive law."""

    classes: tuple[str, ...] = tuple(c.name for c in CLASSES)
    tokens: int = 0
    mean: torch.Tensor = field(default_factory=_per_member)
    second: torch.Tensor = field(default_factory=_per_member)
    outside: torch.Tensor = field(default_factory=_per_member)
    # Σ over scored positions of E_p[log(P'/p)] = -KL(p‖P') (tokens both give mass): Wald's drift under H0
    null: torch.Tensor = field(default_factory=_per_member)
    # standard errors, rows as clusters: with S_r a row's summed drift (or mass outside p's
    # support) and N_r its scored positions, Σ S_r², Σ S_r·N_r, Σ N_r² and the rows with a scored
    # position (`drift`, `outside_rate`)
    row_second: torch.Tensor = field(default_factory=_per_member)
    row_cross: torch.Tensor = field(default_factory=_per_member)
    row_outside_second: torch.Tensor = field(default_factory=_per_member)
    row_outside_cross: torch.Tensor = field(default_factory=_per_member)
    # the same for a row's summed second moment M_r: Σ M_r², Σ M_r·N_r (`second_moment`)
    row_moment_second: torch.Tensor = field(default_factory=_per_member)
    row_moment_cross: torch.Tensor = field(default_factory=_per_member)
    # at the catalogue point (ρ = 1, a second stage's row score), per class under H0: Σ over
    # positions of E_p[log(P'/p)²] and Σ over rows of (a row's summed E_p[log(P'/p)])² (`row_shift`)
    null_second: torch.Tensor = field(default_factory=_per_class)
    row_null_second: torch.Tensor = field(default_factory=_per_class)
    row_tokens_sq: float = 0.0
    rows: int = 0
    rule_out_tokens: int = 0  # of `tokens`, those the rule-out e-values read (`rule_out_rate`)

    def update(
        self,
        p: torch.Tensor,
        q: torch.Tensor,
        filtered: Filtered,
        scored: torch.Tensor,
        other: torch.Tensor | None = None,
        rule_out: torch.Tensor | None = None,
    ) -> None:
        """Add the scored positions [n, L] of a chunk: p, q, other [n, L, V] and the filter's beliefs;
        `rule_out` [n, L], the positions the rule-out e-values read (None: every scored one).
        Member ρ's predictive law is p + ρ·((1 - π_k)·draft + π_k·bonus - p), π_k its belief in
        the bonus slot, draft and bonus its class's laws (`class_laws`)."""
        p_prev = torch.cat([torch.zeros_like(p[:, :1]), p[:, :-1]], dim=1)
        pick = scored.to(torch.bool)
        self.tokens += int(pick.sum())
        self.rule_out_tokens += int(pick.sum() if rule_out is None else (pick & rule_out).sum())
        per_row = pick.sum(1).double()  # [n]
        self.row_tokens_sq += float((per_row * per_row).sum())
        self.rows += int((per_row > 0).sum())
        row_of = torch.arange(pick.shape[0], device=pick.device)[:, None].expand_as(pick)[pick]  # [m]
        # float32: moments for a power estimate need no more, and it halves the cost of 21 laws per token
        ps, qs, prev = (x[pick].float() for x in (p, q, p_prev))  # [m, V]
        os = None if other is None else other[pick].float()
        support = ps > 0
        # no cut-off (p keeps every id): nothing lies outside p's support, and a member ρ < 1 gives
        # every id of p's support mass ((1 - ρ)·p > 0), so its factor needs no mask there; ρ = 1 is
        # the class's law alone
        whole = bool(support.all())
        off = ~support  # [m, V]
        # [m, V] 1 outside p's support (a law's mass there is one vecdot), read only with a cut-off
        off_mass = torch.empty(0) if whole else off.float()
        p_floor = ps.clamp_min(TINY32)  # a subnormal float32 p: P'/p stays finite (as log p's floor did)
        for ci, name in enumerate(self.classes):
            laws = class_laws(BY_NAME[name], ps, qs, prev, os)
            towards = laws.bonus - laws.draft  # [m, V]
            away = laws.draft - ps  # [m, V]
            for gi, rho in enumerate(MEMBERS):
                last = filtered.bonus_belief[..., ci, gi][pick][:, None].float()  # [m, 1]
                # P' - p = ρ·(draft + π·(bonus - draft) - p), and log(P'/p) = log1p((P' - p) / p): no
                # cancellation between two logs of nearby values (float32 keeps a drift near zero)
                delta = torch.addcmul(away, last, towards).mul_(rho)  # [m, V]
                law = delta + ps
                ratio = delta.div_(p_floor).log1p_()  # [m, V]
                if rho == 1.0:  # where p or the member gives no mass: no factor
                    ratio.masked_fill_(~(support & (law > 0)), 0.0)
                elif not whole:
                    ratio.masked_fill_(off, 0.0)
                weighted = law * ratio
                per_token = weighted.sum(-1)  # [m] E_P'[log(P'/p)]
                drift = torch.zeros_like(per_row).index_add_(0, row_of, per_token.double())  # [n]
                self.row_second[ci, gi] += float((drift * drift).sum())
                self.row_cross[ci, gi] += float((drift * per_row).sum())
                self.mean[ci, gi] += float(drift.sum())
                moment = torch.zeros_like(per_row).index_add_(0, row_of, torch.linalg.vecdot(weighted, ratio).double())
                self.row_moment_second[ci, gi] += float((moment * moment).sum())
                self.row_moment_cross[ci, gi] += float((moment * per_row).sum())
                self.second[ci, gi] += float(moment.sum())
                if rho == 1.0:  # the second stage's row score: its law under H0 too
                    under_p = ps * ratio  # [m, V]
                    null = torch.zeros_like(per_row).index_add_(0, row_of, under_p.sum(-1).double())  # [n]
                    self.null[ci, gi] += float(null.sum())
                    self.null_second[ci] += float(torch.linalg.vecdot(under_p, ratio).sum())
                    self.row_null_second[ci] += float((null * null).sum())
                else:
                    self.null[ci, gi] += float(torch.dot(ps.flatten(), ratio.flatten()))
                if whole:
                    continue  # nothing lies outside p's support
                outside = torch.zeros_like(per_row).index_add_(
                    0, row_of, torch.linalg.vecdot(law, off_mass).double()
                )  # [n]
                self.row_outside_second[ci, gi] += float((outside * outside).sum())
                self.row_outside_cross[ci, gi] += float((outside * per_row).sum())
                self.outside[ci, gi] += float(outside.sum())

    def plus(self, other: RoundsPower) -> RoundsPower:
        """The sums of both samples (the same classes): a pilot's and a tested sample's rows as one
        estimate of the per-token moments, the rows of each still clusters."""
        if other.classes != self.classes:
            raise LosscheckError(
                f"RoundsPower.plus: the samples judge different classes ({self.classes} and {other.classes})"
            )
        return RoundsPower(**{f.name: _sum(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})

    def drift(self, name: str, rho: float = 1.0) -> tuple[float, float]:
        """Member ρ's mean per-token drift E_P'[log(P'/p)] and its standard error (`_clustered`)."""
        ci, gi = self.classes.index(name), MEMBERS.index(rho)
        return self._clustered(self.mean[ci, gi], self.row_second[ci, gi], self.row_cross[ci, gi])

    def second_moment(self, name: str, rho: float = 1.0) -> tuple[float, float]:
        """Member ρ's mean per-token second moment E_P'[log(P'/p)²] and its standard error."""
        ci, gi = self.classes.index(name), MEMBERS.index(rho)
        return self._clustered(self.second[ci, gi], self.row_moment_second[ci, gi], self.row_moment_cross[ci, gi])

    def outside_rate(self, name: str, rho: float = 1.0) -> tuple[float, float]:
        """Member ρ's mean per-token mass outside p's support and its standard error."""
        ci, gi = self.classes.index(name), MEMBERS.index(rho)
        return self._clustered(self.outside[ci, gi], self.row_outside_second[ci, gi], self.row_outside_cross[ci, gi])

    def _clustered(self, total: torch.Tensor, second: torch.Tensor, cross: torch.Tensor) -> tuple[float, float]:
        """A per-token mean Σ_r S_r / Σ_r N_r and its standard error. Rows are the independent
        units, so the ratio estimator's error is over rows:
        SE² = R / (R - 1) · Σ_r (S_r - μ·N_r)² / (Σ_r N_r)²; inf with fewer than two rows."""
        mu = float(total) / max(self.tokens, 1)
        if self.rows < 2:
            return mu, math.inf
        spread = float(second) - 2 * mu * float(cross) + mu * mu * self.row_tokens_sq
        return mu, math.sqrt(max(spread, 0.0) * self.rows / (self.rows - 1)) / self.tokens

    def row_shift(self, name: str) -> RowShift:
        """The law of a second stage's row score for class `name` (a row's summed log-LR at ρ = 1,
        `RoundsSample.row_scores`), speculative rows with the class against speculation-off rows
        (`losscheck.stats.second_stage`): under the class the drift at its lower and the second
        moment at its upper `DRIFT_CONFIDENCE` bound, under H0 the point sums (its mean, -KL, is
        the smaller term and only widens the shift by being larger in size)."""
        ci, gi = self.classes.index(name), MEMBERS.index(1.0)
        if self.rows < 2:
            return RowShift(0.0, math.inf, math.inf)
        estimate, error = self.drift(name)
        moment, moment_error = self.second_moment(name)
        rows, per = float(self.rows), max(self.tokens, 1)

        def spread(total: torch.Tensor, squares: torch.Tensor) -> float:  # Var over rows of a row's sum
            return max(float(squares) / rows - (float(total) / rows) ** 2, 0.0)

        return clustered_shift(
            tokens=self.tokens,
            rows=rows,
            bug_mean=estimate - _DRIFT_Z * error,
            bug_second=moment + _DRIFT_Z * moment_error,
            bug_row_spread=spread(self.mean[ci, gi], self.row_second[ci, gi]),
            h0_mean=float(self.null[ci, gi]) / per,
            h0_second=float(self.null_second[ci]) / per,
            h0_row_spread=spread(self.null[ci, gi], self.row_null_second[ci]),
        )

    def support_shift(self, name: str) -> SupportShift:
        """The law of a second stage's `support` score under class `name` at ρ = 1: its mass
        outside p's support per token at the lower `DRIFT_CONFIDENCE` bound, rows of this
        sample's scored tokens a row."""
        rate, error = self.outside_rate(name)
        return SupportShift(max(rate - _DRIFT_Z * error, 0.0), self.tokens / max(self.rows, 1))

    def power(self, name: str, rho: float, tokens: float, alpha: float) -> float:
        """The power of `rounds_test` at level `alpha` after `tokens` scored tokens against member ρ,
        at the lower `DRIFT_CONFIDENCE` bounds of its drift and of its mass outside p's support
        (`drift`, `outside_rate`), and the increment's variance at its upper bound (the second
        moment's, less the drift bound squared) wherever that lowers the power (above one half)."""
        if self.tokens == 0 or tokens <= 0:
            return 0.0
        estimate, error = self.drift(name, rho)
        mu = estimate - _DRIFT_Z * error
        moment, moment_error = self.second_moment(name, rho)
        threshold = math.log(len(MEMBERS) / alpha)
        gauss = 0.0
        if mu > 0:
            point = max(moment - estimate * estimate, 1e-300)
            upper = moment + _DRIFT_Z * moment_error - mu * mu if math.isfinite(moment_error) else point  # >= point
            z = (tokens * mu - threshold) / math.sqrt(tokens)
            gauss = min(float(stats.norm.cdf(z / math.sqrt(v))) for v in (point, upper))
        rate, rate_error = self.outside_rate(name, rho)
        out = min(max(rate - _DRIFT_Z * rate_error, 0.0), 1.0)
        return max(gauss, 1 - (1 - out) ** tokens)

    def rule_out_share(self) -> float | None:
        """Of the scored tokens, the share the rule-out e-values read (None before any token)."""
        return self.rule_out_tokens / self.tokens if self.tokens else None

    def rule_out_rate(self, name: str, rho: float) -> float | None:
        """How fast member ρ of class `name`'s family is ruled out under H0: the mean growth per
        scored token of its log rule-out e-value, KL(p‖P'_ρ) (the tokens both give mass) times the
        share of scored tokens the rule-outs read (`bounded_positions`); None before any token."""
        ci, gi = self.classes.index(name), MEMBERS.index(rho)
        share = self.rule_out_share()
        return None if share is None else -float(self.null[ci, gi]) / self.tokens * share

    def wald(self, name: str, alpha: float, power: float, rho: float = 1.0) -> WaldSize:
        """Wald's SPRT of p against member ρ's predictive law: its expected scored tokens at
        `alpha` and `power`, under the member and under H0 (`losscheck.stats.effects.wald_size`)."""
        ci, gi = self.classes.index(name), MEMBERS.index(rho)
        per = max(self.tokens, 1)
        h1, h0, out = (float(x[ci, gi]) / per for x in (self.mean, self.null, self.outside))
        return wald_size(h1, h0, alpha, power, out) if self.tokens else WaldSize(math.inf, math.inf)

    def tokens_needed(self, name: str, alpha: float, level: float, rho: float = 1.0, cap: int = 10**9) -> float:
        """The fewest scored tokens at which `power` reaches `level` (inf beyond `cap`)."""
        if self.power(name, rho, cap, alpha) < level:
            return math.inf
        low, high = 0, cap
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.power(name, rho, mid, alpha) < level else (low, mid)
        return float(high)

    def smallest_rho(self, name: str, tokens: float, alpha: float, level: float) -> float | None:
        """The smallest member caught at `level` within `tokens` (None: not even ρ = 1)."""
        caught = [rho for rho in MEMBERS if self.power(name, rho, tokens, alpha) >= level]
        return min(caught) if caught else None


CORRECT = RoundClass("correct")  # every part as H0 has it: the filter's belief under the declared draft law


@dataclass
class Acceptance:
    """What an engine's own counters should count over the rows the filter read, if its drafts
    follow the declared law and its output follows p: the rounds (one per slot 0) and the rounds
    whose first draft was accepted, each as a sum over positions of the filter's H0 probability
    given the tokens up to that position (so each sum has the count's expectation), with the sum
    of those probabilities' Bernoulli variances. A round's first draft always lies within the
    emitted tokens, later ones may not (a row's last round, a draft after an end token): only the
    first position is predicted."""

    rounds: float = 0.0
    rounds_var: float = 0.0
    first_accepted: float = 0.0
    first_var: float = 0.0

    def add(
        self, p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, filtered: Filtered, generated: torch.Tensor
    ) -> None:
        """`filtered`: `filter_rounds` over `CORRECT` alone; p, q [n, L, V], `tokens` and `generated` [n, L]."""
        at = tokens[..., None].clamp(0, p.shape[-1] - 1)
        p_x = p.gather(-1, at).squeeze(-1)  # [n, L]
        a_x = torch.minimum(p, q).gather(-1, at).squeeze(-1)
        first = filtered.first_belief[..., 0, 0]  # [n, L]
        w = torch.where(p_x > 0, first * a_x / p_x.clamp_min(TINY), 0.0)
        keep = generated.to(torch.bool)
        self.rounds += float(first[keep].sum())
        self.rounds_var += float((first * (1 - first))[keep].sum())
        self.first_accepted += float(w[keep].sum())
        self.first_var += float((w * (1 - w))[keep].sum())

    def plus(self, other: Acceptance) -> Acceptance:
        return Acceptance(
            self.rounds + other.rounds,
            self.rounds_var + other.rounds_var,
            self.first_accepted + other.first_accepted,
            self.first_var + other.first_var,
        )


@dataclass
class RoundsSample:
    """A sample of engine rows scored chunk by chunk: per class and member the summed log-LR
    (what `rounds_test` reads) over `tokens` scored positions, per row the catalogue point's
    log-LR (a second stage's row scores), and the power sums of `RoundsPower` from the sample's
    own p and q — over every row, or the rows the caller picks (an estimate of the per-token
    moments: the filter itself always runs on every row)."""

    k: int
    first: FirstToken | None = "round"  # where each row's first token comes from (`filter_rounds`)
    log_lr: torch.Tensor = field(default_factory=_per_member)
    tokens: int = 0
    power: RoundsPower = field(default_factory=RoundsPower)
    rows: list[torch.Tensor] = field(default_factory=list)  # [n_j, C] per chunk
    acceptance: Acceptance = field(default_factory=Acceptance)  # what the engine's counters should count
    # per class and member, Σ log(p / P'_ρ) over the positions the rule-out e-values read (`rule_out_log_e`)
    rule_out: torch.Tensor = field(default_factory=_per_member)

    def update(
        self,
        p: torch.Tensor,
        q: torch.Tensor,
        tokens: torch.Tensor,
        generated: torch.Tensor,
        scored: torch.Tensor,
        power_rows: torch.Tensor | None = None,
        other: torch.Tensor | None = None,
        wide: torch.Tensor | None = None,
        no_sure: torch.Tensor | None = None,
    ) -> None:
        """Add a chunk: p, q [n, L, V] float64 teacher-forced over `tokens` [n, L]; `generated` and
        `scored` [n, L] as `filter_rounds` reads them; `power_rows` [n] bool, the rows whose
        positions the power sums read (None: every row); `other` [n, L, V], the draft model's other
        q (`class_laws`; None where it is q itself). Where a cut-off is ambiguous, p is the law on
        its sure tokens, `wide` [n, L, V] the law on every token it may keep and `no_sure` [n, L]
        the positions with no sure token (`losscheck.cells.scoring.ForcedProbs`; None: no position
        is ambiguous): the rule-out e-values then read the filter of `round_bounds`."""
        parts = round_parts(p, q, tokens, other=other)
        filtered = filter_rounds(parts, self.k, generated, scored, self.first)
        self.log_lr += filtered.log_lr.sum(0).cpu()
        if wide is None:  # every member's law is exact: its own log-LR rules it out
            read, rule_log_lr = scored, filtered.log_lr
        else:
            read = bounded_positions(generated, no_sure)
            bounds = round_bounds(p, wide.to(p), q, tokens, other=other, exact=parts)
            rule_log_lr = filter_rounds(bounds, self.k, generated, read, self.first).log_lr
        self.rule_out -= rule_log_lr.sum(0).cpu()
        self.tokens += int(scored.sum())
        self.rows.append(filtered.log_lr[..., MEMBERS.index(1.0)].cpu())
        picked = scored if power_rows is None else scored & power_rows.to(scored.device)[:, None]
        self.power.update(p, q, filtered, picked, other, read)
        h0 = filter_rounds(round_parts(p, q, tokens, (CORRECT,)), self.k, generated, scored, self.first)
        self.acceptance.add(p, q, tokens, h0, generated)

    def rule_out_log_e(self) -> dict[str, float]:
        """Per class and member ρ, under `sequential.member_key`, the log of the e-value that rules
        the member out (`losscheck.stats.sequential`): Π p(x) / P'_ρ(x | x_<t) over the positions
        read, a supermartingale of mean at most 1 under the member, P' its exact predictive law
        given the declared draft law and first token, or a bound on it at least as large where a
        cut-off is ambiguous (`round_bounds`, read at `bounded_positions`).
        Where the engine does not say where its first token comes from, P' is the even mixture of
        the two filters' laws, whose product is at least half the true one's: log 2 is taken off,
        so the threshold keeps its β."""
        slack = math.log(2) if self.first is None else 0.0
        return {
            member_key(cls.name, rho): float(self.rule_out[ci, gi]) - slack
            for ci, cls in enumerate(CLASSES)
            for gi, rho in enumerate(MEMBERS)
        }

    def row_scores(self, name: str) -> torch.Tensor:
        """[N] each row's log-LR of class `name` at ρ = 1, in the order the rows were added."""
        return torch.cat(self.rows)[:, [c.name for c in CLASSES].index(name)]


def rounds_test(sample: RoundsSample, name: str, alpha: float, level: float) -> TestResult:
    """Class `name`'s mixture e-value e = mean over members of Π_rows LR_ρ: H0 rejected when
    e >= 1 / `alpha` (p = min(1, 1/e), valid at any stopping time). States the smallest member
    the tested sample's own p and q say it catches at `level`."""
    ci = [c.name for c in CLASSES].index(name)
    log_e = float(torch.logsumexp(sample.log_lr[ci], 0)) - math.log(len(MEMBERS))
    rho = sample.power.smallest_rho(name, sample.tokens, alpha, level)
    best = int(sample.log_lr[ci].argmax())
    return TestResult(
        name=f"rounds.{name}",
        expected=f"the emitted tokens follow p, not the law of a verifier with {name} (filtered over hidden slots)",
        observed=f"mixture e-value 10^{log_e / math.log(10):.2f} over {len(MEMBERS)} members, largest at "
        f"rho = {MEMBERS[best]:.3g}",
        statistic=log_e,
        p_value=min(1.0, math.exp(-log_e)) if log_e > -700 else 1.0,
        alpha=alpha,
        n=sample.tokens,
        power=level,
        detectable={"rho": math.inf if rho is None else rho},
        log10_p=min(0.0, -log_e / math.log(10)),
    )


def _registered(name: str) -> Callable[[RoundsSample, float, float], TestResult]:
    def run(sample: RoundsSample, alpha: float, power: float) -> TestResult:
        return rounds_test(sample, name, alpha, power)

    return run


# a class whose law only differs where the draft was sampled: nothing to test under greedy drafts
_READS_SAMPLED_DRAFTS = {"top_p_one_side"}
for _cls in CLASSES:
    _needs = frozenset({SAMPLED_DRAFTS}) if _cls.name in _READS_SAMPLED_DRAFTS else frozenset()
    _needs |= frozenset({OTHER_Q}) if _cls.reads_other else frozenset()
    register(StatTest(f"rounds.{_cls.name}", ROUNDS, "conformance", _registered(_cls.name), anytime=True, needs=_needs))
