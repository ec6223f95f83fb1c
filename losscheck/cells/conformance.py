"""Conformance of a verifier to standard speculative sampling, judged from its own inputs and
decisions (white-box: losscheck's loop, or any engine that exposes each round's p, q, drafts and
accept decisions).

`Recorder` wraps the verifier an engine is given and, for every sampled round, turns what the
verifier saw and decided into values that are each exactly U(0,1) — and independent of what came
before them — under standard speculative sampling with an honest drafter:

- *draft honesty*: the randomised PIT of each drafted token under the q its drafter reported
  (descending q, ties by id). Exact for an honest drafter, whatever the verifier does.
- *acceptance*: for each draft the verifier decided (every slot up to the first rejection), the
  Bernoulli PIT w = U·a when it was kept and a + U·(1 - a) when it was rejected, with
  a = min(1, p(x) / q(x)). A rejected draft with p(x) >= q(x)·(1 + ε) is impossible.
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
from dataclasses import dataclass, field

import numpy as np
import torch

from losscheck.core.sampling import SamplingParams, process_logits
from losscheck.core.verify import BlockOutcome, Verifier, normalized, point_mass, recovery_distribution
from losscheck.stats.budget import per_test_alpha
from losscheck.stats.gof import goodness_of_fit, impossible_event
from losscheck.stats.pit import randomized_pit
from losscheck.stats.result import TestResult, scoped

KINDS = ("draft_honesty", "acceptance", "residual", "bonus")
CONFORMANCE_TESTS = len(
    KINDS
)  # uniformity tests sharing the conformance budget (the impossible-rejection check spends none)
IMPOSSIBLE_RTOL = 1e-6  # float64 p / q round-off allowed before a rejection counts as impossible
BINS = 10


@dataclass
class Recorder:
    """A `Verifier` that runs `inner` and records its conformance values.

    generator: the recorder's own uniforms (never the verifier's: that would change its draws).
    """

    inner: Verifier
    generator: torch.Generator
    values: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {kind: [] for kind in KINDS})
    impossible: int = 0  # rejected drafts whose acceptance probability was 1
    decided: int = 0  # draft decisions seen

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
        self.values["acceptance"].append(bernoulli[kept | rejected])
        self.decided += int((kept | rejected).sum())
        self.impossible += int((rejected & (p_x >= q_x * (1 + IMPOSSIBLE_RTOL))).sum())

        stop = outcome.tokens.to(device)[rows, accepted]  # [B] the recovered or bonus token
        law = recovery_distribution(p, q)[rows, accepted]  # [B, V]
        u = randomized_pit(law[:, None], stop[:, None], self._uniform((batch, 1), device))[:, 0]  # [B]
        bonus = accepted == k
        self.values["residual"].append(u[~bonus])
        self.values["bonus"].append(u[bonus])

    def tests(self, alpha: float, power: float) -> list[TestResult]:
        """The conformance tests under the budget `alpha` (Bonferroni over `CONFORMANCE_TESTS`).
        Their sample sizes are whatever the run produced (rejections are random), so each reports
        the effect it detects rather than asserting one."""
        a = per_test_alpha(alpha, CONFORMANCE_TESTS)
        results = [
            impossible_event(
                "conformance.impossible_rejection",
                "no draft rejected whose min(1, p/q) is 1",
                f"{self.impossible} of {self.decided} decided drafts rejected with p >= q",
                self.impossible,
                self.decided,
                power,
            )
        ]
        for kind in KINDS:
            values = torch.cat(self.values[kind]).cpu() if self.values[kind] else torch.zeros(0, dtype=torch.float64)
            results.append(uniformity(f"conformance.{kind}", values, a, power))
        return scoped(results, "conformance")


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
        return TestResult(
            name=name,
            expected=expected_desc,
            observed=f"{n} values: too few to test (need {5 * BINS})",
            statistic=0.0,
            p_value=1.0,
            alpha=alpha,
            n=n,
            power=power,
            detectable={"w": math.inf, "tv": math.inf},
        )
    counts = torch.bincount((values * BINS).long().clamp(max=BINS - 1), minlength=BINS).numpy()
    return goodness_of_fit(name, expected_desc, counts, np.full(BINS, n / BINS), alpha, power)
