"""Black-box engines: implementations that only return generated ids (`--losscheck-engine`).

Such an engine is certified in two-sample mode (DESIGN §4.2): its samples against baseline
samples from losscheck's own plain decoding of the same target, with independent seeds.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from losscheck.contract import Drafter, Target
from losscheck.profiles import ENGINE_BATCH
from losscheck.sampling import SamplingParams


@runtime_checkable
class BlackBoxEngine(Protocol):
    """Anything that samples continuations of a prompt."""

    name: str

    def generate(
        self, prompt: list[int], n: int, params: SamplingParams, seed: int, max_new_tokens: int
    ) -> torch.Tensor:
        """`n` independent continuations of `prompt` → LongTensor [n, max_new_tokens]; a row that
        ends early (EOS) is padded with EOS after it."""


class SpecLoopEngine:
    """losscheck's own batched spec loop behind the black-box interface (family-A drafter)."""

    def __init__(self, target: Target, drafter: Drafter, k: int = 4, batch: int = ENGINE_BATCH) -> None:
        from losscheck.engine import Engine

        self.engine = Engine(target, drafter, k)
        self.eos = target.eos_id if target.eos_id is not None else 0
        self.name = f"spec-loop(k={k})"
        self.batch = batch  # rows per engine call

    def generate(self, prompt: list[int], n: int, params: SamplingParams, seed: int, max_new_tokens: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        chunks = []
        for start in range(0, n, self.batch):
            out = self.engine.generate([prompt] * min(self.batch, n - start), max_new_tokens, params, gen)
            chunks.append(torch.where(out.mask(), out.tokens, self.eos))
        return torch.cat(chunks)


class HFAssistedEngine:
    """Hugging Face assisted generation (`generate(assistant_model=...)`), one row at a time —
    the batch size it supports."""

    def __init__(self, target: Target, assistant: torch.nn.Module) -> None:
        self.model = target.model  # type: ignore[attr-defined]
        self.assistant = assistant
        self.eos = target.eos_id if target.eos_id is not None else 0
        self.name = "hf-assisted"

    def generate(self, prompt: list[int], n: int, params: SamplingParams, seed: int, max_new_tokens: int) -> torch.Tensor:
        torch.manual_seed(seed)  # HF generate draws from the global generator
        ids = torch.tensor([prompt])
        out = torch.full((n, max_new_tokens), self.eos, dtype=torch.long)
        sampling = dict(do_sample=False) if params.greedy else dict(
            do_sample=True, temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
        for i in range(n):
            row = self.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=self.assistant,
                                      max_new_tokens=max_new_tokens, pad_token_id=self.eos, **sampling)
            new = row[0, len(prompt):]
            out[i, : len(new)] = new
        return out


def spec_loop(target: Target) -> SpecLoopEngine:
    """`--losscheck-engine=losscheck.blackbox:spec_loop`"""
    from losscheck import bundled
    from losscheck.drafters.autoregressive import from_path

    return SpecLoopEngine(target, from_path(bundled.fixtures_dir() / "drafter_a", target))


def hf_assisted(target: Target) -> HFAssistedEngine:
    """`--losscheck-engine=losscheck.blackbox:hf_assisted` (the bundled drafter as assistant)."""
    from losscheck import bundled
    from losscheck.target import load_causal_lm

    return HFAssistedEngine(target, load_causal_lm(bundled.fixtures_dir() / "drafter_a"))
