"""Which cells each certification test is parametrised over, for the drafters of a session."""

from __future__ import annotations

from losscheck.matrix import SAMPLING_VARIANTS, Cell, greedy_cells, sampling_cells
from losscheck.sampling import SamplingParams
from losscheck.session import Session

ORACLE = "self"
# The small target has 8 tokens: top-k / top-p values that actually cut its distributions.
SMALL_VARIANTS = (
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=1.5),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
)


def cells_for(session: Session, arg: str) -> list[Cell]:
    if arg == "greedy_cell":
        return [c for name, d in session.drafters("main").items() for c in greedy_cells(name, d)]
    if arg == "sampling_cell":
        return _sampled(session, "main", SAMPLING_VARIANTS)
    if arg == "exact_cell":
        return _sampled(session, "small", SMALL_VARIANTS) if "small" in session.targets else []
    if arg == "engine_cell":  # black-box engines: the sampling variants, block length is theirs
        return [Cell("engine", 0, params) for params in SAMPLING_VARIANTS] if session.options.engine else []
    raise ValueError(f"unknown cell argument {arg!r}")


# The bundled parallel families share one verifier path with A, which carries the full sweep of
# sampling parameters and block lengths; each family keeps the sampled cells that exercise its
# own drafting code (its processing of q, its longest block, its truncation widths), so the whole
# gate stays within its time budget. Their greedy cells cover every declared k and width.
FAMILY_SAMPLING = {
    "B": (SAMPLING_VARIANTS[:2], (16,), ()),
    "C": (SAMPLING_VARIANTS[:1], (), (1, 4)),
    "D": (SAMPLING_VARIANTS[:1], (16,), ()),
    "E": (SAMPLING_VARIANTS[:2], (16,), (1, 4)),
}


def _sampled(session: Session, target: str, variants: tuple[SamplingParams, ...]) -> list[Cell]:
    cells: list[Cell] = []
    for name, drafter in session.drafters(target).items():
        if name == ORACLE:  # the oracle checks the loop, not a drafter: the base cell suffices
            cells.append(Cell(ORACLE, 4, variants[0], target=target))
        elif session.bundled and name in FAMILY_SAMPLING:
            params, ks, widths = FAMILY_SAMPLING[name]
            cells += [Cell(name, 4, p, target=target) for p in params]
            cells += [Cell(name, k, params[0], target=target) for k in ks]
            cells += [Cell(name, 4, params[0], w, target) for w in widths]
        else:
            cells += sampling_cells(name, drafter, variants=variants, target=target)
    return cells
