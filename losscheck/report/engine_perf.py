"""An engine perf run's report: `perf.json` (`losscheck.report.engine_perf_record`) and `perf.md`,
which opens with the sentence the run supports and its environment, then a table per workload and
arrival process: throughput and latency percentiles with speculation off and on, the speedup with
its interval, and acceptance from the engine's counters (both definitions, labelled).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from losscheck import acceptance
from losscheck.report.engine_perf_record import EnginePerfFile, EngineRung
from losscheck.report.markdown import markdown_table

STREAMED = "each emission as the engine streamed it"
WHOLE_CALLS = "whole generate calls (the engine does not stream): TTFT is the end-to-end latency, ITL not measured"


def write_report(doc: EnginePerfFile, out: Path) -> list[Path]:
    """Write `perf.json`, `perf.md` and the plots (`plot`) under `out`; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "perf.json").write_text(json.dumps(doc.to_json(), indent=1, allow_nan=True))
    (out / "perf.md").write_text(markdown(doc))
    return [out / "perf.json", out / "perf.md", *plot(doc, out)]


def plot(doc: EnginePerfFile, out: Path) -> list[Path]:
    """The ladder at the engine's own k, one line per arrival process: `speedup.png`, speculation
    on over off with its interval; `throughput_latency.png`, output throughput and TPOT (P50 solid,
    P99 dotted), off dashed and on solid. Nothing when the ladder has fewer than one rung."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from losscheck.report.perf import _ladder_axis, _save

    own_k = doc.engine.get("k")
    ladder = [r for r in doc.rungs if r.workload == "ladder" and r.k == own_k]
    if not ladder:
        return []
    processes = sorted({r.arrivals for r in ladder}, key=lambda a: (a != "closed", a))
    colours = {a: f"C{i}" for i, a in enumerate(processes)}
    title = f"{doc.engine.get('name')}, k={own_k}, {doc.params}"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arrivals in processes:
        rungs = sorted((r for r in ladder if r.arrivals == arrivals), key=lambda r: r.concurrency)
        c = [r.concurrency for r in rungs]
        ratio = [r.speedup.ratio for r in rungs]
        # an interval's half-widths (NaN with fewer than two runs: no bar; round-off: clipped at 0)
        spread = [
            [0.0 if math.isnan(r.speedup.low) else max(0.0, r.speedup.ratio - r.speedup.low) for r in rungs],
            [0.0 if math.isnan(r.speedup.high) else max(0.0, r.speedup.high - r.speedup.ratio) for r in rungs],
        ]
        ax.errorbar(c, ratio, yerr=spread, marker="o", capsize=3, color=colours[arrivals], label=arrivals)
    ax.axhline(1, color="grey", lw=0.8)
    _ladder_axis(ax, ladder)  # type: ignore[arg-type]  # reads .concurrency only
    ax.set_ylim(0, max(1.5, 1.3 * max(r.speedup.ratio for r in ladder)))
    ax.set_xlabel("concurrency")
    ax.set_ylabel("speedup, speculation on over off (throughput)")
    ax.set_title(f"Speedup against concurrency: {title}; bars: 95% CI", fontsize=9)
    ax.legend(fontsize=7)
    written = [_save(fig, out / "speedup.png")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for arrivals in processes:
        rungs = sorted((r for r in ladder if r.arrivals == arrivals), key=lambda r: r.concurrency)
        c = [r.concurrency for r in rungs]
        for side, style, mark in (("off", "--", "s"), ("on", "-", "o")):
            sides = [getattr(r, side) for r in rungs]
            colour = colours[arrivals]
            label = f"{arrivals}, speculation {side}"
            ax1.plot(
                c,
                [sum(s.throughput_tok_s) / len(s.throughput_tok_s) for s in sides],
                ls=style,
                marker=mark,
                color=colour,
                label=label,
            )
            ax2.plot(
                c, [s.latency_s["tpot"]["p50"] * 1e3 for s in sides], ls=style, marker=mark, color=colour, label=label
            )
            ax2.plot(c, [s.latency_s["tpot"]["p99"] * 1e3 for s in sides], ls=":", color=colour)
    for ax, label in ((ax1, "output tokens / s"), (ax2, "time per output token (ms)")):
        _ladder_axis(ax, ladder)  # type: ignore[arg-type]
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
    ax1.set_title("Throughput: speculation off dashed (squares), on solid (dots)", fontsize=9)
    ax2.set_title("TPOT: P50 (off dashed, on solid), P99 dotted", fontsize=9)
    ax1.legend(fontsize=7)
    written.append(_save(fig, out / "throughput_latency.png"))
    return written


def _headline(doc: EnginePerfFile) -> EngineRung | None:
    """The rung the opening sentence quotes: the ladder's lowest concurrency, closed loop first."""
    own_k = doc.engine.get("k")
    ladder = sorted(
        (r for r in doc.rungs if r.workload == "ladder"),
        key=lambda r: (r.arrivals != "closed", r.k != own_k, r.concurrency),
    )
    return ladder[0] if ladder else (doc.rungs[0] if doc.rungs else None)


def _engine_words(engine: dict[str, object]) -> str:
    packages = engine.get("package")
    versions = ", ".join(f"{k} {v}" for k, v in packages.items()) if isinstance(packages, dict) and packages else ""
    return f"{engine.get('name')}" + (f" ({versions})" if versions else "")


def _model_words(doc: EnginePerfFile) -> str:
    target = doc.target
    sha = str(target.get("sha256") or "")[:12]
    words = f"target {target.get('name')}" + (f" (sha256 {sha}…)" if sha else "")
    draft = doc.engine.get("draft_model")
    if isinstance(draft, dict):
        dsha = str(draft.get("sha256") or "")[:12]
        words += f" with draft model {draft.get('path')}" + (f" (sha256 {dsha}…)" if dsha else "")
    return words


def statement(doc: EnginePerfFile) -> str:
    """The conditional statement the run supports: hardware, engine version, model pair, workload,
    concurrency, and the speedup with its interval."""
    env = doc.environment
    rung = _headline(doc)
    where = f"{env.accelerator} ({env.machine}, {env.cpu_count} CPUs)"
    if rung is None:
        return f"On {where}, {_engine_words(doc.engine)}: nothing was timed."
    s = rung.speedup
    workload = (
        f"{rung.requests} requests of {rung.prompt_tokens:.0f} prompt tokens on average and up to "
        f"{rung.max_new} output tokens, {doc.params}, arrivals {rung.arrivals}"
    )
    runs = f"{rung.repeats} paired runs" if rung.paired else f"{rung.repeats} runs a side"
    interval = "" if math.isnan(s.low) else f" [{s.low:.2f}, {s.high:.2f}] ({s.level:.0%} CI over {runs})"
    return (
        f"On {where}, {_engine_words(doc.engine)}, {_model_words(doc)}, {workload}: at concurrency "
        f"{rung.concurrency} the speedup of speculation on over off is {s.ratio:.2f}x{interval}."
    )


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.1f}"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _tail(percentiles: dict[str, float]) -> str:
    return f"{_ms(percentiles['p95'])} / {_ms(percentiles['p99'])}"


def _rates(values: tuple[float | None, ...]) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in values) or "-"


def markdown(doc: EnginePerfFile) -> str:
    env = doc.environment
    lines = [
        f"# Engine perf: {doc.engine.get('name')}",
        "",
        doc.statement,
        "",
        f"- created {doc.created}; profile {doc.profile}; seed {doc.seed}; sampling {doc.params}",
        f"- environment: losscheck {env.losscheck}, python {env.python}, torch {env.torch}, "
        f"{env.platform}, {env.machine}, {env.cpu_count} CPUs, device {env.device} ({env.accelerator})"
        + (f", CUDA {env.cuda}, driver {env.driver}, {env.device_count} GPUs" if env.cuda else ""),
        f"- engine: {json.dumps(doc.engine, sort_keys=True)}",
        f"- timing: {STREAMED if doc.streamed else WHOLE_CALLS}",
        f"- acceptance from {doc.counters_source}",
        f"- peak memory per timed run: {doc.memory_source or 'not read'}",
        "",
        "Speedup: output throughput with speculation on over off on runs of the same requests and seeds, "
        "the ratio of geometric means; taken in pairs (off then on) with a Student-t interval on the log "
        "ratios, or (an engine with one instance alive at a time) every off run first, with Welch's interval. "
        "Latencies count from admission; ITL is per emission (a speculative round emits several tokens at once).",
        "",
    ]
    groups: dict[tuple[str, str], list[EngineRung]] = {}
    for r in doc.rungs:
        groups.setdefault((r.workload, r.arrivals), []).append(r)
    for (workload, arrivals), rungs in groups.items():
        rungs.sort(key=lambda r: (r.k, r.concurrency))
        lines += [f"## {workload}, arrivals {arrivals}", ""]
        rows = [
            [
                str(r.concurrency),
                str(r.k),
                f"{r.requests} ({r.prompt_tokens:.0f} / {r.max_new})",
                f"{_mean(r.off.throughput_tok_s):.1f}",
                f"{_mean(r.on.throughput_tok_s):.1f}",
                r.speedup.label(),
                *(f"{_ms(r.off.latency_s[m]['p50'])} / {_ms(r.on.latency_s[m]['p50'])}" for m in ("ttft", "tpot")),
                *(f"{_ms(r.off.latency_s['e2e'][p])} / {_ms(r.on.latency_s['e2e'][p])}" for p in ("p50", "p95", "p99")),
                "-" if r.tau is None else f"{r.tau:.2f}",
                f"{_mib(r.off.peak_memory_mib)} / {_mib(r.on.peak_memory_mib)}",
            ]
            for r in rungs
        ]
        header = [
            "c",
            "k",
            "requests (prompt / out)",
            "off tok/s",
            "on tok/s",
            "speedup [95% CI]",
            "TTFT p50 ms off / on",
            "TPOT p50 ms off / on",
            "e2e p50 ms off / on",
            "e2e p95",
            "e2e p99",
            "τ",
            "peak MiB off / on",
        ]
        lines += [markdown_table(header, rows), ""]
        tails = [
            [
                str(r.concurrency),
                str(r.k),
                *(_tail(r.on.latency_s[m]) for m in ("ttft", "tpot", "itl")),
            ]
            for r in rungs
        ]
        lines += [
            markdown_table(["c", "k", "on: TTFT p95 / p99 ms", "TPOT p95 / p99", "ITL p95 / p99"], tails),
            "",
        ]
        counted = [r for r in rungs if r.counters is not None]
        if counted:
            lines += [
                f"Acceptance per draft position. Cumulative: {acceptance.CUMULATIVE}. "
                f"Conditional: {acceptance.CONDITIONAL}.",
                "",
                markdown_table(
                    ["c", "k", "rounds", "τ", "cumulative", "conditional", "wasted drafts"],
                    [
                        [
                            str(r.concurrency),
                            str(r.k),
                            str(r.counters.drafts if r.counters else "-"),
                            "-" if r.tau is None else f"{r.tau:.2f}",
                            _rates(r.cumulative_acceptance),
                            _rates(r.conditional_acceptance),
                            "-" if r.wasted_fraction is None else f"{r.wasted_fraction:.1%}",
                        ]
                        for r in counted
                    ],
                ),
                "",
            ]
    return "\n".join(lines)


def _mean(xs: tuple[float, ...]) -> float:
    return sum(xs) / len(xs) if xs else math.nan
