"""The plugin end to end, run by pytest itself (pytester: in process where no process boundary is
the claim, `tests.support.run_in_process`; the interrupted run in a process of its own).

Each run uses the bundled fixtures and selects a few gate cells with -k to stay fast; a run with a
bad option stops before any cell.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from losscheck import bundled
from losscheck.errors import LosscheckError, OptionError
from tests.support import assert_valid_certificate, run_in_process, run_shipped

pytest_plugins = ["pytester"]

HONEST = """
from losscheck.drafters.autoregressive import from_path
from losscheck import bundled

def factory(target):
    return from_path(bundled.fixtures_dir() / "drafter_a", target)
"""

GATE_OUTCOMES = ("passed", "skipped", "failed", "errors", "xpassed", "xfailed")
# The false-failure probability of an honest drafter's statistical gate cell (a lossy drafter's
# cells: tests/cells/drafters/test_lossy_user_drafters.py).
HONEST_FAILS = "<= the cell's alpha (--losscheck-alpha 0.01 split over the gate's statistical tests)"


def run_gate(pytester: pytest.Pytester, module: str, *args: str, in_process: bool = True) -> pytest.RunResult:
    pytester.makepyfile(mydrafter=textwrap.dedent(module))
    pytester.syspathinsert()
    return run_shipped(
        pytester, "-m", "lossless", "--losscheck-drafter=mydrafter:factory", *args, in_process=in_process
    )


def assert_gate(result: pytest.RunResult, false_failure: str, **expected: int) -> None:
    """`result.assert_outcomes(**expected)` for a statistical gate run, its message stating the
    run's false-failure probability."""
    counts = result.parseoutcomes()
    obtained = {k: counts.get(k, 0) for k in GATE_OUTCOMES}
    assert obtained == {k: expected.get(k, 0) for k in GATE_OUTCOMES}, (
        f"gate outcomes {obtained}, expected {expected}; false-failure probability {false_failure}\n"
        + result.stdout.str()[-4000:]
    )


@pytest.mark.e2e
def test_an_external_drafter_selected_under_xdist_passes_and_the_whole_matrix_is_accounted(
    pytester, tmp_path, monkeypatch
):
    """An honest external drafter runs through the same greedy tests and passes a sampling cell, on
    two xdist workers; the run is a selection of three cells, so the certificate says PARTIAL and
    lists every other cell as not run, splits alpha over the full matrix, hashes every model, names
    both workers; JUnit XML and the CI job summary get the per-cell verdicts."""
    out, junit, step_summary = tmp_path / "reports", tmp_path / "out.xml", tmp_path / "step_summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step_summary))
    result = run_gate(
        pytester,
        HONEST,
        "-n",
        "2",
        "-k",
        "user-k4-greedy] or user-k1-greedy] or (test_pit_uniform and user-k4-T0.3)",
        f"--losscheck-out={out}",
        f"--junitxml={junit}",
    )
    assert_gate(result, HONEST_FAILS, passed=3)
    result.stdout.fnmatch_lines(["*losscheck: seed=* drafter=mydrafter:factory*", "*user-k4-greedy*PASS*"])
    result.stdout.fnmatch_lines(["*losscheck verdict: PARTIAL — 3 passed, 0 failed, 0 errored, * not run of * cells*"])
    [run] = list(out.iterdir())
    cert = assert_valid_certificate(json.loads((run / "certificate.json").read_text()))
    assert cert["schema"] == "losscheck.certificate/2" and cert["verdict"] == "PARTIAL"
    status = {m["cell"]: m["status"] for m in cert["matrix"]}
    assert status.pop("user-k4-greedy") == status.pop("user-k1-greedy") == status.pop("user-k4-T0.3") == "passed"
    assert status and set(status.values()) == {"not run"}
    assert "user-k4-T1" in status and "self-k4-greedy" in status
    statistical = sum(1 for m in cert["matrix"] if m["argument"] in ("sampling_cell", "exact_cell", "engine_cell"))
    assert cert["alpha"]["statistical_tests"] == statistical > 0
    assert cert["alpha"]["per_test"] == pytest.approx(0.01 / statistical)
    assert len(cert["targets"]["main"]["sha256"]) == 64
    assert {len(d.get("sha256") or "") for d in cert["drafters"]["main"].values()} == {64}
    assert set(cert["environment"]["workers"]) == {"gw0", "gw1"}
    assert cert["environment"]["losscheck"] and cert["environment"]["device"] == "cpu"
    summary = (run / "summary.md").read_text()
    assert summary.startswith("# losscheck certificate — PARTIAL") and "Not run (" in summary
    assert (run / "slot_acceptance.png").stat().st_size > 0
    assert step_summary.read_text().startswith("# losscheck certificate — PARTIAL")
    xml = junit.read_text()
    assert xml.count('name="losscheck_verdict" value="PASS"') == 3 and 'name="losscheck_tau"' in xml


INTERRUPTER = """
import pytest

calls = []

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    calls.append(item.nodeid)
    if len(calls) == 2:
        raise KeyboardInterrupt
"""


@pytest.mark.e2e
def test_an_interrupted_run_is_certified_interrupted(pytester, tmp_path):
    out = tmp_path / "reports"
    pytester.makepyfile(interrupter=textwrap.dedent(INTERRUPTER))
    selected = ("-k", "user-k2-greedy or user-k1-greedy", f"--losscheck-out={out}")
    result = run_gate(
        pytester, HONEST, "-p", "interrupter", *selected, in_process=False
    )  # the interrupt ends a process
    assert result.ret == pytest.ExitCode.INTERRUPTED
    [run] = list(out.iterdir())
    cert = assert_valid_certificate(json.loads((run / "certificate.json").read_text()))
    assert cert["verdict"] == "INTERRUPTED" and cert["counts"]["passed"] == 1, cert["reason"]
    assert cert["counts"]["not run"] == len(cert["matrix"]) - 1


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args, message",
    [
        (["--losscheck-alpha=2"], "must be in (0, 1)"),
        (["--losscheck-profile=fast"], "invalid choice"),
        (["--losscheck-mutant=residual_not_normalized"], "not a registered planted bug; choose one of: "),
    ],
)
def test_bad_options_are_rejected(pytester, args, message):
    result = run_in_process(pytester, "-p", "no:cacheprovider", *args)
    assert result.ret != 0
    assert message in result.stderr.str()


# Configuration errors: each is one message naming the option and the fix, with no traceback.


def model_dir(root: Path, name: str, **config: object) -> Path:
    """A model directory whose config.json is the bundled target's with `config` changed, and an
    empty weights file (the start-up checks read configs only)."""
    path = root / name
    path.mkdir()
    base = json.loads((bundled.target_path() / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**base, **config}))
    (path / "model.safetensors").write_bytes(b"")
    return path


def assert_one_error(result: pytest.RunResult, message: str, exit_code: int = pytest.ExitCode.USAGE_ERROR) -> None:
    """`message` printed exactly once, no traceback, the run stopped with `exit_code`. pytest's own
    short test summary recaps a collection error's message (whole under CI=true, cut to the
    terminal's width elsewhere), so the count stops where the recap starts."""
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == exit_code, out
    assert out.partition("short test summary info")[0].count(message) == 1, out
    assert "Traceback" not in out and "INTERNALERROR" not in out, out


def run_certify(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return run_shipped(pytester, *args, in_process=True)


NOT_A_DRAFTER = """
def factory(target):
    return 42
"""
RAISES_ON_IMPORT = """
import no_such_dependency
"""


@pytest.mark.e2e
@pytest.mark.parametrize(
    "option, message",
    [
        (
            "--losscheck-target=/nope",
            "--losscheck-target='/nope': no such directory; pass a local Hugging Face model directory",
        ),
        ("--losscheck-drafter=no_such_module:factory", "cannot import module 'no_such_module' (No module named"),
        ("--losscheck-drafter=mydrafter:missing", "module 'mydrafter' has no attribute 'missing'"),
        (
            "--losscheck-drafter=factory",
            "'factory': expected an import path like 'pkg.module:factory' or a local Hugging",
        ),
    ],
)
def test_a_bad_option_is_one_message(pytester, option, message):
    pytester.makepyfile(mydrafter=NOT_A_DRAFTER)
    assert_one_error(run_certify(pytester, option), message)


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"drafter": "broken_on_import:factory"},
            "importing module 'broken_on_import' failed: No module named 'no_such_dependency'",
        ),
        ({"drafter": "./no_such_dir"}, "--losscheck-drafter='./no_such_dir': no such directory"),
        (
            {"engine": "os"},
            "--losscheck-engine='os': no shipped adapter of that name (hf, vllm, vllm+cpu-fixes, vllm-serve, openvino",
        ),
        ({"engine": "os:sep"}, "--losscheck-engine='os:sep' is a str, not a factory(target) -> black-box engine"),
        pytest.param(
            {"out": Path("/proc/losscheck-reports")},
            "--losscheck-out='/proc/losscheck-reports': cannot write in '/proc'",
            marks=pytest.mark.skipif(
                not Path("/proc").is_dir(), reason="needs Linux's /proc, unwritable also for root"
            ),
        ),
    ],
)
def test_what_the_options_name_is_checked_before_a_run(tmp_path, monkeypatch, changes, message):
    """The start-up check itself (`check_options`), on the cases the plugin tests above leave out."""
    from losscheck.run.loading import check_options
    from losscheck.run.options import Options

    (tmp_path / "broken_on_import.py").write_text(RAISES_ON_IMPORT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "broken_on_import", raising=False)
    with pytest.raises(OptionError) as error:
        check_options(Options(**changes))
    assert message in str(error.value)


def test_a_factory_resolves_from_the_current_directory(tmp_path, monkeypatch):
    """The module of `pkg.mod:factory` is found in the working directory even when it is not on
    sys.path (the `pytest` script, unlike `python -m pytest`, leaves it off)."""
    from losscheck.run.loading import load_object

    (tmp_path / "cwd_drafter_module.py").write_text("def factory(target):\n    return target\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_drafter_module", raising=False)
    assert load_object("cwd_drafter_module:factory", "--losscheck-drafter")(7) == 7


@pytest.mark.e2e
def test_a_target_with_its_own_code_needs_trust_remote_code(pytester, tmp_path):
    own_code = {"model_type": "my-own-llm", "auto_map": {"AutoConfig": "conf.C", "AutoModelForCausalLM": "mod.M"}}
    target = model_dir(tmp_path, "own_code", **own_code)
    message = (
        "does not implement model_type 'my-own-llm'; the directory ships its own modelling code "
        "(config.json auto_map): pass --losscheck-trust-remote-code to run it, if you trust it"
    )
    assert_one_error(run_certify(pytester, f"--losscheck-target={target}"), message)


def test_certify_names_its_own_trust_remote_code_option(tmp_path, capsys):
    from losscheck.cli import main

    target = model_dir(tmp_path, "own_code", model_type="my-own-llm", auto_map={"AutoModelForCausalLM": "mod.M"})
    assert main(["certify", "--target", str(target), "--out", str(tmp_path / "reports")]) == 2
    err = capsys.readouterr().err
    assert err.count("pass --trust-remote-code to run it") == 1 and "--losscheck-" not in err, err


@pytest.mark.e2e
def test_bundled_drafters_on_a_target_of_another_vocabulary_ask_for_a_drafter(pytester, tmp_path):
    target = model_dir(tmp_path, "big_vocab", vocab_size=1000)
    message = (
        "has a vocabulary of 1000 tokens and hidden size 128; the bundled drafters are built for the bundled "
        "target's 64 and 128. Name your drafter: --losscheck-drafter=pkg.mod:factory, or "
        "--losscheck-drafter=DIR"
    )
    assert_one_error(run_certify(pytester, f"--losscheck-target={target}"), message)


@pytest.mark.e2e
def test_a_drafter_directory_of_another_vocabulary_is_refused(pytester, tmp_path):
    drafter = model_dir(tmp_path, "big_vocab", vocab_size=1000)
    message = "has a vocabulary of 1000 tokens, the bundled target 64; a drafter must share the target's vocabulary"
    assert_one_error(run_certify(pytester, f"--losscheck-drafter={drafter}"), message)


@pytest.mark.e2e
def test_an_out_directory_that_cannot_be_made_is_refused_at_start(pytester, tmp_path):
    (tmp_path / "taken").write_text("a file")
    message = f"--losscheck-out='{tmp_path / 'taken' / 'run'}': '{tmp_path / 'taken'}' is a file; name a directory"
    assert_one_error(run_certify(pytester, f"--losscheck-out={tmp_path / 'taken' / 'run'}"), message)


@pytest.mark.e2e
def test_a_factory_that_returns_no_drafter_is_one_usage_error_under_xdist(pytester):
    """Found only once the target is loaded and the factory called (no cell runs): a usage error
    like a bad option's, sent by a worker to the controller, not the collection error of whichever
    test module needed the plan first (test_blackbox.py, though no engine was named). Without
    xdist: a case of tests/e2e/test_bad_inputs.py (`losscheck certify -n 0`)."""
    pytester.makepyfile(mydrafter=NOT_A_DRAFTER)
    result = run_certify(pytester, "--losscheck-drafter=mydrafter:factory", "-n", "2")
    message = "--losscheck-drafter='mydrafter:factory' returned int, which lacks"
    assert_one_error(result, message)
    assert f"ERROR: {message}" in result.stderr.str()
    out = result.stdout.str() + result.stderr.str()
    assert "collecting" not in out and "test_blackbox" not in out and "during collection" not in out, out


def test_a_drafter_directory_is_certified_as_family_a():
    """--losscheck-drafter=DIR: the causal LM in DIR drafts autoregressively through family A's
    cells, greedy and sampled (the plan, in process)."""
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    session = Session(Options(drafter=str(bundled.fixtures_dir() / "drafter_a")), skeleton=True)
    cells = {c.id for cells in session.plan.values() for c in cells}
    assert {"user-k1-greedy", "user-k4-greedy", "user-k4-T1"} <= cells, sorted(cells)
    assert not any(c.startswith("A-") for c in cells)  # the user's drafter replaces the bundled ones


def test_fixtures_are_bundled():
    assert (bundled.fixtures_dir() / "target" / "config.json").is_file()


def test_the_fixtures_directory_is_the_variable_then_the_installed_copy_then_the_checkout(tmp_path, monkeypatch):
    installed = tmp_path / "installed"
    (installed / "target").mkdir(parents=True)
    (installed / "target" / "config.json").write_text("{}")
    monkeypatch.delenv("LOSSCHECK_FIXTURES", raising=False)
    assert bundled.fixtures_dir() == bundled.CHECKOUT
    monkeypatch.setattr(bundled, "INSTALLED", installed)
    assert bundled.fixtures_dir() == installed
    monkeypatch.setenv("LOSSCHECK_FIXTURES", str(bundled.CHECKOUT))
    assert bundled.fixtures_dir() == bundled.CHECKOUT
    monkeypatch.setenv("LOSSCHECK_FIXTURES", str(tmp_path))
    with pytest.raises(LosscheckError, match="LOSSCHECK_FIXTURES=.* holds no target/config.json"):
        bundled.fixtures_dir()


def test_losscheck_fixtures_prints_the_directory(capsys, monkeypatch):
    from losscheck.cli import main

    assert main(["fixtures"]) == 0
    assert capsys.readouterr().out == f"{bundled.fixtures_dir()}\n"
    monkeypatch.setenv("LOSSCHECK_FIXTURES", "/nope")
    assert main(["fixtures"]) == 2
    assert "losscheck fixtures: error: LOSSCHECK_FIXTURES='/nope'" in capsys.readouterr().err


def test_the_cli_and_the_plugin_share_option_definitions():
    """`losscheck certify --X` passes `--losscheck-X` on to pytest, with the same parsers."""
    from losscheck.cli import certify_args, parser

    ns = parser().parse_args(
        ["certify", "--seed", "7", "--alpha", "0.05", "--trust-remote-code", "--mutant", "rows_mixed_up", "-n", "2"]
    )
    args = certify_args(ns)
    for expected in (
        "--losscheck-seed=7",
        "--losscheck-alpha=0.05",
        "--losscheck-trust-remote-code",
        "--losscheck-mutant=rows_mixed_up",
        "--losscheck-out=reports",
        "--losscheck-profile=ci",
    ):
        assert expected in args
    assert args[-2:] == ["-n", "2"] and not any(a.startswith("--losscheck-target") for a in args)
    with pytest.raises(SystemExit):
        parser().parse_args(["certify", "--alpha", "1.5"])
