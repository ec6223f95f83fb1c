"""`losscheck export-perf`: an engine perf run's rungs as `vllm bench serve` result files."""

from __future__ import annotations

import argparse
from pathlib import Path

from losscheck.cli.command import EXIT_PASS, Command


def add_arguments(exp: argparse.ArgumentParser) -> None:
    exp.add_argument("run", help="an engine perf run directory (`losscheck perf --engine ...`) or its perf.json")
    exp.add_argument(
        "--out", type=Path, help="directory for the result files (default: RUN/vllm-bench/), one per rung and side"
    )


def run(ns: argparse.Namespace) -> int:
    from losscheck.report import engine_perf_run, vllm_bench

    doc = engine_perf_run.load(ns.run, said=f"losscheck export-perf {ns.run}")
    run_dir = Path(ns.run) if Path(ns.run).is_dir() else Path(ns.run).parent
    written = vllm_bench.export(doc, ns.out or run_dir / "vllm-bench")
    print(f"wrote {len(written)} vllm bench serve result files under {written[0].parent}" if written else "no rungs")
    return EXIT_PASS


COMMAND = Command(
    "export-perf", "an engine perf run's rungs as `vllm bench serve` result files (flat *_ms keys)", add_arguments, run
)
