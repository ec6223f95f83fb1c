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
at any stopping time (`rounds_test`). Positions the caller does not score (a cut-off's ambiguous
positions, `losscheck.cells.scoring`) move the belief and contribute no factor.

Power (`RoundsPower`): per member, the log-LR increment's mean and second moment under P' at each
scored position (its law over the whole vocabulary, the belief from the filter along the observed
tokens), averaged; the sum over n tokens taken as Gaussian, P(Σ ≥ log(G / α)), or caught outright
by a token outside p's support. Like `losscheck.stats.bugclass`, it assumes the bug changes the
emitted token's law, not which prefixes the run visits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from scipy import stats

from losscheck.errors import LosscheckError
from losscheck.stats.buglaws import TOP_P, top_p
from losscheck.stats.result import TestResult
from losscheck.stats.sequential import family

RHO_MIN = 1 / 8  # the smallest member of each family the mixture e-value spends weight on
MEMBERS = family(RHO_MIN)  # (1, 0.707, 0.5, ..., 0.125): equal weights
TINY = 1e-300

Law = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # two [..., V] laws -> [..., V]


def _accept(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.minimum(p, q)


def _recover(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p - q).clamp_min(0.0)


def _recover_from_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (1 - torch.minimum(p, q).sum(-1, keepdim=True)).clamp_min(0.0) * p


def _accept_top_p_draws(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    ratio = torch.where(q > 0, (p / q.clamp_min(TINY)).clamp(max=1.0), 1.0)  # [..., V]
    return top_p(q, TOP_P) * ratio


def _recover_top_p_draws(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    kept = _accept_top_p_draws(p, q).sum(-1, keepdim=True)  # [..., 1]
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return (1 - kept).clamp_min(0.0) * torch.where(mass > 1e-12, residual / mass.clamp_min(TINY), p)


def _bonus(p: torch.Tensor, p_prev: torch.Tensor) -> torch.Tensor:
    return p


def _bonus_from_previous(p: torch.Tensor, p_prev: torch.Tensor) -> torch.Tensor:
    return torch.where(p_prev.sum(-1, keepdim=True) > 0, p_prev, p)


@dataclass(frozen=True)
class RoundClass:
    """A bug class of the catalogue (`losscheck.stats.buglaws`, same name) as the parts of a round
    it changes: `accept(p, q)`, `recover(p, q)` and `bonus(p, p_prev)`, each [..., V]."""

    name: str
    accept: Law = _accept
    recover: Law = _recover
    bonus: Law = _bonus


CLASSES: tuple[RoundClass, ...] = (
    RoundClass("residual_is_p", recover=_recover_from_p),
    RoundClass("bonus_from_previous_slot", bonus=_bonus_from_previous),
    RoundClass("top_p_one_side", accept=_accept_top_p_draws, recover=_recover_top_p_draws),
)
BY_NAME = {c.name: c for c in CLASSES}
# the catalogue's classes no filter makes exact on an engine's tokens, and why (the certificate says so)
NOT_JUDGED = {
    "stale_q": "its law reads the previous round's q for the slot, which depends on drafts the engine threw away",
    "drafter_misreports_one_id": "its law needs the over-drawn id fixed before the tested sample (a pilot's "
    "choice), which engine cells do not make",
}


class RoundParts(NamedTuple):
    """The probabilities of the emitted tokens under each class's members: [n, L, C, G] each
    (C classes, G members), and p's [n, L]."""

    accept: torch.Tensor
    recover: torch.Tensor
    bonus: torch.Tensor
    p: torch.Tensor


def member_laws(cls: RoundClass, p: torch.Tensor, q: torch.Tensor, p_prev: torch.Tensor, rho: float):
    """Member ρ of `cls` at every position: (accept, recover, bonus) laws [..., V] each, from p, q
    and p_prev [..., V] (float64)."""
    mixes = (
        (cls.accept(p, q), _accept(p, q)),
        (cls.recover(p, q), _recover(p, q)),
        (cls.bonus(p, p_prev), p),
    )
    return tuple(rho * bug + (1 - rho) * h0 for bug, h0 in mixes)


def round_parts(
    p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, classes: tuple[RoundClass, ...] = CLASSES
) -> RoundParts:
    """Gather every class's member laws at the emitted `tokens` [n, L], from the target's p and the
    drafter's q [n, L, V] (float64, rows summing to 1) teacher-forced over the same tokens."""
    p_prev = torch.cat([torch.zeros_like(p[:, :1]), p[:, :-1]], dim=1)  # [n, L, V], zeros at t = 0
    at = tokens[..., None].clamp(0, p.shape[-1] - 1)  # [n, L, 1]
    out: list[list[list[torch.Tensor]]] = [[], [], []]  # part -> class -> members [n, L]
    for cls in classes:
        laws = [member_laws(cls, p, q, p_prev, rho) for rho in MEMBERS]
        for part in range(3):
            out[part].append([law[part].gather(-1, at).squeeze(-1) for law in laws])
    stacked = [torch.stack([torch.stack(m, -1) for m in part], -2) for part in out]  # [n, L, C, G]
    return RoundParts(*stacked, p.gather(-1, at).squeeze(-1))


class Filtered(NamedTuple):
    """The forward filter's output: per row the log-LR of every member, [n, C, G]; the belief in
    the bonus slot before each position, [n, L, C, G]."""

    log_lr: torch.Tensor
    bonus_belief: torch.Tensor


def filter_rounds(parts: RoundParts, k: int, generated: torch.Tensor, scored: torch.Tensor) -> Filtered:
    """Run the slot filter along each row (`generated` [n, L]: positions the engine emitted;
    `scored` [n, L] ⊆ generated: those whose factor counts). Block length `k` >= 1; rows start at slot 0."""
    if k < 1:
        raise LosscheckError(f"the round filter needs a block length k >= 1, got {k}")
    n, length, c, g = parts.accept.shape
    belief = torch.zeros(n, c, g, k + 1, dtype=torch.float64, device=parts.accept.device)
    belief[..., 0] = 1.0
    log_lr = torch.zeros(n, c, g, dtype=torch.float64, device=belief.device)
    bonus_belief = torch.zeros(n, length, c, g, dtype=torch.float64, device=belief.device)
    for t in range(length):
        accept, recover, bonus = parts.accept[:, t], parts.recover[:, t], parts.bonus[:, t]  # [n, C, G]
        draft, last = belief[..., :k].sum(-1), belief[..., k]  # [n, C, G]
        bonus_belief[:, t] = last
        predicted = draft * (accept + recover) + last * bonus  # [n, C, G]
        factor = predicted.clamp_min(TINY).log() - parts.p[:, t, None, None].clamp_min(TINY).log()
        log_lr += torch.where(scored[:, t, None, None], torch.where(predicted > 0, factor, -math.inf), 0.0)
        after = torch.cat([(draft * recover + last * bonus)[..., None], belief[..., :k] * accept[..., None]], -1)
        total = after.sum(-1, keepdim=True)
        after = torch.where(total > 0, after / total.clamp_min(TINY), _start(belief))  # an impossible token: restart
        belief = torch.where(generated[:, t, None, None, None], after, belief)
    return Filtered(log_lr, bonus_belief)


def _start(belief: torch.Tensor) -> torch.Tensor:
    fresh = torch.zeros_like(belief)
    fresh[..., 0] = 1.0
    return fresh


@dataclass
class RoundsPower:
    """Per class and member, sums over scored positions of the log-LR increment's mean, second
    moment and mass outside p's support under the member's predictive law."""

    classes: tuple[str, ...] = tuple(c.name for c in CLASSES)
    tokens: int = 0
    mean: torch.Tensor = field(default_factory=lambda: torch.zeros(len(CLASSES), len(MEMBERS), dtype=torch.float64))
    second: torch.Tensor = field(default_factory=lambda: torch.zeros(len(CLASSES), len(MEMBERS), dtype=torch.float64))
    outside: torch.Tensor = field(default_factory=lambda: torch.zeros(len(CLASSES), len(MEMBERS), dtype=torch.float64))

    def update(self, p: torch.Tensor, q: torch.Tensor, filtered: Filtered, scored: torch.Tensor) -> None:
        """Add the scored positions [n, L] of a chunk: p, q [n, L, V] and the filter's beliefs."""
        p_prev = torch.cat([torch.zeros_like(p[:, :1]), p[:, :-1]], dim=1)
        pick = scored.to(torch.bool)
        self.tokens += int(pick.sum())
        ps, qs, prev = p[pick], q[pick], p_prev[pick]  # [m, V]
        support = ps > 0
        for ci, name in enumerate(self.classes):
            for gi, rho in enumerate(MEMBERS):
                accept, recover, bonus = member_laws(BY_NAME[name], ps, qs, prev, rho)
                last = filtered.bonus_belief[..., ci, gi][pick][:, None]  # [m, 1]
                law = (1 - last) * (accept + recover) + last * bonus  # [m, V]
                ratio = torch.where(support & (law > 0), law.clamp_min(TINY).log() - ps.clamp_min(TINY).log(), 0.0)
                self.mean[ci, gi] += float((law * ratio).sum())
                self.second[ci, gi] += float((law * ratio.square()).sum())
                self.outside[ci, gi] += float(torch.where(support, 0.0, law).sum())

    def power(self, name: str, rho: float, tokens: float, alpha: float) -> float:
        """The power of `rounds_test` at level `alpha` after `tokens` scored tokens against member ρ."""
        ci, gi = self.classes.index(name), MEMBERS.index(rho)
        if self.tokens == 0 or tokens <= 0:
            return 0.0
        mu = float(self.mean[ci, gi]) / self.tokens
        var = max(float(self.second[ci, gi]) / self.tokens - mu * mu, 1e-300)
        threshold = math.log(len(MEMBERS) / alpha)
        gauss = float(stats.norm.cdf((tokens * mu - threshold) / math.sqrt(tokens * var))) if mu > 0 else 0.0
        out = float(self.outside[ci, gi]) / self.tokens
        return max(gauss, 1 - (1 - min(out, 1.0)) ** tokens)

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


@dataclass
class RoundsValues:
    """What `rounds_test` reads, summed over the tested rows: per class and member the log-LR, the
    scored tokens, and per row the catalogue point's log-LR (the second stage's row scores)."""

    log_lr: torch.Tensor = field(default_factory=lambda: torch.zeros(len(CLASSES), len(MEMBERS), dtype=torch.float64))
    tokens: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)  # [n_j, C] per chunk

    def add(self, filtered: Filtered, scored: torch.Tensor) -> None:
        self.log_lr += filtered.log_lr.sum(0).cpu()
        self.tokens += int(scored.sum())
        self.rows.append(filtered.log_lr[..., MEMBERS.index(1.0)].cpu())

    def row_scores(self, name: str) -> torch.Tensor:
        """[N] each tested row's log-LR of class `name` at ρ = 1."""
        return torch.cat(self.rows)[:, [c.name for c in CLASSES].index(name)]


def rounds_test(values: RoundsValues, name: str, alpha: float, power: RoundsPower, level: float) -> TestResult:
    """Class `name`'s mixture e-value e = mean over members of Π_rows LR_ρ: H0 rejected when
    e >= 1 / `alpha` (p = min(1, 1/e), valid at any stopping time). States the smallest member
    the tested sample's own p and q say it catches at `level`."""
    ci = [c.name for c in CLASSES].index(name)
    log_e = float(torch.logsumexp(values.log_lr[ci], 0)) - math.log(len(MEMBERS))
    rho = power.smallest_rho(name, values.tokens, alpha, level)
    best = int(values.log_lr[ci].argmax())
    return TestResult(
        name=f"rounds.{name}",
        expected=f"the emitted tokens follow p, not the law of a verifier with {name} (filtered over hidden slots)",
        observed=f"mixture e-value 10^{log_e / math.log(10):.2f} over {len(MEMBERS)} members, largest at "
        f"ρ = {MEMBERS[best]:.3g}",
        statistic=log_e,
        p_value=min(1.0, math.exp(-log_e)) if log_e > -700 else 1.0,
        alpha=alpha,
        n=values.tokens,
        power=level,
        detectable={"rho": math.inf if rho is None else rho},
        log10_p=min(0.0, -log_e / math.log(10)),
        scope="conformance",
    )
