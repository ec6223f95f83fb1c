"""A run's declared scope: the part of the matrix it certifies. Pure planning, no models.

By default a run certifies every cell of what it was given (`--losscheck-scope` unset). A user may
declare kinds in and aspects out, before any cell runs — on one GPU the tensor-parallel split
cannot run, so `--losscheck-scope=-split` declares it out; `--losscheck-scope=greedy` certifies the
greedy cells only. Cells declared out leave the matrix before the run's alpha is split, are listed
in the certificate with the term that put them out, and the verdict is PASS *of that scope*.

Terms, comma-separated:

- a kind, `KIND`: certify only cells of the kinds named (`KINDS`, or a group of `GROUPS`);
  without one, every kind;
- an aspect out, `-ASPECT`: leave out every cell that varies along it from the base cell
  (`ASPECTS`, each serving axis by its name: `split`, `prefix`, `batching`, and each axis of the
  named black-box engine's adapter: vLLM's `k`, `dtype`, `prefix`, `chunked_prefill`, `method`);
- cells in, `+EXTRA`: add cells the matrix has only when asked (`EXTRAS`), e.g. `+served`, a
  black-box engine's cells of the sampling parameters engines serve (an engine run on a CPU costs
  minutes a cell, and on a large target tens of minutes); `-served` leaves such cells out of a
  drafter's matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from losscheck.errors import OptionError
from losscheck.plan.modes import MODES, Mode

if TYPE_CHECKING:  # the plugin parses the option before anything imports torch
    from losscheck.core.precision import Precision
    from losscheck.plan.cell import Cell

KINDS = tuple(Mode)  # `Cell.mode`
GROUPS = {
    "sampling": tuple(m for m in Mode if MODES[m].statistical),
    "engine": tuple(m for m in Mode if MODES[m].engine),
}


def _edge(cell: Cell, base: Precision) -> bool:
    from losscheck.plan.tiers import EDGE_VARIANTS

    return cell.params in EDGE_VARIANTS


def _oracle(cell: Cell, base: Precision) -> bool:
    from losscheck.plan.cell import ORACLE

    return cell.drafter == ORACLE


def _served(cell: Cell, base: Precision) -> bool:
    from losscheck.engines.served import served

    return bool(served(cell.params))


# aspect -> (what it leaves out, whether a cell varies along it given the base precision)
ASPECTS: dict[str, tuple[str, Callable[[Cell, Precision], bool]]] = {
    "precision": ("cells in another precision than the base cell's", lambda c, base: c.precision != base),
    "stress": ("stress-drafter cells", lambda c, base: c.stress is not None),
    "width": ("cells at a truncation width", lambda c, base: c.width is not None),
    "edge": ("the edge sampling parameters (T=0.001, T=5, top-p 0.05)", _edge),
    "served": ("the sampling parameters beyond temperature, top-k and top-p (penalties, bias, stops, ...)", _served),
    "oracle": ("the self-draft oracle's cells", _oracle),
    "slow": ("the slow tier", lambda c, base: c.slow),
    "engine-axes": ("the black-box engine's variants (one of its axes changed)", lambda c, base: bool(c.variant)),
}
WHOLE = "the whole matrix"
# extra -> the cells `+EXTRA` adds to the matrix (`losscheck.plan.matrix.plan`)
EXTRAS = {
    "served": "a black-box engine's cells of the sampling parameters engines serve beyond temperature, top-k "
    "and top-p: each penalty, min-p, a logit bias, banned ids, min tokens (losscheck.plan.matrix.SERVED_VARIANTS)",
}


def serving_axis_names() -> tuple[str, ...]:
    from losscheck.serving import axis

    return tuple(a.name for a in axis.axes())


@dataclass(frozen=True)
class Scope:
    """Kinds declared in (empty: every kind), aspects declared out and extras declared in, as the
    user wrote them."""

    kinds: frozenset[str] = frozenset()
    out: tuple[str, ...] = ()
    text: str = ""
    extras: frozenset[str] = frozenset()

    @property
    def whole(self) -> bool:
        return not self.kinds and not self.out and not self.extras

    def label(self) -> str:
        return WHOLE if self.whole else f"--scope={self.text}"

    def check(self, serving_axes: Iterable[str], engine_axes: Iterable[str] = ()) -> None:
        """Aspects that are neither `ASPECTS`, a serving axis nor an axis of the engine are refused."""
        axes, engine = tuple(serving_axes), tuple(engine_axes)
        unknown = [a for a in self.out if a not in ASPECTS and a not in axes and a not in engine]
        if unknown:
            listed = [f"{a} ({what})" for a, (what, _) in ASPECTS.items()] + [f"{a} (a serving axis)" for a in axes]
            listed += [f"{a} (an axis of the engine)" for a in engine if a not in axes]
            raise OptionError(
                f"scope: no aspect {unknown[0]!r} to leave out; the aspects are {', '.join(listed)} "
                "(e.g. -split on one GPU)"
            )

    def reason(self, cell: Cell, base: Precision) -> str | None:
        """Why `cell` is out of this scope (the term that declares it out), or None: in scope."""
        if self.kinds and cell.mode not in self.kinds:
            return f"kind {cell.mode} not declared in"
        for aspect in self.out:
            varies = (
                ASPECTS[aspect][1](cell, base)
                if aspect in ASPECTS
                else any(n == aspect for n, _ in (*cell.serving, *cell.variant))
            )
            if varies:
                return f"-{aspect} declared out"
        return None

    def split(
        self, cells: Mapping[str, list[Cell]], base: Precision
    ) -> tuple[dict[str, list[Cell]], list[dict[str, str]]]:
        """(the cells of each argument in scope, one entry per cell out of scope: its id and why)."""
        kept: dict[str, list[Cell]] = {}
        out: list[dict[str, str]] = []
        for arg, found in cells.items():
            kept[arg] = []
            for cell in found:
                why = self.reason(cell, base)
                if why is None:
                    kept[arg].append(cell)
                else:
                    out.append({"cell": cell.id, "reason": why})
        return kept, out


def parse_scope(text: str | None) -> Scope:
    """`--losscheck-scope` as written: comma-separated kinds and `-ASPECT`s (see the module)."""
    if text is None or not text.strip():
        return Scope()
    kinds: set[str] = set()
    out: list[str] = []
    extras: set[str] = set()
    for term in (t.strip() for t in text.split(",")):
        if not term:
            raise OptionError(f"scope {text!r} has an empty term; separate kinds and -aspects by single commas")
        if term.startswith("-"):
            out.append(term[1:])
        elif term.startswith("+"):
            if term[1:] not in EXTRAS:
                listed = ", ".join(f"+{name} ({what})" for name, what in EXTRAS.items())
                raise OptionError(f"scope {text!r}: no extra {term!r}; the extras are {listed}")
            extras.add(term[1:])
        elif term in GROUPS:
            kinds.update(GROUPS[term])
        elif term in KINDS:
            kinds.add(term)
        else:
            raise OptionError(
                f"scope {text!r}: no kind {term!r}; the kinds are {', '.join((*KINDS, *GROUPS))}, "
                "-ASPECT leaves an aspect out (e.g. greedy,-split) and +EXTRA adds cells (e.g. +served)"
            )
    both = extras & set(out)
    if both:
        raise OptionError(f"scope {text!r} adds and leaves out {', '.join(sorted(both))}; keep one of the two terms")
    return Scope(frozenset(kinds), tuple(out), text.strip(), frozenset(extras))


def hint(aspect: str) -> str:
    """What to add to declare `aspect` out, for a cell this hardware cannot run."""
    return f"declare it out of the certificate's scope with --losscheck-scope=-{aspect} (certify: --scope=-{aspect})"
