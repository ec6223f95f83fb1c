"""Planted random-stream bugs, as wrappers around any black-box engine (the HF adapter, the spec
loop): each request's law stays exact, only the streams behind requests are wrong, so only
`losscheck.cells.engine.streams` sees them. Speculation off is left as it is (the bugs shipped on the
speculative path). Select one like any engine:
`--losscheck-engine=losscheck.selftest.streams:seed_ignored_when_speculating`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from losscheck.core.contract import Target
    from losscheck.engines import BlackBoxEngine
    from losscheck.engines.request import GenerationRequest
    from losscheck.engines.spec_loop import SpecLoopEngine

DEFAULT_SEED = 0  # the engine's own stream, where a request's seed is not read


class _Wrapped:
    """`engine` with another `generate`; every other attribute (k, precision, draft model,
    counters, the reproducibility it declares) is the engine's."""

    bug = ""

    def __init__(self, engine: BlackBoxEngine | SpecLoopEngine) -> None:
        self.engine = engine
        self.name = f"{engine.name}+{self.bug}"

    def __getattr__(self, name: str) -> Any:
        if name == "generate_logprobs":  # the engine's own would draw around the planted `generate`
            raise AttributeError(name)
        return getattr(self.engine, name)


class SeedIgnoredWhenSpeculating(_Wrapped):
    """TensorRT-LLM #17599: the per-request seed is not passed to the speculative path, which
    samples from the engine's default stream: requests of distinct seeds give the same rows."""

    bug = "seed-ignored-when-speculating"

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        if request.speculative:
            request = replace(request, seed=DEFAULT_SEED)  # BUG: the request's seed dropped
        return self.engine.generate(request)


class SharedStream(_Wrapped):
    """TensorRT-LLM #19487: unseeded speculative requests share one stream, restarted for each
    request, so serial requests give identical samples. Each row is its own request here (as a
    server sees n = 1 requests), every one starting the same stream."""

    bug = "shared-stream"

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        if not request.speculative:
            return self.engine.generate(request)
        rows = [
            # BUG: every request starts the one stream afresh, whatever its seed or row
            self.engine.generate(replace(request, prompts=(prompt,), n=1, seed=DEFAULT_SEED))[0, 0]
            for prompt in request.prompts
            for _ in range(request.n)
        ]
        return torch.stack(rows).view(request.shape)


def seed_ignored_when_speculating(target: Target) -> SeedIgnoredWhenSpeculating:
    """losscheck's loop with the bundled drafter A, the speculative path ignoring the seed."""
    return SeedIgnoredWhenSpeculating(_spec_loop(target))


def shared_stream(target: Target) -> SharedStream:
    """losscheck's loop with the bundled drafter A, every speculative request restarting one stream."""
    return SharedStream(_spec_loop(target))


def _spec_loop(target: Target) -> SpecLoopEngine:
    from losscheck import bundled
    from losscheck.drafters.autoregressive import from_path
    from losscheck.engines.spec_loop import SpecLoopEngine

    return SpecLoopEngine(target, from_path(bundled.fixtures_dir() / "drafter_a", target))
