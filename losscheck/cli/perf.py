"""`losscheck perf`: the perf tier, `pytest -m perf` in process (the tier does not time under
xdist) with this command's options passed on, exiting by the table every subcommand shares
(pytest's statuses mapped onto it). With `--engine`, it times that engine with
speculation on against off (`losscheck.perf.engine_suite`) instead of losscheck's own loop."""

from __future__ import annotations

import argparse

import pytest

from losscheck.cli.command import Command, from_pytest
from losscheck.errors import OptionError
from losscheck.plan.arrivals import open_loop
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
    vllm = perf.add_argument_group("as vllm bench serve names them (an engine perf run's arrivals)")
    vllm.add_argument(
        "--request-rate",
        type=float,
        metavar="RATE",
        help="requests per second of an open loop: --perf-arrivals poisson:RATE, or gamma:RATE@B with --burstiness; "
        "it replaces the default closed loop, and is refused beside any other --perf-arrivals",
    )
    vllm.add_argument(
        "--burstiness",
        type=float,
        metavar="B",
        help="with --request-rate: the gaps' gamma shape (1, the default: Poisson; below 1 burstier)",
    )


def perf_args(ns: argparse.Namespace) -> list[str]:
    """The pytest command line that `losscheck perf` runs; `--request-rate` and `--burstiness`
    become the arrival process they name (`--perf-arrivals`)."""
    args = ["--pyargs", "losscheck.plugin.certify", "-m", "perf", "-p", "no:cacheprovider", "-q", "-rfEs"]
    values = {name: getattr(ns, dest(name)) for name in PERF_OPTIONS}
    rate, burstiness = getattr(ns, "request_rate", None), getattr(ns, "burstiness", None)
    if burstiness is not None and rate is None:
        raise OptionError("--burstiness shapes the gaps of --request-rate RATE; give the rate too")
    if rate is not None:
        if values["perf-arrivals"] not in (None, "closed"):  # the default: the closed loop --request-rate replaces
            raise OptionError("--request-rate names the arrival process; leave out --perf-arrivals, or use it alone")
        values["perf-arrivals"] = open_loop(rate, 1.0 if burstiness is None else burstiness).label
    return args + pytest_args(values)


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
