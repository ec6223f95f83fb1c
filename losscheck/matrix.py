"""The experiment matrix: which cells a run certifies.

One variable changes per cell, starting from the base cell (fp32, k=4, full width, T=1); a
drafter only gets the block lengths and widths it declares.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from losscheck.contract import Drafter
from losscheck.sampling import GREEDY, SamplingParams

BASE_K = 4
GREEDY_KS = (1, 2, 4, 8, 16)
SAMPLING_KS = (1, 4, 8, 16)
SAMPLING_VARIANTS = (
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=1.5),
    SamplingParams(temperature=1.0, top_k=8),
    SamplingParams(temperature=1.0, top_p=0.9),
)


@dataclass(frozen=True)
class Cell:
    """One certified configuration."""

    drafter: str  # key in the session's drafter registry
    k: int
    params: SamplingParams = field(default_factory=SamplingParams)
    width: int | None = None  # transition width; None = full / not applicable
    target: str = "main"  # "main" or "small" (the exact-enumeration fixture)

    @property
    def id(self) -> str:
        parts = [self.drafter, f"k{self.k}", self.params.label()]
        if self.width is not None:
            parts.append(f"w{self.width}")
        if self.target != "main":
            parts.append(self.target)
        return "-".join(parts)


def greedy_cells(name: str, drafter: Drafter, ks: tuple[int, ...] = GREEDY_KS) -> list[Cell]:
    """Every declared block length, plus every declared width at the base k."""
    cells = [Cell(name, k, GREEDY) for k in ks if k in drafter.block_lengths]
    cells += [Cell(name, _base_k(drafter), GREEDY, w) for w in drafter.widths if w is not None]
    return cells


def sampling_cells(
    name: str,
    drafter: Drafter,
    ks: tuple[int, ...] = SAMPLING_KS,
    variants: tuple[SamplingParams, ...] = SAMPLING_VARIANTS,
    target: str = "main",
) -> list[Cell]:
    """The base cell, then one change at a time: sampling parameters, block length, width."""
    base_k = _base_k(drafter)
    cells = [Cell(name, base_k, params, target=target) for params in variants]
    cells += [Cell(name, k, variants[0], target=target) for k in ks if k != base_k and k in drafter.block_lengths]
    cells += [Cell(name, base_k, variants[0], w, target) for w in drafter.widths if w is not None]
    return cells


def _base_k(drafter: Drafter) -> int:
    return BASE_K if BASE_K in drafter.block_lengths else max(drafter.block_lengths)
