"""A cell: one certified configuration of the matrix. Pure data, no models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from losscheck.core.precision import Precision
from losscheck.core.sampling import SamplingParams
from losscheck.plan.modes import Mode
from losscheck.serving import axis as serving_axes
from losscheck.serving.axis import Serving

ORACLE = "self"  # drafter name of the self-draft oracle: the target drafting for itself, acceptance must be 1
ENGINE = "engine"  # drafter name of a black-box engine's cells (its block length is its own)
OWN_TARGET = "own"  # target name of a black-box engine's own target, which losscheck does not load (two-sample)


@dataclass(frozen=True)
class Cell:
    """One certified configuration."""

    drafter: str  # key in the run's drafter registry, or ENGINE
    k: int
    params: SamplingParams = field(default_factory=SamplingParams)
    width: int | None = None  # transition width; None = full / not applicable
    target: str = "main"  # "main", "small" (the exact-enumeration fixture) or OWN_TARGET
    precision: Precision = field(default_factory=Precision)  # target / drafter dtypes
    stress: str | None = None  # a stress variant of the drafter (`losscheck.drafters.stress`)
    serving: Serving = ()  # serving axis values other than the base cell's (`losscheck.serving.axis.serving`)
    # a black-box engine's variant: its axis values other than the engine's as named
    # (`losscheck.engines.registry.EngineAxis`)
    variant: tuple[tuple[str, int | str], ...] = ()
    slow: bool = field(default=False, compare=False)  # in the slow tier (`losscheck.plan.tiers`)

    @property
    def id(self) -> str:
        parts = [self.drafter, f"k{self.k}", self.params.label()]
        if self.width is not None:
            parts.append(f"w{self.width}")
        if self.target == "small":
            parts.append(self.target)
        if self.target == OWN_TARGET:
            parts.append("two-sample")
        if self.precision != Precision():
            parts.append(self.precision.id())
        if self.stress is not None:
            parts.append(f"stress-{self.stress}")
        return "-".join(parts + serving_axes.id_suffix(self.serving) + self._variant_suffix())

    def _variant_suffix(self) -> list[str]:
        """The engine axes the id does not already name: `k` is the cell's k, `dtype` its
        precision when it has one (a two-sample cell's is the engine's own)."""
        named = {"k"} | ({"dtype"} if self.target != OWN_TARGET else set())
        return [f"{name.replace('_', '-')}-{value}" for name, value in self.variant if name not in named]

    def axis(self, name: str) -> Any:
        """The cell's value of serving axis `name`."""
        return serving_axes.value(self.serving, name)

    @property
    def mode(self) -> Mode:
        """How the cell is certified (`losscheck.plan.modes`)."""
        if self.drafter == ENGINE:
            if self.params.greedy:
                return Mode.ENGINE_GREEDY
            return Mode.TWO_SAMPLE if self.target == OWN_TARGET else Mode.ONE_SAMPLE
        if self.params.greedy:
            return Mode.GREEDY
        return Mode.EXACT if self.target == "small" else Mode.PIT
