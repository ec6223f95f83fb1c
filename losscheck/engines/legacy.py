"""The old engine contract, `generate(prompts, n, params, seed, max_new_tokens, speculative)`, behind
the current one (`LegacyEngine`): `losscheck.engines.checks.check_engine` wraps such an engine and
warns (docs/deprecations.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

from losscheck.engines.counters import EngineCounters
from losscheck.engines.outputs import engine_counters
from losscheck.engines.request import GenerationRequest

if TYPE_CHECKING:
    import torch


OLD_SIGNATURE = "generate(prompts, n, params, seed, max_new_tokens, speculative)"


class LegacyEngine:
    """An engine written against the old contract, `generate(prompts, n, params, seed,
    max_new_tokens, speculative)`, behind the new one."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.name: str = engine.name  # type: ignore[attr-defined]  # check_engine read them
        self.k: int = engine.k  # type: ignore[attr-defined]
        self.precision: str | None = engine.precision  # type: ignore[attr-defined]

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        prompts = [list(prompt) for prompt in request.prompts]
        args = (request.n, request.params, request.seed, request.max_new_tokens, request.speculative)
        return self.engine.generate(prompts, *args)  # type: ignore[attr-defined]

    def counters(self) -> EngineCounters | None:
        return engine_counters(self.engine)


def takes_old_signature(generate: Callable[..., object]) -> bool:
    """Whether a bound `generate` needs more than one positional argument (the old contract)."""
    try:
        parameters = inspect.signature(generate).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): assume the current contract
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is inspect.Parameter.empty for p in parameters) > 1
