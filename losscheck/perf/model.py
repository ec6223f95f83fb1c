"""Where a speedup comes from: the analytic prediction from acceptance length and measured
round costs, beside the measured speedup.

A speculative round emits τ tokens per row and costs `draft + verify` (+ engine overhead); a
baseline round emits one token per row and costs one target step `step`. With every cost
measured at the same concurrency (Leviathan et al. 2023, §3.4, with measured rather than
assumed costs):

    predicted = τ · step / (draft + verify)

so the speedup splits into two sources, as the seeds ask: the *acceptance-length gain* τ (what
drafting would give if a round cost one baseline step) and the *round cost* `(draft + verify) /
step` = draft cost + verify cost, each in baseline steps. Cheap drafting shows as a small draft
cost, long acceptance as a large τ. The prediction leaves out what the engine spends outside the
two models and the prefill of admissions; the gap to the measured speedup is that toll.
"""

from __future__ import annotations

from dataclasses import dataclass

from losscheck.report.perf_record import Sources


@dataclass(frozen=True)
class Decomposition:
    tau: float  # tokens per row per speculative round
    step_s: float  # baseline: target forward seconds per round (one token per row)
    draft_s: float  # speculative: drafter seconds per round
    verify_s: float  # speculative: target forward seconds per round (k + 1 positions per row)

    def __post_init__(self) -> None:
        if self.step_s <= 0 or self.draft_s < 0 or self.verify_s <= 0 or self.tau < 1:
            raise ValueError(f"a decomposition needs tau >= 1 and positive step and verify costs, got {self}")

    @property
    def draft_cost(self) -> float:
        """Drafting per round, in baseline steps."""
        return self.draft_s / self.step_s

    @property
    def verify_cost(self) -> float:
        """Verification per round, in baseline steps (1 when scoring k + 1 positions is as cheap as one)."""
        return self.verify_s / self.step_s

    @property
    def predicted(self) -> float:
        return self.tau / (self.draft_cost + self.verify_cost)

    def sources(self) -> Sources:
        """The record of the run file (`losscheck.report.perf_record`)."""
        return Sources(
            self.tau, self.step_s, self.draft_s, self.verify_s, self.draft_cost, self.verify_cost, self.predicted
        )
