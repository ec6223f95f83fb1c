"""Beyond each token's law: the random streams behind a sample.

Terms, defined once:

- *top token*: at a position, the first token of the target's law p in the PIT order (descending
  probability, ties by id) — the token a greedy decoder emits; `top` is its probability.
- *repeat*: a row whose whole output (up to its EOS) equals an earlier row's output of the same
  prompt; its *repeat law* is the probability of that under H0, given the earlier rows: the summed
  target probability of the distinct earlier outputs of its prompt.
- *slack*: the factor a probability read from the reference may be off by at the cell's
  precision, e^(2τ/T) per token for a logit tolerance τ at temperature T (1 in fp32).

Four tests read them, each a test of a count of events whose probabilities under H0
are known, given the past, from the teacher-forced pass:

- `greedy_fallback`: the count of tokens equal to their top token. Given the tokens before it a
  token is the top token with probability `top`; a verifier or engine that returns the argmax at
  T > 0 makes (almost) every token the top token. An engine's count is judged against the tops
  times `slack` (capped at 1): a reference off by its precision's tolerance cannot fail it.
- `repeats`: the count of repeated outputs. Rows (and an engine's requests) are independent
  under H0, so a row repeats an earlier output with its repeat law; rows or requests that share
  one random stream (a stream restarted per request, a seed ignored) repeat each other.
- `serial`: the correlation of consecutive rows' first-token PITs, mapped to normal scores: under
  H0 they are iid N(0, 1) (the first token of a row is drawn afresh from p given its prompt, and
  the PIT is exactly uniform), so Pearson's test on disjoint pairs is exact; a stream shared or
  carried over from one row or request to the next correlates them.

- `stop_hazard`: the count of rows ending (an EOS or a stop id drawn) against the target's hazard,
  two-sided. Given the tokens before it, a position is a row's end with the target's probability of
  an end token there (`end_p`, min tokens' mask included), so the count of ends is the stopping
  times' whole law read one position at a time: an engine that drops, defers or forces stops
  (an end token inside an accepted block lost, min tokens counted in rounds) moves it. Its effect
  is the share ρ of end events lost (each end probability h becoming (1 - ρ)·h) it detects.

The count tests use the Poisson-binomial law of the count with the per-event probabilities
(`scipy.stats.poisson_binom`, exact up to `EXACT_EVENTS` events; past it, for the p-value,
Hoeffding's binomial bound on its upper tail, and for the power the normal law with its mean and
variance). When the probabilities are fixed before the draw the law is exact;
when they depend on earlier draws (a token's top probability depends on the tokens before it) the
count minus its summed probabilities is a martingale whose predictable variance is the
Poisson-binomial one, so the test keeps its level asymptotically, as the pooled PIT tests do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy import optimize, stats

from losscheck.errors import LosscheckError
from losscheck.stats._checks import check_open_unit
from losscheck.stats.result import TestResult

EXACT_EVENTS = 2000  # events up to which the Poisson-binomial tail is computed exactly (O(n²))
MIN_PAIRS = 4  # the serial test needs this many disjoint pairs (Pearson's test needs 3 for df >= 1)


@dataclass(frozen=True)
class StreamValues:
    """What the stream tests read about a sample's rows, in the order they were drawn.

    top      [N, L] float64  the target's top probability at each position
    at_top   [N, L] bool     the token drawn there is the top token
    tested   [N, L] bool     positions the tests read (generated, kept by every cut-off)
    repeats  [N] bool        the row's output equals an earlier output of its prompt
    repeat_law [N] float64   P(repeat) under H0 given the earlier rows
    first_u  [N] float64     each row's first-token PIT (NaN: not tested)
    slack    float >= 1      per-token factor on probabilities read from the reference
    end_p    [N, L] float64  the target's probability of an end token (EOS or a stop id) there;
                             None: not scored (the stopping-time test then has nothing to test)
    at_end   [N, L] bool     the token drawn there is an end token (None with `end_p`)
    """

    top: torch.Tensor
    at_top: torch.Tensor
    tested: torch.Tensor
    repeats: torch.Tensor
    repeat_law: torch.Tensor
    first_u: torch.Tensor
    slack: float = 1.0
    end_p: torch.Tensor | None = None
    at_end: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, length = self.top.shape
        if (self.end_p is None) != (self.at_end is None):
            raise LosscheckError("StreamValues: give end_p and at_end together, or neither")
        ends = () if self.end_p is None else (("end_p", (n, length)), ("at_end", (n, length)))
        for name, shape in (("at_top", (n, length)), ("tested", (n, length)), ("repeats", (n,)), *ends):
            if tuple(getattr(self, name).shape) != shape:
                raise LosscheckError(
                    f"StreamValues.{name} must have shape {shape}, got {tuple(getattr(self, name).shape)}"
                )
        for name in ("repeat_law", "first_u"):
            if tuple(getattr(self, name).shape) != (n,):
                raise LosscheckError(
                    f"StreamValues.{name} must have shape ({n},), got {tuple(getattr(self, name).shape)}"
                )
        if not (math.isfinite(self.slack) and self.slack >= 1):
            raise LosscheckError(f"StreamValues.slack must be a finite factor >= 1, got {self.slack!r}")


def precision_slack(tolerance: float, temperature: float) -> float:
    """The factor a token's probability may be off by when each logit is off by up to
    `tolerance` before the temperature: e^(2·tolerance / T)."""
    if tolerance < 0 or temperature <= 0:
        raise LosscheckError(f"precision_slack needs a tolerance >= 0 and T > 0, got {tolerance!r}, {temperature!r}")
    return math.exp(2 * tolerance / temperature)


def top_tokens(probs: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top probability [..., L] of `probs [..., L, V]` and whether `tokens [..., L]` is the top
    token (the first id of the largest probability, as the PIT order ranks it)."""
    top, first = probs.max(-1)  # torch.max returns the first index of a tied maximum
    return top.double(), tokens.to(first.device) == first


def output_logp(p: torch.Tensor, tokens: torch.Tensor, generated: torch.Tensor, left_out: torch.Tensor) -> torch.Tensor:
    """Log target probability [N] of each output: `tokens [N, L]` under `p [N, L, V]` where
    `generated [N, L]`. A token one implementation of the cut-off may keep and another cut
    (`left_out [N, L]`) counts at probability 1: its output's repeat law is then over-stated, so a
    repeat of it can never look rarer than it is."""
    drawn = p.gather(-1, tokens[..., None]).squeeze(-1).double()  # [N, L]
    drawn = torch.where(left_out, 1.0, drawn)
    return torch.where(generated, drawn.clamp_min(1e-300).log(), 0.0).sum(-1)


def outputs(tokens: torch.Tensor, generated: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row's output: the ids of `tokens [N, L]` where `generated [N, L]` (up to its EOS)."""
    return [tuple(t for t, kept in zip(row, keep) if kept) for row, keep in zip(tokens.tolist(), generated.tolist())]


def repeat_law(keys: Sequence[tuple[object, tuple[int, ...]]], logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows (prompt, output) `keys` in draw order with log target probabilities `logp [N]` of
    their outputs: whether each repeats an earlier output of its prompt, and the probability of
    that under H0 given the earlier rows (the summed probability of the distinct earlier outputs)."""
    if len(keys) != len(logp):
        raise LosscheckError(f"repeat_law: {len(keys)} rows but {len(logp)} log probabilities")
    seen: dict[object, set[tuple[int, ...]]] = {}
    mass: dict[object, float] = {}
    hit, law = torch.zeros(len(keys), dtype=torch.bool), torch.zeros(len(keys), dtype=torch.float64)
    for i, (prompt, output) in enumerate(keys):
        earlier = seen.setdefault(prompt, set())
        law[i] = min(1.0, mass.get(prompt, 0.0))
        if output in earlier:
            hit[i] = True
        else:
            earlier.add(output)
            mass[prompt] = mass.get(prompt, 0.0) + math.exp(float(logp[i]))
    return hit, law


def _tail(count: int, probs: np.ndarray) -> float:
    """P(S >= count) under H0 for S Poisson-binomial with success probabilities `probs` [n]: exact
    up to `EXACT_EVENTS` events; past them Hoeffding's bound (1956), the binomial tail at the mean
    probability, which is at least the Poisson-binomial's for counts >= mean + 1 (1 below that):
    never smaller than the true p-value, however rare the events (a normal law would be, by orders
    of magnitude, for a count of rare repeats)."""
    n = len(probs)
    if count <= 0:
        return 1.0
    if count > n:
        return 0.0
    if n <= EXACT_EVENTS:
        return float(stats.poisson_binom.sf(count - 1, probs))
    mean = float(probs.sum())
    if count < mean + 1:
        return 1.0
    return float(stats.binom.sf(count - 1, n, mean / n))


def _power_tail(count: int, probs: np.ndarray) -> float:
    """P(S >= count) under an alternative with event probabilities `probs` [n]: exact up to
    `EXACT_EVENTS` events, past them the normal law of the same mean and variance (the power
    stated, not a level)."""
    if count <= 0:
        return 1.0
    if count > len(probs):
        return 0.0
    if len(probs) <= EXACT_EVENTS:
        return float(stats.poisson_binom.sf(count - 1, probs))
    sd = math.sqrt(float((probs * (1 - probs)).sum()))
    if sd == 0:
        return float(count <= probs.sum())
    return float(stats.norm.sf(count - 0.5, loc=float(probs.sum()), scale=sd))


def _critical(probs: np.ndarray, alpha: float) -> int:
    """The smallest count c with `_tail(c) <= alpha` (len(probs) + 1 when no count is that rare)."""
    low, high = 0, len(probs) + 1  # _tail(high) = 0 <= alpha
    while high - low > 1:
        mid = (low + high) // 2
        if _tail(mid, probs) <= alpha:
            high = mid
        else:
            low = mid
    return high


def detectable_share(probs: np.ndarray, alpha: float, power: float) -> float:
    """The smallest share ρ of events forced to happen (each event's probability p becoming
    ρ + (1 - ρ)·p) that the upper-tail count test at `alpha` detects with probability `power`;
    math.inf when even ρ = 1 is not detected (too few events, or events near-certain under H0)."""
    if len(probs) == 0:
        return math.inf
    critical = _critical(probs, alpha)

    def gap(rho: float) -> float:
        return _power_tail(critical, rho + (1 - rho) * probs) - power

    if gap(1.0) < 0:
        return math.inf
    if gap(0.0) >= 0:
        return 0.0
    return float(optimize.brentq(gap, 0.0, 1.0, xtol=1e-4))


def excess_test(
    name: str,
    expected: str,
    what: str,
    hits: torch.Tensor,
    probs: torch.Tensor,
    alpha: float,
    power: float,
    effect: str,
) -> TestResult:
    """Upper-tail test of the count of `hits [n]` (bool) against events of probabilities
    `probs [n]` under H0; its detectable `effect` is `detectable_share`'s ρ."""
    check_open_unit("power", power)
    p = probs.double().clamp(0.0, 1.0).cpu().numpy()
    count, n = int(hits.sum()), len(p)
    if n == 0:
        return TestResult.untestable(name, expected, f"no {what} to test", alpha, power, effects=(effect,))
    p_value = _tail(count, p)
    return TestResult(
        name=name,
        expected=f"{expected}: {p.sum():.4g} of {n} {what} expected (Poisson-binomial)",
        observed=f"{count} of {n} {what}",
        statistic=float(count),
        p_value=p_value,
        alpha=alpha,
        n=n,
        power=power,
        detectable={effect: detectable_share(p, alpha, power) if alpha > 0 else math.inf},
    )


def greedy_fallback(values: StreamValues, alpha: float, power: float, name: str = "pit.greedy_fallback") -> TestResult:
    """Too many tokens equal to their top token: a verifier or engine returning the argmax at T > 0."""
    tested = values.tested & torch.isfinite(values.top)
    return excess_test(
        name,
        "each token the top token with its top probability",
        "tokens at the top token",
        values.at_top[tested],
        (values.top[tested] * values.slack).clamp(max=1.0),
        alpha,
        power,
        "argmax_share",
    )


def repeats(values: StreamValues, alpha: float, power: float, name: str = "pit.row_repeats") -> TestResult:
    """Too many rows repeating an earlier row's output of the same prompt: a shared random stream."""
    # each output's probability is a product over its tokens, so the slack compounds per token
    per_row = values.slack ** values.tested.sum(-1).double()  # [N]
    return excess_test(
        name,
        "each row an earlier output of its prompt with the summed probability of those outputs",
        "rows repeating an earlier output",
        values.repeats,
        (values.repeat_law * per_row).clamp(max=1.0),
        alpha,
        power,
        "repeat_share",
    )


def serial(values: StreamValues, alpha: float, power: float, name: str = "pit.row_serial") -> TestResult:
    """Pearson correlation of disjoint pairs of consecutive rows' first-token normal scores."""
    expected = "consecutive rows' first-token PITs independent (normal scores uncorrelated)"
    u = values.first_u.double().cpu().numpy()
    pairs = len(u) // 2
    first, second = u[0 : 2 * pairs : 2], u[1 : 2 * pairs : 2]
    keep = np.isfinite(first) & np.isfinite(second)
    first, second = first[keep], second[keep]
    if len(first) < MIN_PAIRS:
        return TestResult.untestable(
            name, expected, f"{len(first)} pairs: too few to test (need {MIN_PAIRS})", alpha, power, len(first), ("r",)
        )
    # u in (0, 1) under H0 (v ~ U(0,1) never 0 or 1 in float64 but for rounding): clip off the ends
    z = stats.norm.ppf(np.clip(np.stack([first, second]), 1e-12, 1 - 1e-12))
    result = stats.pearsonr(z[0], z[1])
    m = len(first)
    return TestResult(
        name=name,
        expected=expected,
        observed=f"correlation {result.statistic:.4g} over {m} disjoint pairs of consecutive rows",
        statistic=float(result.statistic),
        p_value=float(result.pvalue),
        alpha=alpha,
        n=m,
        power=power,
        detectable={"r": detectable_correlation(m, alpha, power) if alpha > 0 else math.inf},
    )


def detectable_correlation(pairs: int, alpha: float, power: float) -> float:
    """The smallest |correlation| a two-sided test on `pairs` bivariate normal pairs detects at
    `alpha` with probability `power` (Fisher's z, standard error 1/sqrt(pairs - 3))."""
    if pairs <= 3:
        return math.inf
    z = (stats.norm.isf(alpha / 2) + stats.norm.ppf(power)) / math.sqrt(pairs - 3)
    return float(math.tanh(z))


def stop_hazard(values: StreamValues, alpha: float, power: float, name: str = "pit.stop_hazard") -> TestResult:
    """The count of rows ending where they did against the target's hazard, two-sided (α/2 a tail):
    too few ends (stops lost or deferred) or too many (stops forced early). Each tail reads the
    reference's end probabilities moved by the precision's `slack` against itself, so a reference off
    by its tolerance cannot fail it."""
    expected = "each position a row's end with the target's probability of an end token there"
    what = "positions"
    effect = "stop_loss_share"
    if values.end_p is None or values.at_end is None:
        return TestResult.untestable(name, expected, "no end probabilities scored", alpha, power, effects=(effect,))
    check_open_unit("power", power)
    count, h = _ends(values)
    n = len(h)
    if n == 0:
        return TestResult.untestable(name, expected, f"no {what} to test", alpha, power, effects=(effect,))
    return TestResult(
        name=name,
        expected=f"{expected}: {h.sum():.4g} ends of {n} {what} expected (Poisson-binomial)",
        observed=f"{count} ends over {n} {what}",
        statistic=float(count),
        p_value=_stop_p_value(count, h, values.slack),
        alpha=alpha,
        n=n,
        power=power,
        # a share ρ of ends lost is `detectable_share`'s ρ of non-ends forced: 1 - (1 - ρ)·h = ρ + (1 - ρ)·(1 - h)
        detectable={effect: detectable_share(1 - h / values.slack, alpha / 2, power) if alpha > 0 else math.inf},
    )


def stop_hazard_p_value(values: StreamValues) -> float:
    """`stop_hazard`'s p-value alone (1 where no end is scored), without the search for its
    detectable share: what a Monte Carlo of its level and power draws hundreds of times."""
    if values.end_p is None or values.at_end is None:
        return 1.0
    count, h = _ends(values)
    return _stop_p_value(count, h, values.slack) if len(h) else 1.0


def _ends(values: StreamValues) -> tuple[int, np.ndarray]:
    """The rows' ends counted over the tested, scored positions, and the target's end probability
    at each of them [n]."""
    assert values.end_p is not None and values.at_end is not None
    tested = values.tested & torch.isfinite(values.end_p)
    return int(values.at_end[tested].sum()), values.end_p[tested].double().clamp(0.0, 1.0).cpu().numpy()


def _stop_p_value(count: int, h: np.ndarray, slack: float) -> float:
    """Two-sided: too few ends is too many positions that did not end, each with probability 1 - h,
    read by the upper-tail machinery (exact, or Hoeffding's bound) on the complement; each tail at
    the end probabilities moved by `slack` against it."""
    low, high = h / slack, np.minimum(h * slack, 1.0)
    return min(1.0, 2 * min(_tail(len(h) - count, 1 - low), _tail(count, high)))
