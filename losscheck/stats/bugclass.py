"""Power per bug class: how many tokens each test needs to catch a realistic verifier or drafter
bug, from the bug's exact law at every step of a cell's own run.

The classes and their laws are `losscheck.stats.buglaws`: at each step t (a generated position,
with the target's p_t, the drafter's reported q_t for the emitting slot, the slot and k) a class
gives the exact conditional law p'_t of the emitted token under the bug.

`PowerAccumulator` sums, over the steps it is shown, each class's sufficient statistics
(`losscheck.stats.bugsums`; the per-id class at every id at once, `losscheck.stats.bugperid`) and
asks every test that the registry gives a power model (`losscheck.stats.registry.designed`; the
built-in ones are `losscheck.stats.powermodels`) what it sees per token under each class
(`losscheck.stats.effects`): the tokens it needs at a per-test level α and a power, and its power
after n tokens. A test registered with a power model enters the design with no change here; its
level is the registry's: α, or α / looks for a test not valid at any stopping time. Beside the
tests it reports the likelihood-ratio bound (`LR_BOUND`): the Neyman–Pearson test that knows the
bug's law at every step, its log-LR sum taken as Gaussian: with ℓ = log(p'/p), per token means
μ1 = KL(p'‖p) under the bug and μ0 = -KL(p‖p') under H0 and variances σ1², σ0² (all averaged over
steps), n = ((z_{1-α}·σ0 + z_power·σ1) / (μ1 - μ0))² — in the local limit (z_{1-α} + z_power)² / χ̄²,
the form used for the per-id class, χ̄² the mean χ²-divergence χ²(p'‖p). Mass p' puts outside
p's support is caught by the support check after n = log(1 - power) / log(1 - mass) tokens;
the bound is the smaller. It is a benchmark, not a guarantee: for bugs concentrated on few
steps (the bonus slot) the log-LR sum is far from Gaussian.

Family members: every number above is also given for a class's mixture (1 - ρ)·p + ρ·p'
(`rho`, `losscheck.stats.sequential`) from the same sums — bin masses, drifts, support and TV
are linear in the law, and the squared per-step drifts the accumulator also keeps make the
variances exact (`Sums.mixed`); the LR bound takes its local form there. `smallest_rho` is the
power curve: the smallest member a test catches at a power within n tokens.

What the numbers assume: the steps are those of the run shown (p, q and slots from the cell's own
loop), and the bug changes only the emitted token's law at each step, not which prefixes and
slots the run visits; the steps' contributions are summed as if independent given the steps (true
of the tests' martingale sums). Everything is a sum over steps: `update` takes rows a chunk at a
time and keeps O(V · bins) numbers, never [N, L, V].
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from losscheck.errors import LosscheckError
from losscheck.stats import registry
from losscheck.stats._checks import check_open_unit, check_positive, normalized_rows
from losscheck.stats.buglaws import CATALOGUE, BugClass, Step, chunk_steps, targeted
from losscheck.stats.bugperid import per_id_rule_out, per_id_sums
from losscheck.stats.bugsums import NullSums, Sums, SumsShape, Tiles, law_sums, log_mixture_ratio, zeros
from losscheck.stats.conditional import reported_q, surprisal_scores, targeted_scores
from losscheck.stats.effects import ClassView, Effect, EvalueEffect, WaldSize
from losscheck.stats.powermodels import count_effect, likelihood_ratio
from losscheck.stats.second_stage import RowShift, token_shift
from losscheck.stats.sequential import id_key, member_key

BINS = 10  # the PIT tests' equal bins of [0, 1]
LR_BOUND = "lr_bound"
RHO_FLOOR = 1 / 128  # the smallest family member ρ a power curve reports


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
    slot_steps: torch.Tensor = field(default_factory=lambda: zeros(0))  # [S] tested steps per slot
    count_h0_var: torch.Tensor = field(default_factory=lambda: zeros(0))  # [V] Σ_t p_t(v)(1 - p_t(v))
    surprisal_h0_var: float = 0.0  # Σ_t Var_p(y_t)
    class_h0_var: torch.Tensor = field(default_factory=lambda: zeros(0))  # [C] Σ_t Var_p(y_c) per class score
    # The members ρ of each class's family the rule-out e-values are kept for (class name ->
    # ρs, fixed before the steps are added; a class not named: its catalogue point ρ = 1 only).
    # Member ρ is the mixture p_ρ = (1 - ρ)·p + ρ·p' (`losscheck.stats.sequential`).
    grid: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # per class, [G] Σ_t log(p_t(x_t) / p_ρ,t(x_t)) at the emitted tokens for each member ρ: the
    # log of the e-value that rules the member out; kept for the classes `targeted` scores
    rule_out: dict[str, torch.Tensor] = field(default_factory=dict)
    rule_out_ids: torch.Tensor = field(default_factory=lambda: zeros(0))  # [V, G] the per-id class at every id
    has_slots: bool = True
    has_q: bool = True  # False: no drafter's q (a black-box engine): only target-side classes are scored
    sums: dict[str, Sums] = field(default_factory=dict)

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
        moments: torch.Tensor | None = None,
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
        moments [n, L]    bool ⊆ tested, the steps whose full-vocabulary sums (every power
                          estimate, `steps`) are added; the rule-out sums read every tested step.
                          None: tested. A per-token effect is a mean: a subset estimates it.
        """
        what = "PowerAccumulator.update"
        if p.dim() != 3:
            raise LosscheckError(f"{what} needs p [n, L, V], got {tuple(p.shape)}")
        shape2 = tuple(p.shape[:2])
        for name, t in (("tokens", tokens), ("slots", slots), ("tested", tested), ("moments", moments)):
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
        self._start(vocab, k, slots is not None, q is not None)
        pick = tested.to(torch.bool).to(p.device)
        emitted = tokens.to(p.device)[pick]  # [m] row-major, as `chunk_steps`
        summed = None if moments is None else moments.to(torch.bool).to(p.device)[pick]  # [m]
        for (part, block), (_, scored_block) in zip(step.blocks(), scored.blocks()):
            keep = None if summed is None else summed[part]
            self._add(block, block if step is scored else scored_block, emitted[part], keep)

    @property
    def _shape(self) -> SumsShape:
        assert self.vocab is not None and self.k is not None
        return SumsShape(self.vocab, self.n_bins, self.k + 1, len(self.classes))

    def _start(self, vocab: int, k: int, has_slots: bool, has_q: bool) -> None:
        if self.vocab is None:
            self.vocab, self.k, self.has_slots = vocab, k, has_slots
            self.slot_steps = zeros(k + 1)
            self.count_h0_var = zeros(vocab)
            self.class_h0_var = zeros(len(self.classes))
            self.rule_out = {bug.name: zeros(len(self.members(bug.name))) for bug in self.classes}
            per_id = [bug.name for bug in self.classes if bug.per_id]
            self.rule_out_ids = zeros(vocab, len(self.members(per_id[0])) if per_id else 1)
            self.sums = {bug.name: Sums.empty(self._shape, bug.per_id) for bug in self.classes}
        elif (self.vocab, self.k) != (vocab, k):
            raise LosscheckError(
                f"PowerAccumulator: a chunk with V = {vocab}, k = {k} after chunks with V = {self.vocab}, k = {self.k}"
            )
        self.has_slots = self.has_slots and has_slots
        self.has_q = self.has_q and has_q

    def _add(self, step: Step, scored: Step, emitted: torch.Tensor, summed: torch.Tensor | None = None) -> None:
        """Add a block of steps: `step` for the bugs' laws, `scored` (the same steps, q_prev as
        the test approximates it) for the class scores and the rule-out sums, `emitted` [m] the
        tokens the steps emitted, `summed` [m] bool the steps whose power sums are added (None: all)."""
        if len(step.p) == 0:
            return
        laws = {bug.name: bug.law(step) for bug in self.classes if not bug.per_id}  # name -> p' [m, V]
        if self.misreported is not None:
            laws.update({bug.name: bug.law(step) for bug in self.classes if bug.per_id})
        self._add_rule_out(laws, step, scored, emitted)
        if summed is not None and not bool(summed.all()):
            kept = summed.nonzero().squeeze(1)  # [m']
            same = scored is step
            step = step.rows(kept)
            scored = step if same else scored.rows(kept)
            laws = {name: law[kept] for name, law in laws.items()}
        self._add_sums(step, scored, laws)

    def _add_sums(self, step: Step, scored: Step, laws: dict[str, torch.Tensor]) -> None:
        """The power sums of a block of steps, whose classes' laws `laws` are evaluated."""
        m = len(step.p)
        if m == 0:
            return
        p, q = step.p, step.q
        tiles_p = Tiles.of(p, p, self.n_bins)
        tiles_r = Tiles.of(p, p - q, self.n_bins)
        y, y_var, _ = surprisal_scores(p)  # [m, V], [m]
        self.steps += m
        slot = step.slot.cpu()
        self.slot_steps.index_add_(0, slot[slot >= 0], torch.ones(int((slot >= 0).sum()), dtype=torch.float64))
        self.count_h0_var += (p * (1 - p)).sum(0).cpu()
        self.surprisal_h0_var += float(y_var.sum())
        for bug in self.classes:
            if bug.per_id:
                self.sums[bug.name].add(per_id_sums(step, tiles_p, tiles_r, y, self.n_bins, len(self.classes)))
            else:
                self.sums[bug.name].add(law_sums(laws[bug.name], step, tiles_p, tiles_r, y, self._shape))
        self._add_class_scores(laws, step, scored)

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
                self.rule_out_ids += per_id_rule_out(step, emitted, self.members(bug.name)).cpu()
            if bug.name not in laws:
                continue
            law = laws[bug.name] if scored is step else bug.law(scored)
            rho = torch.tensor(self.members(bug.name), dtype=p_x.dtype, device=p_x.device)  # [G]
            log_ratio = log_mixture_ratio(p_x, law.gather(-1, at), rho)  # [m, G]
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

    @staticmethod
    def merge(parts: list[PowerAccumulator], moments_only: bool = False) -> PowerAccumulator:
        """One accumulator holding all `parts` (same classes, vocabulary, k). `moments_only`: the
        parts' power sums alone, whatever members their rule-out e-values keep (a pilot's and a
        tested sample's steps as one estimate of the per-token effects); the result has no
        rule-out e-values."""
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
            return a.vocab, a.k, a.n_bins, a.classes, a.misreported, None if moments_only else a.grid

        if any(design(a) != design(first) for a in started):
            raise LosscheckError(
                "PowerAccumulator.merge: parts differ in vocabulary, k, bins, classes, misreported id or grid"
            )
        grid = {} if moments_only else first.grid
        out = PowerAccumulator(classes=first.classes, n_bins=first.n_bins, misreported=first.misreported, grid=grid)
        assert first.vocab is not None and first.k is not None
        out._start(first.vocab, first.k, all(a.has_slots for a in started), all(a.has_q for a in started))
        if moments_only:  # no rule-out sums: `rule_out_log_e` of the result fails rather than reads zeros
            out.rule_out, out.rule_out_ids = {}, zeros(0)
        for part in started:
            out.steps += part.steps
            out.slot_steps += part.slot_steps
            out.count_h0_var += part.count_h0_var
            out.surprisal_h0_var += part.surprisal_h0_var
            out.class_h0_var += part.class_h0_var
            if not moments_only:
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
        return {bug.name: float(self._class_sums(bug).tv) / max(self.steps, 1) for bug in self.classes}

    def tokens_needed(
        self, alpha_test: float, power: float, looks: int = 1, rho: float = 1.0
    ) -> dict[str, dict[str, float]]:
        """Per class and test (`design_tests()` and `LR_BOUND`), the tokens needed for the test, at level
        `alpha_test`, to reject with probability `power`; math.inf where it has no power. The
        per-id class has no `pit.slot_chisquare` entry (its slot table would cost O(k·V·B)), and
        no `pit.bug_classes` entry unless `misreported` fixed its id. `looks`: a sequential cell's
        stopping points (`losscheck.stats.sequential`) — its fixed-sample tests (the χ² ones) are
        judged at `alpha_test / looks`, the e-value tests, valid at any stopping time, at `alpha_test`.
        `rho`: each class's family member (1 - ρ)·p + ρ·p' instead of its catalogue point (`Sums.mixed`)."""
        return self.tokens_needed_at(alpha_test, (power,), looks, rho)[0]

    def tokens_needed_at(
        self, alpha_test: float, powers: tuple[float, ...], looks: int = 1, rho: float = 1.0
    ) -> list[dict[str, dict[str, float]]]:
        """`tokens_needed` at each of `powers` (a design's and the partial power), every test's
        effect computed once."""
        check_open_unit("alpha_test", alpha_test)
        for power in powers:
            check_open_unit("power", power)
        out: list[dict[str, dict[str, float]]] = [{} for _ in powers]
        for bug in self.classes:
            effects = self._effects(bug, rho, alpha_test, looks).items()
            for at, power in zip(out, powers):
                at[bug.name] = {name: effect.tokens_needed(level, power) for name, (effect, level) in effects}
        return out

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
                name: effect.power(n_tokens, level)
                for name, (effect, level) in self._effects(bug, rho, alpha_test, looks).items()
            }
            for bug in self.classes
        }

    def best_power(self, name: str, n_tokens: float, alpha_test: float, looks: int = 1, rho: float = 1.0) -> float:
        """Class `name`'s member ρ: the power of the cell's best test against it after `n_tokens`
        (the LR bound, a benchmark, left out)."""
        bug = next(b for b in self.classes if b.name == name)
        return max(
            (
                effect.power(n_tokens, level)
                for test, (effect, level) in self._effects(bug, rho, alpha_test, looks).items()
                if test != LR_BOUND
            ),
            default=0.0,
        )

    def rule_out_rate(self, name: str, rho: float = 1.0) -> float | None:
        """How fast member ρ of class `name`'s family is ruled out under H0: the mean growth per
        tested token of its log rule-out e-value, KL(p‖p_ρ) over these steps (the log-LR's H0
        drift, `likelihood_ratio`: exact at ρ = 1, its local form ρ²·χ²/2 below); None where
        `rule_out_log_e` has none (the class's law not evaluable, a per-id class, no step)."""
        bug = next(b for b in self.classes if b.name == name)
        scored = targeted(self.classes, self.has_slots, self.misreported, self.has_q)
        if bug.per_id or not self.steps or bug not in scored:
            return None
        return -likelihood_ratio(self.class_view(bug, rho)).h0_mean

    def wald(self, name: str, alpha: float, power: float) -> WaldSize:
        """Wald's SPRT of p against class `name`'s law over these steps: its expected tokens at
        `alpha` and `power`, under the class and under H0 (`losscheck.stats.effects.wald_size`)."""
        bug = next(b for b in self.classes if b.name == name)
        return likelihood_ratio(self.class_view(bug)).wald(alpha, power)

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
        scored = targeted(self.classes, self.has_slots, self.misreported, self.has_q)
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
            return count_effect(drift, h0_var, h1_var, [v], n).tokens_needed(alpha_test, power)

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
        effect = EvalueEffect(
            [rho * float(sums.count_drift[v]) / n],
            [h0 / n],
            [(h0 + rho * (shift + sq) - rho**2 * sq) / n],
            len(self.count_h0_var),
        )
        return effect.power(n_tokens, alpha_test)

    def _class_sums(self, bug: BugClass) -> Sums:
        """The class's sums; for the per-id class, at `misreported_id` (counts at that id)."""
        sums = self.sums[bug.name]
        if not bug.per_id:
            return sums
        v = self.misreported_id
        assert v is not None
        n = float(self.steps)
        count_drift, count_sq = zeros(len(sums.count_drift)), zeros(len(sums.count_drift))
        count_drift[v], count_sq[v] = sums.count_drift[v], sums.count_sq[v]
        count_var = self.count_h0_var.clone()
        count_var[v] += sums.count_var[v]
        return Sums(
            pooled=sums.pooled[v] + n / self.n_bins,
            residual=sums.residual[v] + n / self.n_bins,
            slot=zeros(0, self.n_bins),
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

    def surprisal_shift(self, name: str, per_row: float) -> RowShift:
        """The law of a second stage's `surprisal` row score (a row's sum of `pit.surprisal`'s
        bounded score y over its tested tokens, `losscheck.cells.engine.attribution`) under class
        `name` at its catalogue point and under H0, rows of `per_row` tested tokens
        (`losscheck.stats.second_stage.token_shift`; y is centred under p at every position)."""
        bug = next((b for b in self.classes if b.name == name), None)
        if bug is None:
            raise LosscheckError(f"PowerAccumulator: no class {name!r}; it holds {[b.name for b in self.classes]}")
        view = self.class_view(bug)
        n = view.steps
        return token_shift(
            per_row,
            float(view.sums.surprisal_drift) / n,
            float(view.sums.surprisal_var) / n,
            float(view.sums.surprisal_sq) / n,
            view.h0.surprisal_var / n,
        )

    @property
    def h0(self) -> NullSums:
        """The tested steps' sums under H0."""
        return NullSums(self.steps, self.slot_steps, self.count_h0_var, self.surprisal_h0_var, self.class_h0_var)

    def class_view(self, bug: BugClass, rho: float = 1.0) -> ClassView:
        """What the power models read about class `bug` at member `rho` of its family."""
        if self.steps == 0:
            raise LosscheckError("PowerAccumulator: no tested step was added")
        if not 0 < rho <= 1:
            raise LosscheckError(f"PowerAccumulator: a family member needs 0 < rho <= 1, got {rho}")
        scored = targeted(self.classes, self.has_slots, self.misreported, self.has_q)
        return ClassView(
            bug=bug,
            sums=self._class_sums(bug).mixed(rho, self.h0),
            h0=self.h0,
            n_bins=self.n_bins,
            has_slots=self.has_slots,
            reported_id=self.misreported_id if bug.per_id else None,
            id_fixed=self.misreported is not None,
            class_scores=tuple(c for c, b in enumerate(self.classes) if b in scored),
        )

    def _effects(self, bug: BugClass, rho: float, alpha_test: float, looks: int) -> dict[str, tuple[Effect, float]]:
        """Each designed test's effect against class `bug` (member `rho`) and the level it is judged
        at: `alpha_test`, over `looks` for a test not valid at any stopping time; then the LR bound's."""
        view = self.class_view(bug, rho)
        out: dict[str, tuple[Effect, float]] = {}
        for test in registry.designed():
            assert test.power is not None
            effect = test.power.effect(view)
            if effect is not None:
                out[test.name] = (effect, alpha_test if test.anytime else alpha_test / looks)
        # a benchmark, not a test the cell runs: kept at the full level, so it reads the same in every design
        out[LR_BOUND] = (likelihood_ratio(view), alpha_test)
        return out


def design_tests() -> tuple[str, ...]:
    """The tests a PIT cell's design sizes its sample for (`registry.designed`), in table order."""
    return tuple(t.name for t in registry.designed())


def __getattr__(name: str) -> tuple[str, ...]:
    if name == "TESTS":  # the removed hand-kept list (CHANGELOG.md, Deprecated)
        warnings.warn(
            "losscheck.stats.bugclass.TESTS is deprecated: the designed tests are registered; "
            "use losscheck.stats.bugclass.design_tests()",
            DeprecationWarning,
            stacklevel=2,
        )
        return design_tests()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
