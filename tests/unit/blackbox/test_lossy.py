"""Modes lossy by design (`losscheck.engines.lossy`): each one reachable from the command line is
refused by `losscheck certify`'s option check before anything runs, naming the mode, the setting
and `--allow-lossy-mode`; with the flag the options pass and the certificate FAILs, its reason
naming the mode as lossy by design, never as a bug found. No engine is built, no weight loaded."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from losscheck import bundled, cli
from losscheck.engines import lossy
from losscheck.engines.named import ADAPTERS
from losscheck.errors import FLAG_PREFIX_ENV, LosscheckError, OptionError
from losscheck.report import certificate
from losscheck.run.loading import check_options, lossy_configuration
from losscheck.run.options import Options
from tests.support import assert_valid_certificate
from tests.unit.report.test_certificate import manifest, record

FIXTURES = bundled.fixtures_dir()
ASSISTANT = str(FIXTURES / "drafter_a")


def spec(**extra: object) -> str:
    return json.dumps({"method": "ngram", "prompt_lookup_max": 3, "num_speculative_tokens": 2, **extra})


# (the certify command line that sets the mode, the mode's label, the setting the message names)
REACHABLE = {
    "vllm-synthetic": (
        ["--engine", "vllm", "--speculative-config", spec(rejection_sample_method="synthetic")],
        "vLLM synthetic rejection sampling",
        "--speculative-config rejection_sample_method='synthetic'",
    ),
    "vllm-serve-fly": (
        ["--engine", "vllm-serve", "--speculative-config", spec(rejection_sample_method="fly", fly_window_size=1)],
        "vLLM FLy verification",
        "--speculative-config rejection_sample_method='fly', fly_window_size=1",
    ),
    "hf-ensemble": (
        ["--engine", "hf", "--assistant", ASSISTANT, "--engine-arg", "assistant_ensemble_weight=0.5"],
        "transformers static ensemble verification",
        "--engine-arg assistant_ensemble_weight=0.5",
    ),
    "speculators-top-k": (
        ["--drafter", f"speculators:{FIXTURES / 'speculators_eagle3_accept_k2'}"],
        "speculators checkpoint top-k acceptance",
        "--drafter's config.json: verifier_accept_k=2, accept_tolerance=5.0",
    ),
}


def options_of(argv: list[str], allow: bool = False) -> Options:
    """`Options` as `losscheck certify` parses `argv`."""
    from losscheck.run.options import from_parsed

    ns = cli.parser().parse_args(["certify", *argv, *(["--allow-lossy-mode"] if allow else [])])
    return from_parsed(lambda d: getattr(ns, d))


def test_every_adapter_a_mode_names_is_registered():
    named = {a for mode in lossy.LOSSY_MODES for a in mode.adapters}
    assert named and named <= set(ADAPTERS), f"lossy modes name adapters that do not exist: {named - set(ADAPTERS)}"
    for mode in lossy.LOSSY_MODES:
        detectable = mode.where is not lossy.Where.SERVER
        assert (mode.lossy is not None) == detectable, mode.label
        assert mode.keys and mode.values and mode.why and mode.source, mode.label


def test_the_docs_list_every_mode():
    page = (Path(__file__).parents[3] / "docs" / "black-box-engines.md").read_text()
    section = page.split("### Modes lossy by design", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| engine")]
    for mode in lossy.LOSSY_MODES:
        assert any(f"| {mode.engine} | {mode.name} |" in row and f"`{mode.keys[0]}`" in row for row in rows), (
            f"docs/black-box-engines.md lists no row for {mode.label}"
        )


def test_declare_refuses_an_incoherent_or_repeated_mode():
    server = lossy.LossyMode("X", "y", lossy.Where.SERVER, ("k",), "1", "why", "src", adapters=("hf",))
    with pytest.raises(LosscheckError, match="a server mode needs no lossy= and no adapters"):
        lossy.declare(server)
    blind = lossy.LossyMode("X", "y", lossy.Where.ENGINE_ARG, ("k",), "1", "why", "src", ("hf",))
    with pytest.raises(LosscheckError, match="needs lossy= and the adapters"):
        lossy.declare(blind)
    with pytest.raises(LosscheckError, match="already declared"):
        lossy.declare(lossy.LOSSY_MODES[0])


@pytest.mark.parametrize("case", sorted(REACHABLE))
def test_a_lossy_mode_is_refused_before_anything_runs_naming_it_and_the_flag(case, capsys):
    argv, label, setting = REACHABLE[case]
    assert cli.main(["certify", *argv, "--list"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert f"{label} ({setting}) is lossy by design" in err, err
    assert "pass --allow-lossy-mode to run it anyway" in err, err


@pytest.mark.parametrize("case", sorted(REACHABLE))
def test_with_the_flag_the_options_pass_and_the_mode_reaches_the_certificate(case, monkeypatch):
    argv, label, setting = REACHABLE[case]
    options = options_of(argv, allow=True)
    check_options(options, prefix="--")
    assert [f.describe() for f in lossy_configuration(options, "--")] == [f"{label} ({setting})"]
    monkeypatch.setenv(FLAG_PREFIX_ENV, "--")  # as `losscheck certify` runs pytest
    assert certificate.run_meta(options, []).lossy_modes == (f"{label} ({setting})",)


def test_under_pytest_the_refusal_names_the_plugins_options():
    options = Options(engine="vllm", speculative_config=spec(rejection_sample_method="synthetic"))
    with pytest.raises(OptionError) as refused:
        check_options(options)  # the plugin's check, at pytest_configure: a usage error
    assert "(--losscheck-speculative-config rejection_sample_method='synthetic') is lossy by design" in str(
        refused.value
    )
    assert "pass --losscheck-allow-lossy-mode" in str(refused.value)
    check_options(Options(engine="vllm", speculative_config=options.speculative_config, allow_lossy_mode=True))


@pytest.mark.parametrize(
    "argv",
    [
        ["--engine", "vllm", "--speculative-config", spec(rejection_sample_method="standard")],
        ["--engine", "vllm", "--speculative-config", spec(rejection_sample_method="block")],
        ["--engine", "vllm", "--speculative-config", spec()],
        ["--engine", "hf", "--assistant", ASSISTANT, "--engine-arg", "num_assistant_tokens=3"],
        ["--drafter", f"speculators:{FIXTURES / 'speculators_eagle3'}"],
    ],
)
def test_the_lossless_settings_of_the_same_options_are_not_lossy(argv):
    options = options_of(argv)
    assert lossy_configuration(options, "--") == []
    check_options(options, prefix="--")


def test_a_mode_is_looked_for_only_in_the_adapters_it_names():
    # OpenVINO passes unknown keys on as properties: transformers' ensemble weight means nothing there
    config = lossy.Configuration(engine="openvino", engine_args={"assistant_ensemble_weight": 0.5})
    assert lossy.configured(config) == []
    assert [f.mode.engine for f in lossy.configured(lossy.Configuration("hf", {"assistant_ensemble_weight": 0.5}))] == [
        "transformers"
    ]


def test_the_checkpoint_rule_agrees_with_the_drafters_own():
    from dataclasses import asdict

    from losscheck.drafters.speculators_config import GreedyProposal

    (mode,) = [m for m in lossy.LOSSY_MODES if m.where is lossy.Where.CHECKPOINT]
    assert mode.lossy is not None
    for k_top, tolerance in [(1, 0.0), (1, 5.0), (2, 0.0), (2, 5.0), (4, 0.1)]:
        proposal = GreedyProposal(4, k_top, tolerance)
        assert mode.lossy(asdict(proposal)) == proposal.relaxed, (k_top, tolerance)


@pytest.mark.parametrize("weight", ["0", "1", "1.5", "-0.2"])
def test_an_ensemble_weight_outside_0_1_is_a_usage_error(weight):
    argv = ["--engine", "hf", "--assistant", ASSISTANT, "--engine-arg", f"assistant_ensemble_weight={weight}"]
    with pytest.raises(OptionError, match=re.escape("assistant_ensemble_weight=") + ".*need a number in \\(0, 1\\)"):
        check_options(options_of(argv, allow=True), prefix="--")


def test_the_hf_engine_verifies_with_the_weight_it_was_given():
    import torch

    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.hf import HFAssistedEngine, HFOptions
    from losscheck.engines.registry import EngineSpec

    options = ADAPTERS["hf"].parse(EngineSpec("t", ASSISTANT, args={"assistant_ensemble_weight": 0.25}))
    assert options == HFOptions(assistant_ensemble_weight=0.25)
    from transformers import GenerationConfig

    assistant = SimpleNamespace(generation_config=GenerationConfig())
    engine = HFAssistedEngine(torch.nn.Linear(2, 2), assistant, 3, 0, ensemble_weight=0.25)  # type: ignore[arg-type]
    for each in (engine, engine.with_k(2)):
        assert each.generation_config(SamplingParams(temperature=1.0), 8).assistant_ensemble_weight == 0.25
    plain = HFAssistedEngine(torch.nn.Linear(2, 2), assistant, 3, 0)  # type: ignore[arg-type]
    assert plain.generation_config(SamplingParams(temperature=1.0), 8).assistant_ensemble_weight is None


# ---- the verdict ---------------------------------------------------------------------------------

MODE = "vLLM synthetic rejection sampling (--losscheck-speculative-config rejection_sample_method='synthetic')"


def lossy_build(records: list, exit_status: int = 0, interrupted: bool = False):
    import dataclasses

    meta = dataclasses.replace(certificate.run_meta(Options(), []), lossy_modes=(MODE,))
    return certificate.build(meta, [manifest()], records, exit_status, interrupted)


def test_a_lossy_run_whose_cells_all_passed_fails_naming_the_mode(tmp_path):
    cert = lossy_build([record("A-k4-greedy"), record("A-k4-T1")])
    assert cert.verdict == "FAIL" and cert.counts.failed == 0
    assert cert.reason.startswith(f"lossy by design: {MODE}")
    assert "does not make it lossless" in cert.reason and "bug found" not in cert.reason
    assert certificate.headline(cert).startswith(f"losscheck verdict: FAIL — lossy by design: {MODE}")
    run = certificate.write_run(tmp_path, cert)
    written = json.loads((run / "certificate.json").read_text())
    assert_valid_certificate(written)
    assert written["lossy_modes"] == [MODE] and written["verdict"] == "FAIL"
    assert f"lossy by design: {MODE}" in (run / "summary.md").read_text()


def test_a_lossy_runs_failed_cells_are_the_design_not_a_bug_found():
    cert = lossy_build([record("A-k4-greedy"), record("A-k4-T1", passed=False)], exit_status=1)
    assert cert.verdict == "FAIL" and cert.reason.startswith("lossy by design: ")
    assert "its 1 failed or errored cells show that design, not a bug found" in cert.reason


def test_a_lossy_run_interrupted_stays_interrupted_and_a_plain_one_passes():
    assert lossy_build([record("A-k4-greedy")], exit_status=2, interrupted=True).verdict == "INTERRUPTED"
    plain = certificate.build(
        certificate.run_meta(Options(), []), [manifest()], [record("A-k4-greedy"), record("A-k4-T1")], 0, False
    )
    assert plain.verdict == "PASS" and plain.meta.lossy_modes == ()
