"""The experiment matrix: which cells each certification test runs. Pure planning, no models.

One variable changes per cell, starting from the base cell (the first `--losscheck-precision`,
fp32 by default; k=4, full width, T=1); a drafter only gets the block lengths and widths it
declares. `plan` maps the drafters of each target to the cells of every certification test
argument (`CELL_ARGS`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from losscheck.core.grammar import BUNDLED
from losscheck.core.precision import Precision
from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.engines.registry import QUANTIZATION
from losscheck.errors import flag
from losscheck.plan import bundled_sets
from losscheck.plan.cell import ENGINE, ORACLE, OWN_TARGET, Cell
from losscheck.plan.entry import MatrixEntry
from losscheck.plan.sampling_spec import with_vocabulary
from losscheck.plan.tiers import BASE_K, EDGE_VARIANTS, EXACT_K, HISTORY_VARIANTS, TierContext, in_slow_tier
from losscheck.serving import axis as serving_axes
from losscheck.serving.axis import serving

if TYPE_CHECKING:
    from losscheck.engines import BlackBoxEngine

__all__ = ["ENGINE", "ORACLE", "OWN_TARGET", "Cell", "plan", "statistical_tests", "entries"]  # with the constants

# The certification tests' cell arguments, and why a test has no cells when it has none.
GREEDY_CELL, PIT_CELL, EXACT_CELL, ENGINE_CELL = "greedy_cell", "sampling_cell", "exact_cell", "engine_cell"
ENGINE_GREEDY_CELL = "engine_greedy_cell"
CELL_ARGS = (GREEDY_CELL, PIT_CELL, EXACT_CELL, ENGINE_CELL, ENGINE_GREEDY_CELL)
STATISTICAL_ARGS = (PIT_CELL, EXACT_CELL, ENGINE_CELL)  # one Bonferroni share of alpha per cell
OFF_REASONS = {  # {engine}, {exact}: the options as the user spells them (`off_reason`)
    GREEDY_CELL: "no drafter declares a block length",
    PIT_CELL: "no drafter declares a block length",
    EXACT_CELL: "exact mode runs on the bundled small-vocabulary target, which certifies bundled drafters only "
    "(and is off under {exact}=off)",
    ENGINE_CELL: "no {engine} given: black-box mode is off",
    ENGINE_GREEDY_CELL: "no {engine} given: black-box mode is off",
}


def off_reason(arg: str) -> str:
    """Why the certification test argument `arg` has no cells, its options named as the user
    spells them (`--engine` under the CLI, `--losscheck-engine` under pytest)."""
    return OFF_REASONS[arg].format(engine=flag("engine"), exact=flag("exact"))


# Drafters whose rounds are trees (`losscheck.drafters.tree`): on the main target the bundled tree
# family gets its greedy cells and one PIT cell at T = 1, sized by and claiming the classes that are
# laws of p alone (a tree round reports no chain q: `losscheck.core.tree_engine`), no stress cells;
# its exact cells on the small-vocabulary target test the whole law with no model at all.
TREE_FAMILIES = ("tree",)

SAMPLING_KS = (1, 4, 8, 16)
SAMPLING_VARIANTS = (
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=1.5),
    SamplingParams(temperature=1.0, top_k=8),
    SamplingParams(temperature=1.0, top_p=0.9),
)
# The sampling parameters engines serve beyond temperature, top-k and top-p, one per engine cell on
# the T = 1 cell, in cells a run adds with `--scope=+served` (`losscheck.plan.scope.EXTRAS`): an
# engine's sampled cell costs ~20 s on vLLM's CPU build with the bundled target and 20-45 min with
# Hugging Face on the 8,192-token text target, so the default engine run does not carry them. The
# ids must act on whichever target the engine runs, the bundled 64-token one (vLLM's CPU build) or
# the text target (Hugging Face): at T = 1 after the bundled prompts, id 5 is 1.9% of the 64-token
# target's tokens and 1.6% of the text target's ("#"), the id most frequent in both; id 16 is
# 0.8% and 2.1% ("."), which a +2 bias raises about sevenfold. Min tokens ends on EOS (0.8% and
# 3.0% of their tokens); the stop id is the most frequent id, 5, so that about a quarter of the
# 16-token rows stop there, often inside an accepted block (`losscheck.engines.lengths`
# ends a row at its first EOS or stop id).
BIASED_ID, BANNED_ID, STOP_ID = 16, 5, 5
SERVED_VARIANTS = (
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(presence_penalty=1.0),
    SamplingParams(frequency_penalty=0.5),
    SamplingParams(min_p=0.1),
    SamplingParams(logit_bias=((BIASED_ID, 2.0),)),
    SamplingParams(banned_ids=(BANNED_ID,)),
    SamplingParams(min_tokens=8),
    SamplingParams(stop_ids=(STOP_ID,)),
)

# The small target has 8 tokens: top-k / top-p values that actually cut its distributions.
SMALL_VARIANTS = (*SAMPLING_VARIANTS[:3], SamplingParams(top_k=3), SamplingParams(top_p=0.8))

# The bundled parallel families share one verifier path with A, which carries the full sweep of
# sampling parameters and block lengths; each family keeps the sampled cells that exercise its
# own drafting code (its processing of q, its longest block, its truncation widths), so the whole
# gate stays within its time budget. Their greedy cells cover every declared k and width.
# family -> (sampling variants, extra block lengths, widths)
FAMILY_SAMPLING = {
    "B": (SAMPLING_VARIANTS[:2], (16,), ()),
    "C": (SAMPLING_VARIANTS[:1], (), (1, 4)),
    "D": (SAMPLING_VARIANTS[:1], (16,), ()),
    "E": (SAMPLING_VARIANTS[:2], (16,), (1, 4)),
    # the speculators-format fixtures (losscheck.drafters.speculators): T=1 and, for EAGLE-3 with
    # its smaller draft vocabulary, T=0.3; each at its longest block
    "eagle3": (SAMPLING_VARIANTS[:2], (8,), ()),
    "peagle": (SAMPLING_VARIANTS[:1], (8,), ()),
    # transformers-format DFlash (losscheck.drafters.dflash): one block per forward, as P-EAGLE's,
    # T=1 and T=0.3 (its slots past the first are drawn from marginals, far from p)
    "dflash": (SAMPLING_VARIANTS[:2], (8,), ()),
    # speculators-format DSpark (losscheck.drafters.dspark): each slot's q reads the draft before
    # it through the Markov head; T=1 and T=0.3, its longest block, and vLLM's top-k truncation
    "dspark": (SAMPLING_VARIANTS[:2], (8,), (8,)),
}


# Stress cells (`losscheck.drafters.stress`): honest variants of each drafter that reject more,
# in directions that expose verifier bugs to the PIT tests of a main-target cell. Every drafter
# gets all of them, except that the bundled parallel families share A's verifier path and keep one.
STRESS_VARIANTS = ("tempered2", "argmax", "mix0.25")
FAMILY_STRESS = ("tempered2",)


class Declares(Protocol):
    """What the plan reads of a drafter: its declared block lengths and transition widths (a
    built `Drafter`, or a bundled drafter's declarations read from its files without weights)."""

    @property
    def block_lengths(self) -> Sequence[int]: ...

    @property
    def widths(self) -> Sequence[int | None]: ...


def plan(
    drafters: Mapping[str, Mapping[str, Declares]],
    bundled: str | None,
    engine: BlackBoxEngine | None,
    precisions: tuple[Precision, ...] = (Precision(),),
    precision_drafters: frozenset[str] = frozenset(),
    engine_variants: Sequence[tuple[str, int | str]] = (),
    served: bool = False,
    sampling: Sequence[SamplingParams] = (),
    vocabulary: str | None = BUNDLED,
) -> dict[str, list[Cell]]:
    """The cells of every certification test argument.

    drafters: target ("main", and "small" when exact mode is on) -> drafter name -> drafter.
    bundled: the bundled set the drafters are (`losscheck.plan.bundled_sets`: its families get the
        cells of `FAMILY_SAMPLING` and it keeps those of its selection), or None for a user's drafter.
    engine: the black-box engine certified (`ENGINE_CELL`, `ENGINE_GREEDY_CELL`; `engine_cells`), or None,
        with `engine_variants`, the (axis, value) its adapter varies it along, and with `served` its
        cells of `SERVED_VARIANTS` (`--scope=+served`).
    precisions: the base cell's precision first, then one greedy and one sampled cell each for
        the main target's `precision_drafters` (those whose dtype losscheck sets).
    sampling: the run's own sampling parameters (`--losscheck-sampling`), one more sampled cell
        each on the base cell of every drafter certified along the serving axes and of the engine.
    vocabulary: what the planned grammar cell's grammar is compiled against (`history_variants`):
        the bundled target's characters, a user's target's tokenizer directory, or None (a target
        without a tokenizer: no planned grammar cell).
    """
    base = precisions[0]
    bundled_families = bundled is not None
    small = drafters.get("small", {})
    cells = {
        GREEDY_CELL: [c for name, d in drafters["main"].items() for c in greedy_cells(name, d)],
        PIT_CELL: _sampled(drafters["main"], "main", SAMPLING_VARIANTS, bundled_families),
        EXACT_CELL: [
            Cell(name, EXACT_K, params, target="small")
            for name in small
            for params in (SMALL_VARIANTS[:1] if name == ORACLE else SMALL_VARIANTS)
        ],
    }
    cells = {arg: [replace(c, precision=base) for c in found] for arg, found in cells.items()}
    cells[ENGINE_CELL], cells[ENGINE_GREEDY_CELL] = (
        engine_cells(engine, engine_variants, served, sampling) if engine is not None else ([], [])
    )
    for name, drafter in drafters["main"].items():
        if name == ORACLE or _drafts_trees(name, drafter, bundled_families):
            continue  # the oracle accepts everything: nothing to stress; a tree's PIT cell claims p's classes alone
        variants = FAMILY_STRESS if bundled_families and name in FAMILY_SAMPLING else STRESS_VARIANTS
        cells[PIT_CELL] += [
            Cell(name, _base_k(drafter), SAMPLING_VARIANTS[0], precision=base, stress=v) for v in variants
        ]
    for name, drafter in drafters["main"].items():
        if name not in precision_drafters:
            continue
        for precision in precisions[1:]:
            cells[GREEDY_CELL].append(Cell(name, _base_k(drafter), GREEDY, precision=precision))
            cells[PIT_CELL].append(Cell(name, _base_k(drafter), SAMPLING_VARIANTS[0], precision=precision))
    for name in _reference(drafters["main"], bundled_families):
        k = _base_k(drafters["main"][name])
        if _drafts_trees(name, drafters["main"][name], bundled_families):
            # the tree loop has no serving axes yet and refuses history-reading parameters
            cells[PIT_CELL] += [Cell(name, k, params, precision=base) for params in EDGE_VARIANTS]
            continue
        for along in serving_cells():
            cells[GREEDY_CELL].append(Cell(name, k, GREEDY, precision=base, serving=along))
            cells[PIT_CELL].append(Cell(name, k, SAMPLING_VARIANTS[0], precision=base, serving=along))
        for precision in precisions[1:2] if name in precision_drafters else ():
            for axis in serving_axes.axes():
                if axis.with_reduced_precision:
                    extra = [serving(**{axis.name: v}) for v in axis.values]
                    cells[GREEDY_CELL] += [Cell(name, k, GREEDY, precision=precision, serving=s) for s in extra]
        planned = EDGE_VARIANTS + history_variants(vocabulary)
        asked = tuple(p for p in dict.fromkeys(sampling) if p not in planned + SAMPLING_VARIANTS)
        cells[PIT_CELL] += [Cell(name, k, params, precision=base) for params in planned + asked]
    # each drafter's base k on the main target (the small target's cells are all at EXACT_K)
    base_ks = {name: _base_k(d) for target in ("small", "main") for name, d in drafters.get(target, {}).items()}
    tiers = TierContext(base, base_ks, frozenset(FAMILY_SAMPLING) if bundled_families else frozenset())
    return {
        arg: [replace(c, slow=in_slow_tier(c, tiers)) for c in found if bundled_sets.selected(bundled, c)]
        for arg, found in cells.items()
    }


def history_variants(vocabulary: str | None) -> tuple[SamplingParams, ...]:
    """`HISTORY_VARIANTS` for a main target whose tokens `vocabulary` spells: the grammar and the
    stop strings read against it (a tokenizer directory), or their cells left out (None: no
    tokenizer)."""
    if vocabulary == BUNDLED:
        return HISTORY_VARIANTS
    if vocabulary is None:
        return tuple(p for p in HISTORY_VARIANTS if p.grammar is None and p.stop_strings is None)
    return tuple(with_vocabulary(params, vocabulary) for params in HISTORY_VARIANTS)


def serving_cells() -> list[Any]:
    """The serving of each serving-axis cell: every axis value alone (one change from the base
    cell), then each axis's declared pairs (slow tier)."""
    axes = serving_axes.axes()
    alone = [serving(**{a.name: v}) for a in axes for v in a.values]
    pairs = [serving(**{a.name: v}, **pair) for a in axes for pair in a.pairs for v in a.values]
    return alone + pairs


def statistical_tests(cells: Mapping[str, list[Cell]]) -> int:
    """Statistical tests in the full parametrisation of a plan: one per cell of every statistical
    argument. The run's alpha is split over this count, whatever a `-k` selection or a CI shard
    collects, so the shares of every subset add up to at most the family alpha."""
    return sum(len(cells[arg]) for arg in STATISTICAL_ARGS)


def entries(cells: Mapping[str, list[Cell]]) -> list[MatrixEntry]:
    """The full matrix of a plan: one entry per cell of every certification argument."""
    from losscheck.plan.cost import estimated_seconds

    return [
        MatrixEntry(c.id, c.mode, arg, c.slow, round(estimated_seconds(c), 1)) for arg in CELL_ARGS for c in cells[arg]
    ]


def greedy_cells(name: str, drafter: Declares) -> list[Cell]:
    """Every declared block length (those outside `GREEDY_KS` in the slow tier), plus every
    declared width at the base k."""
    cells = [Cell(name, k, GREEDY) for k in sorted(set(drafter.block_lengths))]
    cells += [Cell(name, _base_k(drafter), GREEDY, w) for w in drafter.widths if w is not None]
    return cells


def sampling_cells(
    name: str, drafter: Declares, variants: tuple[SamplingParams, ...], target: str = "main"
) -> list[Cell]:
    """The base cell, then one change at a time: sampling parameters, block length, width."""
    base_k = _base_k(drafter)
    cells = [Cell(name, base_k, params, target=target) for params in variants]
    cells += [
        Cell(name, k, variants[0], target=target) for k in SAMPLING_KS if k != base_k and k in drafter.block_lengths
    ]
    cells += [Cell(name, base_k, variants[0], w, target) for w in drafter.widths if w is not None]
    return cells


def _sampled(
    drafters: Mapping[str, Declares], target: str, variants: tuple[SamplingParams, ...], bundled_families: bool
) -> list[Cell]:
    cells: list[Cell] = []
    for name, drafter in drafters.items():
        if name == ORACLE:  # the oracle checks the loop, not a drafter: the base cell suffices
            cells.append(Cell(ORACLE, BASE_K, variants[0], target=target))
        elif bundled_families and name in TREE_FAMILIES:
            cells.append(Cell(name, _base_k(drafter), variants[0], target=target))
        elif bundled_families and name in FAMILY_SAMPLING:
            params, ks, widths = FAMILY_SAMPLING[name]
            cells += [Cell(name, BASE_K, p, target=target) for p in params]
            cells += [Cell(name, k, params[0], target=target) for k in ks]
            cells += [Cell(name, BASE_K, params[0], w, target) for w in widths]
        else:
            cells += sampling_cells(name, drafter, variants, target)
    return cells


def _reference(drafters: Mapping[str, Declares], bundled_families: bool) -> list[str]:
    """The drafters certified along the serving axes: the user's, or among the bundled ones
    family A (the others share its engine paths)."""
    if bundled_families:
        return [name for name in drafters if name == "A"]
    return [name for name in drafters if name != ORACLE]


def _drafts_trees(name: str, drafter: Declares, bundled_families: bool) -> bool:
    """Whether the drafter's rounds are trees: a built drafter declaring its `tree`, or the bundled
    tree family (its declarations carry no tree)."""
    return getattr(drafter, "tree", None) is not None or (bundled_families and name in TREE_FAMILIES)


def _base_k(drafter: Declares) -> int:
    return BASE_K if BASE_K in drafter.block_lengths else max(drafter.block_lengths)


def engine_cells(
    engine: BlackBoxEngine,
    variants: Sequence[tuple[str, int | str]] = (),
    served: bool = False,
    sampling: Sequence[SamplingParams] = (),
) -> tuple[list[Cell], list[Cell]]:
    """(sampled, greedy) cells of a black-box engine at its own block length: every sampling
    variant (with `served` every one of `SERVED_VARIANTS`, then the run's own `sampling`) and one
    greedy cell, in the engine's precision when losscheck loads its target (one-sample mode), else
    on the engine's own target (`OWN_TARGET`, two-sample mode). Then
    each of its `variants` (axis, value: one knob of its adapter changed, `EngineAxis`) gets a
    greedy and a T = 1 cell of its own; a `k` variant runs at that k, a `dtype` variant of a
    one-sample engine is scored in that precision, a `quantization` variant is two-sample against
    its own plain side (a value the engine already has is no variant)."""
    if engine.precision is None:
        target, precision = OWN_TARGET, Precision()
    else:
        target, precision = "main", Precision(engine.precision, engine.precision)
    asked = tuple(dict.fromkeys(SAMPLING_VARIANTS + (SERVED_VARIANTS if served else ()) + tuple(sampling)))
    sampled = [Cell(ENGINE, engine.k, params, target=target, precision=precision) for params in asked]
    greedy = [Cell(ENGINE, engine.k, GREEDY, target=target, precision=precision)]
    for name, value in variants:
        if (name, value) in (("k", engine.k), ("dtype", engine.precision)):
            continue  # the engine as named
        k = int(value) if name == "k" else engine.k
        where, varied = target, precision
        if name == "dtype" and target != OWN_TARGET:
            varied = Precision(str(value), str(value))
        elif name == QUANTIZATION:  # weights losscheck does not load: no reference but the variant's own
            where, varied = OWN_TARGET, Precision()
        cell = Cell(ENGINE, k, GREEDY, target=where, precision=varied, variant=((name, value),))
        greedy.append(cell)
        sampled.append(replace(cell, params=SAMPLING_VARIANTS[0]))
    return sampled, greedy
