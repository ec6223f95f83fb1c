"""The log-probability an engine reports beside each token it emits.

Engines return, with every sampled token, its log-probability under the law it was drawn from
(vLLM's `logprobs` in `processed_logprobs` mode, Hugging Face's processed `scores`); training on
speculative rollouts reads them. Speculation must not change them: the token at slot j of a round —
accepted draft, recovered or bonus — is reported with log p_j(x), the target's processed law at its
own position, never the draft's q, a stale buffer, or 0. The loop reports them for sampled
requests (`Generation.logprobs`); the sampled cells compare them with a teacher-forced pass
(`losscheck.cells.scoring.PitScores`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (probs [B, k+1, V] the target's processed law at each slot of the round, tokens [B, k+1] the
# verified tokens, draft probs [B, k, V] or None) -> [B, k+1] float, the reported log-probabilities
LogprobRule = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def emitted_logprobs(probs: torch.Tensor, tokens: torch.Tensor, draft_probs: torch.Tensor | None) -> torch.Tensor:
    """[B, k+1] log p_j(tokens[:, j]): each verified token under the target's law at its slot.
    `draft_probs` is not read (a planted rule may)."""
    return probs.gather(-1, tokens[..., None]).squeeze(-1).log()
