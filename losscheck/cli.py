"""`losscheck`: certify a drafter, run the mutant catalogue, compare families, benchmark the loop,
run the verifier tier, show where the bundled fixtures are.

The options shared with the pytest plugin come from `losscheck.run.options` (same names without the
`--losscheck-` prefix, same help); `certify` passes them on to pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

import losscheck
from losscheck.errors import FLAG_PREFIX_ENV, LosscheckError
from losscheck.run.loading import check_options
from losscheck.run.options import SPECS, add_options, dest, from_parsed, pytest_args

REFERENCE_VERIFIER = "losscheck.verifiers:reference"
TIER_DETECT_TV = 0.01  # the verifier tier's default: its draws are cheap
BENCH_OUT, CELLS_OUT = Path("reports/bench"), Path("reports/bench-cells")  # `losscheck bench`'s outputs
# The options `losscheck mutants` and `losscheck families` take.
EXPERIMENT_OPTIONS = ("seed", "alpha", "profile", "detect-tv", "exact")
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
)


# `losscheck certify`'s exit statuses (docs/certificate-and-ci.md): the verdict's, or a usage error.
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_PARTIAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 4
VERDICT_EXIT = {"PASS": EXIT_PASS, "FAIL": EXIT_FAIL, "PARTIAL": EXIT_PARTIAL, "INTERRUPTED": EXIT_INTERRUPTED}


def certify_args(ns: argparse.Namespace, extra: Sequence[str] = ()) -> list[str]:
    """The pytest command line that `losscheck certify` runs; `extra`: pytest's own arguments, given
    after `--` (`-k EXPR`, `-x`, `-v`, `--junitxml F`)."""
    args = ["--pyargs", "losscheck.plugin.certify", "-m", "lossless", "-p", "no:cacheprovider", "-q", "-rfE"]
    args += pytest_args({name: getattr(ns, dest(name)) for name in SPECS})
    if ns.workers:
        args += ["-n", str(ns.workers)]
    return args + list(extra)


def exit_status(pytest_status: int, verdict: str | None) -> int:
    """`losscheck certify`'s exit status from pytest's and the certificate's verdict."""
    if verdict is not None:
        return VERDICT_EXIT[verdict]
    if pytest_status == pytest.ExitCode.USAGE_ERROR:
        return EXIT_USAGE
    if pytest_status == pytest.ExitCode.INTERRUPTED:
        return EXIT_INTERRUPTED
    if pytest_status == pytest.ExitCode.NO_TESTS_COLLECTED:
        return EXIT_PARTIAL  # a selection that ran no cell certifies nothing
    return EXIT_FAIL


def perf_args(ns: argparse.Namespace) -> list[str]:
    """The pytest command line that `losscheck perf` runs (in process: the tier does not time under xdist)."""
    args = ["--pyargs", "losscheck.plugin.certify", "-m", "perf", "-p", "no:cacheprovider", "-q", "-rfEs"]
    return args + pytest_args({name: getattr(ns, dest(name)) for name in PERF_OPTIONS})


def default_workers(device: str | None) -> int:
    """xdist workers `losscheck certify` starts: one per core on the CPU; in process (0) on an
    accelerator, where every worker would hold its own copy of the models in device memory."""
    from losscheck.core.precision import resolve_device

    return (os.cpu_count() or 1) if resolve_device(device).type == "cpu" else 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="losscheck", description=__doc__)
    top.add_argument("--version", action="version", version=f"losscheck {losscheck.__version__}")
    sub = top.add_subparsers(dest="command", required=True)
    cert = sub.add_parser(
        "certify",
        help="certify a drafter (default: the bundled reference drafter, family A, and family E's truncation "
        "widths, on the bundled target; --bundled all: every bundled drafter)",
    )
    add_options(cert.add_argument, "--")
    cert.set_defaults(**{dest("out"): "reports", dest("bundled"): "reference"})
    cert.add_argument(
        "--list",
        action="store_true",
        help="print the plan (every cell in scope, its kind and estimated seconds, the cells out of scope) and exit",
    )
    cert.add_argument(
        "-n",
        "--workers",
        type=int,
        default=None,
        help="pytest-xdist workers (0 = in process; default: one per core on the CPU, 0 on a GPU)",
    )
    bench = sub.add_parser(
        "bench", help="time the loop against plain decoding and HF assisted generation; --cells: what each cell costs"
    )
    bench.add_argument(
        "--out", help=f"output directory (default: {BENCH_OUT}; with --cells: {CELLS_OUT})", type=Path, default=None
    )
    bench.add_argument(
        "--cells",
        action="store_true",
        help="instead: what each cell of a certificate costs (seconds, target passes and tokens, tokens tested, "
        "the share of each PIT phase) and the totals, in OUT/cost.json and cost.md; runs the main job "
        "(`losscheck certify`, its certificate under OUT/certificate/) unless --from names a certificate",
    )
    bench.add_argument(
        "--from",
        dest="from_run",
        metavar="RUN",
        help="with --cells: a written certificate (run directory or certificate.json) instead of running the main job",
    )
    bench.add_argument(
        "--pit-memory",
        metavar="VOCAB",
        type=int,
        help="instead: peak memory of one PIT cell's teacher-forced scoring on a random model of VOCAB tokens",
    )
    bench.add_argument(
        "--near-ties",
        action="store_true",
        help="instead: how far each precision's top-2 logit margins move with the batch shape",
    )
    add_options(bench.add_argument, "--", ("memory-budget",))
    fam = sub.add_parser("families", help="compare the bundled drafter families' acceptance on the bundled target")
    fam.add_argument("--out", default="reports/families", help="output directory (default: %(default)s)")
    add_options(fam.add_argument, "--", ("seed",))
    fam.add_argument("--ks", type=int, nargs="+", default=[4, 8, 16], help="block lengths (default: 4 8 16)")
    fam.add_argument("--max-new", type=int, default=64, help="new tokens per prompt (default: %(default)s)")
    fam.add_argument("--repeats", type=int, default=16, help="T=1 draws per prompt (default: %(default)s)")
    mut = sub.add_parser("mutants", help="run the gate against the planted-bug catalogue; write the catch table")
    mut.add_argument("names", nargs="*", help="mutants to run (default: the whole catalogue)")
    mut.add_argument("--out", default="reports/mutants", help="output directory (default: %(default)s)")
    add_options(mut.add_argument, "--", EXPERIMENT_OPTIONS)
    mut.add_argument(
        "--all-cells", action="store_true", help="run every cell a mutant shows in, not only up to the first catch"
    )
    mut.add_argument(
        "--stress",
        choices=("on", "off"),
        default="on",
        help="stress cells (default: on); off leaves the catching to the drafter's own cells",
    )
    perf = sub.add_parser(
        "perf",
        help="the perf tier: speedup against concurrency, latency, the HF peer; writes "
        "OUT/perf/perf.json, perf.md and plots",
    )
    add_options(perf.add_argument, "--", PERF_OPTIONS)
    perf.set_defaults(**{dest("out"): "reports"})
    rep = sub.add_parser("report", help="re-render a saved run's summary.md and plots from its certificate.json")
    rep.add_argument("run", help="run directory (reports/<run>) or its certificate.json")
    cmp = sub.add_parser("compare", help="verdict and acceptance differences between two certificates")
    cmp.add_argument("before", help="the earlier run (directory or certificate.json)")
    cmp.add_argument("after", help="the later run; exit status 1 when it regressed")
    cmp.add_argument(
        "--allow-different",
        action="store_true",
        help="compare certificates of different targets, drafters or engines (refused otherwise, exit status 2); "
        "the report opens with what differs",
    )
    tier = sub.add_parser(
        "verifier-tier",
        help="drive a Verifier with synthetic targets and drafts and test its output law exactly "
        "(docs/verifier-tier.md); exit status 1 when a check fails",
    )
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
    sub.add_parser(
        "fixtures", help='print the bundled fixtures directory (e.g. --target "$(losscheck fixtures)/text_target")'
    )
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:  # what follows is pytest's (`losscheck certify ... -- -k EXPR -x`)
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    os.environ[FLAG_PREFIX_ENV] = "--"  # option checks made while parsing name this command's options
    try:
        ns = parser().parse_args(argv)
    except SystemExit as exc:  # argparse's usage errors exit 2; --help and --version 0
        return int(exc.code or 0)
    finally:
        os.environ.pop(FLAG_PREFIX_ENV, None)
    if extra and ns.command != "certify":
        print(f"losscheck {ns.command}: error: only certify passes arguments after -- to pytest", file=sys.stderr)
        return EXIT_USAGE
    ns.pytest_extra = extra
    try:
        return run_command(ns)
    except LosscheckError as exc:  # a configuration problem: its message, not a traceback
        print(f"losscheck {ns.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


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
    check_options(options, prefix="--")
    if options.verifier is not None:
        from losscheck.run.factory import load_verifier

        load_verifier(options.verifier, "--verifier")
    if getattr(ns, "list", False):
        from losscheck.report.plan import plan_lines

        print("\n".join(plan_lines(options, full=True)))
        return EXIT_PASS, VerdictProbe()
    if ns.workers is None:
        ns.workers = default_workers(getattr(ns, dest("device")))
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


def bench_cells(ns: argparse.Namespace) -> int:
    """`losscheck bench --cells`: the cost table of a certificate (`losscheck.report.cell_cost`),
    the main job's, run here through `losscheck certify` with its defaults, unless --from names
    one. Exit status: the main job's (0 when it was read, not run)."""
    from losscheck.report import cell_cost

    out, run, status, wall = ns.out or CELLS_OUT, ns.from_run, 0, None
    if run is None:
        started = time.perf_counter()
        status, probe = certify(parser().parse_args(["certify", "--out", str(out / "certificate")]))
        wall = time.perf_counter() - started
        if probe.run_dir is None:
            raise LosscheckError(f"the main job wrote no certificate (exit status {status}); its output says why")
        run = probe.run_dir
    cert, path = cell_cost.read(run)
    cost = cell_cost.report(cert, path, wall)
    written = cell_cost.write(cost, out)
    print(cell_cost.headline(cost))
    print("wrote " + ", ".join(str(p) for p in written))
    return status


def run_command(ns: argparse.Namespace) -> int:
    if ns.command == "certify":
        return certify(ns)[0]
    if ns.command == "perf":
        check_options(from_parsed(lambda d: getattr(ns, d)), prefix="--")
        return int(pytest.main(perf_args(ns)))
    if ns.command == "report":
        from losscheck.report import certificate
        from losscheck.report.runs import certificate_file

        path = certificate_file(ns.run)
        cert = certificate.load(path)
        written = certificate.render(cert, path.parent)
        print(certificate.headline(cert))
        print("wrote " + ", ".join(str(p) for p in written))
        return 0
    if ns.command == "compare":
        from losscheck.report import certificate, compare
        from losscheck.report.runs import certificate_file

        before, after = (certificate.load(certificate_file(run)) for run in (ns.before, ns.after))
        text, regressed = compare.report(before, after, ns.allow_different)
        print(text, end="")
        return int(regressed)
    if ns.command == "fixtures":
        from losscheck.bundled import fixtures_dir

        print(fixtures_dir())
        return 0
    if ns.command == "mutants":
        from losscheck.selftest.command import run

        return run(Path(ns.out), from_parsed(lambda d: getattr(ns, d)), ns.names, ns.all_cells, ns.stress == "on")
    if ns.command == "verifier-tier":
        return verifier_tier(ns)
    if ns.command == "families":
        from losscheck.perf.families import compare_families

        compare_families(Path(ns.out), getattr(ns, dest("seed")), tuple(ns.ks), ns.max_new, ns.repeats)
        print(f"wrote {ns.out}/table.md, table.json, slot_acceptance.png")
        return 0
    if ns.from_run is not None and not ns.cells:
        raise LosscheckError("--from names the certificate of --cells; add --cells")
    if ns.cells:
        return bench_cells(ns)
    from losscheck.perf import bench

    if ns.near_ties:
        for dtype in ("fp32", "bf16", "fp16"):
            print(json.dumps(bench.margin_noise(dtype).to_json()))
    elif ns.pit_memory:
        print(json.dumps(bench.pit_peak_memory(ns.pit_memory, getattr(ns, dest("memory-budget"))).to_json()))
    else:
        bench.run_benchmarks(ns.out or BENCH_OUT)
    return 0


def verifier_tier(ns: argparse.Namespace) -> int:
    """`losscheck verifier-tier`: the tier's per-check verdicts, draws and draws/s; 1 on a failure."""
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
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
