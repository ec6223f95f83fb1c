"""The perf report: `perf.json` (the run file), `perf.md` and plots, under one directory.

Plots (matplotlib, Agg): `speedup.png` (measured speedup against concurrency with its CI, the
analytic prediction dashed, the HF peer at concurrency 1), `throughput_latency.png`,
`acceptance.png` (per-slot acceptance and a round's cost split, concurrency 1) and
`sensitivity.png` (speedup by workload: output length and entropy tier).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from losscheck import acceptance
from losscheck.report import perf_run
from losscheck.report.markdown import markdown_table
from losscheck.report.perf_record import BASELINE, PerfRunFile, Rung, Sources, Speedup

WORKLOAD_ORDER = ("short", "low", "mid", "high")


def write_report(doc: PerfRunFile, out: Path, comparisons: list[perf_run.Comparison] | None = None) -> list[Path]:
    """Write the run file, the Markdown summary and the plots under `out`; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    perf_run.save(doc, out / "perf.json")
    (out / "perf.md").write_text(markdown(doc, comparisons))
    return [out / "perf.json", out / "perf.md", *plot(doc, out)]


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.1f}"


def _drafted(rungs: Iterable[Rung]) -> list[tuple[Rung, Speedup, Sources]]:
    """The drafters' rungs among `rungs`, each with its speedup and the speedup's sources."""
    return [(r, r.speedup, r.decomposition) for r in rungs if r.speedup is not None and r.decomposition is not None]


def _mean(xs: tuple[float, ...]) -> float:
    return sum(xs) / len(xs)


def statement(doc: PerfRunFile) -> str:
    """The conditional statement the run supports: hardware, the loop's version, the model pair,
    the workload and the speedup at the lowest concurrency of the reference drafter (A, or the
    user's; else the first drafter measured)."""
    env, p = doc.environment, doc.profile
    drafted = _drafted(doc.ladder())
    if not drafted:
        return f"On {env.accelerator} ({env.machine}, {env.cpu_count} CPUs): no drafter rung was timed."
    rung, s, _ = min(drafted, key=lambda d: (d[0].engine not in ("A", "user"), d[0].concurrency, d[0].engine))
    drafter = doc.drafters.get(rung.engine, {})
    sha = str(drafter.get("sha256") or "")[:12]
    return (
        f"On {env.accelerator} ({env.machine}, {env.cpu_count} CPUs, {env.threads} torch threads), losscheck's "
        f"own loop (losscheck {env.losscheck}, torch {env.torch}), target {doc.target['name']} "
        f"(sha256 {str(doc.target.get('sha256'))[:12]}…) with drafter {drafter.get('name', rung.engine)}"
        + (f" (sha256 {sha}…)" if sha else "")
        + f", {rung.requests} requests with output budgets in [{p.max_new // 2}, {p.max_new}], {doc.params}, "
        f"k = {rung.k}, closed loop: at concurrency {rung.concurrency} the speedup over plain decoding is "
        f"{s.label()} ({s.level:.0%} CI over {rung.repeats} paired runs)."
    )


def markdown(doc: PerfRunFile, comparisons: list[perf_run.Comparison] | None = None) -> str:
    env, p = doc.environment, doc.profile
    lines = [
        "# losscheck perf\n",
        statement(doc) + "\n",
        (
            f"- run {doc.created}; losscheck {env.losscheck} ({env.git_revision}); "
            f"torch {env.torch}, transformers {env.transformers}, {env.threads} threads"
        ),
        f"- device {env.device}: {env.accelerator}; {env.platform}, {env.cpu_count} CPUs",
        (
            f"- target {doc.target['name']} ({doc.target.get('precision')}, "
            f"sha256 {str(doc.target.get('sha256'))[:12]}); drafters: "
        )
        + ", ".join(f"{k} = {v['name']}" for k, v in doc.drafters.items()),
        (
            f"- profile {p.name}: k={p.k}, {doc.params}, output budgets uniform in "
            f"[{p.max_new // 2}, {p.max_new}], {p.repeats} timed runs per rung after a warm-up; "
            f"requests = max({p.min_requests}, {p.requests_per_slot} x concurrency), admitted into finished "
            "rows between rounds (closed loop)"
        ),
        "",
        "## Speedup and its sources\n",
        (
            "Speedup = spec / baseline throughput (ratio of geometric means over runs alternating with the "
            "drafter's own baseline runs; 95% CI, t on the pairs' log ratios). "
            "Predicted = tau / (draft cost + verify cost), costs in baseline target steps at the same concurrency "
            "(`losscheck.perf.model`). Overhead = engine time in a round outside drafter and target forwards.\n"
        ),
    ]
    rows: list[tuple[object, ...]] = []
    for r, s, d in _drafted(doc.ladder()):
        rows.append(
            (
                r.engine,
                r.concurrency,
                f"{_mean(r.baseline_tok_s or ()):.0f}",
                f"{_mean(r.throughput_tok_s):.0f}",
                s.label(),
                f"{d.predicted:.2f}x",
                f"{r.tau:.2f}",
                f"{d.draft_cost:.2f}",
                f"{d.verify_cost:.2f}",
                f"{r.draft_time_fraction:.0%}",
                f"{r.overhead_fraction:.1%}",
                f"{r.wasted_fraction:.0%}",
            )
        )
    lines.append(
        markdown_table(
            (
                "drafter",
                "concurrency",
                "baseline tok/s",
                "spec tok/s",
                "speedup [95% CI]",
                "predicted",
                "tau",
                "draft cost",
                "verify cost",
                "draft time",
                "overhead",
                "wasted drafts",
            ),
            rows,
        )
    )
    lines += [
        "## Latency (ms)\n",
        (
            "TTFT and end-to-end from admission; TPOT per request; ITL between a request's "
            "emission events (a speculative round emits several tokens at once).\n"
        ),
    ]
    rows = []
    for r in doc.ladder(spec=False) + doc.ladder():
        lat = r.latency_s
        rows.append(
            (
                r.engine,
                r.concurrency,
                *(_ms(lat[m][q]) for m in ("ttft", "tpot", "itl") for q in ("p50", "p95", "p99")),
                _ms(lat["e2e"]["p50"]),
                _ms(lat["e2e"]["p99"]),
            )
        )
    lines.append(
        markdown_table(
            (
                "engine",
                "c",
                "TTFT p50",
                "p95",
                "p99",
                "TPOT p50",
                "p95",
                "p99",
                "ITL p50",
                "p95",
                "p99",
                "E2E p50",
                "p99",
            ),
            rows,
        )
    )
    k = max((len(r.cumulative_acceptance) for r in doc.rungs), default=0)
    lines += [
        "## Per-slot acceptance\n",
        f"Conditional: {acceptance.CONDITIONAL}; cumulative: {acceptance.CUMULATIVE} "
        "(τ = 1 + the cumulative figures' sum)."
        + (
            " This perf.json predates the conditional figure: it is derived as the ratio of successive "
            "cumulative figures (exact when every round proposed k drafts).\n"
            if any(r.cumulative_acceptance and not r.conditional_acceptance for r in doc.rungs)
            else "\n"
        ),
    ]
    lines.append(
        markdown_table(
            ("drafter", "c", "figure", *(f"slot {j + 1}" for j in range(k))),
            [
                (r.engine, r.concurrency, name, *acceptance.formatted(rates, digits=2))
                for r in doc.ladder()
                for name, rates in (("conditional", r.conditional()), ("cumulative", r.cumulative_acceptance))
            ],
        )
    )
    lines += ["## Memory (MiB)\n", "Weights and the KV caches allocated for the rung; device peak on CUDA only.\n"]

    def mib(b: float | None) -> str:
        return "-" if b is None else f"{b / 2**20:.2f}"

    lines.append(
        markdown_table(
            ("engine", "c", "target weights", "drafter weights", "target KV", "drafter KV", "device peak"),
            [
                (
                    r.engine,
                    r.concurrency,
                    *(
                        mib(r.memory[m])
                        for m in (
                            "target_weights_bytes",
                            "drafter_weights_bytes",
                            "target_kv_bytes",
                            "drafter_kv_bytes",
                            "device_peak_bytes",
                        )
                    ),
                )
                for r in doc.ladder(spec=False) + doc.ladder()
            ],
        )
    )
    other = sorted(
        (r for r in doc.rungs if r.workload != "ladder" and r.speedup is not None),
        key=lambda r: (r.engine, r.workload),
    )
    if other:
        lines += [
            "## Sensitivity: output length and entropy tier\n",
            f"short = output budgets in [{p.short_max_new // 2}, {p.short_max_new}]; "
            "low/mid/high = prompts of one tier.\n",
        ]
        lines.append(
            markdown_table(
                ("drafter", "c", "workload", "speedup [95% CI]", "predicted", "tau", "draft time"),
                [
                    (
                        r.engine,
                        r.concurrency,
                        r.workload,
                        s.label(),
                        f"{d.predicted:.2f}x",
                        f"{r.tau:.2f}",
                        f"{r.draft_time_fraction:.0%}",
                    )
                    for r, s, d in _drafted(other)
                ],
            )
        )
    peer = doc.peer
    if peer:
        lines += [
            "## The peer: Hugging Face assisted generation, concurrency 1\n",
            markdown_table(
                ("loop", "drafter", "plain tok/s", "speculative tok/s", "speedup [95% CI]"),
                [
                    (
                        "losscheck",
                        peer.drafter,
                        f"{_mean(peer.ours_baseline_tok_s):.0f}",
                        f"{_mean(peer.ours_spec_tok_s):.0f}",
                        peer.ours_speedup.label(),
                    ),
                    (
                        "HF assisted generation",
                        peer.drafter,
                        f"{_mean(peer.hf_plain_tok_s):.0f}",
                        f"{_mean(peer.hf_assisted_tok_s):.0f}",
                        peer.hf_speedup.label(),
                    ),
                ],
            ),
        ]
    if comparisons is not None:
        lines += ["## Compared with a saved run\n"] + [f"- {c.line()}" for c in comparisons] + [""]
    return "\n".join(lines) + "\n"


def plot(doc: PerfRunFile, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    spec = _drafted(doc.ladder())
    drafters = sorted({r.engine for r, _, _ in spec})
    colours = {name: f"C{i}" for i, name in enumerate(drafters)}
    if spec:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in drafters:
            rs = [(r, s, d) for r, s, d in spec if r.engine == name]
            c = [r.concurrency for r, _, _ in rs]
            ratio = [s.ratio for _, s, _ in rs]
            err = [
                [0 if math.isnan(s.low) else max(s.ratio - s.low, 0) for _, s, _ in rs],
                [0 if math.isnan(s.high) else max(s.high - s.ratio, 0) for _, s, _ in rs],
            ]
            ax.errorbar(c, ratio, yerr=err, marker="o", capsize=3, color=colours[name], label=f"{name} measured")
            ax.plot(
                c,
                [d.predicted for _, _, d in rs],
                ls="--",
                color=colours[name],
                alpha=0.6,
                label=f"{name} predicted",
            )
        peer = doc.peer
        if peer:
            ax.plot(
                [1],
                [peer.hf_speedup.ratio],
                marker="*",
                ms=14,
                ls="none",
                color="black",
                label=f"HF assisted ({peer.drafter})",
            )
        ax.axhline(1, color="grey", lw=0.8)
        _ladder_axis(ax, [r for r, _, _ in spec])
        # A wide interval (few noisy runs) must not flatten the curves: the axis follows the
        # points, and the bars are clipped at its edge.
        points = [s.ratio for _, s, _ in spec] + [d.predicted for _, _, d in spec]
        ax.set_ylim(0, max(1.5, 1.3 * max(points + ([peer.hf_speedup.ratio] if peer else []))))
        ax.set_ylabel("speedup over baseline (throughput)")
        ax.set_title(f"Speedup against concurrency, k={doc.profile.k}, {doc.params}; bars: 95% CI")
        ax.legend(fontsize=7, ncol=2)
        written.append(_save(fig, out / "speedup.png"))

    rungs = doc.ladder(spec=False) + [r for r, _, _ in spec]
    if rungs:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for name in [BASELINE, *drafters]:
            own = [r for r in rungs if r.engine == name]
            if not own:
                continue
            colour = "black" if name == BASELINE else colours[name]
            c = [r.concurrency for r in own]
            ax1.plot(c, [_mean(r.throughput_tok_s) for r in own], marker="o", color=colour, label=name)
            ax2.plot(c, [r.latency_s["tpot"]["p50"] * 1e3 for r in own], marker="o", color=colour, label=f"{name} P50")
            ax2.plot(c, [r.latency_s["tpot"]["p99"] * 1e3 for r in own], ls=":", color=colour, label=f"{name} P99")
        for ax, label in ((ax1, "output tokens / s"), (ax2, "time per output token (ms)")):
            ax.set_yscale("log")
            _ladder_axis(ax, rungs)
            ax.set_ylabel(label)
        ax1.set_title("Throughput")
        ax2.set_title("TPOT, P50 solid, P99 dotted")
        ax1.legend(fontsize=7)
        written.append(_save(fig, out / "throughput_latency.png"))

    low = min((r.concurrency for r, _, _ in spec), default=None)
    first = [(r, d) for r, _, d in spec if r.concurrency == low]
    if first:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for r, _ in first:
            slots = range(1, len(r.cumulative_acceptance) + 1)
            conditional = [math.nan if a is None else a for a in r.conditional()]
            ax1.plot(slots, conditional, marker="o", color=colours[r.engine], label=f"{r.engine} (tau {r.tau:.2f})")
            ax1.plot(slots, r.cumulative_acceptance, ls=":", color=colours[r.engine])
        ax1.set_ylim(0, 1.05)
        ax1.set_xticks(range(1, max(len(r.cumulative_acceptance) for r, _ in first) + 1))
        ax1.set_xlabel("draft slot j")
        ax1.set_ylabel("acceptance at slot j")
        title = f"Per-slot acceptance, concurrency {low}\nsolid: {acceptance.CONDITIONAL}; dotted: cumulative"
        ax1.set_title(title, fontsize=9)
        ax1.legend(fontsize=7)
        names = [r.engine for r, _ in first]
        draft = [r.per_round.draft_s / d.step_s for r, d in first]
        verify = [r.per_round.verify_s / d.step_s for r, d in first]
        over = [r.per_round.overhead_s / d.step_s for r, d in first]
        ax2.bar(names, draft, label="draft", color="C1")
        ax2.bar(names, verify, bottom=draft, label="verify (target)", color="C0")
        ax2.bar(names, over, bottom=[d + v for d, v in zip(draft, verify)], label="engine overhead", color="C7")
        for i, (r, _) in enumerate(first):
            ax2.text(i, draft[i] + verify[i] + over[i], f"tau {r.tau:.2f}", ha="center", va="bottom", fontsize=8)
        ax2.set_ylabel("seconds per round / baseline target step")
        ax2.set_title(f"Cost of a round, concurrency {low}")
        ax2.legend(fontsize=7)
        written.append(_save(fig, out / "acceptance.png"))

    drafted = _drafted(doc.rungs)
    other = [r for r, _, _ in drafted if r.workload != "ladder"]
    if other:
        present = {r.workload for r in other}
        kinds = ["ladder", *(k for k in WORKLOAD_ORDER if k in present), *sorted(present - set(WORKLOAD_ORDER))]
        conc = min(r.concurrency for r in other)
        pool = [(r, s) for r, s, _ in drafted if r.concurrency == conc]
        names = sorted({r.engine for r in other})
        fig, ax = plt.subplots(figsize=(8, 4.2))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs, ys = [], []
            for j, kind in enumerate(kinds):
                found = [s for r, s in pool if r.engine == name and r.workload == kind]
                if found:
                    xs.append(j + i * width)
                    ys.append(found[0].ratio)
            ax.bar(xs, ys, width=width, color=colours.get(name, f"C{i}"), label=name)
        ax.axhline(1, color="grey", lw=0.8)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(kinds))], labels=kinds)
        ax.set_ylabel("speedup over baseline")
        ax.set_title(f"Speedup by workload, concurrency {conc} (short = short outputs; low/mid/high = entropy tier)")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / "sensitivity.png"))
    return written


def _ladder_axis(ax: Any, rungs: list[Rung]) -> None:
    """A log2 concurrency axis labelled with the ladder's own values."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ladder = sorted({r.concurrency for r in rungs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ladder, labels=[str(c) for c in ladder])
    ax.xaxis.set_minor_formatter(NullFormatter())
    if ax.get_yscale() == "log":  # 1-2-5 ticks in plain numbers: a range within one decade keeps labels
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("requests in flight (concurrency)")


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
