"""The sufficient sums of the bug-class power design: what the tests' power models read.

Per bug class, `Sums` holds per-step quantities of the class's law p'_t summed over a cell's
tested steps — the bin masses of the PIT orderings, the count and surprisal drifts and variances,
the log-likelihood ratio's moments, TV, the class scores' drifts — and `NullSums` the same
steps' quantities under H0 (p itself), shared by every class. A power model
(`losscheck.stats.effects.PowerModel`) turns them into what its test sees per token; `Sums.mixed`
gives every sum for a member (1 - ρ)·p + ρ·p' of the class's family from the class's own.
Everything is a sum over steps: chunks of rows reduce by addition, O(V · bins) numbers per class.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from losscheck.stats.buglaws import Step


@dataclass(frozen=True)
class Tiles:
    """The PIT intervals of each step's tokens when the vocabulary is ordered by descending key,
    ties by id. m steps; edges e_b = b / B of the B equal bins."""

    p: torch.Tensor  # [m, V]
    order: torch.Tensor  # [m, V] ids in PIT order
    start: torch.Tensor  # [m, V] F(x⁻) of each id (id order)
    at: torch.Tensor  # [m, B-1] index j of the interval holding each inner edge (1-based over cumsum)
    frac: torch.Tensor  # [m, B-1] where in that interval the edge lies, in [0, 1]

    @classmethod
    def of(cls, p: torch.Tensor, key: torch.Tensor, n_bins: int) -> Tiles:
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

    def rows(self, keep: torch.Tensor) -> Tiles:
        """The tiles of the steps `keep` [m] selects."""
        return Tiles(self.p[keep], self.order[keep], self.start[keep], self.at[keep], self.frac[keep])


def zeros(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float64)


@dataclass(frozen=True)
class SumsShape:
    """The sizes every class's sums share: vocabulary V, PIT bins B, slots S (k + 1), class scores C."""

    vocab: int
    n_bins: int
    slots: int
    classes: int


@dataclass(frozen=True)
class NullSums:
    """The tested steps' sums under H0 (the emitted token drawn from p), shared by every class."""

    steps: int  # tested steps
    slot_steps: torch.Tensor  # [S] tested steps per slot
    count_var: torch.Tensor  # [V] Σ_t p_t(v)(1 - p_t(v))
    surprisal_var: float  # Σ_t Var_p(y_t)
    class_var: torch.Tensor  # [C] Σ_t Var_p(y_c) per class score


@dataclass
class Sums:
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
    def empty(cls, shape: SumsShape, per_id: bool) -> Sums:
        """Zero sums of a class (`per_id`: the per-id class, every sum kept at every id)."""
        vocab, n_bins, slots, n_classes = shape.vocab, shape.n_bins, shape.slots, shape.classes
        lead = (vocab,) if per_id else ()
        return cls(
            pooled=zeros(*lead, n_bins),
            residual=zeros(*lead, n_bins),
            slot=zeros(0 if per_id else slots, n_bins),
            in_support=zeros(*lead),
            count_drift=zeros(vocab),
            count_var=zeros(vocab),
            surprisal_drift=zeros(*lead),
            surprisal_var=zeros(*lead),
            lr=zeros(*lead, 4),
            tv=zeros(*lead),
            class_drift=zeros(n_classes),
            class_var=zeros(n_classes),
            count_sq=zeros(vocab),
            surprisal_sq=zeros(*lead),
            class_sq=zeros(n_classes),
            chi2=zeros(*lead),
        )

    def add(self, other: Sums) -> None:
        """Add `other` (on any device) into these CPU sums."""
        for name in self.__dataclass_fields__:
            getattr(self, name).add_(getattr(other, name).cpu())

    def mixed(self, rho: float, h0: NullSums) -> Sums:
        """These sums (a class's view: explicit law p', or the per-id class at one id) for the
        mixture member p_ρ = (1 - ρ)·p + ρ·p' at every step: the bug at magnitude ρ, or acting on
        each token with probability ρ. Bin masses, drifts, support and TV are linear in the law;
        a variance is (1 - ρ)·Var_p + ρ·E_{p'}[y²] - ρ²·d² per step, so the squared drifts make
        it exact. The log-LR moments take their local form from ρ²·χ²(p'‖p) (the LR bound is a
        benchmark); at ρ = 1 the sums are returned unchanged."""
        if rho == 1.0:
            return self
        n = float(h0.steps)
        keep = 1.0 - rho
        n_bins = self.pooled.shape[-1]
        h0_count = h0.count_var
        chi2 = rho**2 * self.chi2
        return Sums(
            pooled=keep * n / n_bins + rho * self.pooled,
            residual=keep * n / n_bins + rho * self.residual,
            slot=keep * h0.slot_steps[: self.slot.shape[0], None] / n_bins + rho * self.slot,
            in_support=keep * n + rho * self.in_support,
            count_drift=rho * self.count_drift,
            count_var=h0_count + rho * (self.count_var - h0_count + self.count_sq) - rho**2 * self.count_sq,
            surprisal_drift=rho * self.surprisal_drift,
            surprisal_var=keep * h0.surprisal_var
            + rho * (self.surprisal_var + self.surprisal_sq)
            - rho**2 * self.surprisal_sq,
            lr=torch.stack([chi2 / 2, chi2, -chi2 / 2, chi2], -1),
            tv=rho * self.tv,
            class_drift=rho * self.class_drift,
            class_var=keep * h0.class_var + rho * (self.class_var + self.class_sq) - rho**2 * self.class_sq,
            count_sq=rho**2 * self.count_sq,
            surprisal_sq=rho**2 * self.surprisal_sq,
            class_sq=rho**2 * self.class_sq,
            chi2=chi2,
        )


SUMS = frozenset(f.name for f in fields(Sums))  # the sums a power model may read


def law_sums(law: torch.Tensor, step: Step, tiles_p: Tiles, tiles_r: Tiles, y: torch.Tensor, shape: SumsShape) -> Sums:
    """The sums of one chunk's steps under an explicit law p' [m, V]: `tiles_p`, `tiles_r` the
    steps' PIT tiles by descending p and by descending p - q, `y` [m, V] their surprisal scores.
    The class-score sums are left at zero: the accumulator adds them apart, under every law."""
    p = step.p
    inside = p > 0
    pooled = tiles_p.masses(law)  # [m, B]
    slot = pooled.new_zeros(shape.slots, shape.n_bins)
    known = step.slot >= 0
    slot.index_add_(0, step.slot[known], pooled[known])
    drift = (law * y).sum(-1)  # [m]
    safe_p = torch.where(inside, p, 1.0)
    return Sums(
        pooled=pooled.sum(0),
        residual=tiles_r.masses(law).sum(0),
        slot=slot,
        in_support=torch.where(inside, law, 0.0).sum(),
        count_drift=(law - p).sum(0),
        count_var=(law * (1 - law)).sum(0),
        surprisal_drift=drift.sum(),
        surprisal_var=((law * y**2).sum(-1) - drift**2).clamp_min(0.0).sum(),
        lr=log_lr_moments(p, law).sum(0),
        tv=0.5 * (law - p).abs().sum(),
        class_drift=zeros(shape.classes),
        class_var=zeros(shape.classes),
        count_sq=((law - p) ** 2).sum(0),
        surprisal_sq=(drift**2).sum(),
        class_sq=zeros(shape.classes),
        chi2=torch.where(inside, (law - p) ** 2 / safe_p, 0.0).sum(),
    )


def log_lr_moments(p: torch.Tensor, law: torch.Tensor) -> torch.Tensor:
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


def log_mixture_ratio(p_x: torch.Tensor, law_x: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """log(p(x) / ((1 - ρ)·p(x) + ρ·p'(x))) [..., G] of tokens with probabilities p_x and law_x
    [..., 1] under p and the bug, for the members `rho` [G]; at most log(1 / (1 - ρ)) for ρ < 1."""
    mixture = (1 - rho) * p_x + rho * law_x  # [..., G]
    return p_x.clamp_min(1e-300).log() - mixture.clamp_min(1e-300).log()
