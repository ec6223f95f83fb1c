"""Rendering of the benchmark results (`losscheck.perf.bench`): `bench.json` and `bench.md`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from losscheck.report.markdown import markdown_table

COLUMNS = ("batch", "params", "new tokens", "k", "baseline tok/s", "spec tok/s", "speedup", "tau", "draft time")


def write_report(results: dict[str, Any], out: Path) -> None:
    """Write `bench.json` and `bench.md` under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    (out / "bench.md").write_text(markdown(results))


def markdown(results: dict[str, Any]) -> str:
    """The loop-throughput table, then samples per second against Hugging Face assisted generation."""
    rows = [
        (
            r["batch"],
            r["params"],
            r["new_tokens"],
            r["k"],
            f"{r['baseline_tokens_per_s']:.0f}",
            f"{r['spec_tokens_per_s']:.0f}",
            f"{r['speedup']:.2f}x",
            f"{r['acceptance_length']:.2f}",
            f"{r['draft_time_fraction']:.0%}",
        )
        for r in results["rows"]
    ]
    s = results["samples_per_s"]
    return (
        f"torch {results['torch']}, {results['threads']} threads; best of repeats after a warm-up.\n\n"
        + markdown_table(COLUMNS, rows)
        + f"\nSampled sequences per second ({s['horizon']} tokens, T=1, k={s['k']}): losscheck loop at batch 1024 "
        f"{s['losscheck_batch1024']:.0f}/s; "
        f"Hugging Face assisted generation (batch 1) {s['hf_assisted_batch1']:.1f}/s; "
        f"ratio {s['ratio']:.0f}x.\n"
    )
