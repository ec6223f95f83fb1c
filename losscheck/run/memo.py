"""What a run computes once and its cells share (`Session.memo`), each kind under a key of its own
type: two kinds never collide, and a key names what it stands for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from losscheck.core.sampling import SamplingParams
    from losscheck.plan.cell import Cell


@dataclass(frozen=True)
class GreedyBaseline:
    """Plain greedy decoding of `prompts` by a target in a precision (`losscheck.cells.greedy`)."""

    target: str
    precision: str
    prompts: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ExactContinuations:
    """Every continuation of the exact prompt and its probability under a target at `params` up
    to `horizon` tokens (`losscheck.cells.sampled.exact_continuations`)."""

    target: str
    params: SamplingParams
    horizon: int


@dataclass(frozen=True)
class EngineBatch:
    """The draws of a batch of engine cells drawn side by side (`losscheck.cells.engine.dispatch`)."""

    cells: tuple[Cell, ...]


@dataclass(frozen=True)
class EngineDrafter:
    """An engine's draft model, wrapped to be teacher-forced (`losscheck.cells.engine.handle`)."""

    engine: str


@dataclass(frozen=True)
class EngineVocab:
    """The vocabulary size and EOS id of the engine's target in a precision (`CellContext.engine_vocab`)."""

    precision: str


MemoKey = GreedyBaseline | ExactContinuations | EngineBatch | EngineDrafter | EngineVocab
