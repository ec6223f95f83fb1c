"""The power models of the PIT-mode tests that a cell's design sizes its sample for: what each
test sees per token under a bug class, from the class's sufficient sums (`ClassView`).

Each is carried by its test's registration (`losscheck.stats.pit`, `losscheck.stats.conditional`):

- `pit.pooled_chisquare` (u ordered by descending p), `pit.residual_order` (u ordered by
  descending p - q): under the bug, u at a step has the law of p'(x) spread uniformly over x's
  PIT interval, bin masses π_b; the test's law is their average over steps. Tokens outside p's
  support are not seen (the support check catches them).
- `pit.slot_chisquare`: the slot × bin table, w² per slot weighted by the slots' shares, df as
  `losscheck.stats.pit` uses. The per-id class has no entry (its slot table would cost O(k·V·B)).
- `pit.token_counts`: judged at α / V (Bonferroni over ids) for its best id, searched among the
  `COUNT_CANDIDATES` ids with the largest d²/τ²; the per-id class at its reported id.
- `pit.surprisal`: one e-value sum.
- `pit.bug_classes`: judged one-sided at α / C (Bonferroni over its C class scores) for its best
  score: against each bug's law every class score the test holds is a candidate (the score aimed
  at that bug is usually, not always, the best), with its drift and variances under that law; the
  `CLASS_CANDIDATES` with the largest d²/max(σ², τ²) are solved exactly. The per-id class has an
  entry only when its id was fixed before the sample, as the test itself scores it.

`likelihood_ratio` is the LR bound's model: a benchmark the design reports beside the tests, not a
registered test.
"""

from __future__ import annotations

import torch

from losscheck.stats.bugsums import Sums
from losscheck.stats.effects import ChisquareEffect, ClassView, EvalueEffect, LikelihoodRatioEffect, PowerModel, w2

COUNT_CANDIDATES = 8  # ids whose count test is solved exactly, of those with the largest d²/τ²
CLASS_CANDIDATES = 2  # class scores of pit.bug_classes solved exactly against each law, likewise


def _support(view: ClassView) -> float:
    """The share of tokens p' emits inside p's support."""
    return float(view.sums.in_support) / view.steps


def _pooled(view: ClassView) -> ChisquareEffect:
    return ChisquareEffect(w2(view.sums.pooled, view.n_bins), view.n_bins, _support(view))


def _residual(view: ClassView) -> ChisquareEffect:
    return ChisquareEffect(w2(view.sums.residual, view.n_bins), view.n_bins, _support(view))


def _slot(view: ClassView) -> ChisquareEffect | None:
    """The slot × bin χ²: per-token noncentrality w² and df; no power without slots."""
    if view.bug.per_id:
        return None
    slot_steps, sums = view.h0.slot_steps, view.sums
    if not view.has_slots or sums.slot.shape[0] == 0:
        return ChisquareEffect(0.0, 2, 1.0)
    present = slot_steps > 0
    share = slot_steps[present] / view.h0.steps  # [S']
    w2_slots = torch.stack([torch.tensor(w2(row, view.n_bins)) for row in sums.slot[present]])  # [S']
    return ChisquareEffect(float((share * w2_slots).sum()), int(present.sum()) * (view.n_bins - 1) + 1, 1.0)


def count_candidates(sums: Sums, h0_var: torch.Tensor) -> list[int]:
    """Ids whose count test is solved exactly: the largest d² / τ² (detectability per token)."""
    score = sums.count_drift**2 / torch.maximum(sums.count_var, h0_var).clamp_min(1e-300)
    return score.topk(min(COUNT_CANDIDATES, len(score))).indices.tolist()


def count_effect(
    drift: torch.Tensor, h0_var: torch.Tensor, h1_var: torch.Tensor, ids: list[int], n: float
) -> EvalueEffect:
    """The count test at `ids`, from the sums [V] of drift and variances over `n` steps, judged at α / V."""
    return EvalueEffect(
        drift=[float(drift[v]) / n for v in ids],
        h0_var=[float(h0_var[v]) / n for v in ids],
        h1_var=[float(h1_var[v]) / n for v in ids],
        bonferroni=len(h0_var),
    )


def _counts(view: ClassView) -> EvalueEffect:
    sums, h0_var = view.sums, view.h0.count_var
    if view.bug.per_id:
        assert view.reported_id is not None
        ids = [view.reported_id]
    else:
        ids = count_candidates(sums, h0_var)
    return count_effect(sums.count_drift, h0_var, sums.count_var, ids, view.steps)


def _surprisal(view: ClassView) -> EvalueEffect:
    n, sums = view.steps, view.sums
    return EvalueEffect(
        [float(sums.surprisal_drift) / n], [view.h0.surprisal_var / n], [float(sums.surprisal_var) / n], 1
    )


def _classes(view: ClassView) -> EvalueEffect | None:
    if view.bug.per_id and not view.id_fixed:  # the test scores no id chosen after the sample
        return None
    n, sums, scores = view.steps, view.sums, view.class_scores
    drift, h0_var, h1_var = sums.class_drift / n, view.h0.class_var / n, sums.class_var / n  # [C]
    rank = drift.clamp_min(0.0) ** 2 / torch.maximum(h0_var, h1_var).clamp_min(1e-300)
    best = sorted(scores, key=lambda c: -float(rank[c]))[:CLASS_CANDIDATES]
    return EvalueEffect(
        [float(drift[c]) for c in best],
        [float(h0_var[c]) for c in best],
        [float(h1_var[c]) for c in best],
        len(scores),
        one_sided=True,
    )


def likelihood_ratio(view: ClassView) -> LikelihoodRatioEffect:
    """The LR bound: the log-LR's moments per token under the bug and under H0, and the mass
    outside p's support."""
    h1_mean, h1_var, h0_mean, h0_var = (view.sums.lr / view.steps).tolist()
    return LikelihoodRatioEffect(h1_mean, h1_var, h0_mean, h0_var, outside=1.0 - _support(view))


POOLED_CHISQUARE = PowerModel(_pooled, frozenset({"pooled", "in_support"}))
RESIDUAL_ORDER = PowerModel(_residual, frozenset({"residual", "in_support"}))
SLOT_CHISQUARE = PowerModel(_slot, frozenset({"slot"}))
TOKEN_COUNTS = PowerModel(_counts, frozenset({"count_drift", "count_var", "count_sq"}))
SURPRISAL = PowerModel(_surprisal, frozenset({"surprisal_drift", "surprisal_var", "surprisal_sq"}))
BUG_CLASSES = PowerModel(_classes, frozenset({"class_drift", "class_var", "class_sq"}))
