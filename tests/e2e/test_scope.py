"""A run's declared scope, engine-only runs, the CLI's exit statuses and progress lines.

The scope is pure planning (`losscheck.plan.scope`), tested on cells directly and on the bundled
reference plan; a scoped run where the split cannot run, end to end in a subprocess (the PASS of
the same scope: tests/e2e/test_shards.py, merged from two shards).
"""

from __future__ import annotations

import dataclasses

import pytest

from losscheck import cli
from losscheck.core.precision import Precision
from losscheck.errors import OptionError
from losscheck.plan import matrix
from losscheck.plan.cell import ENGINE, Cell
from losscheck.plan.scope import Scope, parse_scope
from losscheck.progress import CellProgress
from losscheck.report import certificate
from losscheck.serving.axis import serving
from tests.support import cell_record, manifest_record, run_in_process

pytest_plugins = ["pytester"]

T1 = matrix.SAMPLING_VARIANTS[0]
CELLS = {
    "greedy_cell": [Cell("A", 4, matrix.GREEDY), Cell("A", 4, matrix.GREEDY, serving=serving(split=2))],
    "sampling_cell": [
        Cell("A", 4, T1),
        Cell("A", 4, T1, precision=Precision("bf16", "bf16")),
        Cell("A", 4, T1, stress="argmax"),
    ],
    "engine_cell": [Cell(ENGINE, 4, T1)],
}


def ids(cells: dict[str, list[Cell]]) -> set[str]:
    return {c.id for found in cells.values() for c in found}


def test_the_default_scope_is_the_whole_matrix():
    kept, out = parse_scope(None).split(CELLS, Precision())
    assert ids(kept) == ids(CELLS) and out == [] and Scope().label() == "the whole matrix"


def test_an_aspect_out_leaves_every_cell_along_it_out_with_its_reason():
    kept, out = parse_scope("-split").split(CELLS, Precision())
    assert ids(kept) == ids(CELLS) - {"A-k4-greedy-tp2"}
    assert out == [{"cell": "A-k4-greedy-tp2", "reason": "-split declared out"}]
    kept, out = parse_scope("-precision,-stress").split(CELLS, Precision())
    assert {e["cell"] for e in out} == {"A-k4-T1-bf16", "A-k4-T1-stress-argmax"}


def test_served_out_leaves_the_cells_of_parameters_beyond_temperature_top_k_and_top_p():
    cells = {"sampling_cell": [Cell("A", 4, T1), Cell("A", 4, dataclasses.replace(T1, min_p=0.1, top_k=8))]}
    kept, out = parse_scope("-served").split(cells, Precision())
    assert ids(kept) == {"A-k4-T1"} and [e["reason"] for e in out] == ["-served declared out"]
    with pytest.raises(OptionError, match="adds and leaves out served; keep one of the two terms"):
        parse_scope("+served,-served")


def test_kinds_in_keep_only_those_kinds_and_groups_expand():
    kept, _ = parse_scope("greedy").split(CELLS, Precision())
    assert ids(kept) == {"A-k4-greedy", "A-k4-greedy-tp2"}
    kept, out = parse_scope("engine").split(CELLS, Precision())
    assert ids(kept) == {"engine-k4-T1"}
    assert {e["reason"] for e in out} == {"kind greedy not declared in", "kind pit not declared in"}
    kept, _ = parse_scope("sampling,-precision").split(CELLS, Precision())
    assert ids(kept) == {"A-k4-T1", "A-k4-T1-stress-argmax", "engine-k4-T1"}


@pytest.mark.parametrize(
    ("text", "says"),
    [("gredy", "no kind 'gredy'"), ("greedy,,pit", "empty term"), ("-splitt", "no aspect 'splitt'")],
)
def test_a_bad_scope_is_one_clear_error(text, says):
    from losscheck.plan.scope import serving_axis_names

    with pytest.raises(OptionError, match=says):
        parse_scope(text).check(serving_axis_names())


def test_a_scope_leaves_the_alpha_split_over_the_cells_it_keeps():
    """Cells out of scope leave the matrix before the Bonferroni split: the statistical cells of
    the reference plan without the split are fewer, each one's alpha share larger."""
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    whole = Session(Options(bundled="reference"))
    scoped = whole.derive(scope=parse_scope("-split"))
    scoped.n_statistical  # noqa: B018 (plans)
    split = [e["cell"] for e in scoped.out_of_scope]
    assert split and all("tp2" in c for c in split)
    assert not any("tp2" in c.id for found in scoped.plan.values() for c in found)
    removed = sum(1 for c in split if "greedy" not in c)
    assert scoped.n_statistical == whole.n_statistical - removed
    assert scoped.per_test_alpha > whole.per_test_alpha


def test_an_engine_without_a_drafter_plans_the_engines_cells_only():
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    session = Session(Options(engine="losscheck.engines.spec_loop:spec_loop", bundled="reference"))
    assert session.engine_only
    planned = ids(session.plan)
    assert planned and all(c.startswith("engine-") for c in planned)
    assert session.n_statistical == len(session.plan["engine_cell"])


def meta(scope: str | None):
    from losscheck.run.options import Options

    return dataclasses.replace(certificate.run_meta(Options(seed=1), []), scope_option=scope)


def manifest(cells: list[str], out: list[dict]):
    matrix = [{"cell": c, "mode": "greedy", "argument": "greedy_cell", "slow": False} for c in cells]
    return manifest_record(matrix, "main", out)


def test_a_scoped_pass_names_its_scope_first():
    out = [{"cell": "A-k4-greedy-tp2", "reason": "-split declared out"}]
    records = [cell_record("A-k4-greedy", kind="greedy", passed=True)]
    cert = certificate.build(meta("-split"), [manifest(["A-k4-greedy"], out)], records, 0, False)
    assert cert.verdict == "PASS" and cert.to_json()["scope"]["out"] == out
    assert certificate.headline(cert).startswith("losscheck verdict: PASS of --scope=-split — ")
    summary = certificate.markdown(cert).splitlines()
    assert summary[2].startswith("scope: -split (1 cells in scope; out of scope: 1 cells: -split declared out)")


def test_a_cell_the_hardware_cannot_run_makes_the_run_partial_with_its_reason():
    reason = "cell A-k4-greedy-tp2 cannot run here: 1 CUDA device; declare it out ... --losscheck-scope=-split"
    records = [
        cell_record("A-k4-greedy", kind="greedy", passed=True),
        cell_record("A-k4-greedy-tp2", "skipped", skip_reason=reason),
    ]
    cert = certificate.build(meta(None), [manifest(["A-k4-greedy", "A-k4-greedy-tp2"], [])], records, 0, False)
    assert cert.verdict == "PARTIAL" and "--losscheck-scope=-split" in cert.reason
    assert [m.reason for m in cert.matrix] == [None, reason]


def test_an_unavailable_cell_is_skipped_with_the_scope_that_declares_it_out():
    from losscheck.plugin.certify import certify
    from losscheck.serving.split import SplitUnavailable

    class NoTarget:
        target = "own"
        id = "A-k4-greedy-tp2"

    class Context:
        cell = NoTarget()

    def unavailable(ctx):
        raise SplitUnavailable("split=2 runs one rank per CUDA device and 1 are visible")

    with pytest.raises(pytest.skip.Exception, match=r"--losscheck-scope=-split \(certify: --scope=-split\)"):
        certify(unavailable, Context(), {})


@pytest.mark.parametrize(
    ("status", "verdict", "code"),
    [
        (0, "PASS", 0),
        (1, "FAIL", 1),
        (0, "PARTIAL", 3),
        (2, "INTERRUPTED", 4),
        (4, None, 2),  # pytest's usage error: a bad option
        (5, None, 3),  # a selection that ran no cell
        (3, None, 1),  # pytest's internal error
    ],
)
def test_certify_exit_status(status, verdict, code):
    assert cli.exit_status(status, verdict) == code


def test_progress_lines_count_cells_and_extrapolate_the_time_left():
    lines: list[str] = []
    progress = CellProgress(lines.append, started=0.0)
    progress.collected(["a", "b", "c", "unrelated[x]"])
    progress.planned({"a": 10.0, "b": 10.0, "c": 20.0})
    progress.finished("a", "PASS", 4.0)
    progress.finished("a", "PASS", 4.0)  # a second report of the same cell (teardown) adds nothing
    assert len(lines) == 1 and lines[0].startswith("[1/3] a PASS 4.0 s — ") and "left" in lines[0]
    progress.finished("b", "FAIL", 5.0)
    progress.finished("c", "PASS", 9.0)
    assert lines[-1].startswith("[3/3] c PASS 9.0 s") and "left" not in lines[-1]


# A's greedy cells and the split's (7 cells); the split declared out, A's greedy cells alone
GREEDY_AND_SPLIT = "greedy,-prefix,-batching,-precision,-oracle,-width"
GREEDY_SCOPE = f"{GREEDY_AND_SPLIT},-split"


@pytest.mark.e2e
def test_on_hardware_that_cannot_split_the_run_is_partial_with_the_hint(pytester, monkeypatch):
    """The split cells where the platform cannot split (simulated: the backend check refuses):
    PARTIAL, the reason names --losscheck-scope=-split, and --losscheck-require-pass makes plain
    pytest exit non-zero. Declaring the split out (GREEDY_SCOPE) makes the same cells PASS:
    tests/e2e/test_shards.py. In process: the run reads this process's `split` module, patched
    for the test alone."""
    from losscheck.serving import split

    def no_backend(options, ranks):
        raise split.SplitUnavailable(f"split={ranks} runs one rank per CUDA device and 1 is visible")

    monkeypatch.setattr(split, "_backend", no_backend)
    common = ["--pyargs", "losscheck.plugin.certify", "-m", "lossless", "-p", "no:cacheprovider"]
    common += ["--losscheck-bundled=reference"]
    result = run_in_process(pytester, *common, f"--losscheck-scope={GREEDY_AND_SPLIT}", "--losscheck-require-pass")
    result.stdout.fnmatch_lines(["*losscheck verdict: PARTIAL*could not run here*--losscheck-scope=-split*"])
    assert result.ret == 1


@pytest.mark.parametrize("bundled", ["reference", "all"])
def test_the_weightless_plan_is_the_runs_plan(bundled):
    """`losscheck certify --list` plans the bundled drafters from their declarations (no model
    built) and a target's skeleton (no weight read or hashed): the same cells, in the same order,
    as the run's plan."""
    from losscheck.plan.matrix import entries
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    options = Options(bundled=bundled, scope=parse_scope("-split"))
    listed, run = Session(options, skeleton=True), Session(options)
    assert listed.target("main").model.device.type == "meta"
    assert entries(listed.plan) == entries(run.plan)
    assert listed.out_of_scope == run.out_of_scope
