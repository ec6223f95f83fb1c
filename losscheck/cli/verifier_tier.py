"""`losscheck verifier-tier`: drive a Verifier with synthetic targets and drafts and test its
output law exactly (docs/verifier-tier.md); exit status 1 when a check fails."""

from __future__ import annotations

import argparse

from losscheck.cli.command import EXIT_FAIL, EXIT_PASS, Command
from losscheck.errors import LosscheckError
from losscheck.run.options import add_options, dest

REFERENCE_VERIFIER = "losscheck.verifiers:reference"
TIER_DETECT_TV = 0.01  # the verifier tier's default: its draws are cheap


def add_arguments(tier: argparse.ArgumentParser) -> None:
    which = tier.add_mutually_exclusive_group()
    which.add_argument(
        "--verifier",
        metavar="MOD:FACTORY",
        default=REFERENCE_VERIFIER,
        help="import path of a factory() -> Verifier (default: %(default)s, losscheck's own; e.g. "
        "losscheck.verifiers.hf:speculative_sampling)",
    )
    which.add_argument(
        "--mutant", metavar="NAME", help="instead: the verifier of a planted bug (see `losscheck mutants`)"
    )
    add_options(tier.add_argument, "--", ("seed", "alpha"))
    tier.add_argument(
        "--detect-tv",
        metavar="TV",
        type=float,
        default=TIER_DETECT_TV,
        help="binned TV every χ² test of the tier must detect at power 0.99 (default: %(default)s)",
    )


def run(ns: argparse.Namespace) -> int:
    """The tier's per-check verdicts, draws and draws/s."""
    from losscheck.verifiers.tier import TierConfig, run_tier

    if ns.mutant is not None:
        from losscheck.run.plant import get_plant

        verifier = get_plant(ns.mutant).verifier
        if verifier is None:
            raise LosscheckError(f"--mutant={ns.mutant!r} plants no verifier (it plants another part of the engine)")
        name = f"mutant {ns.mutant}"
    else:
        from losscheck.run.factory import load_verifier

        verifier, name = load_verifier(ns.verifier, "--verifier"), ns.verifier
    config = TierConfig(seed=getattr(ns, dest("seed")), alpha=getattr(ns, dest("alpha")), detect_tv=ns.detect_tv)
    report = run_tier(verifier, config, name)
    print("\n".join(report.lines()))
    return EXIT_PASS if report.passed else EXIT_FAIL


COMMAND = Command(
    "verifier-tier",
    "drive a Verifier with synthetic targets and drafts and test its output law exactly "
    "(docs/verifier-tier.md); exit status 1 when a check fails",
    add_arguments,
    run,
)
