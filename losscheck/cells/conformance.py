"""Conformance of a verifier to standard speculative sampling, judged from its own inputs and
decisions (white-box: losscheck's loop, or any engine that exposes each round's p, q, drafts and
accept decisions).

`Recorder` wraps the verifier an engine is given and, for every sampled round, turns what the
verifier saw and decided into values that are each exactly U(0,1) — and independent of what came
before them — under standard speculative sampling with an honest drafter:

- *draft honesty*: the randomised PIT of each drafted token under the q its drafter reported
  (descending q, ties by id). Exact for an honest drafter, whatever the verifier does.
- *acceptance*: for each draft the verifier decided (every slot up to the first rejection) whose
  acceptance probability a = min(1, p(x) / q(x)) is below 1, the Bernoulli PIT w = U·a when it
  was kept and a + U·(1 - a) when it was rejected; and the 1-df score Σ (kept - a) over the same
  decisions (increments in [-1, 1] of variance a(1 - a): a Bennett mixture e-value,
  `losscheck.stats.conditional`), which sees an acceptance rule biased one way at every
  prefix. A decision with a = 1 is not random: a rejected draft with p(x) >= q(x)·(1 + ε) is
  impossible, as is a kept draft with p(x) = 0.
- *residual*: at each rejection, the randomised PIT of the recovered token under
  norm(max(0, p - q)) at that slot.
- *bonus*: after every draft was kept, the randomised PIT of the bonus token under p at slot k.

Each value is uniform given everything before it (which slots were decided, whether a round
rejected, depends only on earlier values), so pooled uniformity tests keep their level, as the PIT
tests do (`losscheck.stats.pit`). These test conformance to *standard* speculative sampling, not
losslessness: a verifier that is lossless by another rule (another acceptance function with the
same output law) fails them legitimately. p is recomputed from the raw logits with
`process_logits`, in float64, and q renormalised, as `losscheck.core.verify` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from losscheck.core.sampling import SamplingParams, process_logits
from losscheck.core.verify import BlockOutcome, Verifier, normalized, point_mass, recovery_distribution
from losscheck.stats.gof import goodness_of_fit, impossible_event
from losscheck.stats.pit import randomized_pit
from losscheck.stats.registry import CONFORMANCE, StatTest, deprecated_count, register, run_family
from losscheck.stats.result import TestResult

if TYPE_CHECKING:
    from losscheck.core.engine import Engine

KINDS = ("draft_honesty", "acceptance", "residual", "bonus")
# float64 p / q round-off allowed before a rejection counts as impossible; a verifier computing in
# reduced precision is allowed that precision's round-off (`conformance_rtol`)
IMPOSSIBLE_RTOL = 1e-6
BINS = 10


@dataclass
class Recorder:
    """A `Verifier` that runs `inner` and records its conformance values.

    generator: the recorder's own uniforms (never the verifier's: that would change its draws).
    """

    inner: Verifier
    generator: torch.Generator
    rtol: float = IMPOSSIBLE_RTOL  # p / q round-off allowed before a rejection is impossible
    values: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {kind: [] for kind in KINDS})
    impossible: int = 0  # rejected drafts whose acceptance probability was 1, kept drafts of p = 0
    decided: int = 0  # draft decisions seen
    score: float = 0.0  # Σ (kept - a) over decisions with a < 1
    score_var: float = 0.0  # Σ a(1 - a)

    def __call__(
        self,
        logits: torch.Tensor,
        drafts: torch.Tensor,
        q: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> BlockOutcome:
        outcome = self.inner(logits, drafts, q, params, generator)
        if not params.greedy and drafts.shape[1] > 0:
            self._record(logits, drafts, q, params, outcome)
        return outcome

    def _uniform(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, dtype=torch.float64).to(device)

    @torch.no_grad()
    def _record(
        self,
        logits: torch.Tensor,
        drafts: torch.Tensor,
        q: torch.Tensor | None,
        params: SamplingParams,
        outcome: BlockOutcome,
    ) -> None:
        batch, k = drafts.shape
        device = logits.device
        p = normalized(process_logits(logits, params))  # [B, k+1, V] float64
        q = point_mass(drafts, p.shape[-1]).double() if q is None else normalized(q)  # [B, k, V]
        accepted = outcome.accepted.to(device)  # [B]
        rows = torch.arange(batch, device=device)

        self.values["draft_honesty"].append(randomized_pit(q, drafts, self._uniform((batch, k), device)).flatten())

        p_x = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [B, k]
        q_x = q.gather(-1, drafts[..., None]).squeeze(-1)  # [B, k]
        a = (p_x / q_x).clamp(max=1.0)  # [B, k]
        slot = torch.arange(k, device=device)[None, :]  # [1, k]
        kept, rejected = slot < accepted[:, None], slot == accepted[:, None]  # [B, k]
        w = self._uniform((batch, k), device)
        bernoulli = torch.where(kept, w * a, a + w * (1 - a))  # [B, k]
        decided = kept | rejected  # [B, k]
        random = decided & (a < 1)  # decisions the verifier had to draw
        self.values["acceptance"].append(bernoulli[random])
        self.score += float((kept.double() - a)[random].sum())
        self.score_var += float((a * (1 - a))[random].sum())
        self.decided += int(decided.sum())
        self.impossible += int((rejected & (p_x >= q_x * (1 + self.rtol))).sum()) + int((kept & (p_x == 0)).sum())

        stop = outcome.tokens.to(device)[rows, accepted]  # [B] the recovered or bonus token
        law = recovery_distribution(p, q)[rows, accepted]  # [B, V]
        u = randomized_pit(law[:, None], stop[:, None], self._uniform((batch, 1), device))[:, 0]  # [B]
        bonus = accepted == k
        self.values["residual"].append(u[~bonus])
        self.values["bonus"].append(u[bonus])

    def tests(self, alpha: float, power: float, looks: int = 1) -> list[TestResult]:
        """The registered tests of the `conformance` family under the budget `alpha`, split evenly
        over them. Their sample sizes are whatever the run produced (rejections are random), so
        each reports the effect it detects rather than asserting one. `looks`: the stopping points
        of a sequential cell (`losscheck.stats.sequential`); the fixed-sample uniformity tests are
        then judged at their share / `looks`, the e-value acceptance score at its whole share."""
        return run_family(CONFORMANCE, self, alpha, power, looks)

    def collected(self, kind: str) -> torch.Tensor:
        """The recorded values of `kind` [n] float64, on the CPU."""
        parts = self.values[kind]
        return torch.cat(parts).cpu() if parts else torch.zeros(0, dtype=torch.float64)

    def impossible_decisions(self, power: float) -> TestResult:
        return impossible_event(
            "conformance.impossible_rejection",
            "no draft rejected whose min(1, p/q) is 1, none kept whose p is 0",
            f"{self.impossible} of {self.decided} decided drafts rejected with p >= q or kept with p = 0",
            self.impossible,
            self.decided,
            power,
        )

    def acceptance_score(self, alpha: float, power: float) -> TestResult:
        """The two-sided Bennett mixture e-value of Σ (kept - a): kept drafts, counted against
        their acceptance probabilities."""
        from losscheck.stats.evalue import evalue_threshold, log_mixture_evalue

        log_e = float(log_mixture_evalue(self.score, self.score_var))
        sd = math.sqrt(self.score_var)
        z = self.score / sd if sd else 0.0
        way = "more" if self.score > 0 else "fewer"
        return TestResult(
            name="conformance.acceptance_score",
            expected="drafts kept as often as their acceptance probabilities min(1, p/q) say",
            observed=(
                f"{way} kept than expected: Σ (kept - a) = {self.score:+.4g} over decisions of variance "
                f"{self.score_var:.4g} ({z:+.2f} sd; e-value 10^{log_e / math.log(10):.2f})"
            ),
            statistic=self.score,
            p_value=min(1.0, math.exp(-log_e)),
            alpha=alpha,
            n=self.decided,
            power=power,
            detectable={"kept_excess": evalue_threshold(self.score_var, alpha) if self.score_var > 0 else math.inf},
        )


def conformance_rtol(logit_tolerance: float) -> float:
    """The p / q round-off a verifier computing at a precision of logit round-off
    `logit_tolerance` may show: e^tolerance - 1, at least the float64 `IMPOSSIBLE_RTOL`."""
    return max(IMPOSSIBLE_RTOL, math.expm1(logit_tolerance))


@contextmanager
def recording(engine: Engine | None, generator: torch.Generator, rtol: float) -> Iterator[Recorder | None]:
    """A `Recorder` (of its own `generator` and `rtol`) watching `engine`'s verifier over the blocks
    decided inside the `with`; None when the cell has no engine in this process (a split run's
    engines live in its ranks) or when its rounds are trees (`losscheck.core.tree_engine`: the
    recorder checks a chain verifier's conformance)."""
    if engine is None or getattr(engine, "tree", None) is not None:
        yield None
        return
    with engine.verifier_wrapped(lambda inner: Recorder(inner, generator, rtol)) as recorder:
        yield recorder


def uniformity(name: str, values: torch.Tensor, alpha: float, power: float) -> TestResult:
    """Pearson χ² of `values` [n] on `BINS` equal bins of [0, 1] against uniform; NaN values (a
    token of probability 0 under its law) fall in no bin and are counted as a failed support."""
    impossible = int(torch.isnan(values).sum())
    values = values[~torch.isnan(values)]
    n = len(values)
    expected_desc = f"{name.split('.')[-1].replace('_', ' ')} values uniform over {BINS} equal bins of [0, 1]"
    if impossible:
        return impossible_event(
            name,
            "every token inside the support of the law it is judged under",
            f"{impossible} of {impossible + n} tokens have probability 0 under it",
            impossible,
            impossible + n,
            power,
        )
    if n < 5 * BINS:
        return TestResult.untestable(
            name, expected_desc, f"{n} values: too few to test (need {5 * BINS})", alpha, power, n
        )
    counts = torch.bincount((values * BINS).long().clamp(max=BINS - 1), minlength=BINS).numpy()
    return goodness_of_fit(name, expected_desc, counts, np.full(BINS, n / BINS), alpha, power)


def _uniformity_test(kind: str) -> StatTest[Recorder]:
    """The registered uniformity test of the recorded `kind` values."""
    name = f"conformance.{kind}"
    return StatTest(
        name,
        CONFORMANCE,
        "conformance",
        lambda rec, alpha, power: uniformity(name, rec.collected(kind), alpha, power),
    )


register(
    StatTest(
        "conformance.impossible_rejection",
        CONFORMANCE,
        "conformance",
        lambda rec, _alpha, power: rec.impossible_decisions(power),
        spends_alpha=False,
    )
)
for _kind in KINDS:
    register(_uniformity_test(_kind))
register(StatTest("conformance.acceptance_score", CONFORMANCE, "conformance", Recorder.acceptance_score, anytime=True))


def __getattr__(name: str) -> int:
    if name == "CONFORMANCE_TESTS":  # the removed hand-kept count (CHANGELOG.md, Deprecated)
        return deprecated_count("losscheck.cells.conformance.CONFORMANCE_TESTS", CONFORMANCE)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
