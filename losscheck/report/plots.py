"""The certificate's plots, drawn from the certificate alone (so `losscheck report RUN` redraws them).

- `slot_acceptance.png`: conditional per-slot acceptance P(draft j accepted | drafts 1..j-1 accepted) of
  every drafter, pooled over prompt tiers: greedy at its longest block, and T = 1 at its base block.
- `pit_histograms.png`: one panel per teacher-forced PIT cell, the PIT values' histogram relative to
  uniform, with the band a uniform sample of that size stays in with probability 0.99 per bin.
- `pit_qq.png`: every PIT cell's empirical quantiles minus the uniform's (a detrended QQ plot),
  with the DKW band at the cell's per-test alpha: a correct loop stays inside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from losscheck import acceptance
from losscheck.cells.record import CellRecord

if TYPE_CHECKING:
    from losscheck.report.document import Certificate

PIT_BINS = 20  # the record's `pit_histogram` has this many equal bins on [0, 1]
HIDDEN = {"self", "engine"}  # the oracle and black-box cells are not drafters to compare


def plot_certificate(cert: Certificate, run: Path) -> list[Path]:
    """Draw what the certificate has data for under `run`; return the files written."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for name, draw in (
        ("slot_acceptance.png", lambda: slot_acceptance(cert.meta.precisions[0], cert.cells)),
        ("pit_histograms.png", lambda: pit_histograms(cert.cells)),
        ("pit_qq.png", lambda: pit_qq(cert.alpha.per_test if cert.alpha else None, cert.meta.alpha_option, cert.cells)),
    ):
        figure = draw()
        if figure is not None:
            figure.savefig(run / name, dpi=110, bbox_inches="tight")
            written.append(run / name)
            import matplotlib.pyplot as plt

            plt.close(figure)
    return written


def pooled_slot_acceptance(record: CellRecord) -> list[float]:
    """`acceptance.CONDITIONAL` per slot, from the counts of every prompt group of a cell pooled
    (NaN: slot never reached)."""
    groups = list(record.acceptance.values())
    if not groups:
        return []
    k = len(groups[0].accepted)
    accepted = [sum(g.accepted[j] for g in groups) for j in range(k)]
    reached = [sum(g.reached_counts()[j] for g in groups) for j in range(k)]
    return [math.nan if a is None else a for a in acceptance.conditional(accepted, reached)]


def slot_acceptance(base: str, records: Sequence[CellRecord]) -> Any:
    """Per-slot acceptance of each drafter's cells at the base precision `base`."""
    import matplotlib.pyplot as plt

    greedy: dict[str, CellRecord] = {}
    sampled: dict[str, CellRecord] = {}
    for r in records:
        if not r.acceptance or r.drafter is None or r.drafter in HIDDEN or (r.target or "main") != "main":
            continue
        if r.width is not None or r.precision != base or r.k is None:
            continue  # one variable at a time: base width and precision only
        known = greedy.get(r.drafter)
        if r.kind == "greedy" and (known is None or r.k >= (known.k or 0)):
            greedy[r.drafter] = r
        elif r.kind == "pit" and r.params == "T1" and r.k == 4:
            sampled[r.drafter] = r
    if not greedy and not sampled:
        return None
    panels = [
        (chosen, title) for chosen, title in ((greedy, "greedy, longest block"), (sampled, "T = 1, k = 4")) if chosen
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), sharey=True, squeeze=False)
    for ax, (chosen, title) in zip(axes[0], panels):
        for drafter, r in sorted(chosen.items()):
            rates = pooled_slot_acceptance(r)
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{drafter} (k={r.k})")
        ax.set_title(title)
        ax.set_xlabel("draft slot j")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("P(draft j accepted | drafts 1..j-1 accepted)")
    axes[0][0].set_ylim(0, 1.02)
    fig.suptitle("Conditional per-slot acceptance (pooled over prompt tiers)")
    return fig


def _pit_cells(records: Sequence[CellRecord]) -> list[tuple[CellRecord, tuple[float, ...]]]:
    """The cells with a PIT histogram, and it, by cell id."""
    found = [(r, r.sample.pit_histogram) for r in records if r.sample.pit_histogram]
    return sorted(((r, h) for r, h in found if h), key=lambda rh: rh[0].cell)


def pit_histograms(records: Sequence[CellRecord]) -> Any:
    import matplotlib.pyplot as plt
    from scipy.stats import binom

    found = _pit_cells(records)
    if not found:
        return None
    cols = min(6, len(found))
    rows = math.ceil(len(found) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.3 * cols, 1.9 * rows), squeeze=False, sharey=False)
    for ax, (r, counts) in zip(axes.flat, found):
        n = sum(counts)
        expected = n / PIT_BINS
        low, high = binom.ppf([0.005, 0.995], n, 1 / PIT_BINS) / expected
        density = [c / expected for c in counts]
        ax.axhspan(low, high, color="grey", alpha=0.3, lw=0)
        ax.axhline(1.0, color="black", lw=0.6)
        ax.stairs(
            density,
            [i / PIT_BINS for i in range(PIT_BINS + 1)],
            lw=1.2,
            color="tab:blue" if r.passed else "tab:red",
        )
        furthest = max(high - 1, 1 - low, *(abs(d - 1) for d in density))
        spread = furthest * 1.15
        ax.set_ylim(1 - spread, 1 + spread)
        ax.set_title(r.cell, fontsize=7, color="black" if r.passed else "red")
        ax.set_xlim(0, 1)
        # fixed ticks: the locators' search over each of dozens of panels is most of the drawing time
        ax.set_xticks([0, 0.5, 1], ["0", "0.5", "1"])
        ax.set_yticks([1 - furthest, 1, 1 + furthest], [f"{1 - furthest:.2f}", "1", f"{1 + furthest:.2f}"])
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(found) :]:
        ax.axis("off")
    fig.suptitle("PIT histograms relative to uniform (grey: 99% band per bin under H0)", fontsize=9)
    fig.tight_layout()
    return fig


def pit_qq(per_test: float | None, alpha: float, records: Sequence[CellRecord]) -> Any:
    """The detrended QQ of every PIT cell, with the DKW band at the per-test alpha (`alpha`, the
    run's, where no per-test one is known)."""
    import matplotlib.pyplot as plt

    found = [(r, r.sample.pit_quantiles, counts) for r, counts in _pit_cells(records) if r.sample.pit_quantiles]
    a = per_test or alpha
    if not found:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    widest = 0.0
    for r, quantiles, counts in found:
        probs = [(i + 1) / (len(quantiles) + 1) for i in range(len(quantiles))]
        ax.plot(
            probs,
            [q - p for q, p in zip(quantiles, probs)],
            lw=0.8,
            color=None if r.passed else "red",
            label=None if r.passed else r.cell,
        )
        widest = max(widest, math.sqrt(math.log(2 / a) / (2 * sum(counts))))
    ax.axhspan(
        -widest,
        widest,
        color="grey",
        alpha=0.2,
        lw=0,
        label=f"DKW band at the per-test alpha (smallest cell: ±{widest:.4f})",
    )
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xlabel("probability p")
    ax.set_ylabel("empirical PIT quantile − p")
    ax.set_title(f"Detrended QQ of the PIT values, {len(found)} cell{'s' * (len(found) > 1)}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig
