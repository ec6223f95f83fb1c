"""The peer in the same run: Hugging Face assisted generation (`generate(assistant_model=...)`)
with the same target and the family-A drafter, on the same requests at concurrency 1 (the only
batch size it supports), against the same `generate` without the assistant.

The assistant drafts a constant `k` tokens per round with no confidence cut-off, as the
losscheck loop does, so the two speedups compare loops and not block-length schedules.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from losscheck.core.contract import Drafter
from losscheck.core.precision import synchronize
from losscheck.core.sampling import SamplingParams
from losscheck.errors import OptionError
from losscheck.perf.workload import Request

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def assistant_model(drafter: Drafter) -> PreTrainedModel:
    """The model HF assisted generation drafts with: a family-A drafter's causal LM; an
    `OptionError` for any other drafter."""
    from losscheck.drafters.autoregressive import AutoregressiveDrafter

    if not isinstance(drafter, AutoregressiveDrafter):
        raise OptionError(
            f"the HF assisted-generation peer needs a family-A drafter (a causal LM); drafter "
            f"{drafter.name!r} is a {type(drafter).__name__}. Pass --losscheck-drafter=DIR (a local "
            "Hugging Face causal LM) to compare with the peer"
        )
    return cast("PreTrainedModel", drafter.lm.model)  # RaggedLM keeps the causal LM it was built from


def hf_generate_seconds(
    model: PreTrainedModel,
    assistant: PreTrainedModel | None,
    requests: Sequence[Request],
    params: SamplingParams,
    k: int,
    seed: int,
) -> tuple[float, int]:
    """(wall seconds, output tokens) of `model.generate` over `requests` one at a time, with
    `assistant` drafting `k` tokens per round, or plain when None."""
    from losscheck.engines.hf import sampling_config

    device = next(model.parameters()).device
    eos = model.generation_config.eos_token_id
    sampling = sampling_config(params, "hf-assisted peer", eos if isinstance(eos, int) else None)
    extra: dict[str, Any] = {}
    if assistant is not None:
        config = assistant.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
        config.assistant_confidence_threshold = 0.0
        extra["assistant_model"] = assistant
    torch.manual_seed(seed)  # HF's sampling draws from the global generator
    tokens = 0
    synchronize(device)
    started = time.perf_counter()
    for r in requests:
        ids = torch.tensor([r.prompt], device=device)
        # `generate` comes from GenerationMixin, which every *ForCausalLM has and transformers'
        # PreTrainedModel type lacks
        out = model.generate(  # type: ignore[operator]
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=r.max_new,
            pad_token_id=eos if isinstance(eos, int) else 0,
            **sampling,
            **extra,
        )
        tokens += out.shape[1] - ids.shape[1]
    synchronize(device)
    return time.perf_counter() - started, tokens
