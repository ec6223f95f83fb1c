"""Hugging Face assisted generation behind the black-box interface.

Speculation on: `model.generate(assistant_model=...)`, which with `do_sample=True` verifies the
assistant's candidates by standard speculative sampling (`transformers.generation.utils.
_speculative_sampling`); off: plain `model.generate`. Assisted generation runs one row per call
(batch size 1 is all it supports), so speculative rows are drawn one after another; with
speculation off a prompt's rows are drawn in one batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from losscheck.core.contract import Target
from losscheck.core.sampling import SamplingParams
from losscheck.engines.request import GenerationRequest

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPE_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class HFAssistedEngine:
    """A Hugging Face causal LM (`model`) with `assistant` drafting `k` candidates per round."""

    def __init__(
        self, model: PreTrainedModel, assistant: PreTrainedModel, k: int, eos: int, name: str = "hf-assisted"
    ) -> None:
        self.model, self.assistant, self.k, self.eos = model, assistant, k, eos
        self.precision: str | None = DTYPE_PRECISION[next(model.parameters()).dtype]
        self.name = f"{name}(k={k})"

    def generation_config(self, params: SamplingParams, max_new_tokens: int) -> Any:
        """Exactly the request: no model-default top-k or penalties, a fixed block of `k` candidates
        (no schedule, no confidence early-stop: the declared k is the block drafted)."""
        from transformers import GenerationConfig

        sampling = (
            {"do_sample": False}
            if params.greedy
            else {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
        )
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            eos_token_id=self.eos,
            pad_token_id=self.eos,
            num_assistant_tokens=self.k,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
            **sampling,
        )

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        config = self.generation_config(request.params, request.max_new_tokens)
        speculative, n = request.speculative, request.n
        assistant = {"assistant_model": self.assistant} if speculative else {}
        device = next(self.model.parameters()).device
        out = torch.full(request.shape, self.eos, dtype=torch.long)  # [P, n, L]
        # HF samples from the global generator: seed it inside a fork, leaving the caller's state alone.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(request.seed)
            for i, prompt in enumerate(request.prompts):
                ids = torch.tensor([list(prompt)], device=device)  # [1, P]
                # assisted generation takes one row per call; plain generation takes a prompt's n at once
                for start, rows in _batches(n, 1 if speculative else n):
                    batch = ids.expand(rows, -1)  # [rows, P]
                    # `generate` comes from GenerationMixin, which every *ForCausalLM has and
                    # transformers' PreTrainedModel type lacks
                    new = self.model.generate(  # type: ignore[operator]
                        batch, attention_mask=torch.ones_like(batch), generation_config=config, **assistant
                    )[:, len(prompt) :].cpu()  # [rows, generated]; rows that end early pad with eos
                    out[i, start : start + rows, : new.shape[1]] = new
        return out


def _batches(n: int, size: int) -> list[tuple[int, int]]:
    """(first row, rows) of each batch of at most `size` covering `n` rows."""
    return [(start, min(size, n - start)) for start in range(0, n, size)]


def _bundled_parts(target: Target) -> tuple[PreTrainedModel, PreTrainedModel, int]:
    from losscheck import bundled
    from losscheck.core.target import load_causal_lm

    model = target.model  # type: ignore[attr-defined]
    weight = next(model.parameters())
    assistant = load_causal_lm(
        bundled.fixtures_dir() / "drafter_a", DTYPE_PRECISION[weight.dtype], device=weight.device
    )
    return model, assistant, target.eos_id if target.eos_id is not None else 0


def hf_assisted(target: Target) -> HFAssistedEngine:
    """`--losscheck-engine=losscheck.engines.hf:hf_assisted`: the target with the bundled drafter A
    as assistant, k = 4."""
    model, assistant, eos = _bundled_parts(target)
    return HFAssistedEngine(model, assistant, 4, eos)


def tempered(assistant: PreTrainedModel, factor: float) -> PreTrainedModel:
    """`assistant` drafting at `factor` times the request's temperature: its LM head's output is
    divided by `factor` (a forward hook, so tied embeddings are untouched). HF computes the draft
    distribution q from these logits with the request's processors, so the assistant stays an
    honest drafter — the black-box form of the `tempered` stress drafter
    (`losscheck.drafters.stress`): it rejects more often, which is where verifier bugs show."""
    assistant.get_output_embeddings().register_forward_hook(lambda module, args, out: out / factor)
    return assistant


def hf_assisted_stress(target: Target) -> HFAssistedEngine:
    """`--losscheck-engine=losscheck.engines.hf:hf_assisted_stress`: `hf_assisted` with the
    assistant tempered by 2 (a stress cell for a black-box engine)."""
    model, assistant, eos = _bundled_parts(target)
    return HFAssistedEngine(model, tempered(assistant, 2.0), 4, eos, name="hf-assisted-tempered2")
