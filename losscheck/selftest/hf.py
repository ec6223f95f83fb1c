"""A planted bug in Hugging Face assisted generation (`losscheck.engines.hf`), for the slow tier
to show that the same black-box certification rejects it.

`HFResidualFromP` patches transformers' speculative sampling step
(`transformers.generation.utils._speculative_sampling`) for the duration of each `generate` call
and differs from it by one line marked as the bug. Select it like any engine:
`--losscheck-engine=losscheck.selftest.hf:hf_assisted_residual_from_p`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from losscheck.core.contract import Target
from losscheck.engines.hf import HFAssistedEngine, hf_assisted, hf_assisted_stress
from losscheck.engines.request import GenerationRequest


@contextmanager
def residual_from_p() -> Iterator[None]:
    """Inside: at a rejection the recovered token is drawn from the target's p instead of the
    residual norm(max(0, p - q)); accepted drafts and the bonus token are transformers' own."""
    from unittest import mock

    import transformers.generation.utils as hf_utils

    correct = hf_utils._speculative_sampling

    def sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
        valid_tokens, n_matches = correct(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs)
        if n_matches < candidate_logits.shape[1]:  # a draft was rejected: the last token is the recovered one
            p = new_logits[:, n_matches].softmax(-1)  # [1, V] the target's processed distribution there
            valid_tokens[:, -1] = torch.multinomial(p, 1)[:, 0]  # BUG: from p, not norm(max(0, p - q))
        return valid_tokens, n_matches

    with mock.patch.object(hf_utils, "_speculative_sampling", sampling):
        yield


class HFResidualFromP(HFAssistedEngine):
    """Planted bug: the engine with `residual_from_p` in force — the bug class of a verifier that
    forgets to subtract the draft distribution."""

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        with residual_from_p():
            return super().generate(request)


def planted(engine: HFAssistedEngine, name: str) -> HFResidualFromP:
    """`engine` (its model, assistant, k and EOS) with the planted residual bug, called `name`."""
    return HFResidualFromP(engine.model, engine.assistant, engine.k, engine.eos, name=name)


def hf_assisted_residual_from_p(target: Target) -> HFResidualFromP:
    """`--losscheck-engine=losscheck.selftest.hf:hf_assisted_residual_from_p`: `hf_assisted` with
    the planted residual bug."""
    return planted(hf_assisted(target), "hf-assisted-residual-from-p")


def hf_assisted_stress_residual_from_p(target: Target) -> HFResidualFromP:
    """`--losscheck-engine=losscheck.selftest.hf:hf_assisted_stress_residual_from_p`: the planted
    residual bug under the tempered assistant (`hf_assisted_stress`)."""
    return planted(hf_assisted_stress(target), "hf-assisted-tempered2-residual-from-p")
