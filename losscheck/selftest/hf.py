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
| `hf_assisted_q_raw_in_verify` | drafts from the assistant's processed logits, verified with its raw ones (#47932) |
| `hf_assisted_state_not_rolled_back` | a hybrid target's recurrent state keeps the rejected drafts |
| `hf_assisted_state_rollback_one_off` | a hybrid target's recurrent state restored one position late |

The last two patch transformers' rollback of linear-attention cache layers
(`LinearAttentionCacheLayerMixin.crop`) instead, and need a target with recurrent layers. They plant
on top of `every_verified_state_recorded`, the fix of transformers' own rollback bug with such
targets (docs/hybrid-targets.md), so that the planted bug is the only one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from losscheck.core.contract import Target
from losscheck.engines.hf import HFAnswer, HFAssistedEngine, hf_assisted, hf_assisted_stress
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


def _q_raw_in_verify(correct: Callable[..., Any], request: GenerationRequest) -> Callable[..., Any]:
    temperature = request.params.temperature

    def sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
        # transformers' candidate logits are the assistant's processed ones, raw / T: times T is its
        # raw law (within a cut-off, whose -inf stays); the drafts were drawn from the processed one
        raw = candidate_logits * temperature  # BUG: q for acceptance and recovery is the raw law
        return correct(candidate_input_ids, raw, candidate_length, new_logits, **kwargs)

    return sampling


@contextmanager
def planted(plant: Planting, request: GenerationRequest) -> Iterator[None]:
    """Inside: transformers' speculative sampling step replaced by `plant(correct, request)`."""
    from unittest import mock

    import transformers.generation.utils as hf_utils

    with mock.patch.object(hf_utils, "_speculative_sampling", plant(hf_utils._speculative_sampling, request)):
        yield


# the correct crop of a linear-attention cache layer -> the buggy one (tokens_to_remove <= 0)
StatePlanting = Callable[[Callable[..., Any]], Callable[..., Any]]


def _state_not_rolled_back(correct: Callable[..., Any]) -> Callable[..., Any]:
    def crop(layer: Any, tokens_to_remove: int) -> None:
        removed = abs(tokens_to_remove)
        correct(layer, 0)  # BUG: the conv window and recurrent state keep the rejected tokens
        layer.cumulative_length_linear.sub_(removed)  # (the token count is rolled back, as for the KV cache)

    return crop


def _state_rollback_one_off(correct: Callable[..., Any]) -> Callable[..., Any]:
    def crop(layer: Any, tokens_to_remove: int) -> None:
        correct(layer, min(0, tokens_to_remove + 1))  # BUG: one rejected token's state kept
        if tokens_to_remove < 0:
            layer.cumulative_length_linear.sub_(1)

    return crop


@contextmanager
def every_verified_state_recorded() -> Iterator[None]:
    """Inside: transformers' assisted decoding records a recurrent state after every token its
    verification pass reads. It asks for `num_assistant_tokens` of them (generation/utils.py,
    `cache.activate_past_recording(recurrent_states_to_keep=candidate_generator.num_drafting_tokens)`)
    while the pass reads one more (the last committed token and the drafts), so after a rejection of
    every draft the state is restored to before that token; one more recorded state fixes it."""
    from unittest import mock

    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    correct = LinearAttentionCacheLayerMixin.activate_past_recording

    def recording(layer: Any, recurrent_states_to_keep: int | None = None) -> None:
        correct(layer, None if recurrent_states_to_keep is None else recurrent_states_to_keep + 1)

    with mock.patch.object(LinearAttentionCacheLayerMixin, "activate_past_recording", recording):
        yield


@contextmanager
def state_planted(plant: StatePlanting) -> Iterator[None]:
    """Inside: transformers' linear-attention crop replaced by `plant(correct)`, on top of
    `every_verified_state_recorded`."""
    from unittest import mock

    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    crop = plant(LinearAttentionCacheLayerMixin.crop)
    with every_verified_state_recorded(), mock.patch.object(LinearAttentionCacheLayerMixin, "crop", crop):
        yield


STATE_PLANTED: dict[str, StatePlanting] = {
    "state-not-rolled-back": _state_not_rolled_back,
    "state-rollback-one-off": _state_rollback_one_off,
}


class HFPlanted(HFAssistedEngine):
    """Planted bug: the engine with a patched speculative sampling step (`PLANTED`)."""

    def __init__(self, engine: HFAssistedEngine, bug: str, name: str) -> None:
        super().__init__(engine.model, engine.assistant, engine.k, engine.eos, name=name)
        self.bug = bug

    def _generate(self, request: GenerationRequest, logprobs: bool) -> HFAnswer:
        # both public paths (`generate`, `generate_logprobs`) come through here: both planted
        if self.bug in STATE_PLANTED:
            if request.speculative:  # plain decoding never crops: the bug is speculation's alone
                with state_planted(STATE_PLANTED[self.bug]):
                    return super()._generate(request, logprobs)
            return super()._generate(request, logprobs)
        with planted(PLANTED[self.bug], request):
            return super()._generate(request, logprobs)


PLANTED: dict[str, Planting] = {
    "residual-from-p": _residual_from_p(1.0),
    "residual-from-p-half": _residual_from_p(0.5),
    "bonus-off-by-one": _bonus_off_by_one,
    "temperature-draft-only": _temperature_draft_only,
    "stale-q": _stale_q,
    "q-raw-in-verify": _q_raw_in_verify,
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


def hf_assisted_q_raw_in_verify(target: Target) -> HFPlanted:
    """`hf_assisted` accepting and recovering with the assistant's raw law while drafting from its
    processed one (transformers #47932's shape; lossless at temperature 1 with nothing processed)."""
    return _planted(hf_assisted(target), "q-raw-in-verify")


def hf_assisted_state_not_rolled_back(target: Target) -> HFPlanted:
    """`hf_assisted` on a hybrid target whose recurrent state is never rolled back after a rejection."""
    return _planted(hf_assisted(target), "state-not-rolled-back")


def hf_assisted_state_rollback_one_off(target: Target) -> HFPlanted:
    """`hf_assisted` on a hybrid target whose recurrent state is restored one position late."""
    return _planted(hf_assisted(target), "state-rollback-one-off")
