"""The verifier's bug classes in a black-box engine's one-sample cell: the drafter the engine runs
(`losscheck.engines.RunsDraftModel`) teacher-forced over the engine's tokens beside its target,
each chunk's p and q fed to the round filter (`losscheck.stats.hidden_rounds`).

An engine whose drafter losscheck cannot load (n-gram, heads inside the engine, a draft model of
another vocabulary) is certified without these classes, and its cells say so
(`not_judged`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from losscheck.stats.hidden_rounds import CLASSES, NOT_JUDGED, FirstToken, RoundsSample

if TYPE_CHECKING:
    from losscheck.cells.scoring import ForcedProbs
    from losscheck.core.generation import Generation
    from losscheck.core.sampling import SamplingParams
    from losscheck.core.target import HFTarget
    from losscheck.engines import DraftLaw


@dataclass
class RoundsScoring:
    """The drafter (wrapped as a teacher-forceable `HFTarget`), how the engine forms q from its
    logits (`law`), and the sample its chunks feed."""

    drafter: HFTarget
    k: int
    law: DraftLaw = "processed"
    first: FirstToken | None = None  # where the engine's first token comes from; None: not said
    sample: RoundsSample = field(init=False)

    def __post_init__(self) -> None:
        self.sample = RoundsSample(self.k, self.first)

    def observe(
        self,
        rows: list[list[int]],
        gen: Generation,
        at: slice,
        forced: ForcedProbs,
        power_rows: torch.Tensor | None = None,
    ) -> None:
        """Score rows `at` of `gen` (continuing `rows`, the chunk's prompts), whose target law the
        caller's teacher-forced pass gave (`forced`): q from one drafter pass over the same tokens,
        formed as the engine forms it (`law`); positions whose cut-off is ambiguous move the
        filter only. `power_rows` [c] bool: the chunk's rows the power sums read (None: all)."""
        from losscheck.cells.scoring import teacher_forced_probs

        tokens = gen.tokens[at]
        params = draft_params(gen.params, self.law)
        q = teacher_forced_probs(self.drafter, rows, tokens.to(self.drafter.device), params).probs  # [c, L, V]
        if self.law == "greedy":  # a point mass at the draft model's argmax
            q = torch.nn.functional.one_hot(q.argmax(-1), q.shape[-1])
        p = forced.probs.double()
        generated = gen.mask()[at].to(p.device)
        scored = generated & ~forced.ambiguous
        self.sample.update(p, q.double().to(p.device), tokens.to(p.device), generated, scored, power_rows)


def draft_params(params: SamplingParams, law: DraftLaw) -> SamplingParams:
    """The parameters that process the draft model's logits into the engine's q under `law`
    (greedy: its argmax is taken after, which temperature 1 leaves where it is)."""
    from losscheck.core.sampling import SamplingParams

    if law == "processed":
        return params
    return SamplingParams(temperature=params.temperature if law == "temperature" and params.temperature > 0 else 1.0)


def not_judged(drafter: DraftLaw | None) -> dict[str, str]:
    """The catalogue's classes a one-sample engine cell has no power against, and why: `drafter`,
    the law of the engine's draft model (None: it gives none)."""
    out = dict(NOT_JUDGED)
    if drafter is None:
        reason = "the engine gives no draft model losscheck can teacher-force for q (RunsDraftModel)"
        out.update({cls.name: reason for cls in CLASSES})
    elif drafter == "greedy":
        out["top_p_one_side"] = "the engine drafts its draft model's argmax: top-p of a point mass is itself"
    return out


def as_target(model: torch.nn.Module, name: str) -> HFTarget:
    """A draft model as a teacher-forceable `HFTarget`."""
    from losscheck.core.target import HFTarget

    return HFTarget(model, name, {"role": "engine draft model"})  # type: ignore[arg-type]
