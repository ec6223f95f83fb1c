"""Power of the two-sample tests against the target-side bug classes, for an engine losscheck has
no reference for (a quantized target, kernels it does not reproduce) but a *proxy*: the same model
in fp32.

The per-position χ² homogeneity test (`losscheck.stats.two_sample`) compares the tokens two sides
emit at position l. Under H0 both follow the marginal m_l = E[p_t] over the rows' prefixes; under a
class whose law at every step is p' = f(p_t) (the target-side classes, `buglaws.TARGET_SIDE`: they
read p alone) the speculative side follows m'_l = E[f(p_t)] — the bug changes the emitted token's
law, not which prefixes the rows visit (`losscheck.stats.bugclass`'s assumption too). On bins B the
test has noncentrality (n/2)·w_l² for n rows a side, w_l² = Σ_B (m'_l - m_l)² / m̄_l with m̄ the
pooled law (m + m') / 2. Its bins are the test's rule applied to m̄: every id whose expected pooled
count reaches the test's minimum a bin, at most `max_bins` (the most probable), the rest one
bucket — so the bins, and w_l, grow with n. The df is `max_bins` - 1 whatever the bins, as the
test's own power statement takes it (fewer bins only add power).

A class is caught where any position's test rejects; the rows a class needs are the fewest that
one position needs (a conservative figure: the positions' tests add power).

Marginals dilute a bug that tilts every step a little (a temperature) across the prompts' many
prefixes. The proxy itself gives a sharper two-sample test: each row's *surprisal score* under the
proxy, S = Σ_t (-log p(x_t) - H(p_t)), compared between the sides by a Mann–Whitney U test
(`losscheck.cells.engine.attribution`). The proxy is fixed before either side is drawn, so the test
keeps its level whatever the proxy is; its power is the proxy's approximation. Under H0, S has
mean 0 and variance Σ_t Var_p(-log p) (a martingale); under a class, mean Σ_t δ_t with
δ_t = E_{p'}[-log p] - H(p). With d = E[Σ δ_t] / sqrt(E[Σ Var_p(-log p)]) over the rows, n rows a
side reach the power when d ≥ (z_{tail} + z_power)·sqrt(2 / n) / sqrt(3/π) (the U test's normal
efficiency, `SurprisalSums`).

The p behind either model is the proxy's, teacher-forced on the variant's own rows: the figures
are the effects these classes would have on the unquantized model, stated as such wherever they
are reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from scipy import stats

from losscheck.errors import LosscheckError
from losscheck.stats._checks import check_open_unit
from losscheck.stats.buglaws import TARGET_SIDE, BugClass, Step
from losscheck.stats.power import chisquare_required_n

MIN_EXPECTED = 5.0  # `two_sample_tests`' default: tokens a bin needs per sample
ARE = 3 / math.pi  # the U test's efficiency against the t test under normal scores
TINY = 1e-300


def target_side_law(bug: BugClass, p: torch.Tensor) -> torch.Tensor:
    """The law [..., V] a target-side class emits at steps of law `p` [..., V]."""
    if not bug.target_side:
        raise LosscheckError(f"bug class {bug.name!r} reads more than p; the two-sample power model takes p alone")
    none = torch.zeros_like(p)
    slot = torch.full(p.shape[:-1], -1, dtype=torch.long, device=p.device)
    return bug.law(Step(p, none, slot, 0, none, none, None))


@dataclass
class MarginalSums:
    """Σ over the rows shown of p_t and of each class's law f(p_t), per position: the marginals
    m_l and m'_l of the module docstring, kept as sums [L, V] (float64) and counts [L]."""

    classes: tuple[BugClass, ...] = TARGET_SIDE
    p: torch.Tensor | None = None  # [L, V]
    bugged: dict[str, torch.Tensor] = field(default_factory=dict)  # class -> [L, V]
    rows: torch.Tensor | None = None  # [L] rows summed at each position

    def add(self, probs: torch.Tensor, read: torch.Tensor) -> None:
        """`probs` [n, L, V]: the proxy's law at every position of n rows; `read` [n, L] bool: the
        positions the tests read (generated, before the row's EOS pad)."""
        probs, weight = probs.double(), read.double()[..., None]  # [n, L, V], [n, L, 1]
        if self.p is None:
            self.p = torch.zeros(probs.shape[1:], dtype=torch.float64)
            self.rows = torch.zeros(probs.shape[1], dtype=torch.float64)
            self.bugged = {bug.name: torch.zeros_like(self.p) for bug in self.classes}
        assert self.rows is not None
        self.p += (probs * weight).sum(0).cpu()
        self.rows += weight[..., 0].sum(0).cpu()
        for bug in self.classes:
            self.bugged[bug.name] += (target_side_law(bug, probs) * weight).sum(0).cpu()

    def w2(self, name: str, rows: float, max_bins: int) -> torch.Tensor:
        """[L] w_l² of class `name` on the bins the test would form from n = `rows` a side."""
        if self.p is None or self.rows is None:
            raise LosscheckError("MarginalSums.w2 before any rows were added")
        count = self.rows.clamp_min(1.0)[:, None]
        m, bugged = self.p / count, self.bugged[name] / count  # [L, V]
        pooled = (m + bugged) / 2
        # the test's bins: ids of enough expected pooled count (2n rows), the most probable
        # `max_bins` - 1 of them when there are more, the rest one bucket
        ranked, order = pooled.sort(-1, descending=True)
        own = (2 * rows * ranked >= 2 * MIN_EXPECTED) & (torch.arange(ranked.shape[-1]) < max_bins - 1)
        diff = (bugged - m).gather(-1, order)  # [L, V] in the ranked order
        binned = torch.where(own, diff**2 / ranked.clamp_min(1e-300), 0.0).sum(-1)
        rest_diff = torch.where(own, 0.0, diff).sum(-1)
        rest_mass = torch.where(own, 0.0, ranked).sum(-1)
        return binned + torch.where(rest_mass > 1e-300, rest_diff**2 / rest_mass.clamp_min(1e-300), 0.0)

    def power_at(self, name: str, rows: int, alpha_test: float, max_bins: int) -> float:
        """The best position's power against class `name` with `rows` a side, at level `alpha_test`."""
        w2 = float(self.w2(name, rows, max_bins).max())
        critical = stats.chi2.isf(alpha_test, max_bins - 1)
        return float(stats.ncx2.sf(critical, max_bins - 1, rows / 2 * w2)) if w2 > 0 else alpha_test

    def rows_needed(self, name: str, alpha_test: float, power: float, max_bins: int, cap: int) -> float:
        """The fewest rows a side at which some position's test reaches `power` against class
        `name` at level `alpha_test`; math.inf when not within `cap` rows."""
        check_open_unit("power", power)

        def enough(n: int) -> bool:  # the effective size of n rows a side is n / 2
            w2 = float(self.w2(name, n, max_bins).max())
            return w2 > 0 and n / 2 >= chisquare_required_n(math.sqrt(w2), max_bins, alpha_test, power)

        if not enough(cap):
            return math.inf
        low, high = 1, cap  # enough(high); w² grows with n (more ids get bins), so bisection finds the least
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if enough(middle) else (middle + 1, high)
        return float(high)


@dataclass
class SurprisalSums:
    """Σ over the rows shown of each row's H0 variance of the surprisal score and, per class, its
    mean shift (the module docstring), for the U test on the score."""

    classes: tuple[BugClass, ...] = TARGET_SIDE
    rows: int = 0
    variance: float = 0.0  # Σ_rows Σ_t Var_p(-log p)
    shift: dict[str, float] = field(default_factory=dict)  # class -> Σ_rows Σ_t δ_t
    # the rows' own scores s = Σ_t (-log p(x_t) - H_t), where the tokens were given: their sum and
    # sum of squares (under a proxy that is the engine's law, mean 0 and variance the model's)
    observed: int = 0
    score_sum: float = 0.0
    score_squares: float = 0.0

    def add(self, probs: torch.Tensor, read: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """`probs` [n, L, V]: the proxy's law at every position of n rows; `read` [n, L] bool: the
        positions the score sums (generated, not cut-off ambiguous); `tokens` [n, L]: the rows' ids,
        whose own scores then say whether the proxy describes them (`centre_z`, `measured_ratio`)."""
        p, weight = probs.double(), read.double()  # [n, L, V], [n, L]
        surprise = -p.clamp_min(TINY).log()  # [n, L, V]
        entropy = (p * surprise).sum(-1)  # [n, L]
        second = (p * surprise**2).sum(-1)
        self.rows += p.shape[0]
        self.variance += float(((second - entropy**2) * weight).sum())
        for bug in self.classes:
            moved = (target_side_law(bug, p) * surprise).sum(-1) - entropy  # [n, L] δ_t
            self.shift[bug.name] = self.shift.get(bug.name, 0.0) + float((moved * weight).sum())
        if tokens is not None:
            drawn = surprise.gather(-1, tokens.to(p.device).clamp_min(0)[..., None]).squeeze(-1)  # [n, L]
            score = ((drawn - entropy) * weight).sum(-1)  # [n]
            self.observed += p.shape[0]
            self.score_sum += float(score.sum())
            self.score_squares += float((score**2).sum())

    def centre_z(self) -> float | None:
        """The rows' mean score in standard errors of the model (0 ± 1 where the proxy is the law
        the rows were drawn from; None: no rows' tokens given)."""
        if self.observed == 0 or self.variance <= 0:
            return None
        return self.score_sum / math.sqrt(self.variance * self.observed / max(self.rows, 1))

    def measured_ratio(self) -> float:
        """The rows' measured score variance over the model's (1 where the proxy is their law; 1
        when no tokens were given): the effect is read against the larger of the two."""
        if self.observed < 2 or self.variance <= 0:
            return 1.0
        mean = self.score_sum / self.observed
        measured = (self.score_squares - self.observed * mean**2) / (self.observed - 1)
        return measured / (self.variance / max(self.rows, 1))

    def effect(self, name: str) -> float:
        """d: the class's standardized mean shift of the score per row, against the larger of the
        model's and the rows' measured variance (a proxy that is not the engine's law must not
        inflate its own power)."""
        if self.rows == 0 or self.variance <= 0:
            return 0.0
        variance = self.variance / self.rows * max(1.0, self.measured_ratio())
        return abs(self.shift[name] / self.rows) / math.sqrt(variance)

    def power_at(self, name: str, rows: int, tail: float) -> float:
        """The U test's power against class `name` with `rows` a side at one-tail level `tail`."""
        reach = self.effect(name) * math.sqrt(rows / 2 * ARE)
        return float(stats.norm.sf(stats.norm.isf(tail) - reach))

    def rows_needed(self, name: str, tail: float, power: float) -> float:
        """Rows a side at which the U test reaches `power` (math.inf: no shift)."""
        check_open_unit("power", power)
        d = self.effect(name)
        if d <= 0:
            return math.inf
        z = float(stats.norm.isf(tail) + stats.norm.ppf(power))
        return float(math.ceil(2 * (z / d) ** 2 / ARE))
