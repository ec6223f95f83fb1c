"""`losscheck bench`: the benchmarks, one subcommand each (`MODES`): `loop` (what `losscheck
bench` alone runs), `cells`, `near-ties`, `pit-memory`.

The flags that chose among them before (`--cells`, `--near-ties`, `--pit-memory VOCAB`, and `--out`,
`--from`, `--memory-budget` given to `bench` itself) still work: they print a deprecation warning
naming the subcommand and go with the first release after 0.1.0.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from losscheck.cli import certify
from losscheck.cli.command import EXIT_PASS, Command, add_commands, parse
from losscheck.errors import LosscheckError
from losscheck.run.options import add_options, dest

LOOP_OUT, CELLS_OUT = Path("reports/bench"), Path("reports/bench-cells")


def add_loop(loop: argparse.ArgumentParser) -> None:
    loop.add_argument("--out", type=Path, default=LOOP_OUT, help="output directory (default: %(default)s)")


def run_loop(ns: argparse.Namespace) -> int:
    from losscheck.perf import bench

    bench.run_benchmarks(ns.out)
    return EXIT_PASS


def add_cells(cells: argparse.ArgumentParser) -> None:
    cells.add_argument("--out", type=Path, default=CELLS_OUT, help="output directory (default: %(default)s)")
    cells.add_argument(
        "--from",
        dest="from_run",
        metavar="RUN",
        help="a written certificate (run directory or certificate.json) instead of running the main job",
    )


def run_cells(ns: argparse.Namespace) -> int:
    """The cost table of a certificate (`losscheck.report.cell_cost`), the main job's, run here
    through `losscheck certify` with its defaults, unless --from names one. Exit status: the main
    job's (0 when it was read, not run)."""
    from losscheck.report import cell_cost

    out, run, wall = ns.out, ns.from_run, None
    status: int = EXIT_PASS
    if run is None:
        started = time.perf_counter()
        status, probe = certify.certify(parse(certify.COMMAND, ["--out", str(out / "certificate")]))
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


def add_near_ties(near_ties: argparse.ArgumentParser) -> None:
    """No options."""


def run_near_ties(ns: argparse.Namespace) -> int:
    from losscheck.perf import bench

    for dtype in ("fp32", "bf16", "fp16"):
        print(json.dumps(bench.margin_noise(dtype).to_json()))
    return EXIT_PASS


def add_pit_memory(pit_memory: argparse.ArgumentParser) -> None:
    pit_memory.add_argument("vocab", metavar="VOCAB", type=int, help="vocabulary of the random model")
    add_options(pit_memory.add_argument, "--", ("memory-budget",))


def run_pit_memory(ns: argparse.Namespace) -> int:
    from losscheck.perf import bench

    print(json.dumps(bench.pit_peak_memory(ns.vocab, getattr(ns, dest("memory-budget"))).to_json()))
    return EXIT_PASS


def add_rollback(rollback: argparse.ArgumentParser) -> None:
    rollback.add_argument(
        "--out", type=Path, default=Path("reports/bench-rollback"), help="output directory (default: %(default)s)"
    )
    rollback.add_argument("--repeats", type=int, default=3, help="runs per variant and k, the median kept")


def run_rollback(ns: argparse.Namespace) -> int:
    from losscheck.perf import rollback

    if ns.repeats < 1:
        raise LosscheckError(f"--repeats must be >= 1, got {ns.repeats}")
    rows = rollback.measure(repeats=ns.repeats)
    written = rollback.write(rows, ns.out)
    print(written[1].read_text(), end="")
    print("wrote " + ", ".join(str(p) for p in written))
    return EXIT_PASS


MODES = (
    Command("loop", "time the loop against plain decoding and HF assisted generation", add_loop, run_loop),
    Command(
        "cells",
        "what each cell of a certificate costs (seconds, target passes and tokens, tokens tested, the share of "
        "each PIT phase) and the totals, in OUT/cost.json and cost.md; runs the main job (`losscheck certify`, "
        "its certificate under OUT/certificate/) unless --from names a certificate",
        add_cells,
        run_cells,
    ),
    Command(
        "near-ties",
        "how far each precision's top-2 logit margins move with the batch shape",
        add_near_ties,
        run_near_ties,
    ),
    Command(
        "rollback",
        "a hybrid target's recurrent state rolled back by checkpoints (the loop's way) against replay: time, "
        "target passes and state memory at each block length, on the bundled hybrid pair",
        add_rollback,
        run_rollback,
    ),
    Command(
        "pit-memory",
        "peak memory of one PIT cell's teacher-forced scoring on a random model of VOCAB tokens",
        add_pit_memory,
        run_pit_memory,
    ),
)
DEFAULT_MODE = "loop"

# The old form, flag -> dest; the first mode flag given chooses, in this order, as it did.
OLD_MODE_FLAGS = {"--cells": "old_cells", "--near-ties": "old_near_ties", "--pit-memory": "old_pit_memory"}
OLD_FLAGS = {**OLD_MODE_FLAGS, "--from": "old_from", "--out": "old_out", "--memory-budget": "old_memory_budget"}


def add_arguments(bench: argparse.ArgumentParser) -> None:
    add_commands(bench.add_subparsers(dest="bench_mode"), MODES)
    old = bench.add_argument_group("deprecated", "the old form of the subcommands; each warns and names its new form")
    old.add_argument("--cells", dest="old_cells", action="store_true", help="bench cells")
    old.add_argument("--from", dest="old_from", metavar="RUN", help="bench cells --from RUN")
    old.add_argument("--near-ties", dest="old_near_ties", action="store_true", help="bench near-ties")
    old.add_argument("--pit-memory", dest="old_pit_memory", metavar="VOCAB", type=int, help="bench pit-memory VOCAB")
    old.add_argument(
        "--memory-budget",
        dest="old_memory_budget",
        metavar="MIB",
        type=int,
        help="bench pit-memory VOCAB --memory-budget MIB",
    )
    old.add_argument(
        "--out", dest="old_out", type=Path, metavar="OUT", help="bench loop --out OUT, bench cells --out OUT"
    )


def run(ns: argparse.Namespace) -> int:
    modes = {mode.name: mode for mode in MODES}
    given = [flag for flag, name in OLD_FLAGS.items() if getattr(ns, name) not in (None, False)]
    if ns.bench_mode is not None:
        if given:
            raise LosscheckError(
                f"{', '.join(given)}: the old form of the subcommands, not with `bench {ns.bench_mode}`"
            )
        return modes[ns.bench_mode].run(ns)
    argv = new_form(ns, given)
    if given:
        print(
            f"losscheck bench: warning: the old form ({', '.join(given)}) is deprecated and goes after 0.1.0; "
            f"use `losscheck bench {shlex.join(argv)}`",
            file=sys.stderr,
        )
    ns.bench_mode = argv[0]
    return modes[ns.bench_mode].run(parse(modes[ns.bench_mode], argv[1:], ns, "losscheck bench"))


def new_form(ns: argparse.Namespace, given: list[str]) -> list[str]:
    """The subcommand's command line (after `bench`) that the old flags `given` stand for; each value
    joined to its option, so that one starting with `-` parses as it did."""
    mode = next((flag.removeprefix("--") for flag in OLD_MODE_FLAGS if flag in given), DEFAULT_MODE)
    if "--from" in given and mode != "cells":
        raise LosscheckError("--from names the certificate of --cells; add --cells")
    argv = [mode]
    if mode == "pit-memory":
        argv.append(str(ns.old_pit_memory))
        argv += [f"--memory-budget={ns.old_memory_budget}"] if ns.old_memory_budget is not None else []
    if mode in ("loop", "cells"):
        argv += [f"--out={ns.old_out}"] if ns.old_out is not None else []
    if mode == "cells":
        argv += [f"--from={ns.old_from}"] if ns.old_from is not None else []
    return argv


COMMAND = Command(
    "bench",
    "the benchmarks: loop (the default: the loop against plain decoding and HF assisted generation), "
    "cells (what each cell costs), near-ties, pit-memory",
    add_arguments,
    run,
)
