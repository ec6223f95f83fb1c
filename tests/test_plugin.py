"""The plugin end to end, run by pytest itself (pytester, in a subprocess).

Each run uses the bundled fixtures and selects a few gate cells with -k to stay fast.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from losscheck import bundled
from losscheck.errors import LosscheckError

pytest_plugins = ["pytester"]

HONEST = """
from losscheck.drafters.autoregressive import from_path
from losscheck import bundled

def factory(target):
    return from_path(bundled.fixtures_dir() / "drafter_a", target)
"""

# Proposes its argmax but reports its softmax as q (a real bug of a popular library).
SOFTMAX_Q_FOR_ARGMAX = """
from losscheck import bundled
from losscheck.drafters.autoregressive import AutoregressiveDrafter, from_path
from losscheck.sampling import process_logits

class ArgmaxWithSoftmaxQ(AutoregressiveDrafter):
    def draw(self, logits, ctx):
        q = process_logits(logits, ctx.params)
        return q.argmax(-1), q

def factory(target):
    honest = from_path(bundled.fixtures_dir() / "drafter_a", target)
    return ArgmaxWithSoftmaxQ(honest.lm.model, "argmax-softmax-q")
"""

# Samples at the request's temperature but reports q at temperature 1.
Q_AT_T1 = """
import dataclasses
from losscheck import bundled
from losscheck.drafters.autoregressive import AutoregressiveDrafter, from_path
from losscheck.sampling import SamplingParams, process_logits

class WrongTemperatureQ(AutoregressiveDrafter):
    def draw(self, logits, ctx):
        token, _ = super().draw(logits, ctx)
        return token, process_logits(logits, dataclasses.replace(ctx.params, temperature=1.0))

def factory(target):
    honest = from_path(bundled.fixtures_dir() / "drafter_a", target)
    return WrongTemperatureQ(honest.lm.model, "q-at-T1")
"""

BASE_PIT_CELL = "test_pit_uniform and user-k4-T1 and not T1.5 and not topk and not topp"
GATE_OUTCOMES = ("passed", "skipped", "failed", "errors", "xpassed", "xfailed")
# False-failure probabilities of one statistical gate cell, by what the test expects of it.
HONEST_FAILS = "<= the cell's alpha (--losscheck-alpha 0.01 split over the gate's statistical tests)"
BUG_MISSED = "<= 1 - 0.99 (the gate's power) if the bug moves the law by at least the detectable TV"


def run_gate(pytester: pytest.Pytester, module: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(mydrafter=textwrap.dedent(module))
    pytester.syspathinsert()
    return pytester.runpytest_subprocess(
        "--pyargs", "losscheck.certify", "-m", "lossless", "-p", "no:cacheprovider",
        "--losscheck-drafter=mydrafter:factory", *args,
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


def test_an_external_drafter_runs_through_the_same_greedy_tests(pytester):
    result = run_gate(pytester, HONEST, "-k", "user-k4-greedy or user-k1-greedy")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*losscheck: seed=* drafter=mydrafter:factory*", "*user-k4-greedy*PASS*"])


def test_softmax_q_reported_for_argmax_drafts_fails_the_sampling_gate(pytester):
    result = run_gate(pytester, SOFTMAX_Q_FOR_ARGMAX, "-k", BASE_PIT_CELL)
    assert_gate(result, BUG_MISSED, failed=1)
    result.stdout.fnmatch_lines(["*pit.pooled_* FAILED*p = *alpha = *detects*"])


def test_q_reported_at_the_wrong_temperature_fails_the_sampling_gate(pytester):
    result = run_gate(pytester, Q_AT_T1, "-k", "test_pit_uniform and user-k4-T0.3")
    assert_gate(result, BUG_MISSED, failed=1)
    result.stdout.fnmatch_lines(["*FAILED*p = *alpha = *"])


def test_an_honest_external_drafter_passes_the_sampling_gate(pytester):
    result = run_gate(pytester, HONEST, "-k", "test_pit_uniform and user-k4-T0.3")
    assert_gate(result, HONEST_FAILS, passed=1)


# A black-box engine that drops top-p (a real bug class: sampling parameters lost on one path).
TOP_P_DROPPED_ENGINE = """
import dataclasses
from losscheck.blackbox import spec_loop

class DropsTopP:
    def __init__(self, inner):
        self.inner, self.name = inner, "drops-top-p"
    def generate(self, prompt, n, params, seed, max_new_tokens):
        return self.inner.generate(prompt, n, dataclasses.replace(params, top_p=1.0), seed, max_new_tokens)

def factory(target):
    return DropsTopP(spec_loop(target))
"""


@pytest.mark.parametrize("engine, outcome", [("losscheck.blackbox:spec_loop", "passed"), ("bb:factory", "failed")])
def test_two_sample_mode_for_black_box_engines(pytester, engine, outcome):
    """At --losscheck-detect-tv=0.1 (a few thousand rows a side) to keep the test fast."""
    pytester.makepyfile(bb=textwrap.dedent(TOP_P_DROPPED_ENGINE))
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess(
        "--pyargs", "losscheck.certify", "-p", "no:cacheprovider", "-k", "engine-k0-T1-topp0.9",
        f"--losscheck-engine={engine}", "--losscheck-detect-tv=0.1",
    )
    assert_gate(result, HONEST_FAILS if outcome == "passed" else BUG_MISSED, **{outcome: 1})


def test_certificate_is_written(pytester, tmp_path):
    out = tmp_path / "reports"
    result = run_gate(pytester, HONEST, "-k", "user-k2-greedy", f"--losscheck-out={out}")
    result.assert_outcomes(passed=1)
    [run] = list(out.iterdir())
    cert = json.loads((run / "certificate.json").read_text())
    assert cert["schema"] == "losscheck.certificate/1" and cert["verdict"] == "pass"
    assert len(cert["targets"]["main"]["sha256"]) == 64
    [cell] = cert["cells"]
    assert cell["cell"] == "user-k2-greedy" and cell["passed"] and "acceptance" in cell
    assert (run / "summary.md").read_text().startswith("# losscheck certificate — PASS")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--losscheck-alpha=2"], "must be in (0, 1)"),
        (["--losscheck-profile=fast"], "invalid choice"),
        (["--losscheck-mutant=residual_not_normalized"], "not in the mutant catalogue; choose one of: "),
    ],
)
def test_bad_options_are_rejected(pytester, args, message):
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    assert result.ret != 0
    assert message in result.stderr.str()


def test_an_unimportable_drafter_is_named(pytester):
    result = pytester.runpytest_subprocess("--pyargs", "losscheck.certify", "-p", "no:cacheprovider",
                                           "--losscheck-drafter=no_such_module:factory")
    assert result.ret != 0
    assert "cannot import module 'no_such_module'" in result.stdout.str() + result.stderr.str()


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

    ns = parser().parse_args(["certify", "--seed", "7", "--alpha", "0.05", "--trust-remote-code",
                              "--mutant", "rows_mixed_up", "-n", "2"])
    args = certify_args(ns)
    for expected in ("--losscheck-seed=7", "--losscheck-alpha=0.05", "--losscheck-trust-remote-code",
                     "--losscheck-mutant=rows_mixed_up", "--losscheck-out=reports", "--losscheck-profile=ci"):
        assert expected in args
    assert args[-2:] == ["-n", "2"] and not any(a.startswith("--losscheck-target") for a in args)
    with pytest.raises(SystemExit):
        parser().parse_args(["certify", "--alpha", "1.5"])
