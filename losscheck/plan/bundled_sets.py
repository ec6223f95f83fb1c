"""The bundled drafter sets `--losscheck-bundled` names: which bundled drafters a run builds, and
which cells of each one's matrix it certifies. Pure planning, no models.

`losscheck.run.drafters` builds the families of a set; `losscheck.plan.matrix.plan` plans each
family's cells as usual and keeps those its selection accepts. The self-draft oracle is in every
set, with all its cells.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.plan.cell import ORACLE, Cell
from losscheck.plan.tiers import BASE_K, HISTORY_VARIANTS

Selection = Callable[[Cell], bool]  # the cells of a family's matrix a set certifies

# every bundled drafter, in plan order
FAMILIES = ("A", "B", "C", "D", "E", "eagle3", "peagle", "dflash", "dspark", "tree")


def every_cell(cell: Cell) -> bool:
    return True


def no_cell(cell: Cell) -> bool:
    return False


def width_axis(cell: Cell) -> bool:
    """The greedy and the T=1 cell at the base block length, at every planned truncation width
    (full width included): the base cell and its one-change-of-width neighbours, nothing else."""
    return (
        cell.k == BASE_K
        and cell.params in (GREEDY, SamplingParams(temperature=1.0))
        and cell.stress is None
        and not cell.serving
    )


def without_grammar(cell: Cell) -> bool:
    """Family A's cells in the main job: all but the planned grammar cell, which needs xgrammar
    (`losscheck[grammar]`, installed with the tests); a run's own `--sampling` grammar stays."""
    return cell.params.grammar is None or cell.params not in HISTORY_VARIANTS


# set -> family -> its selection. The main job (`losscheck certify`) certifies "reference": the
# reference drafter A over its whole matrix, which has every axis but one; A has no transition
# cache, so E, the bundled drafter that has one, adds the truncation-width axis. E's other cells
# (block lengths, sampling variants, stress) run the same engine and verifier paths as A's.
REFERENCE: Mapping[str, Selection] = {"A": without_grammar, "E": width_axis}
SETS: Mapping[str, Mapping[str, Selection]] = {
    "reference": REFERENCE,
    "all": dict.fromkeys(FAMILIES, every_cell),
    # every cell of "all" that "reference" leaves out: with the main job, the whole bundled matrix
    # with no cell certified twice (CI's test step runs its quick gate)
    "others": {
        "A": lambda cell: not without_grammar(cell),  # its grammar cell
        **{f: every_cell for f in FAMILIES if f not in REFERENCE},
        "E": lambda cell: not width_axis(cell),
        ORACLE: no_cell,
    },
}


def families(which: str) -> tuple[str, ...]:
    """The bundled drafters set `which` builds, in plan order (the oracle is always built)."""
    return tuple(name for name in FAMILIES if name in SETS[which] and SETS[which][name] is not no_cell)


def selected(which: str | None, cell: Cell) -> bool:
    """Whether set `which` certifies `cell`: always for a drafter outside the set (the oracle) and
    when `which` is None (a user's drafter, not a bundled set)."""
    return which is None or SETS[which].get(cell.drafter, every_cell)(cell)
