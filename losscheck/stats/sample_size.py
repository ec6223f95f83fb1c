"""How many sequences a sampled cell draws: the power requirement of its tests, plus a margin.

Pure functions of the cell's budget `alpha`, the `power`, the total variation `detect_tv` it must
detect and the test's shape; the runner calls them, the tests then assert their own power.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from losscheck.stats.exact import exact_required_n
from losscheck.stats.pit import pit_required_values

SAMPLE_MARGIN = 1.1  # draw 10% more than the power calculation needs (EOS shortens rows)


def pit_sequences(alpha: float, power: float, detect_tv: float, n_bins: int, tokens_per_sequence: float) -> int:
    """Sequences whose pooled PIT values reach the pooled tests' power when each yields
    `tokens_per_sequence` tested values (a pilot's: EOS and cut-off uncertainty leave some out)."""
    values = pit_required_values(alpha, power, detect_tv, n_bins)
    return math.ceil(values * SAMPLE_MARGIN / max(tokens_per_sequence, 1e-9))


def exact_sequences(n_continuations: int, horizon: int, alpha: float, power: float, detect_tv: float) -> int:
    """Sampled sequences an exact-mode cell over `n_continuations` enumerated continuations needs."""
    return math.ceil(exact_required_n(n_continuations, horizon, alpha, power, detect_tv) * SAMPLE_MARGIN)


def _best(needed: Mapping[str, Mapping[str, float]], lr_bound: str) -> dict[str, tuple[str, float]]:
    """Per class, the test (not the benchmark `lr_bound`) that needs fewest tokens, and those tokens."""
    return {
        name: min(((t, n) for t, n in tests.items() if t != lr_bound), key=lambda tn: tn[1])
        for name, tests in needed.items()
    }


# The tested sample aims this much above what the pilot says each covered class needs: the pilot's
# estimate of a class's per-token effect varies with the prefixes it happened to visit.
DESIGN_MARGIN = 1.25


@dataclass(frozen=True)
class ClassDesign:
    """How a PIT cell sizes its tested sample from its bug classes' power (`losscheck.stats.bugclass`).

    best:    class -> (the test that needs fewest tokens to catch it, those tokens), from the pilot
    covered: the classes whose best test reaches the power within the cap, cheapest first
    reached: the classes beyond the cap whose best test reaches the partial power within it
             (`of`'s `partial`): they take the design to the cap
    tokens:  tested tokens the sample aims at: the most any covered class needs, with the margin,
             or the cap where a class is reached, within [floor, cap], and at least `pooled` (the
             pooled tests' own requirement, if any)
    floor:   the fewest tested tokens any sample of the design has: the floor, and `pooled`
    covering: the tokens the covered classes alone need (as `tokens`, no class reached); None: `tokens`
    """

    best: dict[str, tuple[str, float]]
    covered: tuple[str, ...]
    tokens: int
    cap: int
    floor: int
    reached: tuple[str, ...] = ()
    covering: int | None = None

    @property
    def promising(self) -> int:
        """The tokens the design's promises to its covered classes' family members are made at
        (`losscheck.stats.design.design_looks`): the covered classes' own, not the cap a reached
        class takes the last look to — a promise made at the cap would hold the early stop until
        members far smaller than the covered classes need were ruled out."""
        return self.tokens if self.covering is None else self.covering

    @classmethod
    def of(
        cls,
        needed: Mapping[str, Mapping[str, float]],
        lr_bound: str,
        floor: int,
        cap: int,
        pooled: int = 0,
        partial: Mapping[str, Mapping[str, float]] | None = None,
    ) -> ClassDesign:
        """`needed`: class -> test -> tokens needed (`PowerAccumulator.tokens_needed`; math.inf:
        no power); the entry `lr_bound` is a benchmark, not a test the cell runs. `partial`: the
        same at a partial power (`sequential.PARTIAL_POWER`). A class the cap leaves uncovered but
        reaches at that power takes the design to the cap, so that the looks' early stop must rule
        it out (`losscheck.stats.design.design_looks`) before the cell stops short of its tests'
        reach: without it, a cell whose bug sits just beyond the cap stops at the covered classes'
        tokens, where its tests barely see that bug."""
        best = _best(needed, lr_bound)
        covered = tuple(sorted((c for c, (_, n) in best.items() if n * DESIGN_MARGIN <= cap), key=lambda c: best[c][1]))
        partly = _best(partial or {}, lr_bound)
        reached = tuple(sorted(c for c, (_, n) in partly.items() if c in best and c not in covered and n <= cap))
        most = max((best[c][1] * DESIGN_MARGIN for c in covered), default=0.0)
        top = max(cap, pooled)
        covering = min(max(floor, math.ceil(most), pooled), top)
        tokens = min(max(covering, cap), top) if reached else covering
        return cls(best, covered, tokens, cap, max(floor, pooled), reached, covering)

    def sequences(self, tokens_per_sequence: float) -> int:
        """Sequences to draw when a sequence yields `tokens_per_sequence` tested tokens (the pilot's)."""
        return math.ceil(self.tokens / max(tokens_per_sequence, 1e-9))
