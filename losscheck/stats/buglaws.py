"""The bug classes: realistic verifier and drafter bugs, each by the exact law of the emitted token
at a step.

A *step* is one generated position t: the target's distribution p_t [V] after logits processing,
the drafter's reported q_t [V] for the slot that emitted the token (all zeros where no draft did:
a bonus slot, or no drafter), the slot s_t (0 = the round's first emitted token, k = the bonus
slot) and the block length k, the previous step's p and the previous round's q for the slot. Each
`BugClass` gives `law(step)`: the exact conditional law p'_t of the emitted token at that step
under the bug, known before the token is drawn. A correct loop has p'_t = p_t everywhere.

Two readers: the class-targeted test (`losscheck.stats.conditional`, `pit.bug_classes`) scores
each token by log(p'_t / p_t), and the power table (`losscheck.stats.bugclass`) asks what every
test sees per token under each law. Both build their steps from a chunk of rows with
`chunk_steps`, so the test and its power are computed from the same laws.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from losscheck.errors import LosscheckError

MISREPORT_FACTOR = 3.0  # drafter_misreports_one_id: the id is drawn this many times as often as reported
TOP_P = 0.9  # top_p_one_side: the drafter samples from q truncated to this mass
TARGET_TEMPERATURE_FACTOR = 1.1  # target_temperature_1.1: the target side runs at 1.1·T
OTHER_REQUEST_TEMPERATURE = 0.7  # per_request_params_mixed: a T = 1 row verified at the other row's T
# Steps are evaluated in blocks of at most this many probabilities (a few dozen [m, V] float64
# temporaries of 32 MiB each), whatever the chunk the caller passes.
BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Step:
    """Steps, vectorised over any leading shape [...]: what a bug's law may depend on.

    p       [..., V]  target distribution at the step (float64, sums to 1)
    q       [..., V]  drafter's reported distribution for the emitting slot; zeros: no draft
    slot    [...]     long, slot of the emitted token in its round; -1: unknown
    k       int       block length (slot k is the bonus slot)
    p_prev  [..., V]  p at the previous step of the row; zeros: none
    q_prev  [..., V]  the previous round's q for this slot; zeros: none
    misreported int | None  the id drafter_misreports_one_id over-draws (None: no such id chosen)
    q_prev_known [...] bool  where q_prev is the previous round's own (None: everywhere); elsewhere
                      an approximation from an older round (`chunk_steps`)
    """

    p: torch.Tensor
    q: torch.Tensor
    slot: torch.Tensor
    k: int
    p_prev: torch.Tensor
    q_prev: torch.Tensor
    misreported: int | None = None
    q_prev_known: torch.Tensor | None = None

    def rows(self, part: slice | torch.Tensor) -> Step:
        """The steps `part` (a slice, or long indices) of a flat batch of steps [m, ...]."""
        known = None if self.q_prev_known is None else self.q_prev_known[part]
        return Step(
            self.p[part],
            self.q[part],
            self.slot[part],
            self.k,
            self.p_prev[part],
            self.q_prev[part],
            self.misreported,
            known,
        )

    def blocks(self) -> Iterator[tuple[slice, Step]]:
        """The flat batch of steps [m, ...] in consecutive blocks of at most `BLOCK_ELEMENTS`
        probabilities: (the block's slice of the m steps, its steps)."""
        block = max(1, BLOCK_ELEMENTS // max(1, self.p.shape[-1]))
        for start in range(0, len(self.p), block):
            part = slice(start, start + block)
            yield part, self.rows(part)

    @property
    def drafted(self) -> torch.Tensor:
        """[..., 1] bool: a draft decided this step (q has mass)."""
        return self.q.sum(-1, keepdim=True) > 0


def mismatched_law(p: torch.Tensor, drawn: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """Law [..., V] of the token a draft slot emits when the draft is drawn from `drawn` but the
    verifier accepts with min(1, p / used) and recovers from norm(max(0, p - used)):
    p'(x) = drawn(x)·a(x) + (1 - Σ_y drawn(y)·a(y))·r(x). `used` = `drawn` gives p exactly."""
    accept = torch.where(used > 0, (p / used.clamp_min(1e-300)).clamp(max=1.0), 1.0)  # [..., V]
    kept = drawn * accept  # [..., V]
    residual = (p - used).clamp_min(0.0)  # [..., V]
    mass = residual.sum(-1, keepdim=True)
    recovered = torch.where(mass > 1e-12, residual / mass.clamp_min(1e-300), p)
    return kept + (1 - kept.sum(-1, keepdim=True)).clamp_min(0.0) * recovered


def tempered(p: torch.Tensor, exponent: float) -> torch.Tensor:
    """p^exponent renormalised [..., V]: p at temperature T / exponent when p is at T (zeros kept)."""
    powered = torch.where(p > 0, p.clamp_min(1e-300) ** exponent, 0.0)
    return powered / powered.sum(-1, keepdim=True)


# `top_p` ranks this many of a row's largest entries first, and sorts the whole row only where
# its kept set does not end inside them (a flat q at a high temperature)
_TOP_P_CANDIDATES = 256


def top_p(q: torch.Tensor, top: float) -> torch.Tensor:
    """q [..., V] truncated to its smallest most-probable set of mass >= `top`, renormalised; ties
    ranked by id, as a stable descending sort ranks them.

    A row's kept set is read from its largest `_TOP_P_CANDIDATES` entries (ranked by value, then
    id) when its smallest kept entry exceeds the smallest candidate: every entry ranked before a
    kept one is then a candidate, so the masses before it agree with the whole row's, and the
    kept mass already reaches `top`, so no entry outside is kept. Other rows are sorted whole."""
    flat = q.reshape(-1, q.shape[-1])  # [m, V]
    keep = torch.zeros(flat.shape, dtype=torch.bool, device=q.device)  # [m, V]
    rest = torch.arange(len(flat), device=q.device)  # [r] rows sorted whole
    if flat.shape[-1] > 2 * _TOP_P_CANDIDATES:
        ids = flat.topk(_TOP_P_CANDIDATES, dim=-1).indices.sort(dim=-1).values  # [m, C] by id
        values = flat.gather(-1, ids)  # [m, C]
        kept = _nucleus(values, top)  # [m, C]
        smallest_kept = torch.where(kept, values, torch.inf).amin(-1)  # [m]
        found = smallest_kept > values.amin(-1)  # [m]
        keep[found] = keep[found].scatter(-1, ids[found], kept[found])
        rest = rest[~found]
    if len(rest):
        keep[rest] = _nucleus(flat[rest], top)
    kept_q = torch.where(keep.reshape(q.shape), q, 0.0)
    total = kept_q.sum(-1, keepdim=True)
    return torch.where(total > 0, kept_q / total.clamp_min(1e-300), q)


def _nucleus(values: torch.Tensor, top: float) -> torch.Tensor:
    """[m, C] bool: the entries of each row of `values` [m, C] whose mass ranked before them (by
    value, descending; ties by position) is short of `top`."""
    ranked, order = values.sort(dim=-1, descending=True, stable=True)
    keep_ranked = (ranked.cumsum(-1) - ranked) < top  # the mass before each entry is still short
    return torch.zeros_like(keep_ranked).scatter(-1, order, keep_ranked)


def tilted(q: torch.Tensor, token: int, factor: float) -> torch.Tensor:
    """q [..., V] with `token`'s probability multiplied by `factor`, renormalised."""
    weight = torch.ones(q.shape[-1], dtype=q.dtype, device=q.device)
    weight[token] = factor
    raw = q * weight
    total = raw.sum(-1, keepdim=True)
    return torch.where(total > 0, raw / total.clamp_min(1e-300), q)


def reused_noise_recovery(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Law [..., V] of the token recovered as argmax_i r_i / E_i from the residual
    r = norm(max(0, p - q)) with the noise the drafter drew its draft with: E_i = q_i·M + e_i,
    M, e_i ~ Exp(1) independent (given the draft, the race's other entries; vLLM #54282's shape).

    Given M = m, token i's time T_i = E_i / r_i survives past t with S_i(t) = min(1, exp(q_i·m - r_i·t)),
    so P(x | m) = r_x ∫_{s_x·m}^∞ Π_i S_i(t) dt with s_i = q_i / r_i. Between consecutive breakpoints
    (in an order that does not depend on m) the product is exp(m·a - b·t), a and b the active
    tokens' Σq and Σr; with t = m·τ each piece is m·(e^{m·c0} - e^{m·c1}) / (b·m), c = a - b·τ <= 0
    at its ends, and E_M e^{m·c} = 1 / (1 - c): the law in closed form. Tokens without residual
    mass never win.
    """
    residual = (p - q).clamp_min(0.0)  # [..., V]
    mass = residual.sum(-1, keepdim=True)
    r = torch.where(mass > 1e-12, residual / mass.clamp_min(1e-300), p)  # [..., V]
    live = r > 0
    tau, order = torch.where(live, q / r.clamp_min(1e-300), torch.inf).sort(-1)  # [..., V] breakpoints per unit m
    r_s = torch.where(live, r, 0.0).gather(-1, order)  # [..., V] in breakpoint order
    a = torch.where(live, q, 0.0).gather(-1, order).cumsum(-1)  # [..., V] Σ q of the active tokens
    b = r_s.cumsum(-1)  # [..., V] Σ r of the active tokens (> 0 wherever tau is finite)
    tau_next = torch.cat([tau[..., 1:], torch.full_like(tau[..., :1], torch.inf)], -1)  # [..., V]

    def expected_exp(at: torch.Tensor) -> torch.Tensor:  # E_M exp(M·(a - b·at)); 0 at at = inf
        finite = torch.isfinite(at)
        return torch.where(finite, 1 / (1 - (a - b * torch.where(finite, at, 0.0))), 0.0)

    piece = torch.where(torch.isfinite(tau), (expected_exp(tau) - expected_exp(tau_next)) / b.clamp_min(1e-300), 0.0)
    law = r_s * piece.flip(-1).cumsum(-1).flip(-1)  # [..., V] r_x · ∫ from x's breakpoint on
    law = law / law.sum(-1, keepdim=True)  # sums to 1 analytically; this removes round-off
    return torch.zeros_like(law).scatter(-1, order, law)


def _draft_noise_reused(step: Step) -> torch.Tensor:
    overlap = torch.minimum(step.p, step.q)
    rejected = 1 - overlap.sum(-1, keepdim=True)
    return torch.where(step.drafted, overlap + rejected * reused_noise_recovery(step.p, step.q), step.p)


def _residual_is_p(step: Step) -> torch.Tensor:
    overlap = torch.minimum(step.p, step.q)
    return torch.where(step.drafted, overlap + (1 - overlap.sum(-1, keepdim=True)) * step.p, step.p)


def _stale_q(step: Step) -> torch.Tensor:
    acts = step.drafted & (step.q_prev.sum(-1, keepdim=True) > 0)
    return torch.where(acts, mismatched_law(step.p, step.q, step.q_prev), step.p)


def _bonus_from_previous_slot(step: Step) -> torch.Tensor:
    acts = (step.slot == step.k)[..., None] & (step.p_prev.sum(-1, keepdim=True) > 0)
    return torch.where(acts, step.p_prev, step.p)


def _misreports_one_id(step: Step) -> torch.Tensor:
    if step.misreported is None:
        raise LosscheckError("drafter_misreports_one_id needs Step.misreported: the id the drafter over-draws")
    drawn = tilted(step.q, step.misreported, MISREPORT_FACTOR)
    return torch.where(step.drafted, mismatched_law(step.p, drawn, step.q), step.p)


def _top_p_one_side(step: Step) -> torch.Tensor:
    return torch.where(step.drafted, mismatched_law(step.p, top_p(step.q, TOP_P), step.q), step.p)


@dataclass(frozen=True)
class BugClass:
    """A realistic losslessness bug, by the exact law of the emitted token at a step."""

    name: str
    models: str  # the real bug it stands for
    law: Callable[[Step], torch.Tensor]  # Step -> p' [..., V]
    caught_by: tuple[str, ...]  # the tests meant to catch it (besides the LR bound)
    # True: the bug has a free token id (the one misreported); the accumulator evaluates it at
    # every id at once and reports the id where its TV is largest
    per_id: bool = False
    # True: the law reads the slot (the bonus slot, or the previous round's q for the slot, which
    # `chunk_steps` finds by slot); without recorded slots it cannot be evaluated
    needs_slots: bool = False
    # True: the law reads the previous round's q, known exactly only where that round reached the
    # slot (`Step.q_prev_known`)
    reads_q_prev: bool = False
    # True: the law reads the target's p alone (no q, no slots), so it can be evaluated on the
    # samples of a black-box engine, which reports neither (`losscheck.cells.engine`)
    target_side: bool = False


CATALOGUE: tuple[BugClass, ...] = (
    BugClass(
        "residual_is_p",
        "the recovered token is drawn from p instead of norm(max(0, p - q)) at a rejection",
        _residual_is_p,
        ("pit.residual_order",),
    ),
    BugClass(
        "stale_q",
        "the verifier reads the previous round's q for the slot while the draft came from the current q",
        _stale_q,
        ("pit.residual_order",),
        needs_slots=True,
        reads_q_prev=True,
    ),
    BugClass(
        "target_temperature_1.1",
        "the target side is processed at 1.1·T (p' ∝ p^(1/1.1))",
        lambda step: tempered(step.p, 1 / TARGET_TEMPERATURE_FACTOR),
        ("pit.surprisal",),
        target_side=True,
    ),
    BugClass(
        "bonus_from_previous_slot",
        "the bonus token is drawn from p at slot k - 1 instead of slot k",
        _bonus_from_previous_slot,
        ("pit.slot_chisquare",),
        needs_slots=True,
    ),
    BugClass(
        "drafter_misreports_one_id",
        f"the drafter draws one id {MISREPORT_FACTOR:g}x as often as the q it reports (the rest "
        "renormalised); the verifier accepts and recovers with the reported q",
        _misreports_one_id,
        ("pit.token_counts",),
        per_id=True,
    ),
    BugClass(
        "top_p_one_side",
        f"the drafter samples from q truncated to top-p {TOP_P:g} but reports the untruncated q",
        _top_p_one_side,
        ("pit.pooled_chisquare",),  # the output leans to the head of p: the pooled law moves
    ),
    BugClass(
        "per_request_params_mixed",
        f"two requests of a batch swap temperatures: a T = 1 row is verified at T = {OTHER_REQUEST_TEMPERATURE:g}",
        lambda step: tempered(step.p, 1 / OTHER_REQUEST_TEMPERATURE),
        ("pit.surprisal",),
        target_side=True,
    ),
    BugClass(
        "draft_noise_reused",
        "the recovered token is drawn with the exponential-race noise the draft was drawn with (vLLM #54282): "
        "the residual's tokens the draft favoured are under-emitted",
        _draft_noise_reused,
        ("pit.residual_order",),
    ),
)
BY_NAME = {bug.name: bug for bug in CATALOGUE}
TARGET_SIDE = tuple(bug for bug in CATALOGUE if bug.target_side)


def targeted(
    classes: tuple[BugClass, ...], has_slots: bool, misreported: int | None, has_q: bool = True
) -> tuple[BugClass, ...]:
    """The classes of `classes` whose law is known before each token is drawn, and so can be
    scored: those needing slots only when slots are recorded, the per-id class only when its id
    was fixed beforehand (`misreported`; an id the scored sample picked itself would let it choose
    its own direction), and without a drafter's q (`has_q` False: a black-box engine) only those
    whose law reads p alone."""
    return tuple(
        bug
        for bug in classes
        if (has_slots or not bug.needs_slots)
        and (misreported is not None or not bug.per_id)
        and (has_q or bug.target_side)
    )


def chunk_steps(
    p: torch.Tensor,
    q: torch.Tensor | None,
    slots: torch.Tensor | None,
    k: int,
    tested: torch.Tensor,
    what: str,
    *,
    q_prev: torch.Tensor | None = None,
    misreported: int | None = None,
) -> Step:
    """The tested steps [m] of a chunk of rows, flat, in row-major order.

    p       [n, L, V]  target distributions, float64 rows summing to 1
    q       [n, L, V]  reported q of the emitting slot, float64, zeros where no draft; None: no drafter
    slots   [n, L]     slot of each token in its round, in [0, k]; None: not recorded (-1)
    k       int        block length
    tested  [n, L]     bool, the steps kept
    q_prev  [n, L, V]  the previous round's q for each step's slot, zeros where none. None:
                       approximated by the q of the most recent earlier step of the row with the
                       same slot and a draft — the previous round that reached that slot (exact
                       when the previous round did; the loop's wasted drafts are not recorded,
                       so a round that stopped earlier is skipped over).
    `what` names the caller in errors; `misreported` is carried into the steps.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise LosscheckError(f"{what} needs k an int >= 0, got {k!r}")
    shape2 = tuple(p.shape[:2])
    slot = torch.full(shape2, -1, dtype=torch.long) if slots is None else slots.long().cpu()
    if slots is not None and slot.numel() and (int(slot.min()) < 0 or int(slot.max()) > k):
        raise LosscheckError(f"{what} slots: must lie in [0, k = {k}]")
    if misreported is not None and not 0 <= misreported < p.shape[-1]:
        raise LosscheckError(f"{what} misreported id: must lie in [0, {p.shape[-1]}), got {misreported}")
    pick = tested.to(torch.bool).cpu()  # [n, L]
    row, col = pick.nonzero(as_tuple=True)  # [m] each, row-major: the order of p[pick]
    device = p.device

    def at(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x [n, L, V] at the picked rows and steps t [m] (zeros where t < 0): [m, V]."""
        found = x[row.to(device), t.clamp_min(0).to(device)]
        return torch.where((t >= 0).to(device)[:, None], found, 0.0)

    p_now = p[row.to(device), col.to(device)]  # [m, V]
    known = None
    if q is None:
        q_now = q_before = torch.zeros_like(p_now)
    else:
        q_now = q[row.to(device), col.to(device)]
        if q_prev is None:
            previous = _previous_same_slot((q.sum(-1) > 0).cpu(), slot)  # [n, L]
            q_before = at(q, previous[row, col])
            known = _in_previous_round(previous, slot)[row, col].to(device)
        else:
            q_before = q_prev[row.to(device), col.to(device)]
    return Step(
        p=p_now,
        q=q_now,
        slot=slot[row, col].to(device),  # [m]
        k=k,
        p_prev=at(p, col - 1),
        q_prev=q_before,
        misreported=misreported,
        q_prev_known=known,
    )


def _in_previous_round(previous: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """[n, L] bool: the step `previous` [n, L] points at (-1: none) lies in the round just before
    each step's own — or the step's round is its row's first, which has no previous round — so
    that its q is the previous round's q for the slot, not an older round's. Rounds start at slot 0."""
    rounds = (slot == 0).long().cumsum(1)  # [n, L] 1-based round of each step
    first = rounds <= 1
    found = previous >= 0
    before = rounds.gather(1, previous.clamp_min(0))  # [n, L]
    return (slot >= 0) & ((found & (before == rounds - 1)) | (~found & first))


def _previous_same_slot(drafted: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """[n, L] index of the most recent earlier step of each row with the same slot and a draft
    (`drafted` [n, L] bool, `slot` [n, L] long); -1 where none, or where the slot is unknown (-1)."""
    n, length = slot.shape
    steps = torch.arange(length).expand(n, -1)  # [n, L]
    none = torch.full((n, 1), -1, dtype=torch.long)
    previous = torch.full((n, length), -1, dtype=torch.long)
    for s in range(int(slot.max()) + 1 if slot.numel() else 0):
        here = slot == s
        latest = torch.where(here & drafted, steps, -1).cummax(1).values  # [n, L] up to and with t
        previous = torch.where(here, torch.cat([none, latest[:, :-1]], 1), previous)
    return previous
