"""The per-id bug class (`drafter_misreports_one_id`) at every candidate id at once.

Its law depends on which id v* the drafter over-draws, and the design asks about every v*: at a
draft slot with reported q the drafter draws from q tilted by f = `MISREPORT_FACTOR` at v*, which
makes p' an exact linear combination of per-step vectors shared by all candidates (the kept mass
b = min(p, q), the residual r) with per-candidate scalars. Every sum of `losscheck.stats.bugsums`
and every rule-out e-value then costs O(V·B) per step for all V candidates together, where one
law per candidate would cost O(V²).
"""

from __future__ import annotations

import math

import torch

from losscheck.stats.buglaws import MISREPORT_FACTOR, Step
from losscheck.stats.bugsums import Sums, SumsShape, Tiles, log_mixture_ratio


def per_id_sums(step: Step, tiles_p: Tiles, tiles_r: Tiles, y: torch.Tensor, n_bins: int, n_classes: int) -> Sums:
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
    empty = Sums.empty(SumsShape(vocab, n_bins, 0, n_classes), True)
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
    sums.tv = per_id_tv(p, q, b, r, alpha, delta, at_v).sum(0)
    return sums


def per_id_tv(
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


def per_id_rule_out(step: Step, emitted: torch.Tensor, members: tuple[float, ...]) -> torch.Tensor:
    """[V, G] Σ_t log(p_t(x_t) / p_ρ,v,t(x_t)) of drafter_misreports_one_id at every candidate id
    v and member ρ of `members`, over a block of steps with emitted tokens `emitted` [m]. With the
    terms of `per_id_sums`, p'_v(x) = p(x) - α_v·b(x) - Δ_v·r(x) + γ_v·[x = v]: O(V) per step and
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
        [log_mixture_ratio(p_x[..., None], law[..., None], law.new_tensor([rho])).sum(0)[..., 0] for rho in members],
        -1,
    )
