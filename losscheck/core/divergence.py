"""Divergence analysis for the greedy gate: where speculative output first leaves the baseline.

Each divergence names the prompt, the position, both tokens and the target's top-2 logit margin
at that prefix recomputed in float64. In reduced precision a margin below the precision's
round-off (`losscheck.core.precision.LOGIT_TOLERANCE`) marks a numerical *near-tie*: two batch shapes
of the same model may legitimately pick different argmaxes there. Anything else is an
algorithmic failure.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from losscheck.core.generation import Generation

if TYPE_CHECKING:
    from transformers import PreTrainedModel

VOCAB_CHUNK = 16384  # LM-head rows cast to float64 at once


@dataclass(frozen=True)
class Divergence:
    tier: str
    prompt_index: int
    prompt: list[int]
    position: int  # index into the generated tokens
    spec_token: int | None  # None: the speculative output ended here
    base_token: int | None  # None: the baseline ended here
    top1: int
    top2: int
    margin: float  # float64 logit(top1) - logit(top2) of the target at the baseline prefix
    near_tie: bool = False  # margin within the target precision's round-off (never in fp32)

    def describe(self) -> str:
        return (
            f"divergence on {self.tier}-entropy prompt #{self.prompt_index} {self.prompt} at generated "
            f"position {self.position}: speculative emitted {self.spec_token}, baseline "
            f"{self.base_token}; target float64 top-2 there: {self.top1} vs {self.top2}, margin "
            f"{self.margin:.4g}" + (" (numerical near-tie)" if self.near_tie else "")
        )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def first_divergence(spec: Generation, base: Generation, b: int) -> int | None:
    """Generated position where row b of the two runs first differs, or None if identical."""
    a, c = spec.row(b), base.row(b)
    for i, (x, y) in enumerate(zip(a, c)):
        if x != y:
            return i
    return None if len(a) == len(c) else min(len(a), len(c))


def top2_float64(model: PreTrainedModel, prefix: list[int]) -> tuple[int, int, float]:
    """The target's two best next tokens after `prefix` and their logit margin in float64.

    The final hidden state comes from the model as it runs (its own precision); the LM head is
    applied in float64, `VOCAB_CHUNK` of its rows at a time, so no float64 copy of the model (or of
    a 128k x H head) is ever made. Final-logit soft-capping (Gemma) is applied when configured.
    """
    head = model.get_output_embeddings()
    with torch.inference_mode():
        ids = torch.tensor([prefix], device=head.weight.device)
        hidden = model.base_model(input_ids=ids).last_hidden_state[0, -1].double()  # [H]
        logits = torch.cat([rows.double() @ hidden for rows in head.weight.split(VOCAB_CHUNK)])  # [V]
        if getattr(head, "bias", None) is not None:
            logits = logits + head.bias.double()
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap:
            logits = cap * torch.tanh(logits / cap)
    top = logits.topk(2)
    return int(top.indices[0]), int(top.indices[1]), float(top.values[0] - top.values[1])


def find_divergences(
    model: PreTrainedModel | None,
    tier: str,
    prompts: list[list[int]],
    spec: Generation,
    base: Generation,
    tolerance: float = 0.0,
) -> list[Divergence]:
    """The first divergence of every row of `spec` from `base` (rows = `prompts` of `tier`); one
    whose float64 margin is below `tolerance` (0 in fp32) is a near-tie. Without the target's
    `model` (a black-box engine's target losscheck cannot load) the margin is NaN: no near-tie."""
    found = []
    for b, prompt in enumerate(prompts):
        pos = first_divergence(spec, base, b)
        if pos is None:
            continue
        spec_row, base_row = spec.row(b), base.row(b)
        top1, top2, margin = top2_float64(model, prompt + base_row[:pos]) if model is not None else (-1, -1, math.nan)
        found.append(
            Divergence(
                tier=tier,
                prompt_index=b,
                prompt=prompt,
                position=pos,
                spec_token=spec_row[pos] if pos < len(spec_row) else None,
                base_token=base_row[pos] if pos < len(base_row) else None,
                top1=top1,
                top2=top2,
                margin=margin,
                near_tie=margin < tolerance,
            )
        )
    return found
