"""How a cell is certified (its *mode*), and what the plan knows of each mode, in one table.

The cells layer maps each mode to the function that runs it; everything the plan needs — which
modes spend a share of α, which belong to a black-box engine, what a base cell of the mode
costs — is read from `MODES`. Torch-free: the plugin parses `--losscheck-scope` with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Mode(str, Enum):  # equal to its value, so JSON, ids and `--losscheck-scope` read it as text
    GREEDY = "greedy"  # token-for-token equality with plain decoding
    PIT = "pit"  # teacher-forced PIT and conditional tests of losscheck's own loop
    EXACT = "exact"  # exact enumeration on the small-vocabulary target
    ENGINE_GREEDY = "engine-greedy"  # a black-box engine, drafting on against off, greedy
    ONE_SAMPLE = "one-sample"  # a black-box engine's samples, PIT under losscheck's copy of its target
    TWO_SAMPLE = "two-sample"  # a black-box engine drafting on against off, no target loaded

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ModeFacts:
    statistical: bool  # a sampling cell: spends one share of the run's α
    engine: bool  # a black-box engine's cell
    # seconds of a base cell on one worker of a 2-core CPU for the bundled target
    # (`losscheck.plan.cost` says where the figures come from)
    base_seconds: float
    k_cost: tuple[float, float] = (1.0, 0.0)  # (a, b): a block length k costs max(1, a + b·k) times more

    def seconds(self, k: int) -> float:
        a, b = self.k_cost
        return self.base_seconds * max(1.0, a + b * k)


MODES: dict[Mode, ModeFacts] = {
    Mode.GREEDY: ModeFacts(False, False, 0.8, (1.0, 1 / 8)),
    Mode.PIT: ModeFacts(True, False, 3.5, (1 / 5, 1 / 5)),
    Mode.EXACT: ModeFacts(True, False, 3.2),
    Mode.ENGINE_GREEDY: ModeFacts(False, True, 30.0),
    Mode.ONE_SAMPLE: ModeFacts(True, True, 20.0),
    Mode.TWO_SAMPLE: ModeFacts(True, True, 300.0),
}
