"""The two tiers of the matrix, as code: a cell is in the slow tier when a rule below applies.

The quick gate (`-m "lossless and not slow"`) keeps, for each drafter, every greedy cell of the
base precision at k in `GREEDY_KS` and every width, a greedy cell of each serving axis alone, and
the sampled cells at its base block length (every sampling variant, its stress cells, the
oracle's and the exact-mode cells of that k). The slow tier (`-m lossless` runs both, so does
`losscheck certify`) holds what costs most CPU time for what it adds beyond them; each rule says
why. Black-box engine cells are always in the quick gate: they are the engine's only cells.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from losscheck.core.grammar import Grammar
from losscheck.core.precision import Precision
from losscheck.core.sampling import SamplingParams
from losscheck.core.stops import StopStrings
from losscheck.plan.cell import ENGINE, Cell

GREEDY_KS = (1, 2, 4, 8, 16)
BASE_K = 4
# Exact cells enumerate V**L continuations of the small target, so their horizon stays short (4);
# they run at the block length whose rounds fit it twice with a bonus slot (2k + 2 <= 4).
EXACT_K = 1
# Edge sampling parameters: near-greedy, near-flat and a top-p that keeps one token.
EDGE_VARIANTS = (SamplingParams(temperature=1e-3), SamplingParams(temperature=5.0), SamplingParams(top_p=0.05))
# The parameters engines serve beyond temperature / top-k / top-p, one per cell on the base cell
# (T = 1), at values that act within the main target's 16-token horizon over its 64 ids: id 25 is
# its most frequent T = 1 token (~2.7% of them), id 5 one it emits ~2% of the time. A PIT cell of
# them costs what the base cell does (~4 s here): all are in the quick gate; the main job has all but
# the grammar's, which needs xgrammar (`losscheck[grammar]`) and is in `--bundled all` and CI's tests.
STOP_STRINGS = ("rR", "RS", "44", "xh", "P4")
HISTORY_VARIANTS = (
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(min_tokens=8, stop_ids=(25,)),
    SamplingParams(presence_penalty=1.0),
    SamplingParams(frequency_penalty=0.5),
    SamplingParams(min_p=0.1),
    SamplingParams(logit_bias=((5, 2.0),)),
    SamplingParams(banned_ids=(25,)),
    # structured output: letters and digits alternate (the bundled target's ids spell characters,
    # `losscheck.core.grammar.BUNDLED_TEXTS`), so the allowed ids change with every token
    SamplingParams(grammar=Grammar("regex", "([a-z][0-9])+")),
    # stop strings: five of the bigrams the target draws most at T = 1 (each in ~7% of its 16-token
    # rows after the bundled prompts), so that about a third of the rows stop on one, often on a
    # string whose first character closed the round before (`losscheck.core.stops`)
    SamplingParams(stop_strings=StopStrings(STOP_STRINGS)),
)


@dataclass(frozen=True)
class TierContext:
    """What the rules compare a cell with: the base precision, each drafter's base block length,
    and the bundled families that share family A's verifier path."""

    base: Precision
    base_ks: Mapping[str, int]
    families: frozenset[str]


@dataclass(frozen=True)
class Rule:
    reason: str  # what the rule moves to the slow tier, and why (the docs and certificate show it)
    applies: Callable[[Cell, TierContext], bool]


def _sampled(cell: Cell) -> bool:
    return not cell.params.greedy


def _base_k(cell: Cell, ctx: TierContext) -> int:
    return EXACT_K if cell.target == "small" else ctx.base_ks.get(cell.drafter, BASE_K)


SLOW_TIER: tuple[Rule, ...] = (
    Rule(
        "reduced-precision cells (CPU torch emulates bf16 / fp16: each PIT cell costs ~4x an fp32 one)",
        lambda c, ctx: c.precision != ctx.base,
    ),
    Rule(
        "sampled cells at other block lengths and truncation widths (the greedy cells cover every k and width)",
        lambda c, ctx: _sampled(c) and (c.width is not None or c.k != _base_k(c, ctx)),
    ),
    Rule(
        "sampled cells of the bundled parallel and speculators families (they share family A's verifier "
        "path, which the quick gate samples; their greedy cells stay in it)",
        lambda c, ctx: _sampled(c) and c.drafter in ctx.families,
    ),
    Rule(
        f"greedy cells at declared block lengths outside {', '.join(map(str, GREEDY_KS))} "
        "(e.g. a drafter of 1..16 gets 16 greedy cells)",
        lambda c, ctx: c.params.greedy and c.k not in GREEDY_KS,
    ),
    Rule(
        "sampled cells of the serving axes and pairs of serving axes (the quick gate has each axis alone in a "
        "greedy cell: the axes change scheduling and cache reuse, not the verifier's arithmetic, and a wrong "
        "context shows token for token; each serving mutant is caught there)",
        lambda c, ctx: len(c.serving) > 1 or (bool(c.serving) and _sampled(c)),
    ),
    Rule(
        "the edge sampling parameters on the main target (T=0.001, T=5, top-p 0.05)",
        lambda c, ctx: c.target == "main" and c.params in EDGE_VARIANTS,
    ),
)


def slow_reasons(cell: Cell, context: TierContext) -> list[str]:
    """The rules that put `cell` in the slow tier (none: it is in the quick gate)."""
    if cell.drafter == ENGINE:
        return []
    return [rule.reason for rule in SLOW_TIER if rule.applies(cell, context)]


def in_slow_tier(cell: Cell, context: TierContext) -> bool:
    return bool(slow_reasons(cell, context))
