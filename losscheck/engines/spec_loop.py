"""losscheck's own batched speculative loop behind the black-box interface.

It certifies the black-box machinery itself: the same `Engine` with the bundled family-A drafter
(speculation on) or with no drafter (off), so both sides share every line of sampling code.
"""

from __future__ import annotations

import torch

from losscheck.core.contract import Drafter, Target
from losscheck.core.engine import Engine
from losscheck.core.limits import ENGINE_BATCH
from losscheck.core.sampling import SamplingParams, make_generator


class SpecLoopEngine:
    """`Engine(target, drafter, k)`, or `Engine(target)` with speculation off."""

    precision = "fp32"  # the bundled models' dtype as loaded by the factories below

    def __init__(self, target: Target, drafter: Drafter, k: int = 4, batch: int = ENGINE_BATCH) -> None:
        self.spec, self.plain = Engine(target, drafter, k), Engine(target)
        self.eos = target.eos_id if target.eos_id is not None else 0
        self.k, self.name = k, f"spec-loop(k={k})"
        self.batch = batch  # rows per engine call

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        seed: int,
        max_new_tokens: int,
        speculative: bool,
    ) -> torch.Tensor:
        engine = self.spec if speculative else self.plain
        gen = make_generator(seed, "spec-loop", speculative, device=engine.target.device)
        rows = [prompt for prompt in prompts for _ in range(n)]  # prompt-major: row i*n + j
        out = torch.full((len(rows), max_new_tokens), self.eos, dtype=torch.long)  # [P*n, L]
        for start in range(0, len(rows), self.batch):
            got = engine.generate(rows[start : start + self.batch], max_new_tokens, params, gen)
            out[start : start + len(got.tokens)] = torch.where(got.mask(), got.tokens, self.eos).cpu()
        return out.view(len(prompts), n, max_new_tokens)


def spec_loop(target: Target) -> SpecLoopEngine:
    """`--losscheck-engine=losscheck.engines.spec_loop:spec_loop` (the bundled drafter A, k = 4)."""
    from losscheck import bundled
    from losscheck.drafters.autoregressive import from_path

    return SpecLoopEngine(target, from_path(bundled.fixtures_dir() / "drafter_a", target))
