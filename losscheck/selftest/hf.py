"""Planted bugs in Hugging Face assisted generation (`losscheck.engines.hf`), for the black-box
certification to reject: each patches transformers' speculative sampling step
(`transformers.generation.utils._speculative_sampling`) for the duration of each speculative
`generate` call and differs from it by one line marked as the bug. Select one like any engine,
e.g. `--losscheck-engine=losscheck.selftest.hf:hf_assisted_residual_from_p`.

| factory | the bug |
|---|---|
| `hf_assisted_residual_from_p` | at a rejection the recovered token is drawn from p, not norm(max(0, p - q)) |
| `hf_assisted_residual_from_p_half` | the same on half the rejections |
| `hf_assisted_bonus_off_by_one` | after k accepted drafts the bonus token is drawn from p at slot k - 1 |
| `hf_assisted_temperature_draft_only` | the verifier's p without the request's temperature (q has it) |
| `hf_assisted_stale_q` | the verifier reads the previous round's q while the drafts came from the current one |
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from losscheck.core.contract import Target
from losscheck.engines.hf import HFAssistedEngine, hf_assisted, hf_assisted_stress
from losscheck.engines.request import GenerationRequest

# (the correct sampling step, the request) -> the buggy step, with transformers' signature
Planting = Callable[[Callable[..., Any], GenerationRequest], Callable[..., Any]]


def _residual_from_p(share: float) -> Planting:
    def plant(correct: Callable[..., Any], request: GenerationRequest) -> Callable[..., Any]:
        def sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
            valid, n_matches = correct(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs)
            if n_matches < candidate_logits.shape[1] and float(torch.rand(())) < share:  # a rejection it hits
                p = new_logits[:, n_matches].softmax(-1)  # [1, V] the target's processed distribution there
                valid[:, -1] = torch.multinomial(p, 1)[:, 0]  # BUG: from p, not norm(max(0, p - q))
            return valid, n_matches

        return sampling

    return plant


def _bonus_off_by_one(correct: Callable[..., Any], request: GenerationRequest) -> Callable[..., Any]:
    def sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
        valid, n_matches = correct(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs)
        gamma = candidate_logits.shape[1]
        if gamma > 0 and n_matches == gamma:  # every draft accepted: the last token is the bonus
            valid[:, -1] = torch.multinomial(new_logits[:, gamma - 1].softmax(-1), 1)[:, 0]  # BUG: slot k - 1
        return valid, n_matches

    return sampling


def _temperature_draft_only(correct: Callable[..., Any], request: GenerationRequest) -> Callable[..., Any]:
    temperature = request.params.temperature

    def sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
        # transformers' processed logits are the raw ones / T: times T undoes the temperature
        raw = new_logits * temperature  # BUG: the verifier's p at temperature 1
        return correct(candidate_input_ids, candidate_logits, candidate_length, raw, **kwargs)

    return sampling


def _stale_q(correct: Callable[..., Any], request: GenerationRequest) -> Callable[..., Any]:
    previous: list[torch.Tensor] = []

    def sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
        stale = previous[-1] if previous and previous[-1].shape == candidate_logits.shape else candidate_logits
        previous[:] = [candidate_logits]
        return correct(candidate_input_ids, stale, candidate_length, new_logits, **kwargs)  # BUG: last round's q

    return sampling


@contextmanager
def planted(plant: Planting, request: GenerationRequest) -> Iterator[None]:
    """Inside: transformers' speculative sampling step replaced by `plant(correct, request)`."""
    from unittest import mock

    import transformers.generation.utils as hf_utils

    with mock.patch.object(hf_utils, "_speculative_sampling", plant(hf_utils._speculative_sampling, request)):
        yield


class HFPlanted(HFAssistedEngine):
    """Planted bug: the engine with a patched speculative sampling step (`PLANTED`)."""

    def __init__(self, engine: HFAssistedEngine, bug: str, name: str) -> None:
        super().__init__(engine.model, engine.assistant, engine.k, engine.eos, name=name)
        self.bug = bug

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        with planted(PLANTED[self.bug], request):
            return super().generate(request)


PLANTED: dict[str, Planting] = {
    "residual-from-p": _residual_from_p(1.0),
    "residual-from-p-half": _residual_from_p(0.5),
    "bonus-off-by-one": _bonus_off_by_one,
    "temperature-draft-only": _temperature_draft_only,
    "stale-q": _stale_q,
}


def _planted(engine: HFAssistedEngine, bug: str) -> HFPlanted:
    return HFPlanted(engine, bug, name=f"{engine.name.partition('(')[0]}-{bug}")


def hf_assisted_residual_from_p(target: Target) -> HFPlanted:
    """`hf_assisted` with the recovered token drawn from p at every rejection."""
    return _planted(hf_assisted(target), "residual-from-p")


def hf_assisted_stress_residual_from_p(target: Target) -> HFPlanted:
    """The residual bug under the tempered assistant (`hf_assisted_stress`)."""
    return _planted(hf_assisted_stress(target), "residual-from-p")


def hf_assisted_residual_from_p_half(target: Target) -> HFPlanted:
    """`hf_assisted` with the residual bug on half the rejections."""
    return _planted(hf_assisted(target), "residual-from-p-half")


def hf_assisted_bonus_off_by_one(target: Target) -> HFPlanted:
    """`hf_assisted` drawing the bonus token from p at slot k - 1."""
    return _planted(hf_assisted(target), "bonus-off-by-one")


def hf_assisted_temperature_draft_only(target: Target) -> HFPlanted:
    """`hf_assisted` verifying with p at temperature 1 (the assistant drafts at the request's)."""
    return _planted(hf_assisted(target), "temperature-draft-only")


def hf_assisted_stale_q(target: Target) -> HFPlanted:
    """`hf_assisted` verifying with the previous round's q."""
    return _planted(hf_assisted(target), "stale-q")
