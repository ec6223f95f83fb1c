"""`losscheck perf`: the perf tier, `pytest -m perf` in process (the tier does not time under
xdist) with this command's options passed on, exiting by the table every subcommand shares
(pytest's statuses mapped onto it). With `--engine`, it times that engine with
speculation on against off (`losscheck.perf.engine_suite`) instead of losscheck's own loop."""

from __future__ import annotations

import argparse

import pytest

from losscheck.cli.command import Command, from_pytest
from losscheck.run.loading import check_options
from losscheck.run.options import add_options, dest, from_parsed, pytest_args

# The options `losscheck perf` passes on to `pytest -m perf`.
PERF_OPTIONS = (
    "target",
    "drafter",
    "device",
    "precision",
    "seed",
    "prompts",
    "chat-template",
    "trust-remote-code",
    "out",
    "perf-profile",
    "perf-compare",
    "perf-compare-fail",
    "engine",
    "assistant",
    "speculative-config",
    "engine-arg",
    "allow-lossy-mode",
    "perf-concurrency",
    "perf-arrivals",
    "perf-k",
)


def add_arguments(perf: argparse.ArgumentParser) -> None:
    add_options(perf.add_argument, "--", PERF_OPTIONS)
    perf.set_defaults(**{dest("out"): "reports"})


def perf_args(ns: argparse.Namespace) -> list[str]:
    """The pytest command line that `losscheck perf` runs."""
    args = ["--pyargs", "losscheck.plugin.certify", "-m", "perf", "-p", "no:cacheprovider", "-q", "-rfEs"]
    return args + pytest_args({name: getattr(ns, dest(name)) for name in PERF_OPTIONS})


def run(ns: argparse.Namespace) -> int:
    check_options(from_parsed(lambda d: getattr(ns, d)), prefix="--")
    return from_pytest(pytest.main(perf_args(ns)))


COMMAND = Command(
    "perf",
    "the perf tier: speedup against concurrency, latency, the HF peer; writes OUT/perf/perf.json, perf.md and "
    "plots (with --engine: that engine, speculation on against off, OUT/perf-engine/)",
    add_arguments,
    run,
)
