"""Rendering of the drafter-families document (`losscheck.perf.families`): table, plot, files.

`write_report` writes `table.json` (every run), `table.md` (τ, wasted and draft-time fractions per
prompt group; per-slot acceptance) and `slot_acceptance.png` (one panel per drafter, per-slot
acceptance at the largest k, one curve per tier and mode).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from losscheck import acceptance
from losscheck.cells.record import AcceptanceRecord
from losscheck.jsonrecord import FLAT, JsonRecord
from losscheck.report.manifest import Environment
from losscheck.report.markdown import markdown_table

SCHEMA = "losscheck.perf.families/1"


@dataclass(frozen=True)
class FamilyRun(JsonRecord):
    """One drafter at one k and mode on one prompt group: the loop's counters."""

    drafter: str  # the label: its registry name, and its transition width when truncated
    family: str  # its registry name
    width: int | None
    mode: str  # "greedy" or "T1"
    tier: str  # a prompt group: an entropy tier or "bos"
    stats: AcceptanceRecord = field(metadata=FLAT)

    @property
    def key(self) -> tuple[str, int, str, str]:
        return self.drafter, self.stats.k, self.mode, self.tier


@dataclass(frozen=True)
class FamiliesSetup(JsonRecord):
    ks: tuple[int, ...]
    modes: tuple[str, ...]
    max_new_tokens: int
    prompts_per_tier: dict[str, int]
    sampled_repeats: int  # T=1 rows decode each prompt this many times


@dataclass(frozen=True)
class FamiliesTable(JsonRecord):
    """The drafter-families comparison (`table.json`): every run, and what it ran on."""

    schema: str
    created: str
    seed: int
    target: dict[str, object]  # the target's own identity
    drafters: dict[str, str]  # label → the drafter's name
    setup: FamiliesSetup
    environment: Environment
    runs: tuple[FamilyRun, ...]


def write_report(doc: FamiliesTable, out: Path) -> None:
    """Write `table.json`, `table.md` and `slot_acceptance.png` under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps(doc.to_json(), indent=2) + "\n")
    (out / "table.md").write_text(markdown(doc))
    plot_slot_acceptance(doc, out / "slot_acceptance.png")


# table.md's per-group columns: header prefix, the figure of a run
FRACTIONS: tuple[tuple[str, Callable[[AcceptanceRecord], float | None]], ...] = (
    ("τ", lambda s: s.acceptance_length),
    ("wasted", lambda s: s.wasted_fraction),
    ("draft", lambda s: s.draft_time_fraction),
)


Index = dict[tuple[str, int, str, str], FamilyRun]  # by (label, k, mode, tier)


def markdown(doc: FamiliesTable) -> str:
    """τ, wasted fraction and draft-time fraction per prompt group; per-slot acceptance."""
    runs, setup = doc.runs, doc.setup
    index = {r.key: r for r in runs}
    labels = list(dict.fromkeys(r.drafter for r in runs))
    tiers = list(setup.prompts_per_tier)
    env = doc.environment
    blocks = [
        "# Drafter families on the bundled target",
        f"Seed {doc.seed}; {setup.max_new_tokens} new tokens per prompt, "
        f"{'/'.join(str(n) for n in setup.prompts_per_tier.values())} prompts per tier "
        f"({'/'.join(tiers)}; `bos` = the one-token prompt [BOS] shared by all three sets, run apart); "
        f"T=1 rows decode each prompt {setup.sampled_repeats} times. "
        f"torch {env.torch}, {env.threads} thread(s). "
        "τ = tokens per round (1 + accepted); wasted = drafts discarded after the first rejection; "
        "draft = share of the loop's wall time spent drafting (CPU, batched, tiny models: the "
        "target is cheap, so the draft cost weighs heavily).",
        f"Drafters: {', '.join(f'{k} = `{v}`' for k, v in doc.drafters.items())}.",
    ]
    columns = ["drafter", "k", *(f"{head} {t}" for head, _ in FRACTIONS for t in tiers)]
    for mode in setup.modes:
        rows = [  # a drafter that declares fewer block lengths has no row at the others
            [
                label,
                k,
                *(f"{figure(index[label, k, mode, t].stats):.2f}" for _, figure in FRACTIONS for t in tiers),
            ]
            for label in labels
            for k in setup.ks
            if (label, k, mode, tiers[0]) in index
        ]
        blocks += [f"## {mode}", markdown_table(columns, rows)]
    k_max = max(setup.ks)
    blocks += [
        f"## Per-slot acceptance at k={k_max}",
        f"Two figures per drafter, slots 1..k: conditional = {acceptance.CONDITIONAL}, cumulative = "
        f"{acceptance.CUMULATIVE} (τ = 1 + the cumulative row's sum); `-` = never reached; a drafter "
        "that declares a shorter block is shown at its longest."
        + (
            " This table.json predates the per-slot `reached` counts: the conditional figure is derived "
            "from the accepted counts as if every round proposed k drafts."
            if any(r.stats.k and not r.stats.reached for r in runs)
            else ""
        ),
    ]
    slots = ["drafter", *(str(j + 1) for j in range(k_max))]
    for mode in setup.modes:
        for tier in tiers:
            group = "the [BOS] prompt" if tier == "bos" else f"{tier} entropy"
            curves = []
            for label in labels:
                stats = index[label, _longest(index, label, setup.ks), mode, tier].stats
                for name, rates in (("conditional", stats.conditional()), ("cumulative", stats.cumulative_acceptance)):
                    shown = acceptance.formatted(rates, digits=2)
                    curves.append([f"{label} {name}", *shown, *[""] * (k_max - len(shown))])
            blocks += [f"**{mode}, {group}**", markdown_table(slots, curves)]
    # one blank line between blocks; a table brings its own final newline
    return "\n\n".join(block.rstrip("\n") for block in blocks) + "\n"


def _longest(index: Index, label: str, ks: tuple[int, ...]) -> int:
    """The largest k of `ks` that drafter `label` was run at."""
    return max(k for k in ks if any(key[:2] == (label, k) for key in index))


def plot_slot_acceptance(doc: FamiliesTable, path: Path) -> None:
    """One panel per drafter: conditional per-slot acceptance at the largest k, a curve per tier and mode
    (the `bos` group is left out: it is one degenerate prompt, see `losscheck.perf.families`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, setup = doc.runs, doc.setup
    index = {r.key: r for r in runs}
    labels = list(dict.fromkeys(r.drafter for r in runs))
    k = max(setup.ks)
    cols = 4
    rows = -(-len(labels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), sharex=True, sharey=True, squeeze=False)
    colors = {"low": "tab:blue", "mid": "tab:orange", "high": "tab:red"}
    styles = {"greedy": "-", "T1": "--"}
    for ax, label in zip(axes.flat, labels):
        longest = _longest(index, label, setup.ks)
        for mode in setup.modes:
            for tier in [t for t in setup.prompts_per_tier if t != "bos"]:
                run = index[label, longest, mode, tier].stats
                curve = [math.nan if a is None else a for a in run.conditional()]
                ax.plot(
                    range(1, longest + 1),
                    curve,
                    styles.get(mode, ":"),
                    marker=".",
                    color=colors.get(tier),
                    label=f"{tier} {mode} (τ {run.acceptance_length:.2f})",
                )
        ax.set_title(f"{label}: {doc.drafters[label]}", fontsize=9)
        ax.set_ylim(0, 1.02)
        ax.set_xticks(range(1, k + 1, max(1, k // 8)))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower left")
    for ax in axes.flat[len(labels) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("slot j")
    for ax in axes[:, 0]:
        ax.set_ylabel("P(accept j | 1..j-1 accepted)")
    fig.suptitle(
        f"Conditional per-slot acceptance at k={k}, {acceptance.CONDITIONAL} (solid greedy, dashed T=1; "
        "the cumulative curve and the [BOS] prompt are in table.md)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
