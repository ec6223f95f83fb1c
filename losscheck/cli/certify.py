"""`losscheck certify`: the main job, the lossless tier run by pytest with this command's options
passed on as `--losscheck-*`; its exit status is the certificate's verdict (`VERDICT_EXIT`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pytest

from losscheck.cli.command import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_PARTIAL, EXIT_PASS, Command, from_pytest
from losscheck.errors import FLAG_PREFIX_ENV, OptionError
from losscheck.run.loading import check_options
from losscheck.run.options import SPECS, add_options, dest, from_parsed, pytest_args

if TYPE_CHECKING:
    from losscheck.engines.hardware import Hardware

VERDICT_EXIT = {"PASS": EXIT_PASS, "FAIL": EXIT_FAIL, "PARTIAL": EXIT_PARTIAL, "INTERRUPTED": EXIT_INTERRUPTED}

# The options `losscheck certify` takes: all but the perf tier's own (`perf-*`: `losscheck perf`).
CERTIFY_OPTIONS = tuple(name for name in SPECS if not name.startswith("perf-"))


def add_arguments(cert: argparse.ArgumentParser) -> None:
    add_options(cert.add_argument, "--", CERTIFY_OPTIONS)
    cert.set_defaults(**{dest("out"): "reports", dest("bundled"): "reference"})
    cert.add_argument(
        "--list",
        action="store_true",
        help="print the plan (every cell in scope, its kind and estimated seconds, the cells out of scope) and exit",
    )
    cert.add_argument(
        "--plan-for",
        metavar="HARDWARE",
        type=_hardware,
        default=None,
        help="with --list: the plan on hardware that need not be present, COUNTxNAME-MEMGB (1xH100-80GB, "
        "2xL40S-48GB): each engine instance's and the reference's memory, the instance policy it gets, the "
        "memory of each phase, the axes that need more devices; config.json is enough, no weights",
    )
    cert.add_argument(
        "-n",
        "--workers",
        type=int,
        default=None,
        help="pytest-xdist workers (0 = in process; default: one per core on the CPU, 0 on a GPU)",
    )


def _hardware(text: str) -> Hardware:
    from losscheck.engines.hardware import parse_hardware

    try:
        return parse_hardware(text)
    except OptionError as exc:  # argparse prints it as a usage error and exits 2
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--plan-for={text!r}: ")) from None


def certify_args(ns: argparse.Namespace, extra: Sequence[str] = ()) -> list[str]:
    """The pytest command line that `losscheck certify` runs; `extra`: pytest's own arguments, given
    after `--` (`-k EXPR`, `-x`, `-v`, `--junitxml F`)."""
    args = ["--pyargs", "losscheck.plugin.certify", "-m", "lossless", "-p", "no:cacheprovider", "-q", "-rfE"]
    # this process imported losscheck before pytest started, so pytest cannot rewrite the plugin's
    # asserts and would say so in every run's summary; the cells report through their own messages
    args += ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    args += pytest_args({name: getattr(ns, dest(name)) for name in CERTIFY_OPTIONS})
    if ns.workers:
        args += ["-n", str(ns.workers)]
    return args + list(extra)


def exit_status(pytest_status: int, verdict: str | None) -> int:
    """`losscheck certify`'s exit status from pytest's and the certificate's verdict."""
    if verdict is not None:
        return VERDICT_EXIT[verdict]
    if pytest_status == pytest.ExitCode.OK:
        return EXIT_FAIL  # pytest passed, but no certificate says what was certified
    return from_pytest(pytest_status)


def default_workers(device: str | None) -> int:
    """xdist workers `losscheck certify` starts: one per core on the CPU; in process (0) on an
    accelerator, where every worker would hold its own copy of the models in device memory."""
    from losscheck.core.precision import resolve_device

    return (os.cpu_count() or 1) if resolve_device(device).type == "cpu" else 0


class VerdictProbe:
    """Reads the certificate's verdict and run directory off the pytest run `losscheck certify` starts."""

    verdict: str | None = None
    run_dir: str | None = None

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        from losscheck.plugin.hooks import RUN_DIR_KEY, VERDICT_KEY

        self.verdict = config.stash.get(VERDICT_KEY, None)
        self.run_dir = config.stash.get(RUN_DIR_KEY, None)


def certify(ns: argparse.Namespace) -> tuple[int, VerdictProbe]:
    """`losscheck certify`: its exit status (`VERDICT_EXIT`: 0 only on a PASS) and what the run wrote."""
    # Checked here too, so that messages name this command's options (--target, not
    # --losscheck-target); the plugin's own check then passes.
    options = from_parsed(lambda d: getattr(ns, d))
    hardware = getattr(ns, "plan_for", None)
    if hardware is not None and not getattr(ns, "list", False):
        raise OptionError("--plan-for plans without running: give it with --list")
    check_options(options, prefix="--", weights=hardware is None)  # a plan for other hardware reads configs only
    if options.verifier is not None:
        from losscheck.run.factory import load_verifier

        load_verifier(options.verifier, "--verifier")
    if ns.workers is None:
        ns.workers = default_workers(getattr(ns, dest("device")))
    if getattr(ns, "list", False):  # estimated for the workers the run would start
        from losscheck.report.plan import plan_lines

        print("\n".join(plan_lines(options, full=True, workers=ns.workers, hardware=hardware)))
        return EXIT_PASS, VerdictProbe()
    if ns.workers:  # the workers load the models; in process the plugin prints the plan itself
        from losscheck.report.plan import plan_lines

        print("\n".join(plan_lines(options, full=False, workers=ns.workers)), flush=True)
    probe = VerdictProbe()
    os.environ[FLAG_PREFIX_ENV] = "--"  # messages from the run (and its workers) name this command's options
    try:
        status = int(pytest.main(certify_args(ns, getattr(ns, "pytest_extra", [])), plugins=[probe]))
    finally:
        os.environ.pop(FLAG_PREFIX_ENV, None)
    code = exit_status(status, probe.verdict)
    if code != EXIT_PASS and probe.verdict is not None:  # a certificate is PASS or it is not
        print(f"losscheck certify: verdict {probe.verdict}; exit status {code} (only PASS exits 0)", file=sys.stderr)
    return code, probe


def run(ns: argparse.Namespace) -> int:
    return certify(ns)[0]


COMMAND = Command(
    "certify",
    "certify a drafter (default: the bundled reference drafter, family A, and family E's truncation "
    "widths, on the bundled target; --bundled all: every bundled drafter)",
    add_arguments,
    run,
)
