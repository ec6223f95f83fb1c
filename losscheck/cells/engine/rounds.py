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
        formed as the engine forms it (`law`); at a position whose cut-off is ambiguous, a drawn
        token every implementation keeps is scored under the law conditioned on those tokens, any
        other moves the filter only. `power_rows` [c] bool: the chunk's rows the power sums read (None: all)."""
        from losscheck.cells.scoring import teacher_forced_probs
        from losscheck.core.sampling import SamplingParams

        tokens = gen.tokens[at]
        params = draft_params(gen.params, self.law)
        q = teacher_forced_probs(self.drafter, rows, tokens.to(self.drafter.device), params).probs  # [c, L, V]
        other = None  # the draft model's raw law, where it is not q (the q-contract classes read it)
        if self.law == "greedy":  # a point mass at the draft model's argmax
            q, other = torch.nn.functional.one_hot(q.argmax(-1), q.shape[-1]), q
        elif has_other_q(gen.params, self.law):
            raw = SamplingParams()
            other = teacher_forced_probs(self.drafter, rows, tokens.to(self.drafter.device), raw).probs
        p = forced.probs.double()
        generated = gen.mask()[at].to(p.device)
        # token-level conditioning: at an ambiguous cut-off p is p_S, the law on the tokens S every
        # implementation keeps, and a drawn token in S is scored against it (under H0 its law given
        # x ∈ S is p_S whatever the engine's cut-off keeps beyond S); a token outside S is left out
        scored = generated & ~forced.left_out.to(generated.device)
        other = None if other is None else other.double().to(p.device)
        q = q.double().to(p.device)
        # the rule-out e-values read every position, bounding each member's law over the kept sets an
        # ambiguous cut-off allows (`forced.wide`; `hidden_rounds.round_bounds`)
        wide = None if forced.wide is None else forced.wide.double().to(p.device)
        no_sure = None if forced.no_sure is None else forced.no_sure.to(p.device)
        self.sample.update(p, q, tokens.to(p.device), generated, scored, power_rows, other, wide, no_sure)


def draft_params(params: SamplingParams, law: DraftLaw) -> SamplingParams:
    """The parameters that process the draft model's logits into the engine's q under `law`
    (greedy: its argmax is taken after, which temperature 1 leaves where it is)."""
    from losscheck.core.sampling import SamplingParams

    if law == "processed":
        return params
    return SamplingParams(temperature=params.temperature if law == "temperature" and params.temperature > 0 else 1.0)


def has_other_q(params: SamplingParams, law: DraftLaw) -> bool:
    """Whether the draft model's raw law differs from the q the engine draws its drafts from
    under `law` at `params` (`registry.OTHER_Q`): always for argmax drafts, else wherever drafting
    processes the logits (a temperature other than 1, a cut-off, a penalty)."""
    from losscheck.core.sampling import SamplingParams

    return law == "greedy" or draft_params(params, law) != SamplingParams()


def not_judged(drafter: DraftLaw | None, params: SamplingParams | None = None) -> dict[str, str]:
    """The catalogue's classes (and the q-contract ones) a one-sample engine cell has no power
    against, and why: `drafter`, the law of the engine's draft model (None: it gives none), at
    the cell's sampling `params` (None: any)."""
    out = dict(NOT_JUDGED)
    if drafter is None:
        reason = "the engine gives no draft model losscheck can teacher-force for q (RunsDraftModel)"
        out.update({cls.name: reason for cls in CLASSES})
        return out
    if drafter == "greedy":
        out["top_p_one_side"] = "the engine drafts its draft model's argmax: top-p of a point mass is itself"
    if params is not None and not has_other_q(params, drafter):
        same = "at these parameters the draft model's raw law is the q it draws from: no other q to confuse"
        out.update({cls.name: same for cls in CLASSES if cls.reads_other})
    return out


def as_target(model: torch.nn.Module, name: str) -> HFTarget:
    """A draft model as a teacher-forceable `HFTarget`."""
    from losscheck.core.target import HFTarget

    return HFTarget(model, name, {"role": "engine draft model"})  # type: ignore[arg-type]
