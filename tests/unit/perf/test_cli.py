"""`losscheck perf` is `pytest -m perf` in process with the shared options passed on."""

from __future__ import annotations

import pytest

from losscheck.cli import parser, perf_args


def test_perf_passes_its_options_on_to_the_perf_tier():
    ns = parser().parse_args(
        ["perf", "--perf-profile", "full", "--perf-compare", "old/perf.json", "--precision", "bf16", "--device", "cpu"]
    )
    args = perf_args(ns)
    assert args[:4] == ["--pyargs", "losscheck.plugin.certify", "-m", "perf"] and "-n" not in args
    for expected in (
        "--losscheck-perf-profile=full",
        "--losscheck-perf-compare=old/perf.json",
        "--losscheck-precision=bf16",
        "--losscheck-device=cpu",
        "--losscheck-out=reports",
        "--losscheck-perf-compare-fail=speedup:10%,tau:5%",
    ):
        assert expected in args


def test_a_bad_threshold_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["perf", "--perf-compare-fail", "speed:5%"])
    assert "'speed:5%' is not METRIC:N%" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("verdict", "status", "expected"), [("PASS", 0, 0), ("PARTIAL", 0, 3), ("FAIL", 1, 1), ("INTERRUPTED", 2, 4)]
)
def test_certify_exits_0_only_on_a_pass(monkeypatch, tmp_path, verdict, status, expected):
    """`losscheck certify` reads the certificate's verdict: a run pytest counts as passed whose
    certificate is PARTIAL (cells skipped) is not a certificate to release with: it exits 3."""
    from losscheck import cli
    from losscheck.plugin.hooks import VERDICT_KEY

    def fake_main(args, plugins):
        config = pytest.Config.__new__(pytest.Config)
        config.stash = pytest.Stash()
        config.stash[VERDICT_KEY] = verdict
        for plugin in plugins:
            plugin.pytest_unconfigure(config)
        return status

    monkeypatch.setattr(pytest, "main", fake_main)
    ns = cli.parser().parse_args(["certify", "--out", str(tmp_path), "-n", "0"])
    assert cli.run_command(ns) == expected
    assert "--losscheck-bundled=reference" in cli.certify_args(ns)
