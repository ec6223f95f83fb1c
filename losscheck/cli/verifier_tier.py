"""`losscheck verifier-tier`: drive a Verifier with synthetic targets and drafts and test its
output law exactly (docs/verifier-tier.md); exit status 1 when a check fails."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, cast

from losscheck.cli.command import EXIT_FAIL, EXIT_PASS, Command
from losscheck.errors import LosscheckError, OptionError
from losscheck.run.options import add_options, dest

if TYPE_CHECKING:
    from losscheck.core.tree import TreeVerifier
    from losscheck.verifiers.tier import TierConfig

REFERENCE_VERIFIER = "losscheck.verifiers:reference"
TREE_REFERENCE = "losscheck.verifiers:tree_reference"
TIER_DETECT_TV = 0.01  # the verifier tier's default: its draws are cheap


def add_arguments(tier: argparse.ArgumentParser) -> None:
    which = tier.add_mutually_exclusive_group()
    which.add_argument(
        "--verifier",
        metavar="MOD:FACTORY",
        help=f"import path of a factory() -> Verifier (default: {REFERENCE_VERIFIER}, losscheck's own; e.g. "
        f"losscheck.verifiers.hf:speculative_sampling); with --tree, a factory() -> TreeVerifier (default: "
        f"{TREE_REFERENCE})",
    )
    which.add_argument(
        "--mutant",
        metavar="NAME",
        help="instead: the verifier of a planted bug (see `losscheck mutants`); with --tree, a planted tree bug: "
        + ", ".join(sorted(_tree_bug_names())),
    )
    tier.add_argument(
        "--tree",
        action="store_true",
        help="the tree tier: a tree verifier over drafted trees (several candidates per slot), its emitted "
        "tokens completed to the tree's depth + 1 and tested against the target's exact law",
    )
    add_options(tier.add_argument, "--", ("seed", "alpha"))
    tier.add_argument(
        "--detect-tv",
        metavar="TV",
        type=float,
        default=TIER_DETECT_TV,
        help="binned TV every χ² test of the tier must detect at power 0.99 (default: %(default)s)",
    )


def _tree_bug_names() -> list[str]:
    from losscheck.selftest.tree_bugs import TREE_BUGS

    return list(TREE_BUGS)


def run(ns: argparse.Namespace) -> int:
    """The tier's per-check verdicts, draws and draws/s."""
    from losscheck.verifiers.tier import TierConfig, run_tier

    config = TierConfig(seed=getattr(ns, dest("seed")), alpha=getattr(ns, dest("alpha")), detect_tv=ns.detect_tv)
    if ns.tree:
        return _run_tree(ns, config)

    if ns.mutant is not None:
        from losscheck.run.plant import get_plant

        verifier = get_plant(ns.mutant).verifier
        if verifier is None:
            raise LosscheckError(f"--mutant={ns.mutant!r} plants no verifier (it plants another part of the engine)")
        name = f"mutant {ns.mutant}"
    else:
        from losscheck.run.factory import load_verifier

        spec = ns.verifier or REFERENCE_VERIFIER
        verifier, name = load_verifier(spec, "--verifier"), spec
    report = run_tier(verifier, config, name)
    print("\n".join(report.lines()))
    return EXIT_PASS if report.passed else EXIT_FAIL


def _run_tree(ns: argparse.Namespace, config: TierConfig) -> int:
    from losscheck.run.factory import load_verifier
    from losscheck.selftest.tree_bugs import TREE_BUGS
    from losscheck.verifiers.tree_tier import run_tree_tier

    if ns.mutant is not None:
        if ns.mutant not in TREE_BUGS:
            raise OptionError(f"--mutant={ns.mutant!r} is not a planted tree bug; with --tree: {', '.join(TREE_BUGS)}")
        verifier, name = TREE_BUGS[ns.mutant], f"mutant {ns.mutant}"
    else:
        spec = ns.verifier or TREE_REFERENCE
        verifier, name = cast("TreeVerifier", load_verifier(spec, "--verifier")), spec
    report = run_tree_tier(verifier, config=config)
    print("\n".join(report.lines(name)))
    return EXIT_PASS if report.passed else EXIT_FAIL


COMMAND = Command(
    "verifier-tier",
    "drive a Verifier with synthetic targets and drafts and test its output law exactly "
    "(docs/verifier-tier.md); exit status 1 when a check fails",
    add_arguments,
    run,
)
