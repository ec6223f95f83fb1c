"""Exact-conditional tests: each generated token judged against the law the target gave it, at its
own prefix, so that distortions of opposite sign at different prefixes add up instead of cancelling.

The pooled PIT tests (`losscheck.stats.pit`) see the law of u pooled over positions. A verifier
bug moves mass one way at one prefix and the other way at the next, and the pooled law barely
moves. But the scorer knows, at every generated position t (a *step*), the target's distribution
p_t and — in white-box cells — the drafter's reported distribution q_t for the slot that emitted
the token, before the token x_t is drawn. Any statistic built from (p_t, q_t) and then evaluated
at x_t is a predictable score: under H0 (x_t ~ p_t given everything before it) its conditional
law is known exactly, step by step. Five such tests:

- `pit.residual_order`: the randomized PIT with the vocabulary ordered by descending p - q (ties
  by id), the direction in which a verifier that mishandles the residual norm(max(0, p - q))
  moves mass. Exactly U(0, 1) under H0 for any key fixed before x_t is drawn (the key only
  permutes the tiles of [0, 1]); Pearson χ² on 10 equal bins.
- `pit.token_counts`: per token id v, S_v = Σ_t (1[x_t = v] - p_t(v)) — the excess of v over what
  the target predicted at the very steps it was drawn — tested by a Bennett mixture e-value,
  Bonferroni over ids. Catches a drafter that over-draws one id.
- `pit.surprisal`: the standardized, clipped surprisal score of each token, centred by its exact
  conditional mean; catches temperature-like bugs (tokens more or less surprising than p says).
- `pit.repeats`: per step after the output's first token, Y_t = 1[x_t repeats an id of the output
  before it] - p_t(those ids): tokens that repeat the output as often as p predicts, by a
  two-sided Bennett mixture e-value. It needs no slot, so black-box cells have it too. Penalties
  act exactly on these ids: an engine that skips them, counts one token per round (SGLang PR
  #33643) or processes a round with the history before it (SGLang PR #40244) over-emits repeats.
- `pit.bug_classes`: per bug class of `losscheck.stats.buglaws.CATALOGUE`, whose law p'_t is a
  function of the step known before x_t is drawn, the log-likelihood ratio ℓ_t = log(p'_t / p_t)
  standardized, clipped and centred like the surprisal score: the likelihood-ratio test that knows
  the bug, made bounded so that its e-value is valid. One-sided (the bug moves mass to where
  ℓ > 0); Bonferroni over the classes. Its null law is exact whatever the true bug is: the
  classes only choose the direction each token is scored in.

Steps are slot-agnostic: q_t is all zeros where no draft emitted the token (a bonus slot, or no
drafter), and p - q is then p. Under standard speculative sampling the emitted token at every slot
is distributed as p given the prefix and the round so far, whatever q the drafter reported, so
every statistic here keeps its exact null law (`pit.repeats` too: the set R_t is the output
before t, fixed before x_t is drawn).

Anytime validity (the e-value tests). For increments Y_t <= 1 with E[Y_t | past] = 0 and
Var[Y_t | past] = σ_t², Bennett's lemma gives E exp(λY_t) <= exp(ψ(λ)σ_t²), ψ(λ) = e^λ - 1 - λ,
for every λ > 0; so M_λ = exp(λS - ψ(λ)W) (S = ΣY_t, W = Σσ_t²) is a nonnegative supermartingale
with M_λ(0) = 1, a fixed-weight mixture over λ is one too, and by Ville's inequality
p = min(1, 1/M) is a valid p-value under any stopping rule — a cell may size its sample by what it
has seen. Rows are scored chunk by chunk; every quantity here is a sum over steps, so chunks
reduce by addition (`ConditionalValues.merge`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from scipy import stats

from losscheck.errors import LosscheckError
from losscheck.stats import powermodels
from losscheck.stats._checks import check_open_unit, normalized_rows
from losscheck.stats.buglaws import CATALOGUE, chunk_steps, targeted
from losscheck.stats.evalue import evalue_threshold, log_mixture_evalue
from losscheck.stats.gof import goodness_of_fit
from losscheck.stats.registry import CONDITIONAL, StatTest, deprecated_count, register, run_family
from losscheck.stats.result import TestResult

ORDER_BINS = 10
SURPRISAL_CLIP = 3.0  # C: the standardized surprisal is clipped to [-C, C] so increments are bounded
CLASS_CLIP = 3.0  # C of the class scores (see `targeted_scores`)
# A token to which a class gives less than this fraction of p's probability is scored as if it got
# exactly this fraction. Such a token is evidence against the bug whatever its exact ratio, and the
# clip cuts most of it anyway; the floor keeps a few tokens the bug never emits (p' = 0, ℓ = -inf)
# from setting the sd — the scale — of every other token's score. On the bug-class table 0.1 to
# 0.3 serve best; 1e-4 costs up to 13% more tokens (top_p_one_side, whose law has such zeros).
RATIO_FLOOR = 0.1
# Below this sd a step's score is constant up to round-off (a point mass, uniform surprisal over
# the support, or a class that cannot act there): its score would be round-off divided by round-off.
_MIN_SCORE_SD = 1e-9


def residual_key(p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """The ordering key p - q [..., V] in float64 (p where `q` is None: no drafter)."""
    p = torch.as_tensor(p).to(torch.float64)
    if q is None:
        return p
    q = torch.as_tensor(q).to(torch.float64)
    if q.shape != p.shape:
        raise LosscheckError(f"residual_key needs q of p's shape {tuple(p.shape)}, got {tuple(q.shape)}")
    return p - q


def ordered_pit(p: torch.Tensor, key: torch.Tensor, tokens: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Randomized PIT u = F(x⁻) + v·p(x) with the vocabulary ordered by descending `key`, ties by id.

    p      [N, L, V]  target distribution at each step (rows renormalised in float64)
    key    [N, L, V]  ordering key, fixed before the token is drawn (p itself: `randomized_pit`)
    tokens [N, L]     emitted token ids
    v      [N, L]     independent U(0, 1) draws
    returns u [N, L]  float64; NaN where p(x) = 0 (a token the target cannot emit).

    Under H0 u is exactly U(0, 1) for any such key: the tokens' intervals [F(x⁻), F(x⁻) + p(x)]
    tile [0, 1] in the key's order and x lands in its interval with probability p(x).
    """
    if p.dim() != 3 or key.shape != p.shape or tokens.shape != p.shape[:2] or v.shape != tokens.shape:
        raise LosscheckError(
            f"ordered_pit needs p [N, L, V], key [N, L, V], tokens [N, L], v [N, L]; got p {tuple(p.shape)}, "
            f"key {tuple(key.shape)}, tokens {tuple(tokens.shape)}, v {tuple(v.shape)}"
        )
    _check_tokens("ordered_pit tokens", tokens, p.shape[-1])
    p = normalized_rows(p, "ordered_pit p")  # [N, L, V]
    key = key.to(torch.float64)
    if not torch.isfinite(key).all():
        raise LosscheckError("ordered_pit key: must be finite")
    x = tokens.long().unsqueeze(-1)  # [N, L, 1]
    p_x = p.gather(-1, x)  # [N, L, 1]
    key_x = key.gather(-1, x)  # [N, L, 1]
    ids = torch.arange(p.shape[-1], device=p.device)  # [V]
    ranked_before = (key > key_x) | ((key == key_x) & (ids < x))  # [N, L, V]
    f_before = torch.where(ranked_before, p, 0.0).sum(-1)  # [N, L]
    p_x = p_x.squeeze(-1)  # [N, L]
    u = (f_before + v.to(torch.float64) * p_x).clamp(0.0, 1.0)  # [N, L]
    return u.masked_fill(p_x == 0, math.nan)


def bounded_scores(
    p: torch.Tensor, raw: torch.Tensor, clip: float, outside: float, one_sided: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per step a raw score made a bounded, centred increment, with its exact variance under p.

    p [m, V] float64 rows summing to 1; raw [m, V] finite on p's support. With s the sd of
    raw(X), X ~ p: g(x) = (raw(x) - E_p raw) / s, h = clip(g, -C, C) on the support and
    h = `outside` (±C) off it (never drawn under H0), y(x) = (h(x) - E_p h) / b with
    b = 2C, so that y lies in [-1, 1] (two-sided tests); `one_sided`: b = C - E_p h, the
    largest value of h - E_p h, so that y <= 1 — all a test of the side S > 0 needs — with
    increments about twice as large relative to their bound (b is known before the token).
    Returns y [m, V], var [m] = Var_p(h) / b² and scored [m] bool (s > 0: steps whose score
    varies at all; the others have y = 0 and var = 0).
    """
    # in place where it can (the [m, V] float64 passes are the cost): no cut-off, no mask
    off = None if bool((p > 0).all()) else p <= 0  # [m, V] tokens outside the support
    centred = raw.masked_fill(off, 0.0) if off is not None else raw.clone()  # [m, V]
    centred -= torch.linalg.vecdot(p, centred)[:, None]
    if off is not None:
        centred.masked_fill_(off, 0.0)
    sd = torch.linalg.vecdot(p * centred, centred).sqrt()  # [m]
    scored = sd > _MIN_SCORE_SD  # [m]
    h = centred.div_(sd.clamp_min(_MIN_SCORE_SD)[:, None]).clamp_(-clip, clip)  # [m, V] g clipped
    if off is not None:
        h.masked_fill_(off, outside)
    ph = p * h  # [m, V]
    mean = ph.sum(-1)  # [m]
    var = (torch.linalg.vecdot(ph, h) - mean**2).clamp_min(0.0)  # [m]
    scale = (clip - mean if one_sided else torch.full_like(mean, 2 * clip)).clamp_min(_MIN_SCORE_SD)  # [m]
    y = h.sub_(mean[:, None]).div_(scale[:, None]).masked_fill_(~scored[:, None], 0.0)  # [m, V]
    return y, torch.where(scored, var / scale**2, 0.0), scored


def surprisal_scores(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per step the centred, bounded surprisal score of every token and its exact variance:
    `bounded_scores` of log p [m, V] (g = (log p(x) + H) / s, H the entropy), clipped to
    ±`SURPRISAL_CLIP`; tokens outside the support score -C (infinitely surprising)."""
    log_p = torch.where(p > 0, p, 1.0).log()  # [m, V]
    return bounded_scores(p, log_p, SURPRISAL_CLIP, -SURPRISAL_CLIP)


def targeted_scores(p: torch.Tensor, law: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per step the centred, bounded score of every token aimed at a bug whose law is `law`:
    `bounded_scores` of ℓ = log(max(p', RATIO_FLOOR·p) / p), clipped to ±`CLASS_CLIP`; tokens
    outside p's support score +C (only a bug emits them).

    p [m, V] and law [m, V] float64. Unclipped, h is the standardized log-likelihood ratio —
    the Neyman–Pearson statistic against p'. The clip bounds the increments (what Bennett's
    inequality needs) at C sd's of ℓ. C trades the evidence clipped off the tail of ℓ against
    Bennett's price for a wide bound: a larger C shrinks every increment relative to its bound,
    and the mixture pays ψ(λ) > λ²/2 at the larger λ it then needs. C = 3, as for the surprisal,
    leaves a Gaussian ℓ unchanged on 99.7% of its mass; on the bug-class table C from 2 to 4
    changes the tokens needed by under 10%, and C = 6 costs 5–20% more. The increments use the
    one-sided bound (`bounded_scores`). Steps where the class cannot act (p' = p on the support)
    have s = 0 and are not scored.
    """
    positive = p > 0
    safe_p = torch.where(positive, p, 1.0)  # [m, V]
    ell = torch.maximum(law, RATIO_FLOOR * safe_p).log() - safe_p.log()  # [m, V]
    return bounded_scores(p, ell, CLASS_CLIP, CLASS_CLIP, one_sided=True)


@dataclass(frozen=True)
class ConditionalValues:
    """What the conditional tests need from the tested steps, reducible chunk by chunk (sums and
    concatenations; nothing of size [N, L, V] is kept).

    order_u         [n_u]  float64 PITs under the p - q order (NaNs — tokens of probability 0 — are
                           left out: the PIT support check of the same tokens fails them)
    surprisal_y     [n_s]  float64 centred, bounded surprisal score y_t in [-1, 1] of each tested
                           step whose surprisal varies (s_t > 0)
    surprisal_var   [n_s]  float64 its exact conditional variance under H0
    count_s         [V]    float64 S_v = Σ_t (1[x_t = v] - p_t(v)) over tested steps
    count_w         [V]    float64 W_v = Σ_t p_t(v)(1 - p_t(v))
    count_expected  [V]    float64 Σ_t p_t(v): the expected count of each id (for the report)
    class_y         {class: [n_c]}  float64 the class-targeted score y_t <= 1 of each tested
                           step where the class can act, one entry per class in `pit.bug_classes`
    class_var       {class: [n_c]}  float64 its exact conditional variance under H0
    repeat_s        []     float64 Σ_t (1[x_t in R_t] - p_t(R_t)) over tested steps after the
                           output's first token, R_t the ids of the output before t (`pit.repeats`)
    repeat_w        []     float64 Σ_t p_t(R_t)(1 - p_t(R_t))
    repeat_n        []     float64 those steps, and repeat_x [] how many of them repeat
    """

    order_u: torch.Tensor
    surprisal_y: torch.Tensor
    surprisal_var: torch.Tensor
    count_s: torch.Tensor
    count_w: torch.Tensor
    count_expected: torch.Tensor
    class_y: dict[str, torch.Tensor] = field(default_factory=dict)
    class_var: dict[str, torch.Tensor] = field(default_factory=dict)
    repeat_s: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    repeat_w: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    repeat_n: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    repeat_x: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))

    @property
    def n_steps(self) -> int:
        """Tested steps (each emitted one token)."""
        return int(round(float((self.count_s + self.count_expected).sum())))

    @classmethod
    def from_chunk(
        cls,
        p: torch.Tensor,
        q: torch.Tensor | None,
        tokens: torch.Tensor,
        v: torch.Tensor,
        tested: torch.Tensor,
        *,
        slots: torch.Tensor | None = None,
        k: int | None = None,
        misreported_id: int | None = None,
    ) -> ConditionalValues:
        """The values of one chunk of rows.

        p      [n, L, V]  target distribution at each step after logits processing
        q      [n, L, V]  the drafter's reported distribution for the slot that emitted the token,
                          all zeros where no draft did (bonus slot, no drafter); None: no drafter
        tokens [n, L]     emitted ids
        v      [n, L]     U(0, 1) draws for the ordered PIT, independent of everything else
        tested [n, L]     bool, steps counted (predictable: decided before the token is drawn)
        slots  [n, L]     slot of each token in its round, in [0, k]; None: not recorded, and the
                          classes whose law reads the slot are left out of `pit.bug_classes`
        k      int        block length; needed with `slots`
        misreported_id    the id drafter_misreports_one_id is scored at, fixed before this sample
                          was drawn (a pilot's `PowerAccumulator.misreported_id`); None: the class
                          is left out of `pit.bug_classes`
        """
        if p.dim() != 3:
            raise LosscheckError(f"ConditionalValues.from_chunk needs p [n, L, V], got {tuple(p.shape)}")
        shape2 = tuple(p.shape[:2])
        for name, t in (("tokens", tokens), ("v", v), ("tested", tested)):
            if tuple(t.shape) != shape2:
                raise LosscheckError(
                    f"ConditionalValues.from_chunk needs {name} [n, L] = {shape2} like p, got {tuple(t.shape)}"
                )
        vocab = p.shape[-1]
        _check_tokens("ConditionalValues.from_chunk tokens", tokens, vocab)
        p = normalized_rows(p, "ConditionalValues.from_chunk p")  # [n, L, V]
        q = None if q is None else reported_q(q, p.shape, "ConditionalValues.from_chunk q")
        tested = tested.to(torch.bool)
        if slots is not None and k is None:
            raise LosscheckError("ConditionalValues.from_chunk needs k with slots")
        if slots is not None and tuple(slots.shape) != shape2:
            raise LosscheckError(
                f"ConditionalValues.from_chunk needs slots [n, L] = {shape2} like p, got {tuple(slots.shape)}"
            )
        step = chunk_steps(
            p,
            q,
            slots,
            0 if k is None else k,
            tested,
            "ConditionalValues.from_chunk",
            misreported=misreported_id,
        )

        u = ordered_pit(p, residual_key(p, q), tokens, v)[tested]  # [m]
        p_t = step.p  # [m, V]
        x = tokens.long()[tested]  # [m]
        y, var, scored = surprisal_scores(p_t)  # [m, V], [m], [m]
        y_x = y.gather(-1, x[:, None]).squeeze(-1)  # [m]
        drawn = torch.bincount(x, minlength=vocab).to(torch.float64)  # [V]
        expected = p_t.sum(0)  # [V]
        classes = targeted(CATALOGUE, slots is not None, misreported_id, has_q=q is not None)
        class_y: dict[str, list[torch.Tensor]] = {bug.name: [] for bug in classes}
        class_var: dict[str, list[torch.Tensor]] = {bug.name: [] for bug in classes}
        for part, block in step.blocks():
            for bug in classes:
                y_c, var_c, scored_c = targeted_scores(block.p, bug.law(block))  # [b, V], [b], [b]
                class_y[bug.name].append(y_c.gather(-1, x[part, None]).squeeze(-1)[scored_c].cpu())
                class_var[bug.name].append(var_c[scored_c].cpu())
        repeats = _repeats(p, tokens, tested)
        return cls(
            order_u=u[~torch.isnan(u)].cpu(),
            surprisal_y=y_x[scored].cpu(),
            surprisal_var=var[scored].cpu(),
            count_s=(drawn - expected).cpu(),
            count_w=(p_t * (1 - p_t)).sum(0).cpu(),
            count_expected=expected.cpu(),
            class_y={name: _cat(parts) for name, parts in class_y.items()},
            class_var={name: _cat(parts) for name, parts in class_var.items()},
            **repeats,
        )

    @staticmethod
    def merge(parts: list[ConditionalValues]) -> ConditionalValues:
        """The values of all `parts` together (chunks of one cell, same vocabulary)."""
        if not parts:
            raise LosscheckError("ConditionalValues.merge needs at least one part")
        vocab = {len(part.count_s) for part in parts}
        if len(vocab) != 1:
            raise LosscheckError(f"ConditionalValues.merge: parts have different vocabularies {sorted(vocab)}")
        classes = {tuple(part.class_y) for part in parts}
        if len(classes) != 1:
            raise LosscheckError(f"ConditionalValues.merge: parts score different bug classes {sorted(classes)}")
        return ConditionalValues(
            order_u=torch.cat([part.order_u for part in parts]),
            surprisal_y=torch.cat([part.surprisal_y for part in parts]),
            surprisal_var=torch.cat([part.surprisal_var for part in parts]),
            count_s=torch.stack([part.count_s for part in parts]).sum(0),
            count_w=torch.stack([part.count_w for part in parts]).sum(0),
            count_expected=torch.stack([part.count_expected for part in parts]).sum(0),
            class_y={name: _cat([part.class_y[name] for part in parts]) for name in parts[0].class_y},
            class_var={name: _cat([part.class_var[name] for part in parts]) for name in parts[0].class_var},
            **{
                name: torch.stack([getattr(part, name) for part in parts]).sum(0)
                for name in ("repeat_s", "repeat_w", "repeat_n", "repeat_x")
            },
        )


def _repeats(p: torch.Tensor, tokens: torch.Tensor, tested: torch.Tensor) -> dict:
    """`pit.repeats`' sums over one chunk: p [n, L, V], tokens, tested [n, L] (a row's tokens past
    its end come after every tested step of it, so they never enter R_t)."""
    tokens = tokens.long()
    width = tokens.shape[1]
    before = torch.ones(width, width, device=tokens.device).tril(-1).bool()  # [L, L] j < t
    same = tokens[:, :, None] == tokens[:, None, :]  # [n, L, L] token t == token j
    first = ~(same & before).any(-1)  # [n, L] token j's id is new at j
    counted = before & first[:, None, :]  # [n, L, L] each id of the output before t, once
    masses = p.gather(-1, tokens[:, None, :].expand(-1, width, -1))  # [n, L, L] p_t(token j)
    steps = tested & counted.any(-1)  # [n, L] after the first token
    mass = torch.where(counted, masses, 0.0).sum(-1)[steps]  # [m] p_t(R_t)
    hit = (same & before).any(-1)[steps].to(torch.float64)  # [m]
    return {
        "repeat_s": (hit - mass).sum().cpu(),
        "repeat_w": (mass * (1 - mass)).sum().cpu(),
        "repeat_n": torch.tensor(float(len(mass)), dtype=torch.float64),
        "repeat_x": hit.sum().cpu(),
    }


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def reported_q(q: torch.Tensor, shape: torch.Size, what: str) -> torch.Tensor:
    """`q` [..., V] in float64 with each row of positive mass renormalised to 1, all-zero rows (no
    draft) kept; checked to be `shape`, finite, >= 0, each row summing to 1 (up to rounding) or 0."""
    if tuple(q.shape) != tuple(shape):
        raise LosscheckError(f"{what}: needs p's shape {tuple(shape)}, got {tuple(q.shape)}")
    q = q.to(torch.float64)
    if not torch.isfinite(q).all() or (q < 0).any():
        raise LosscheckError(f"{what}: must be finite and >= 0")
    total = q.sum(-1, keepdim=True)  # [..., 1]
    drafted = total > 0
    if ((total - 1).abs() > 1e-2)[drafted].any():
        raise LosscheckError(f"{what}: rows must be distributions summing to 1, or all zeros where no draft")
    return torch.where(drafted, q / total.clamp_min(1e-300), 0.0)


def _check_tokens(what: str, tokens: torch.Tensor, vocab: int) -> None:
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise LosscheckError(f"{what}: must be integer token ids, got {tokens.dtype}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise LosscheckError(
            f"{what}: ids must lie in [0, {vocab}), got range [{int(tokens.min())}, {int(tokens.max())}]"
        )


def _evalue_result(
    name: str, expected: str, observed: str, log_e: float, factor: int, statistic: float, **facts: Any
) -> TestResult:
    """The result of an e-value test with p = min(1, `factor` / e) (Bonferroni over `factor`
    candidates), from log e; the e-value is appended to `observed`. `facts`: alpha, n, power,
    detectable."""
    log_p = min(0.0, math.log(factor) - log_e)
    return TestResult(
        name=name,
        expected=expected,
        observed=f"{observed}, e-value 10^{log_e / math.log(10):.2f}",
        statistic=statistic,
        p_value=math.exp(log_p),
        log10_p=log_p / math.log(10),
        **facts,
    )


def _detectable_sum(w: float, alpha: float, power: float, one_sided: bool = False) -> float:
    """The mean of S that the mixture test detects at `power` when S has variance ≈ `w` (normal
    approximation): the rejection threshold plus z_power standard deviations."""
    return evalue_threshold(w, alpha, one_sided) + float(stats.norm.ppf(power)) * math.sqrt(w)


def residual_order_test(order_u: torch.Tensor, alpha: float, power: float) -> TestResult:
    """Pearson χ² of the p - q ordered PITs `order_u` [n] on `ORDER_BINS` equal bins."""
    n = len(order_u)
    expected = f"PIT values under the descending p - q order uniform over {ORDER_BINS} equal bins of [0, 1]"
    if n < 5 * ORDER_BINS:
        return TestResult.untestable(
            "pit.residual_order", expected, f"{n} values: too few to test (need {5 * ORDER_BINS})", alpha, power, n
        )
    bins = (order_u * ORDER_BINS).long().clamp(0, ORDER_BINS - 1)  # [n]
    counts = torch.bincount(bins, minlength=ORDER_BINS).numpy()
    return goodness_of_fit("pit.residual_order", expected, counts, np.full(ORDER_BINS, n / ORDER_BINS), alpha, power)


def token_counts_test(values: ConditionalValues, alpha: float, power: float) -> TestResult:
    """Per id the two-sided mixture e-value of (S_v, W_v); p = min(1, V · min_v 1/e_v)."""
    s = values.count_s.numpy()  # [V]
    w = values.count_w.numpy()  # [V]
    expected = values.count_expected.numpy()  # [V]
    vocab = len(s)
    log_e = log_mixture_evalue(s, w)  # [V]
    worst = int(np.argmax(log_e))
    count = s[worst] + expected[worst]
    ratio = count / expected[worst] if expected[worst] > 0 else math.inf
    # detectable: the count ratio an id as common as the most expected one must reach
    common = int(np.argmax(expected))
    detect = math.inf
    if expected[common] > 0 and w[common] > 0:
        detect = 1 + _detectable_sum(float(w[common]), alpha / vocab, power) / float(expected[common])
    return _evalue_result(
        "pit.token_counts",
        "each id drawn as often as the target's probabilities at the steps predict "
        "(Bennett mixture e-value per id, Bonferroni over the vocabulary)",
        f"id {worst} drawn {count:.0f} times where {expected[worst]:.1f} were expected (ratio {ratio:.3g})",
        float(log_e[worst]),
        vocab,
        float(log_e[worst]),
        alpha=alpha,
        n=values.n_steps,
        power=power,
        detectable={"count_ratio": detect},
    )


def surprisal_test(values: ConditionalValues, alpha: float, power: float) -> TestResult:
    """Two-sided mixture e-value of (Σ y, Σ var) of the surprisal scores."""
    total = float(values.surprisal_y.sum())
    w = float(values.surprisal_var.sum())
    n = len(values.surprisal_y)
    log_e = float(log_mixture_evalue(total, w))
    # y > 0: log p(x) above its mean, the token more probable than p's typical draw
    direction = "less" if total > 0 else "more"
    sd = math.sqrt(w) if w > 0 else math.inf
    return _evalue_result(
        "pit.surprisal",
        "tokens exactly as surprising as the target's distribution at each step predicts (score sum 0)",
        f"score sum {total:+.4g} ({total / sd if w > 0 else 0.0:+.2f} sd): tokens {direction} surprising than p says",
        log_e,
        1,
        total,
        alpha=alpha,
        n=n,
        power=power,
        # the mean score shift per scored step detected (in units of the bounded score y)
        detectable={"drift": _detectable_sum(w, alpha, power) / n if n and w > 0 else math.inf},
    )


def repeats_test(values: ConditionalValues, alpha: float, power: float) -> TestResult:
    """Two-sided mixture e-value of (Σ Y_t, Σ p_t(R_t)(1 - p_t(R_t))) over the steps after the
    output's first token."""
    total, w, n = float(values.repeat_s), float(values.repeat_w), int(values.repeat_n)
    log_e = float(log_mixture_evalue(total, w)) if w > 0 else 0.0
    expected_repeats = float(values.repeat_x) - total
    return _evalue_result(
        "pit.repeats",
        "tokens repeating an id of the output before them as often as p predicts at those steps "
        "(the ids penalties act on)",
        f"{float(values.repeat_x):.0f} repeats where {expected_repeats:.1f} were expected over {n} steps"
        if n
        else "no step after the output's first token",
        log_e,
        1,
        total,
        alpha=alpha,
        n=n,
        power=power,
        detectable={"repeats": _detectable_sum(w, alpha, power) if w > 0 else math.inf},
    )


def bug_classes_test(values: ConditionalValues, alpha: float, power: float) -> TestResult:
    """Per class the one-sided mixture e-value of (Σ y_c, Σ var_c) of its targeted scores;
    p = min(1, C · min_c 1/e_c) over the C classes scored."""
    names = list(values.class_y)
    left_out = [bug.name for bug in CATALOGUE if bug.name not in values.class_y]
    expected = (
        "no token leaning towards any bug class's law (one-sided mixture e-value of each class's "
        "log-likelihood-ratio score, Bonferroni over the classes)"
        + (f"; not scored: {', '.join(left_out)} (law not known before the token)" if left_out else "")
    )
    facts = {"alpha": alpha, "n": values.n_steps, "power": power}
    if not names:
        return _evalue_result(
            "pit.bug_classes", expected, "no class to score", 0.0, 1, 0.0, **facts, detectable={"drift": math.inf}
        )
    s = np.array([float(values.class_y[name].sum()) for name in names])  # [C]
    w = np.array([float(values.class_var[name].sum()) for name in names])  # [C]
    log_e = log_mixture_evalue(s, w, one_sided=True)  # [C]
    worst = int(np.argmax(log_e))
    sd = math.sqrt(w[worst])
    scored = len(values.class_y[names[worst]])
    # detectable: the mean score per scored step the most scored class must reach
    common = max(range(len(names)), key=lambda c: len(values.class_y[names[c]]))
    n_common = len(values.class_y[names[common]])
    drift = math.inf
    if n_common and w[common] > 0:
        drift = _detectable_sum(float(w[common]), alpha / len(names), power, one_sided=True) / n_common
    return _evalue_result(
        "pit.bug_classes",
        expected,
        f"{names[worst]}: score sum {s[worst]:+.4g} ({s[worst] / sd if sd > 0 else 0.0:+.2f} sd) over "
        f"{scored} steps where it can act",
        float(log_e[worst]),
        len(names),
        float(log_e[worst]),
        **facts,
        detectable={"drift": drift},
    )


def conditional_tests(values: ConditionalValues, alpha: float, power: float, looks: int = 1) -> list[TestResult]:
    """The registered tests of the `conditional` family (`pit.residual_order`, `pit.token_counts`,
    `pit.surprisal`, `pit.bug_classes`, and any added since), `alpha` split evenly over them. Their
    sample sizes are what the cell scored; each reports the effect it detects. `looks`: the
    stopping points of a sequential cell (`losscheck.stats.sequential`); the χ² test is then
    judged at its share / `looks`, the e-value tests, valid at any stopping time, at their whole
    share."""
    check_open_unit("power", power)
    return run_family(CONDITIONAL, values, alpha, power, looks)


def _residual_order(values: ConditionalValues, alpha: float, power: float) -> TestResult:
    return residual_order_test(values.order_u, alpha, power)


register(StatTest("pit.residual_order", CONDITIONAL, "conditional", _residual_order, power=powermodels.RESIDUAL_ORDER))
register(
    StatTest(
        "pit.token_counts", CONDITIONAL, "conditional", token_counts_test, anytime=True, power=powermodels.TOKEN_COUNTS
    )
)
register(
    StatTest("pit.surprisal", CONDITIONAL, "conditional", surprisal_test, anytime=True, power=powermodels.SURPRISAL)
)
register(StatTest("pit.repeats", CONDITIONAL, "conditional", repeats_test, anytime=True))
register(
    StatTest(
        "pit.bug_classes", CONDITIONAL, "conditional", bug_classes_test, anytime=True, power=powermodels.BUG_CLASSES
    )
)


def __getattr__(name: str) -> int:
    if name == "CONDITIONAL_TESTS":  # the removed hand-kept count (CHANGELOG.md, Deprecated)
        return deprecated_count("losscheck.stats.conditional.CONDITIONAL_TESTS", CONDITIONAL)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
