"""Power per bug class: how many tokens each test needs to catch a realistic verifier or drafter
bug, from the bug's exact law at every step of a cell's own run.

The classes and their laws are `losscheck.stats.buglaws`: at each step t (a generated position,
with the target's p_t, the drafter's reported q_t for the emitting slot, the slot and k) a class
gives the exact conditional law p'_t of the emitted token under the bug.

For each class and each test, `PowerAccumulator` averages over the steps it is shown what the test
sees per token under the bug and reports the tokens needed at a per-test level α and a power:

- χ² tests (`pit.pooled_chisquare`: u ordered by descending p, what cells run today;
  `pit.residual_order`: u ordered by descending p - q; `pit.slot_chisquare`: the slot × bin
  table): under the bug, u at a step has the law of p'(x) spread uniformly over x's PIT interval,
  bin masses π_b; the test's law is their average over steps, noncentrality n·w² with
  w² = B·Σ_b (π̄_b - 1/B)² (per slot for the slot test, weighted by the slots' shares; df as
  `losscheck.stats.pit` uses), power from statsmodels' `GofChisquarePower`.
- e-value tests (`pit.token_counts`, `pit.surprisal`, `losscheck.stats.conditional`): per token
  the drift d = E_{p'}[Y] of the increment, its variance under H0 σ² = Var_p(Y) (what the test's W
  adds) and under the bug τ² = Var_{p'}(Y), averaged over steps. The rejection threshold on S
  given W = n·σ² is solved exactly from the mixture (`evalue_threshold`); the power is the
  normal approximation P(S_n >= threshold) with S_n ~ N(n·d, n·τ²). The level of the tests is
  exact; their power here is that approximation. `pit.token_counts` is judged at α / V
  (Bonferroni over ids) for its best id, searched among the 8 ids with the largest d²/τ².
  `pit.bug_classes` is judged one-sided at α / C (Bonferroni over its C classes) for its best
  class score: against each bug's law every class score the test holds is a candidate (the score
  aimed at that bug is usually, not always, the best), with its drift and variances under that
  law; the 2 with the largest d²/max(σ², τ²) are solved exactly.
- the likelihood-ratio bound (`lr_bound`): the Neyman–Pearson test that knows the bug's law at
  every step, its log-LR sum taken as Gaussian: with ℓ = log(p'/p), per token means μ1 = KL(p'‖p)
  under the bug and μ0 = -KL(p‖p') under H0 and variances σ1², σ0² (all averaged over steps),
  n = ((z_{1-α}·σ0 + z_power·σ1) / (μ1 - μ0))² — in the local limit (z_{1-α} + z_power)² / χ̄²,
  the form used for the per-id class, χ̄² the mean χ²-divergence χ²(p'‖p). Mass p' puts outside
  p's support is caught by the support check after n = log(1 - power) / log(1 - mass) tokens;
  the bound is the smaller. It is a benchmark, not a guarantee: for bugs concentrated on few
  steps (the bonus slot) the log-LR sum is far from Gaussian.

Family members: every number above is also given for a class's mixture (1 - ρ)·p + ρ·p'
(`rho`, `losscheck.stats.sequential`) from the same sums — bin masses, drifts, support and TV
are linear in the law, and the squared per-step drifts the accumulator also keeps make the
variances exact (`_Sums.mixed`); the LR bound takes its local form there. `smallest_rho` is the
power curve: the smallest member a test catches at a power within n tokens.

What the numbers assume: the steps are those of the run shown (p, q and slots from the cell's own
loop), and the bug changes only the emitted token's law at each step, not which prefixes and
slots the run visits; the steps' contributions are summed as if independent given the steps (true
of the tests' martingale sums). Everything is a sum over steps: `update` takes rows a chunk at a
time and keeps O(V · bins) numbers, never [N, L, V].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from scipy import stats
from statsmodels.stats.power import GofChisquarePower

from losscheck.errors import LosscheckError
from losscheck.stats._checks import check_open_unit, check_positive, normalized_rows
from losscheck.stats.buglaws import CATALOGUE, MISREPORT_FACTOR, BugClass, Step, chunk_steps, targeted
from losscheck.stats.conditional import evalue_threshold, reported_q, surprisal_scores, targeted_scores
from losscheck.stats.power import chisquare_required_n
from losscheck.stats.sequential import id_key, member_key

BINS = 10  # the PIT tests' equal bins of [0, 1]
COUNT_CANDIDATES = 8  # ids whose count test is solved exactly, of those with the largest d²/τ²
CLASS_CANDIDATES = 2  # class scores of pit.bug_classes solved exactly against each law, likewise
MAX_TOKENS = 1e13  # beyond this a test is reported as having no power (math.inf)
TESTS = (
    "pit.pooled_chisquare",
    "pit.residual_order",
    "pit.slot_chisquare",
    "pit.token_counts",
    "pit.surprisal",
    "pit.bug_classes",
)
LR_BOUND = "lr_bound"
RHO_FLOOR = 1 / 128  # the smallest family member ρ a power curve reports
_GOF_POWER = GofChisquarePower()


@dataclass(frozen=True)
class _Tiles:
    """The PIT intervals of each step's tokens when the vocabulary is ordered by descending key,
    ties by id. m steps; edges e_b = b / B of the B equal bins."""

    p: torch.Tensor  # [m, V]
    order: torch.Tensor  # [m, V] ids in PIT order
    start: torch.Tensor  # [m, V] F(x⁻) of each id (id order)
    at: torch.Tensor  # [m, B-1] index j of the interval holding each inner edge (1-based over cumsum)
    frac: torch.Tensor  # [m, B-1] where in that interval the edge lies, in [0, 1]

    @classmethod
    def of(cls, p: torch.Tensor, key: torch.Tensor, n_bins: int) -> _Tiles:
        order = key.sort(dim=-1, descending=True, stable=True).indices  # [m, V]
        ranked = p.gather(-1, order)  # [m, V]
        cum = torch.cat([torch.zeros_like(ranked[:, :1]), ranked.cumsum(-1)], -1)  # [m, V+1]
        start = torch.zeros_like(p).scatter(-1, order, cum[:, :-1])  # [m, V]
        inner = torch.arange(1, n_bins, dtype=p.dtype, device=p.device) / n_bins  # [B-1]
        inner = inner.expand(len(p), -1).contiguous()  # [m, B-1]
        at = torch.searchsorted(cum, inner).clamp(1, p.shape[-1])  # [m, B-1]
        low, high = cum.gather(-1, at - 1), cum.gather(-1, at)
        frac = ((inner - low) / (high - low).clamp_min(1e-300)).clamp(0.0, 1.0)
        return cls(p=p, order=order, start=start, at=at, frac=frac)

    def masses(self, f: torch.Tensor) -> torch.Tensor:
        """[m, B] bin masses of f [m, V] (a law, or a signed weight) spread uniformly over each
        token's PIT interval; f on tokens of p = 0 (intervals of width 0) is left out."""
        ranked = torch.where(self.p > 0, f, 0.0).gather(-1, self.order)  # [m, V]
        cum = torch.cat([torch.zeros_like(ranked[:, :1]), ranked.cumsum(-1)], -1)  # [m, V+1]
        low, high = cum.gather(-1, self.at - 1), cum.gather(-1, self.at)
        inner = low + self.frac * (high - low)  # [m, B-1] law's CDF at the inner edges
        edges = torch.cat([torch.zeros_like(inner[:, :1]), inner, cum[:, -1:]], -1)  # [m, B+1]
        return edges.diff(dim=-1)

    def spread_by_id(self, weight: torch.Tensor, n_bins: int) -> torch.Tensor:
        """[V, B]: Σ_t weight_t(v) · (share of v's PIT interval at step t inside bin b), for
        weight [m, V]; ids of p = 0 have no interval. Most intervals lie inside one bin and are
        added at once; the few that straddle an edge (at most B - 1 per step, plus the ids of
        p > 1/B) are split exactly."""
        m, vocab = self.p.shape
        end = self.start + self.p
        first = (self.start * n_bins).floor().long().clamp(0, n_bins - 1)  # [m, V]
        last = torch.maximum((end * n_bins).ceil().long() - 1, first).clamp(max=n_bins - 1)
        ids = torch.arange(vocab, device=self.p.device).expand(m, -1)
        positive = self.p > 0
        out = torch.zeros(vocab * n_bins, dtype=weight.dtype, device=weight.device)
        inside = positive & (first == last)
        out.index_add_(0, (ids * n_bins + first)[inside], weight[inside])
        straddle = positive & (first != last)
        start, width, w, v = self.start[straddle], self.p[straddle], weight[straddle], ids[straddle]
        for b in range(n_bins):
            share = ((start + width).clamp_max((b + 1) / n_bins) - start.clamp_min(b / n_bins)).clamp_min(0.0) / width
            out.index_add_(0, v * n_bins + b, w * share)
        return out.view(vocab, n_bins)

    def rows(self, keep: torch.Tensor) -> _Tiles:
        """The tiles of the steps `keep` [m] selects."""
        return _Tiles(self.p[keep], self.order[keep], self.start[keep], self.at[keep], self.frac[keep])


def _zeros(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float64)


@dataclass
class _Sums:
    """Per-step quantities of one bug class summed over tested steps (id-indexed for a per-id class)."""

    pooled: torch.Tensor  # [B] or [V, B]  Σ_t π_t (u by descending p)
    residual: torch.Tensor  # [B] or [V, B] Σ_t π_t (u by descending p - q)
    slot: torch.Tensor  # [S, B]  Σ_t π_t per slot (not kept for a per-id class: [0, B])
    in_support: torch.Tensor  # [] or [V]  Σ_t mass of p' inside p's support
    count_drift: torch.Tensor  # [V]  Σ_t (p'_t(v) - p_t(v)); per-id: at the misreported id itself
    count_var: torch.Tensor  # [V]  Σ_t p'_t(v)(1 - p'_t(v)): Var_{p'} of the increment of S_v
    surprisal_drift: torch.Tensor  # [] or [V]  Σ_t E_{p'}[y_t]
    surprisal_var: torch.Tensor  # [] or [V]  Σ_t Var_{p'}(y_t)
    # [4] or [V, 4]: Σ_t of the log-LR ℓ = log(p'/p)'s mean and variance under the bug, then under
    # H0 (over the common support); the per-id class uses the local form from χ²(p'‖p) (below)
    lr: torch.Tensor
    tv: torch.Tensor  # [] or [V]  Σ_t TV(p'_t, p_t)
    # [C] per class score c of pit.bug_classes (the accumulator's classes, in order): Σ_t E_{p'}[y_c]
    # and Σ_t Var_{p'}(y_c) under this class's law (the per-id class: at the fixed id only)
    class_drift: torch.Tensor
    class_var: torch.Tensor
    # Σ_t of the squared per-step drifts, what the variance of a mixture member (1 - ρ)p + ρp'
    # needs besides the sums above (`mixed`): of the counts [V], the surprisal [] or [V] and the
    # class scores [C]; and Σ_t χ²(p'_t‖p_t) over p's support [] or [V], the LR bound's local form
    count_sq: torch.Tensor
    surprisal_sq: torch.Tensor
    class_sq: torch.Tensor
    chi2: torch.Tensor

    @classmethod
    def empty(cls, vocab: int, n_bins: int, slots: int, per_id: bool, n_classes: int) -> _Sums:
        lead = (vocab,) if per_id else ()
        return cls(
            pooled=_zeros(*lead, n_bins),
            residual=_zeros(*lead, n_bins),
            slot=_zeros(0 if per_id else slots, n_bins),
            in_support=_zeros(*lead),
            count_drift=_zeros(vocab),
            count_var=_zeros(vocab),
            surprisal_drift=_zeros(*lead),
            surprisal_var=_zeros(*lead),
            lr=_zeros(*lead, 4),
            tv=_zeros(*lead),
            class_drift=_zeros(n_classes),
            class_var=_zeros(n_classes),
            count_sq=_zeros(vocab),
            surprisal_sq=_zeros(*lead),
            class_sq=_zeros(n_classes),
            chi2=_zeros(*lead),
        )

    def add(self, other: _Sums) -> None:
        """Add `other` (on any device) into these CPU sums."""
        for name in self.__dataclass_fields__:
            getattr(self, name).add_(getattr(other, name).cpu())

    def mixed(self, rho: float, acc: PowerAccumulator) -> _Sums:
        """These sums (a class's view: explicit law p', or the per-id class at one id) for the
        mixture member p_ρ = (1 - ρ)·p + ρ·p' at every step: the bug at magnitude ρ, or acting on
        each token with probability ρ. Bin masses, drifts, support and TV are linear in the law;
        a variance is (1 - ρ)·Var_p + ρ·E_{p'}[y²] - ρ²·d² per step, so the squared drifts make
        it exact. The log-LR moments take their local form from ρ²·χ²(p'‖p) (the LR bound is a
        benchmark); at ρ = 1 the sums are returned unchanged."""
        if rho == 1.0:
            return self
        n = float(acc.steps)
        keep = 1.0 - rho
        n_bins = self.pooled.shape[-1]
        h0_count = acc.count_h0_var
        chi2 = rho**2 * self.chi2
        return _Sums(
            pooled=keep * n / n_bins + rho * self.pooled,
            residual=keep * n / n_bins + rho * self.residual,
            slot=keep * acc.slot_steps[: self.slot.shape[0], None] / n_bins + rho * self.slot,
            in_support=keep * n + rho * self.in_support,
            count_drift=rho * self.count_drift,
            count_var=h0_count + rho * (self.count_var - h0_count + self.count_sq) - rho**2 * self.count_sq,
            surprisal_drift=rho * self.surprisal_drift,
            surprisal_var=keep * acc.surprisal_h0_var
            + rho * (self.surprisal_var + self.surprisal_sq)
            - rho**2 * self.surprisal_sq,
            lr=torch.stack([chi2 / 2, chi2, -chi2 / 2, chi2], -1),
            tv=rho * self.tv,
            class_drift=rho * self.class_drift,
            class_var=keep * acc.class_h0_var + rho * (self.class_var + self.class_sq) - rho**2 * self.class_sq,
            count_sq=rho**2 * self.count_sq,
            surprisal_sq=rho**2 * self.surprisal_sq,
            class_sq=rho**2 * self.class_sq,
            chi2=chi2,
        )


@dataclass
class PowerAccumulator:
    """Sums, over a cell's tested steps, what each test sees per token under each bug class.

    `update` per chunk of rows; `merge` of accumulators of one vocabulary and k; then
    `tokens_needed` and `power_at`. The per-id class (drafter_misreports_one_id) is evaluated
    at every id at once; its reported id (`misreported_id`) is `misreported` when given (a pilot's
    choice, the id the tested sample's `pit.bug_classes` is aimed at), else the one whose TV,
    averaged over the steps, is largest — and then `pit.bug_classes` leaves the class out, as the
    test itself does without an id fixed in advance.
    """

    classes: tuple[BugClass, ...] = CATALOGUE
    n_bins: int = BINS
    misreported: int | None = None
    vocab: int | None = None
    k: int | None = None
    steps: int = 0
    slot_steps: torch.Tensor = field(default_factory=lambda: _zeros(0))  # [S] tested steps per slot
    count_h0_var: torch.Tensor = field(default_factory=lambda: _zeros(0))  # [V] Σ_t p_t(v)(1 - p_t(v))
    surprisal_h0_var: float = 0.0  # Σ_t Var_p(y_t)
    class_h0_var: torch.Tensor = field(default_factory=lambda: _zeros(0))  # [C] Σ_t Var_p(y_c) per class score
    # The members ρ of each class's family the rule-out e-values are kept for (class name ->
    # ρs, fixed before the steps are added; a class not named: its catalogue point ρ = 1 only).
    # Member ρ is the mixture p_ρ = (1 - ρ)·p + ρ·p' (`losscheck.stats.sequential`).
    grid: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # per class, [G] Σ_t log(p_t(x_t) / p_ρ,t(x_t)) at the emitted tokens for each member ρ: the
    # log of the e-value that rules the member out; kept for the classes `targeted` scores
    rule_out: dict[str, torch.Tensor] = field(default_factory=dict)
    rule_out_ids: torch.Tensor = field(default_factory=lambda: _zeros(0))  # [V, G] the per-id class at every id
    has_slots: bool = True
    sums: dict[str, _Sums] = field(default_factory=dict)

    def update(
        self,
        p: torch.Tensor,
        q: torch.Tensor | None,
        tokens: torch.Tensor,
        slots: torch.Tensor | None,
        k: int,
        tested: torch.Tensor,
        *,
        q_prev: torch.Tensor | None = None,
    ) -> None:
        """Add one chunk of rows.

        p      [n, L, V]  target distributions after logits processing
        q      [n, L, V]  reported q of the emitting slot, zeros where no draft; None: no drafter
        tokens [n, L]     emitted ids (checked; the laws are of the token, not functions of it)
        slots  [n, L]     long slot of each token in its round; None: not recorded (the slot test
                          and bonus_from_previous_slot are then reported as having no power)
        k      int        block length
        tested [n, L]     bool, steps the tests count
        q_prev [n, L, V]  the previous round's q for each step's slot, zeros where none, for the
                          bugs' laws. None: approximated from the slots (`chunk_steps`). The
                          class scores of pit.bug_classes always use the approximation, as the
                          test in a cell does (it sees only the recorded slots).
        """
        what = "PowerAccumulator.update"
        if p.dim() != 3:
            raise LosscheckError(f"{what} needs p [n, L, V], got {tuple(p.shape)}")
        shape2 = tuple(p.shape[:2])
        for name, t in (("tokens", tokens), ("slots", slots), ("tested", tested)):
            if t is not None and tuple(t.shape) != shape2:
                raise LosscheckError(f"{what} needs {name} [n, L] = {shape2}, got {tuple(t.shape)}")
        vocab = p.shape[-1]
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            raise LosscheckError(f"{what} tokens: ids must lie in [0, {vocab})")
        p = normalized_rows(p, f"{what} p")
        q = None if q is None else reported_q(q, p.shape, f"{what} q")
        scored = chunk_steps(p, q, slots, k, tested, what, misreported=self.misreported)
        step = scored
        if q_prev is not None:
            q_prev = reported_q(q_prev, p.shape, f"{what} q_prev")
            step = chunk_steps(p, q, slots, k, tested, what, q_prev=q_prev, misreported=self.misreported)
        self._start(vocab, k, slots is not None)
        emitted = tokens.to(p.device)[tested.to(torch.bool).to(p.device)]  # [m] row-major, as `chunk_steps`
        for (part, block), (_, scored_block) in zip(step.blocks(), scored.blocks()):
            self._add(block, block if step is scored else scored_block, emitted[part])

    def _start(self, vocab: int, k: int, has_slots: bool) -> None:
        if self.vocab is None:
            self.vocab, self.k, self.has_slots = vocab, k, has_slots
            self.slot_steps = _zeros(k + 1)
            self.count_h0_var = _zeros(vocab)
            self.class_h0_var = _zeros(len(self.classes))
            self.rule_out = {bug.name: _zeros(len(self.members(bug.name))) for bug in self.classes}
            per_id = [bug.name for bug in self.classes if bug.per_id]
            self.rule_out_ids = _zeros(vocab, len(self.members(per_id[0])) if per_id else 1)
            self.sums = {
                bug.name: _Sums.empty(vocab, self.n_bins, k + 1, bug.per_id, len(self.classes)) for bug in self.classes
            }
        elif (self.vocab, self.k) != (vocab, k):
            raise LosscheckError(
                f"PowerAccumulator: a chunk with V = {vocab}, k = {k} after chunks with V = {self.vocab}, k = {self.k}"
            )
        self.has_slots = self.has_slots and has_slots

    def _add(self, step: Step, scored: Step, emitted: torch.Tensor) -> None:
        """Add a block of steps: `step` for the bugs' laws, `scored` (the same steps, q_prev as
        the test approximates it) for the class scores and the rule-out sums, `emitted` [m] the
        tokens the steps emitted."""
        m = len(step.p)
        if m == 0:
            return
        p, q = step.p, step.q
        tiles_p = _Tiles.of(p, p, self.n_bins)
        tiles_r = _Tiles.of(p, p - q, self.n_bins)
        y, y_var, _ = surprisal_scores(p)  # [m, V], [m]
        self.steps += m
        slot = step.slot.cpu()
        self.slot_steps.index_add_(0, slot[slot >= 0], torch.ones(int((slot >= 0).sum()), dtype=torch.float64))
        self.count_h0_var += (p * (1 - p)).sum(0).cpu()
        self.surprisal_h0_var += float(y_var.sum())
        laws = {}  # name -> p' [m, V], the classes evaluated at explicit laws
        for bug in self.classes:
            if bug.per_id:
                self.sums[bug.name].add(_per_id_sums(step, tiles_p, tiles_r, y, self.n_bins, len(self.classes)))
            else:
                laws[bug.name] = bug.law(step)
                self.sums[bug.name].add(self._law_sums(laws[bug.name], step, tiles_p, tiles_r, y))
        if self.misreported is not None:
            laws.update({bug.name: bug.law(step) for bug in self.classes if bug.per_id})
        self._add_class_scores(laws, step, scored)
        self._add_rule_out(laws, step, scored, emitted)

    def members(self, name: str) -> tuple[float, ...]:
        """The members ρ of class `name`'s family whose rule-out e-values are kept."""
        return self.grid.get(name, (1.0,))

    def _add_rule_out(self, laws: dict[str, torch.Tensor], step: Step, scored: Step, emitted: torch.Tensor) -> None:
        """Σ log(p / p_ρ) at the emitted tokens, per class and member ρ, under the laws the cell
        can evaluate (those `targeted` scores, `scored`'s approximation of the previous round's q)."""
        at = emitted[:, None]  # [m, 1]
        p_x = step.p.gather(-1, at)  # [m, 1]
        for bug in self.classes:
            if bug.per_id:
                self.rule_out_ids += _per_id_rule_out(step, emitted, self.members(bug.name)).cpu()
            if bug.name not in laws:
                continue
            law = laws[bug.name] if scored is step else bug.law(scored)
            rho = torch.tensor(self.members(bug.name), dtype=p_x.dtype, device=p_x.device)  # [G]
            log_ratio = _log_mixture_ratio(p_x, law.gather(-1, at), rho)  # [m, G]
            if bug.reads_q_prev and scored.q_prev_known is not None:
                # where the law's q_prev is a guess, the bug's own law is unknown: the step adds
                # nothing (a factor 1, decided before the token), so the product stays a supermartingale
                log_ratio = torch.where(scored.q_prev_known[:, None], log_ratio, 0.0)
            self.rule_out[bug.name] += log_ratio.sum(0).cpu()

    def _add_class_scores(self, laws: dict[str, torch.Tensor], step: Step, scored: Step) -> None:
        """pit.bug_classes: each class score c under H0 and under every law in `laws`."""
        p = step.p
        for c, bug in enumerate(self.classes):
            if bug.name not in laws:  # the per-id class without a fixed id: not scored
                continue
            model = laws[bug.name] if scored is step else bug.law(scored)
            y_c, var_c, _ = targeted_scores(p, model)  # [m, V], [m]
            self.class_h0_var[c] += float(var_c.sum())
            for name, law in laws.items():
                drift = (law * y_c).sum(-1)  # [m]
                second = (law * y_c**2).sum(-1)  # [m]
                sums = self.sums[name]
                sums.class_drift[c] += float(drift.sum())
                sums.class_var[c] += float((second - drift**2).clamp_min(0.0).sum())
                sums.class_sq[c] += float((drift**2).sum())

    def _law_sums(self, law: torch.Tensor, step: Step, tiles_p: _Tiles, tiles_r: _Tiles, y: torch.Tensor) -> _Sums:
        """The sums of one chunk's steps under an explicit law p' [m, V]."""
        p = step.p
        inside = p > 0
        pooled = tiles_p.masses(law)  # [m, B]
        slot = pooled.new_zeros(self.slot_steps.shape[0], self.n_bins)
        known = step.slot >= 0
        slot.index_add_(0, step.slot[known], pooled[known])
        drift = (law * y).sum(-1)  # [m]
        safe_p = torch.where(inside, p, 1.0)
        return _Sums(
            pooled=pooled.sum(0),
            residual=tiles_r.masses(law).sum(0),
            slot=slot,
            in_support=torch.where(inside, law, 0.0).sum(),
            count_drift=(law - p).sum(0),
            count_var=(law * (1 - law)).sum(0),
            surprisal_drift=drift.sum(),
            surprisal_var=((law * y**2).sum(-1) - drift**2).clamp_min(0.0).sum(),
            lr=_log_lr_moments(p, law).sum(0),
            tv=0.5 * (law - p).abs().sum(),
            class_drift=_zeros(len(self.classes)),
            class_var=_zeros(len(self.classes)),
            count_sq=((law - p) ** 2).sum(0),
            surprisal_sq=(drift**2).sum(),
            class_sq=_zeros(len(self.classes)),
            chi2=torch.where(inside, (law - p) ** 2 / safe_p, 0.0).sum(),
        )

    @staticmethod
    def merge(parts: list[PowerAccumulator]) -> PowerAccumulator:
        """One accumulator holding all `parts` (same classes, vocabulary, k)."""
        started = [part for part in parts if part.vocab is not None]
        if not parts:
            raise LosscheckError("PowerAccumulator.merge needs at least one part")
        if not started:
            first = parts[0]
            return PowerAccumulator(
                classes=first.classes, n_bins=first.n_bins, misreported=first.misreported, grid=first.grid
            )
        first = started[0]

        def design(a: PowerAccumulator) -> tuple:
            return a.vocab, a.k, a.n_bins, a.classes, a.misreported, a.grid

        if any(design(a) != design(first) for a in started):
            raise LosscheckError(
                "PowerAccumulator.merge: parts differ in vocabulary, k, bins, classes, misreported id or grid"
            )
        out = PowerAccumulator(
            classes=first.classes, n_bins=first.n_bins, misreported=first.misreported, grid=first.grid
        )
        assert first.vocab is not None and first.k is not None
        out._start(first.vocab, first.k, all(a.has_slots for a in started))
        for part in started:
            out.steps += part.steps
            out.slot_steps += part.slot_steps
            out.count_h0_var += part.count_h0_var
            out.surprisal_h0_var += part.surprisal_h0_var
            out.class_h0_var += part.class_h0_var
            for name, log_e in part.rule_out.items():
                out.rule_out[name] += log_e
            out.rule_out_ids += part.rule_out_ids
            for name, sums in part.sums.items():
                out.sums[name].add(sums)
        return out

    @property
    def misreported_id(self) -> int | None:
        """The id the per-id class is reported at: `misreported` when fixed, else the largest TV
        averaged over the steps."""
        per_id = [bug for bug in self.classes if bug.per_id]
        if self.misreported is not None or not per_id:
            return self.misreported
        if self.steps == 0:
            return None
        return int(self.sums[per_id[0].name].tv.argmax())

    def tv(self) -> dict[str, float]:
        """Each class's TV(p', p) averaged over the steps (the per-id class at `misreported_id`)."""
        return {bug.name: float(self._view(bug).tv) / max(self.steps, 1) for bug in self.classes}

    def tokens_needed(
        self, alpha_test: float, power: float, looks: int = 1, rho: float = 1.0
    ) -> dict[str, dict[str, float]]:
        """Per class and test (`TESTS` and `LR_BOUND`), the tokens needed for the test, at level
        `alpha_test`, to reject with probability `power`; math.inf where it has no power. The
        per-id class has no `pit.slot_chisquare` entry (its slot table would cost O(k·V·B)), and
        no `pit.bug_classes` entry unless `misreported` fixed its id. `looks`: a sequential cell's
        stopping points (`losscheck.stats.sequential`) — its fixed-sample tests (the χ² ones) are
        judged at `alpha_test / looks`, the e-value tests, valid at any stopping time, at `alpha_test`.
        `rho`: each class's family member (1 - ρ)·p + ρ·p' instead of its catalogue point (`_Sums.mixed`)."""
        check_open_unit("alpha_test", alpha_test)
        check_open_unit("power", power)
        return {
            bug.name: {
                name: effect.tokens_needed(effect.level(alpha_test, looks), power)
                for name, effect in self._effects(bug, rho).items()
            }
            for bug in self.classes
        }

    def power_at(
        self, n_tokens: float, alpha_test: float, power_level: float, looks: int = 1, rho: float = 1.0
    ) -> dict[str, dict[str, float]]:
        """Per class and test, the probability that the test, at level `alpha_test` (`looks` and
        `rho` as in `tokens_needed`), rejects after `n_tokens` tokens (same approximations as `tokens_needed`).
        `power_level` is the power the cell states: it does not enter the probabilities; it is
        checked so that a report pairing `power_at` with `tokens_needed(alpha_test, power_level)`
        speaks of one valid level."""
        check_positive("n_tokens", n_tokens)
        check_open_unit("alpha_test", alpha_test)
        check_open_unit("power_level", power_level)
        return {
            bug.name: {
                name: effect.power(n_tokens, effect.level(alpha_test, looks))
                for name, effect in self._effects(bug, rho).items()
            }
            for bug in self.classes
        }

    def best_power(self, name: str, n_tokens: float, alpha_test: float, looks: int = 1, rho: float = 1.0) -> float:
        """Class `name`'s member ρ: the power of the cell's best test against it after `n_tokens`
        (the LR bound, a benchmark, left out)."""
        bug = next(b for b in self.classes if b.name == name)
        return max(
            (
                effect.power(n_tokens, effect.level(alpha_test, looks))
                for test, effect in self._effects(bug, rho).items()
                if test != LR_BOUND
            ),
            default=0.0,
        )

    def smallest_rho(
        self, name: str, n_tokens: float, alpha_test: float, power: float, looks: int = 1, floor: float = RHO_FLOOR
    ) -> float | None:
        """The smallest member ρ in [`floor`, 1] of class `name`'s family that the cell's best test
        catches at `power` after `n_tokens` (to 2% in ρ; every test's power grows with ρ: its
        noncentrality as ρ², its drift as ρ); None when even the catalogue point is not caught."""
        if self.best_power(name, n_tokens, alpha_test, looks) < power:
            return None
        if self.best_power(name, n_tokens, alpha_test, looks, floor) >= power:
            return floor
        low, high = math.log(floor), 0.0  # the power at e^low is short of `power`, at e^high not
        while high - low > 0.02:
            mid = (low + high) / 2
            low, high = (
                (low, mid)
                if self.best_power(name, n_tokens, alpha_test, looks, math.exp(mid)) >= power
                else (mid, high)
            )
        return math.exp(high)

    def rule_out_log_e(self, ids: Sequence[int] = ()) -> dict[str, float | None]:
        """Per class and member ρ of its family (`members`), under `sequential.member_key`, log of
        the e-value Π_t p_t(x_t) / p_ρ,t(x_t) of the tested steps, which rules the member out
        (`losscheck.stats.sequential`); None where the cell cannot evaluate the class's law (slots
        not recorded, or the per-id class without its id fixed in advance). Also, under
        `sequential.id_key`, the per-id class at each of `ids`."""
        scored = targeted(self.classes, self.has_slots, self.misreported)
        out: dict[str, float | None] = {}
        for bug in self.classes:
            members = self.members(bug.name)
            for g, rho in enumerate(members):
                known = bug in scored and self.steps
                out[member_key(bug.name, rho)] = float(self.rule_out[bug.name][g]) if known else None
                if bug.per_id:
                    for v in ids:
                        log_e = float(self.rule_out_ids[v, g]) if self.steps else None
                        out[member_key(id_key(bug.name, v), rho)] = log_e
        return out

    def covered_ids(self, tokens: float, alpha_test: float, power: float, rho: float = 1.0) -> list[int]:
        """The ids whose misreporting (`drafter_misreports_one_id` at that id, member `rho` of
        its family) the count test, judged at `alpha_test` / V, catches at `power` within
        `tokens` tested tokens — the ids a design of `tokens` covers, besides the one the class
        score is aimed at. The test's tokens fall as d² / max(σ², τ²) grows, so the boundary is
        searched in that order."""
        per_id = [bug for bug in self.classes if bug.per_id]
        if not per_id or not self.steps:
            return []
        sums = self.sums[per_id[0].name]
        h0_var = self.count_h0_var
        drift = rho * sums.count_drift
        h1_var = h0_var + rho * (sums.count_var + sums.count_sq) - rho**2 * sums.count_sq
        score = drift**2 / h1_var.clamp_min(1e-300)
        order = score.argsort(descending=True).tolist()
        n = float(self.steps)

        def needs(v: int) -> float:
            effect = _EvalueEffect([float(drift[v]) / n], [float(h0_var[v]) / n], [float(h1_var[v]) / n], len(h0_var))
            return effect.tokens_needed(alpha_test, power)

        low, high = 0, len(order)  # order[:low] reach the power within tokens; order[high:] do not
        while low < high:
            mid = (low + high) // 2
            low, high = (mid + 1, high) if needs(order[mid]) <= tokens else (low, mid)
        return sorted(order[:low])

    def count_power(self, v: int, n_tokens: float, alpha_test: float, rho: float = 1.0) -> float:
        """The count test's power, judged at `alpha_test` / V, after `n_tokens` against the
        misreport of id `v` (member `rho` of its family): what `covered_ids` asks of each id."""
        per_id = [bug for bug in self.classes if bug.per_id]
        if not per_id or not self.steps:
            return 0.0
        sums, n = self.sums[per_id[0].name], float(self.steps)
        h0 = float(self.count_h0_var[v])
        shift, sq = float(sums.count_var[v]), float(sums.count_sq[v])
        effect = _EvalueEffect(
            [rho * float(sums.count_drift[v]) / n],
            [h0 / n],
            [(h0 + rho * (shift + sq) - rho**2 * sq) / n],
            len(self.count_h0_var),
        )
        return effect.power(n_tokens, alpha_test)

    def _view(self, bug: BugClass) -> _Sums:
        """The class's sums; for the per-id class, at `misreported_id` (counts at that id)."""
        sums = self.sums[bug.name]
        if not bug.per_id:
            return sums
        v = self.misreported_id
        assert v is not None
        n = float(self.steps)
        count_drift, count_sq = _zeros(len(sums.count_drift)), _zeros(len(sums.count_drift))
        count_drift[v], count_sq[v] = sums.count_drift[v], sums.count_sq[v]
        count_var = self.count_h0_var.clone()
        count_var[v] += sums.count_var[v]
        return _Sums(
            pooled=sums.pooled[v] + n / self.n_bins,
            residual=sums.residual[v] + n / self.n_bins,
            slot=_zeros(0, self.n_bins),
            in_support=torch.tensor(n, dtype=torch.float64),
            count_drift=count_drift,
            count_var=count_var,
            surprisal_drift=sums.surprisal_drift[v],
            surprisal_var=sums.surprisal_var[v] + self.surprisal_h0_var,
            lr=sums.lr[v],
            tv=sums.tv[v],
            class_drift=sums.class_drift,
            class_var=sums.class_var,
            count_sq=count_sq,
            surprisal_sq=sums.surprisal_sq[v],
            class_sq=sums.class_sq,
            chi2=sums.chi2[v],
        )

    def _effects(self, bug: BugClass, rho: float = 1.0) -> dict[str, _Effect]:
        if self.steps == 0:
            raise LosscheckError("PowerAccumulator: no tested step was added")
        if not 0 < rho <= 1:
            raise LosscheckError(f"PowerAccumulator: a family member needs 0 < rho <= 1, got {rho}")
        sums = self._view(bug).mixed(rho, self)
        n = float(self.steps)
        support = float(sums.in_support) / n
        slot_w2, slot_df = self._slot_effect(sums)
        counts: _Effect
        if bug.per_id:
            v = self.misreported_id
            assert v is not None
            counts = _EvalueEffect.of(sums, self, [v])
        else:
            counts = _EvalueEffect.of(sums, self, _count_candidates(sums, self.count_h0_var))
        h1_mean, h1_var, h0_mean, h0_var = (sums.lr / n).tolist()
        slot = {} if bug.per_id else {"pit.slot_chisquare": _ChisquareEffect(slot_w2, slot_df + 1, 1.0)}
        classes = {}
        if not bug.per_id or self.misreported is not None:
            classes["pit.bug_classes"] = self._class_effect(sums)
        return {
            "pit.pooled_chisquare": _ChisquareEffect(_w2(sums.pooled, self.n_bins), self.n_bins, support),
            "pit.residual_order": _ChisquareEffect(_w2(sums.residual, self.n_bins), self.n_bins, support),
            **slot,
            "pit.token_counts": counts,
            "pit.surprisal": _EvalueEffect(
                [float(sums.surprisal_drift) / n], [self.surprisal_h0_var / n], [float(sums.surprisal_var) / n], 1
            ),
            **classes,
            LR_BOUND: _LikelihoodRatioEffect(h1_mean, h1_var, h0_mean, h0_var, outside=1.0 - support),
        }

    def _class_effect(self, sums: _Sums) -> _EvalueEffect:
        """pit.bug_classes against the law of `sums`: its class scores, judged at α / (classes
        in the test); the `CLASS_CANDIDATES` with the largest d² / max(σ², τ²) are solved."""
        n = float(self.steps)
        scored = targeted(self.classes, self.has_slots, self.misreported)
        scores = [c for c, bug in enumerate(self.classes) if bug in scored]
        drift, h0_var, h1_var = sums.class_drift / n, self.class_h0_var / n, sums.class_var / n  # [C]
        rank = drift.clamp_min(0.0) ** 2 / torch.maximum(h0_var, h1_var).clamp_min(1e-300)
        best = sorted(scores, key=lambda c: -float(rank[c]))[:CLASS_CANDIDATES]
        return _EvalueEffect(
            [float(drift[c]) for c in best],
            [float(h0_var[c]) for c in best],
            [float(h1_var[c]) for c in best],
            len(scores),
            one_sided=True,
        )

    def _slot_effect(self, sums: _Sums) -> tuple[float, int]:
        """(per-token noncentrality w², df) of the slot × bin χ²; (0, 1) without slots."""
        if not self.has_slots or sums.slot.shape[0] == 0:
            return 0.0, 1
        present = self.slot_steps > 0
        share = self.slot_steps[present] / self.steps  # [S']
        w2 = torch.stack([torch.tensor(_w2(row, self.n_bins)) for row in sums.slot[present]])  # [S']
        return float((share * w2).sum()), int(present.sum()) * (self.n_bins - 1)


def _w2(masses: torch.Tensor, n_bins: int) -> float:
    """Cohen's w² of the average bin law `masses` [B] (normalised) against uniform."""
    total = float(masses.sum())
    if total <= 0:
        return 0.0
    return float(n_bins * ((masses / total - 1 / n_bins) ** 2).sum())


def _log_mixture_ratio(p_x: torch.Tensor, law_x: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """log(p(x) / ((1 - ρ)·p(x) + ρ·p'(x))) [..., G] of tokens with probabilities p_x and law_x
    [..., 1] under p and the bug, for the members `rho` [G]; at most log(1 / (1 - ρ)) for ρ < 1."""
    mixture = (1 - rho) * p_x + rho * law_x  # [..., G]
    return p_x.clamp_min(1e-300).log() - mixture.clamp_min(1e-300).log()


def _per_id_rule_out(step: Step, emitted: torch.Tensor, members: tuple[float, ...]) -> torch.Tensor:
    """[V, G] Σ_t log(p_t(x_t) / p_ρ,v,t(x_t)) of drafter_misreports_one_id at every candidate id
    v and member ρ of `members`, over a block of steps with emitted tokens `emitted` [m]. With the
    terms of `_per_id_sums`, p'_v(x) = p(x) - α_v·b(x) - Δ_v·r(x) + γ_v·[x = v]: O(V) per step and
    member. Steps without a draft add 0."""
    drafted = step.drafted.squeeze(-1)
    vocab = step.p.shape[-1]
    if not bool(drafted.any()):
        return torch.zeros(vocab, len(members), dtype=torch.float64, device=step.p.device)
    p, q, x = step.p[drafted], step.q[drafted], emitted[drafted][:, None]  # [m, V], [m, V], [m, 1]
    f = MISREPORT_FACTOR
    b = torch.minimum(p, q)
    accepted = b.sum(-1, keepdim=True)
    rest = 1 - accepted
    r = torch.where(rest > 1e-12, (p - q).clamp_min(0.0) / rest.clamp_min(1e-300), 0.0)
    norm = 1 + (f - 1) * q  # [m, V] indexed by the candidate v
    alpha, gamma, delta = (f - 1) * q / norm, (f - 1) * b / norm, (f - 1) * (b - q * accepted) / norm
    p_x, b_x, r_x = p.gather(-1, x), b.gather(-1, x), r.gather(-1, x)  # [m, 1]
    at_x = torch.zeros_like(p).scatter(-1, x, 1.0)  # [m, V]: 1 at v = x
    law = p_x - alpha * b_x - delta * r_x + gamma * at_x  # [m, V] p'_v(x)
    # one member at a time: [m, V] per member, where all at once would hold [m, V, G]
    return torch.stack(
        [_log_mixture_ratio(p_x[..., None], law[..., None], law.new_tensor([rho])).sum(0)[..., 0] for rho in members],
        -1,
    )


def _count_candidates(sums: _Sums, h0_var: torch.Tensor) -> list[int]:
    """Ids whose count test is solved exactly: the largest d² / τ² (detectability per token)."""
    score = sums.count_drift**2 / torch.maximum(sums.count_var, h0_var).clamp_min(1e-300)
    return score.topk(min(COUNT_CANDIDATES, len(score))).indices.tolist()


class _Effect:
    anytime = False  # the test's level holds at any stopping time (an e-value test)

    def level(self, alpha: float, looks: int) -> float:
        """The level the test is judged at when a cell may stop at any of `looks` points."""
        return alpha if self.anytime else alpha / looks

    def tokens_needed(self, alpha: float, power: float) -> float:
        raise NotImplementedError

    def power(self, n: float, alpha: float) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class _ChisquareEffect(_Effect):
    w2: float  # per-token noncentrality
    n_bins: int  # cells (df + 1)
    support: float  # share of tokens the test sees (inside p's support)

    def tokens_needed(self, alpha: float, power: float) -> float:
        if self.w2 <= 0 or self.support <= 0:
            return math.inf
        n = chisquare_required_n(math.sqrt(self.w2), self.n_bins, alpha, power) / self.support
        return n if n <= MAX_TOKENS else math.inf

    def power(self, n: float, alpha: float) -> float:
        if self.w2 <= 0:
            return alpha
        return float(_GOF_POWER.power(math.sqrt(self.w2), n * self.support, alpha, self.n_bins))


@dataclass(frozen=True)
class _EvalueEffect(_Effect):
    """Mixture e-value tests of candidate sums, per token: drift d, H0 variance σ², H1 variance τ²;
    judged at alpha / `bonferroni`, the best candidate counts; `one_sided`: only d > 0 is seen."""

    drift: list[float]
    h0_var: list[float]
    h1_var: list[float]
    bonferroni: int
    one_sided: bool = False
    anytime = True

    @classmethod
    def of(cls, sums: _Sums, acc: PowerAccumulator, ids: list[int]) -> _EvalueEffect:
        n = float(acc.steps)
        return cls(
            drift=[float(sums.count_drift[v]) / n for v in ids],
            h0_var=[float(acc.count_h0_var[v]) / n for v in ids],
            h1_var=[float(sums.count_var[v]) / n for v in ids],
            bonferroni=len(acc.count_h0_var),
        )

    def tokens_needed(self, alpha: float, power: float) -> float:
        return min(
            (
                _evalue_tokens(d, s2, t2, alpha / self.bonferroni, power, self.one_sided)
                for d, s2, t2 in zip(self.drift, self.h0_var, self.h1_var)
            ),
            default=math.inf,
        )

    def power(self, n: float, alpha: float) -> float:
        return max(
            (
                _evalue_power(n, d, s2, t2, alpha / self.bonferroni, self.one_sided)
                for d, s2, t2 in zip(self.drift, self.h0_var, self.h1_var)
            ),
            default=0.0,
        )


def _evalue_power(n: float, d: float, h0_var: float, h1_var: float, alpha: float, one_sided: bool = False) -> float:
    """P(mixture e-value of S_n >= 1/alpha) with S_n ~ N(n·d, n·τ²), W_n = n·σ² (the far side
    of a two-sided test left out: it is never the one that rejects here)."""
    shift = d if one_sided else abs(d)
    if shift <= 0 or h0_var <= 0:
        return 0.0
    threshold = evalue_threshold(n * h0_var, alpha, one_sided)
    sd = math.sqrt(n * max(h1_var, 1e-300))
    return 0.5 * math.erfc((threshold - n * shift) / sd / math.sqrt(2))  # the normal survival function


def _evalue_tokens(
    d: float, h0_var: float, h1_var: float, alpha: float, power: float, one_sided: bool = False
) -> float:
    """Smallest n (to 0.1%) with `_evalue_power` >= power; inf beyond `MAX_TOKENS`."""
    shift = d if one_sided else abs(d)
    if shift <= 0 or h0_var <= 0:
        return math.inf

    def enough(n: float) -> bool:
        return _evalue_power(n, d, h0_var, h1_var, alpha, one_sided) >= power

    # start from the fixed-sample z test's n, which the mixture's threshold exceeds by a small
    # factor: a few doublings bracket the answer where doubling from 1 takes a dozen or more
    z = float(stats.norm.isf(alpha)) * math.sqrt(h0_var) + float(stats.norm.isf(1 - power)) * math.sqrt(h1_var)
    high = max(1.0, math.floor((max(z, 0.0) / shift) ** 2))
    while not enough(high):
        high *= 2
        if high > MAX_TOKENS:
            return math.inf
    while high > 1 and enough(high / 2):
        high /= 2
    low = high / 2
    while high - low > max(1.0, 1e-3 * high):
        mid = (low + high) / 2
        low, high = (low, mid) if enough(mid) else (mid, high)
    return float(math.ceil(high))


@dataclass(frozen=True)
class _LikelihoodRatioEffect(_Effect):
    """The Neyman–Pearson test of p' against p, per token: the log-LR's mean and variance under
    the bug and under H0; the sum of n is taken as Gaussian."""

    h1_mean: float
    h1_var: float
    h0_mean: float
    h0_var: float
    outside: float  # mean mass of p' outside p's support (caught by the support check)
    anytime = True  # not so, but a benchmark: kept at the full alpha, so it reads the same in every design

    def tokens_needed(self, alpha: float, power: float) -> float:
        gap = self.h1_mean - self.h0_mean
        # a class whose p' equals p sums to zero up to round-off: a variance may come out at -1e-20
        h0_sd, h1_sd = math.sqrt(max(self.h0_var, 0.0)), math.sqrt(max(self.h1_var, 0.0))
        spread = float(stats.norm.isf(alpha)) * h0_sd + float(stats.norm.ppf(power)) * h1_sd
        gauss = (spread / gap) ** 2 if gap > 0 else math.inf
        support = math.log1p(-power) / math.log1p(-self.outside) if 0 < self.outside < 1 else math.inf
        n = min(gauss, support)
        return float(max(1, math.ceil(n))) if n <= MAX_TOKENS else math.inf

    def power(self, n: float, alpha: float) -> float:
        gap = self.h1_mean - self.h0_mean
        gauss = 0.0
        if gap > 0:
            z = (math.sqrt(n) * gap - float(stats.norm.isf(alpha)) * math.sqrt(max(self.h0_var, 0.0))) / math.sqrt(
                max(self.h1_var, 1e-300)
            )
            gauss = float(stats.norm.cdf(z))
        support = 1.0 - (1.0 - self.outside) ** n if self.outside > 0 else 0.0
        return max(gauss, support)


def _log_lr_moments(p: torch.Tensor, law: torch.Tensor) -> torch.Tensor:
    """[m, 4] per step: mean and variance of ℓ = log(p'/p) under p' (the bug), then under p (H0),
    over the tokens both give positive probability (mass outside p's support is counted apart;
    tokens only p can emit make ℓ = -inf under H0, which only helps the test, and are left out)."""
    common = (p > 0) & (law > 0)
    ell = torch.where(common, law.clamp_min(1e-300).log() - p.clamp_min(1e-300).log(), 0.0)  # [m, V]
    moments = []
    for weight in (law, p):
        w = torch.where(common, weight, 0.0)
        mean = (w * ell).sum(-1)
        moments += [mean, ((w * ell**2).sum(-1) - mean**2).clamp_min(0.0)]
    return torch.stack(moments, -1)


def _per_id_sums(step: Step, tiles_p: _Tiles, tiles_r: _Tiles, y: torch.Tensor, n_bins: int, n_classes: int) -> _Sums:
    """drafter_misreports_one_id at every candidate id at once, over one chunk's steps.

    At a draft slot with reported q the drafter draws from q tilted by f = MISREPORT_FACTOR at v*.
    With b = min(p, q) (the kept mass q·min(1, p/q)), A = Σ b, r = norm(max(0, p - q)) and
    c = q(v*), the kept mass is b·f / (1 + (f-1)c) at v* and b / (1 + (f-1)c) elsewhere, so the law
    is exactly p' = p - α·b - Δ·r + γ·e_{v*} with α = (f-1)c / (1 + (f-1)c),
    γ = (f-1)·b(v*) / (1 + (f-1)c) and Δ = (f-1)(b(v*) - c·A) / (1 + (f-1)c), the accepted mass
    gained. Every statistic is then linear (the χ² divergence quadratic) in per-step vectors
    shared by all candidates and per-candidate scalars: O(V·B) work and memory per step.
    """
    vocab = step.p.shape[-1]
    drafted = step.drafted.squeeze(-1)
    empty = _Sums.empty(vocab, n_bins, 0, True, n_classes)
    if not bool(drafted.any()):
        return empty
    p, q, yd = step.p[drafted], step.q[drafted], y[drafted]  # [m, V]
    tp, tr = tiles_p.rows(drafted), tiles_r.rows(drafted)
    f = MISREPORT_FACTOR
    b = torch.minimum(p, q)  # [m, V]: kept mass per id, q·min(1, p/q)
    accepted = b.sum(-1, keepdim=True)  # [m, 1]
    rest = 1 - accepted
    r = torch.where(rest > 1e-12, (p - q).clamp_min(0.0) / rest.clamp_min(1e-300), 0.0)  # [m, V]
    # per candidate v* (the [m, V] tensors below are indexed by v*), with c = q(v*):
    norm = 1 + (f - 1) * q  # the tilted q's mass before renormalising
    alpha = (f - 1) * q / norm
    gamma = (f - 1) * b / norm
    delta = (f - 1) * (b - q * accepted) / norm  # accepted mass gained = rejection mass lost
    at_v = -alpha * b - delta * r + gamma  # [m, V]: p'(v*) - p(v*)
    law_v = p + at_v

    sums = empty
    m_b, m_r = tp.masses(b), tp.masses(r)  # [m, B]
    n_b, n_r = tr.masses(b), tr.masses(r)
    sums.pooled = -(alpha.T @ m_b) - delta.T @ m_r
    sums.residual = -(alpha.T @ n_b) - delta.T @ n_r
    sums.pooled += tp.spread_by_id(gamma, n_bins)
    sums.residual += tr.spread_by_id(gamma, n_bins)
    sums.count_drift = at_v.sum(0)
    sums.count_sq = (at_v**2).sum(0)
    sums.count_var = (law_v * (1 - law_v) - p * (1 - p)).sum(0)  # the shift from H0's variance
    by, ry = (b * yd).sum(-1, keepdim=True), (r * yd).sum(-1, keepdim=True)  # [m, 1]
    by2, ry2 = (b * yd**2).sum(-1, keepdim=True), (r * yd**2).sum(-1, keepdim=True)
    drift = -alpha * by - delta * ry + gamma * yd  # [m, V]: E_p y = 0
    second_shift = -alpha * by2 - delta * ry2 + gamma * yd**2
    sums.surprisal_drift = drift.sum(0)
    sums.surprisal_var = (second_shift - drift**2).sum(0)  # the shift from H0's variance
    sums.surprisal_sq = (drift**2).sum(0)
    inside = p > 0
    inv = torch.where(inside, 1 / p.clamp_min(1e-300), 0.0)
    bb, br, rr = (
        (b * b * inv).sum(-1, keepdim=True),
        (b * r * inv).sum(-1, keepdim=True),
        (r * r * inv).sum(-1, keepdim=True),
    )
    base = alpha**2 * bb + 2 * alpha * delta * br + delta**2 * rr  # Σ (α b + Δ r)² / p
    chi2 = (base + inv * (gamma**2 - 2 * gamma * (alpha * b + delta * r))).sum(0)  # [V]
    # the local form of the log-LR's moments: mean ±χ²/2, variance χ² under both laws (exact to
    # second order in p' - p; the misreport's distortion per step is small)
    sums.lr = torch.stack([chi2 / 2, chi2, -chi2 / 2, chi2], -1)
    sums.chi2 = chi2
    sums.tv = _per_id_tv(p, q, b, r, alpha, delta, at_v).sum(0)
    return sums


def _per_id_tv(
    p: torch.Tensor,
    q: torch.Tensor,
    b: torch.Tensor,
    r: torch.Tensor,
    alpha: torch.Tensor,
    delta: torch.Tensor,
    at_v: torch.Tensor,
) -> torch.Tensor:
    """[m, V] TV(p', p) of the misreport at each candidate v*, with p' - p = -α·b - Δ·r + γ·e_{v*}.

    TV is the positive part's mass. At v* it is max(0, D(v*)). Elsewhere D = -α·b - Δ·r is <= 0
    when Δ >= 0; when Δ < 0 it is positive exactly where r > 0 (p > q, so b = q) and
    |Δ|·r > α·q, i.e. p / q > θ = 1 + α·(1 - A) / |Δ| — and v* is never one of those (Δ < 0 needs
    b(v*) < q(v*)·A, so p(v*) < q(v*)). With the ratios sorted once per step, the sum over
    ratio > θ is a suffix sum for every candidate.
    """
    ratio = torch.where(p > q, p / q.clamp_min(1e-300), 0.0)  # [m, V]; inf-like where q = 0 < p
    ratio = torch.where((p > q) & (q == 0), math.inf, ratio)
    sorted_ratio, order = ratio.sort(-1)
    zero = torch.zeros_like(p[:, :1])
    r_suffix = torch.cat([r.gather(-1, order).flip(-1).cumsum(-1).flip(-1), zero], -1)  # [m, V+1]
    q_suffix = torch.cat([q.gather(-1, order).flip(-1).cumsum(-1).flip(-1), zero], -1)
    rest = 1 - b.sum(-1, keepdim=True)
    negative = delta < 0
    theta = torch.where(negative, 1 + alpha * rest / (-delta).clamp_min(1e-300), math.inf)  # [m, V]
    first = torch.searchsorted(sorted_ratio.contiguous(), theta.contiguous(), right=True)  # [m, V]
    others = (-delta) * r_suffix.gather(-1, first) - alpha * q_suffix.gather(-1, first)
    return at_v.clamp_min(0.0) + torch.where(negative, others.clamp_min(0.0), 0.0)
