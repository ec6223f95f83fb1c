"""Per-position acceptance: the two figures every report gives, and their definitions.

A round proposes drafts 1..k and verification keeps a prefix of them. Counted per position j
(1-based in reports, index j - 1 in the tuples):

    proposed[j]  rounds that proposed a draft at position j
    reached[j]   rounds that proposed position j with drafts 1..j-1 all accepted
    accepted[j]  rounds whose draft j was accepted (so drafts 1..j-1 were too)

    cumulative[j]  = accepted[j] / proposed[j]  P(drafts 1..j all accepted)
    conditional[j] = accepted[j] / reached[j]   P(draft j accepted | drafts 1..j-1 accepted)

τ = 1 + Σ_j cumulative[j] when every round proposes k drafts. The conditional curve answers "does
the drafter fall off after position 3?"; the cumulative one mixes that with every earlier position.
Where every round proposed the same k, reached[j] = accepted[j-1] (proposed[1] for j = 1), which is
how an engine's counters (rounds, accepted per position) give both.

Imports nothing heavy: the certificate's records and the engine counters read it without torch.
"""

from __future__ import annotations

from collections.abc import Sequence

CUMULATIVE = "P(drafts 1..j all accepted)"
CONDITIONAL = "P(draft j accepted | drafts 1..j-1 accepted)"


def cumulative(accepted: Sequence[int], proposed: Sequence[int]) -> tuple[float | None, ...]:
    """[k] accepted[j] / proposed[j]; None where no round proposed position j."""
    return _ratios(accepted, proposed)


def conditional(accepted: Sequence[int], reached: Sequence[int]) -> tuple[float | None, ...]:
    """[k] accepted[j] / reached[j]; None where no round reached position j."""
    return _ratios(accepted, reached)


def reached_at_fixed_k(accepted: Sequence[int], rounds: int) -> tuple[int, ...]:
    """[k] reached per position when each of `rounds` rounds proposed all k drafts: (rounds,
    accepted[1], ..., accepted[k-1])."""
    return (rounds, *accepted[:-1]) if len(accepted) else ()


def formatted(rates: Sequence[float | None], digits: int = 3) -> list[str]:
    """Rates for a report: `digits` decimals, "-" for a position never reached (None or NaN)."""
    return ["-" if r is None or r != r else f"{r:.{digits}f}" for r in rates]


def shown(rates: Sequence[float | None], digits: int = 3) -> str:
    """Rates on one report line, " / " between positions."""
    return " / ".join(formatted(rates, digits))


def _ratios(numerators: Sequence[int], denominators: Sequence[int]) -> tuple[float | None, ...]:
    if len(numerators) != len(denominators):
        raise ValueError(f"per-position counts of different lengths: {len(numerators)} and {len(denominators)}")
    return tuple(n / d if d else None for n, d in zip(numerators, denominators))
