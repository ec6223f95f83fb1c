"""The `losscheck` command table: every subcommand is in the table, parsed and listed by --help;
`bench`'s benchmarks are subcommands, and its old flags still reach the same benchmark with the
same options, warning on stderr with the new command line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from losscheck import cli
from losscheck.cli import bench
from losscheck.run.options import DEFAULT_MEMORY_BUDGET_MIB, dest

# Each subcommand with the fewest arguments it parses.
MINIMAL_ARGV = {
    "certify": [],
    "bench": [],
    "families": [],
    "mutants": [],
    "perf": [],
    "export-perf": ["reports/perf-run"],
    "report": ["reports/run"],
    "compare": ["reports/a", "reports/b"],
    "merge": ["reports/a", "reports/b"],
    "verifier-tier": [],
    "selftest": ["gpu"],
    "fixtures": [],
}
BENCH_MODES = ("loop", "cells", "near-ties", "rollback", "pit-memory")


def test_the_table_holds_every_subcommand_once():
    names = [command.name for command in cli.COMMANDS]
    assert names == list(MINIMAL_ARGV) and [mode.name for mode in bench.MODES] == list(BENCH_MODES)


@pytest.mark.parametrize("name", MINIMAL_ARGV)
def test_each_subcommand_parses_to_its_own_entry(name):
    ns = cli.parser().parse_args([name, *MINIMAL_ARGV[name]])
    assert ns.command == name


def test_help_lists_every_subcommand_and_every_benchmark(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n    {name} " in out for name in MINIMAL_ARGV), out
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n    {mode} " in out for mode in BENCH_MODES), out


def test_the_console_script_and_python_m_run_main():
    (script,) = entry_points(group="console_scripts", name="losscheck")
    assert script.load() is cli.main
    done = subprocess.run(
        [sys.executable, "-m", "losscheck.cli", "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and "verifier-tier" in done.stdout, done.stderr


@pytest.fixture
def reached(monkeypatch):
    """The benchmarks replaced by a recorder: (mode, its options) for each one run."""
    seen: list[tuple[str, dict]] = []

    def recorder(name):
        def run(ns):
            keys = {"out", "from_run", "vocab", dest("memory-budget")}
            seen.append((name, {k: v for k, v in vars(ns).items() if k in keys}))
            return 0

        return run

    modes = tuple(dataclasses.replace(mode, run=recorder(mode.name)) for mode in bench.MODES)
    monkeypatch.setattr(bench, "MODES", modes)
    return seen


@pytest.mark.parametrize(
    ("old", "new", "options"),
    [
        (["--out", "x"], ["loop", "--out=x"], {"out": Path("x")}),
        (["--cells"], ["cells"], {"out": bench.CELLS_OUT, "from_run": None}),
        (
            ["--cells", "--from", "run", "--out", "o"],
            ["cells", "--out=o", "--from=run"],
            {"out": Path("o"), "from_run": "run"},
        ),
        (["--near-ties"], ["near-ties"], {}),
        (["--pit-memory", "8"], ["pit-memory", "8"], {"vocab": 8, dest("memory-budget"): DEFAULT_MEMORY_BUDGET_MIB}),
        (
            ["--memory-budget", "512", "--pit-memory", "8"],
            ["pit-memory", "8", "--memory-budget=512"],
            {"vocab": 8, dest("memory-budget"): 512},
        ),
        (["--cells", "--near-ties"], ["cells"], {"out": bench.CELLS_OUT, "from_run": None}),  # --cells chose first
    ],
)
def test_the_old_bench_flags_reach_the_same_benchmark_and_warn(reached, capsys, old, new, options):
    assert cli.main(["bench", *old]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("losscheck bench: warning: the old form (") and "deprecated" in err
    assert f"use `losscheck bench {' '.join(new)}`" in err
    assert cli.main(["bench", *new]) == 0
    assert capsys.readouterr().err == ""
    assert reached[0] == reached[1] == (new[0], options)


def test_bench_alone_runs_the_loop_benchmark_without_a_warning(reached, capsys):
    assert cli.main(["bench"]) == 0
    assert reached == [("loop", {"out": bench.LOOP_OUT})] and capsys.readouterr().err == ""


def test_an_old_value_starting_with_a_dash_keeps_its_meaning(reached, capsys):
    assert cli.main(["bench", "--cells", "--from=-run"]) == 0
    assert "use `losscheck bench cells --from=-run`" in capsys.readouterr().err
    assert reached == [("cells", {"out": bench.CELLS_OUT, "from_run": "-run"})]


def test_old_flags_beside_a_subcommand_are_a_usage_error(reached, capsys):
    assert cli.main(["bench", "--cells", "loop"]) == 2
    assert "losscheck bench: error: --cells: the old form of the subcommands" in capsys.readouterr().err
    assert not reached


def test_a_subcommand_option_is_its_own(capsys):
    """--from belongs to `bench cells`: given to another benchmark it is argparse's usage error."""
    assert cli.main(["bench", "loop", "--from", "run"]) == 2
    assert "unrecognized arguments: --from run" in capsys.readouterr().err


# pytest's exit status -> the one `losscheck` exits with (docs/errors.md): one table for every
# subcommand; pytest's 2 (interrupted) and 4 (usage error) trade places.
PYTEST_TO_LOSSCHECK = {0: 0, 1: 1, 2: 4, 3: 1, 4: 2, 5: 3}
# The subcommands that run pytest, with arguments that reach `pytest.main` without starting workers.
RUNS_PYTEST = {"certify": ["certify", "-n", "0"], "perf": ["perf"]}


@pytest.mark.parametrize("pytest_status", sorted(PYTEST_TO_LOSSCHECK))
@pytest.mark.parametrize("command", sorted(RUNS_PYTEST))
def test_a_subcommand_running_pytest_exits_by_the_shared_table(monkeypatch, command, pytest_status):
    def fake_main(args, plugins=()):
        if pytest_status == 0:  # a passing certification run leaves its verdict, as the plugin does
            for plugin in plugins:
                plugin.verdict = "PASS"
        return pytest_status

    monkeypatch.setattr(pytest, "main", fake_main)
    assert cli.main(RUNS_PYTEST[command]) == PYTEST_TO_LOSSCHECK[pytest_status]


def test_the_exit_statuses_are_one_table():
    assert [(s.name, int(s)) for s in cli.ExitStatus] == [
        ("PASS", 0),
        ("FAIL", 1),
        ("USAGE", 2),
        ("PARTIAL", 3),
        ("INTERRUPTED", 4),
    ]
    assert cli.VERDICT_EXIT == {v: cli.ExitStatus[v] for v in ("PASS", "FAIL", "PARTIAL", "INTERRUPTED")}


def test_ctrl_c_outside_pytest_exits_interrupted(monkeypatch, capsys):
    def interrupted(ns):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_command", interrupted)
    assert cli.main(["fixtures"]) == cli.EXIT_INTERRUPTED
    assert "losscheck fixtures: interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(MINIMAL_ARGV))
def test_help_names_the_options_of_its_own_command(capsys, name):
    assert cli.main([name, "--help"]) == cli.EXIT_PASS
    text = capsys.readouterr().out
    assert "--losscheck-" not in text, f"`losscheck {name} --help` names the pytest plugin's options"
    if name != "perf":
        assert "--perf-" not in text, f"`losscheck {name} --help` lists the perf tier's options"


def test_bench_rollback_refuses_zero_repeats(capsys):
    assert cli.main(["bench", "rollback", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err


def test_the_rollback_table_states_both_variants(tmp_path):
    from losscheck.perf.rollback import RollbackRow, write

    _, md = write([RollbackRow(4, 2.0, 5.0, 45, 204, 24.0, 8.0)], tmp_path)
    assert "| 4 | 2.0 | 5.0 | 2.50 | 45 / 204 | 24.0 / 8.0 |" in md.read_text()


def test_the_engine_help_names_every_registered_adapter_and_no_other():
    """`--engine`'s help lists the shipped adapters by hand (building it from the registry would
    import every adapter module in each process that only parses options); this keeps the list equal
    to the registry's."""
    import re

    from losscheck.engines.named import ADAPTERS
    from losscheck.run.options import SPECS

    listed = re.search(r"a shipped adapter by name \(([^;]+);", str(SPECS["engine"]["help"]))
    assert listed, SPECS["engine"]["help"]
    assert [name.strip() for name in listed.group(1).split(",")] == list(ADAPTERS)
