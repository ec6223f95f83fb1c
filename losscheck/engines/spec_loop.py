"""losscheck's own batched speculative loop behind the black-box interface.

It certifies the black-box machinery itself: the same `Engine` with the bundled family-A drafter
(speculation on) or with no drafter (off), so both sides share every line of sampling code.
"""

from __future__ import annotations

import torch

from losscheck.core.contract import Drafter, Target
from losscheck.core.engine import Engine
from losscheck.core.generation import LoopStats
from losscheck.core.limits import ENGINE_BATCH
from losscheck.core.sampling import make_generator
from losscheck.core.verify import Verifier
from losscheck.engines.counters import EngineCounters
from losscheck.engines.request import GenerationRequest
from losscheck.engines.served import SERVED


class SpecLoopEngine:
    """`Engine(target, drafter, k, verifier)`, or `Engine(target)` with speculation off."""

    precision = "fp32"  # the bundled models' dtype as loaded by the factories below
    reproducible_seeds = True  # one request, one seed: the same ids, speculation on or off
    serves = frozenset(SERVED)  # the loop is losscheck's own definition of every field
    first_token = "round"  # the loop drafts from the prompt: a row's first token is slot 0's

    def __init__(
        self,
        target: Target,
        drafter: Drafter,
        k: int = 4,
        batch: int = ENGINE_BATCH,
        verifier: Verifier | None = None,
        name: str = "spec-loop",
    ) -> None:
        self.spec, self.plain = Engine(target, drafter, k, verifier=verifier), Engine(target)
        self.eos = target.eos_id if target.eos_id is not None else 0
        self.k, self.name = k, f"{name}(k={k})"
        self.batch = batch  # rows per engine call
        self._counters = EngineCounters(drafts=0, drafted=0, accepted=0, accepted_per_position=(0,) * k, emitted=0)

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        return self._generate(request)[0]

    def generate_logprobs(self, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """`generate`'s ids and the loop's reported log-probabilities of them (0 after a row's end;
        all 0 under greedy decoding, where the loop reports none)."""
        return self._generate(request)

    def _generate(self, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
        engine = self.spec if request.speculative else self.plain
        gen = make_generator(request.seed, "spec-loop", request.speculative, device=engine.target.device)
        rows = [list(prompt) for prompt in request.rows()]  # prompt-major: row i*n + j
        budget = request.max_new_tokens
        out = torch.full((len(rows), budget), self.eos, dtype=torch.long)  # [P*n, L]
        logprobs = torch.zeros(len(rows), budget, dtype=torch.float64)  # [P*n, L]
        for start in range(0, len(rows), self.batch):
            got = engine.generate(rows[start : start + self.batch], budget, request.params, gen)
            mask = got.mask()
            out[start : start + len(got.tokens)] = torch.where(mask, got.tokens, self.eos).cpu()
            if got.logprobs is not None:
                logprobs[start : start + len(got.tokens), : got.logprobs.shape[1]] = (
                    torch.where(mask, got.logprobs, 0.0).double().cpu()
                )
            if request.speculative:
                self._count(got.stats)
        return out.view(request.shape), logprobs.view(request.shape)

    def _count(self, stats: LoopStats) -> None:
        """Add one call's loop counters: a (row, round) pair is one draft, as vLLM counts them."""
        was = self._counters
        per = tuple(a + b for a, b in zip(was.accepted_per_position or (), stats.accepted.tolist()))
        self._counters = EngineCounters(
            drafts=was.drafts + stats.row_rounds,
            drafted=(was.drafted or 0) + int(stats.proposed.sum()),
            accepted=(was.accepted or 0) + int(stats.accepted.sum()),
            accepted_per_position=per,
            emitted=(was.emitted or 0) + stats.emitted,
        )

    def draft_model(self) -> torch.nn.Module | None:
        """The drafter's model when it is an autoregressive one (its q is its processed logits)."""
        from losscheck.drafters.autoregressive import AutoregressiveDrafter

        drafter = self.spec.drafter
        return drafter.lm.model if isinstance(drafter, AutoregressiveDrafter) else None

    def counters(self) -> EngineCounters:
        return self._counters


def spec_loop(target: Target) -> SpecLoopEngine:
    """`--losscheck-engine=losscheck.engines.spec_loop:spec_loop` (the bundled drafter A, k = 4)."""
    from losscheck import bundled
    from losscheck.drafters.autoregressive import from_path

    return SpecLoopEngine(target, from_path(bundled.fixtures_dir() / "drafter_a", target))
