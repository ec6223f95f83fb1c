"""Black-box mode end to end through the shipped certification tests (pytester, in process:
`tests.support.run_in_process`), with losscheck's own loop as the engine; --losscheck-detect-tv=0.1
keeps the samples small."""

from __future__ import annotations

import textwrap

import pytest

from tests.support import certify_engine

pytestmark = pytest.mark.e2e  # whole plugin runs, each through pytest's own entry point

pytest_plugins = ["pytester"]

HONEST_FAILS = "<= the cell's alpha (--losscheck-alpha 0.01 split over the full matrix)"
BUG_MISSED = "<= 1 - 0.99 (the gate's power) if the bug moves the law by at least the detectable TV"

ENGINES = """
import dataclasses
from losscheck.engines import GenerationRequest
from losscheck.engines.spec_loop import spec_loop

class Wrapped:
    def __init__(self, inner, name, precision="fp32"):
        self.inner, self.name, self.k, self.precision = inner, name, inner.k, precision

    def counters(self):
        return self.inner.counters()

    def draft_model(self):
        return self.inner.draft_model()

class DropsTopP(Wrapped):
    # sampling parameters lost on the speculative path only (a real bug class)
    def generate(self, request):
        if request.speculative:
            request = dataclasses.replace(request, params=dataclasses.replace(request.params, top_p=1.0))
        return self.inner.generate(request)

class NoDraftModel(Wrapped):
    # an honest engine that does not give its draft model
    def generate(self, request):
        return self.inner.generate(request)

    def draft_model(self):
        return None

class Unloadable(Wrapped):
    # an engine whose target losscheck cannot load: two-sample mode
    def generate(self, request):
        return self.inner.generate(request)

class OtherTopP(Wrapped):
    # lossless (on and off alike) but truncating by another rule than losscheck's copy assumes
    def generate(self, request):
        return self.inner.generate(dataclasses.replace(request, params=dataclasses.replace(request.params, top_p=1.0)))

class Hotter(Wrapped):
    # the target side at 1.1 T when speculating: the catalogue's target_temperature_1.1, a law of p alone
    def generate(self, request):
        if request.speculative:
            hotter = dataclasses.replace(request.params, temperature=request.params.temperature * 1.1)
            request = dataclasses.replace(request, params=hotter)
        return self.inner.generate(request)

class OldSignature(Wrapped):
    # written against the six-argument contract of losscheck 0.x
    def generate(self, prompts, n, params, seed, max_new_tokens, speculative):
        request = GenerationRequest(
            prompts=prompts, n=n, params=params, seed=seed, max_new_tokens=max_new_tokens, speculative=speculative
        )
        return self.inner.generate(request)

def hotter(target):
    return Hotter(spec_loop(target), "hotter")

def other_top_p(target):
    return OtherTopP(spec_loop(target), "other-top-p")

def drops_top_p(target):
    return DropsTopP(spec_loop(target), "drops-top-p")

def unloadable(target):
    return Unloadable(spec_loop(target), "unloadable", precision=None)

def no_draft_model(target):
    return NoDraftModel(spec_loop(target), "no-draft-model")

def old_signature(target):
    return OldSignature(spec_loop(target), "old-signature")
"""


def certify(pytester: pytest.Pytester, engine: str, select: str, *extra: str, tv: float = 0.1) -> pytest.RunResult:
    pytester.makepyfile(bb=textwrap.dedent(ENGINES))
    pytester.syspathinsert()
    return certify_engine(pytester, engine, select, f"--losscheck-detect-tv={tv}", *extra, in_process=True)


def outcomes(result: pytest.RunResult, false_failure: str, **expected: int) -> None:
    counts = {k: result.parseoutcomes().get(k, 0) for k in ("passed", "failed", "errors", "skipped")}
    assert counts == {k: expected.get(k, 0) for k in counts}, (
        f"outcomes {counts}, expected {expected}; false-failure probability {false_failure}\n"
        + result.stdout.str()[-4000:]
    )


def test_an_honest_engine_passes_greedy_on_every_prompt_and_one_sample_pit(pytester):
    """losscheck's loop behind the black-box interface passes; it reports logprobs, so the
    one-sample cell checks every generated token's against the reference, none off."""
    import json

    result = certify(
        pytester,
        "losscheck.engines.spec_loop:spec_loop",
        "engine-k4-greedy or engine-k4-T1-topp0.9",
        "--losscheck-out=reports",
    )
    outcomes(result, HONEST_FAILS, passed=2)
    result.stdout.fnmatch_lines(["*engine-k4-greedy*engine-greedy*PASS*", "*engine-k4-T1-topp0.9*one-sample*PASS*"])
    (cert_path,) = (pytester.path / "reports").glob("*/certificate.json")
    (sampled,) = [c for c in json.loads(cert_path.read_text())["cells"] if c["cell"].endswith("topp0.9")]
    assert sampled["logprobs_checked"] > 1000 and sampled["logprobs_off"] == 0, sampled["logprob_worst"]


def test_an_engine_reporting_top_logprobs_has_them_checked_and_one_reading_the_next_position_fails(pytester):
    """An engine that reports each position's top 5 (`ReportsTopLogprobs`: losscheck's loop with a
    scoring pass beside it) has them checked in its one-sample cell, none off; the same engine
    reading each position's top from the next one when drafting fails its cell on them."""
    import json

    honest = certify(
        pytester, "losscheck.selftest.logprob_bugs:spec_loop_top_logprobs", ONLY_T1, "--losscheck-out=reports"
    )
    outcomes(honest, HONEST_FAILS, passed=1)
    (cert_path,) = (pytester.path / "reports").glob("*/certificate.json")
    (sampled,) = json.loads(cert_path.read_text())["cells"]
    assert sampled["top_logprobs"] == 5 and sampled["top_logprobs_checked"] > 1000 and sampled["top_logprobs_off"] == 0
    planted = certify(pytester, "losscheck.selftest.logprob_bugs:top_logprobs_of_next_position", ONLY_T1)
    outcomes(planted, BUG_MISSED, failed=1)
    planted.stdout.fnmatch_lines(
        ["*logprobs: at * positions the reported top 5 ids are not the target's most probable*"]
    )


def test_an_engine_reporting_zero_logprobs_when_speculating_fails_naming_them(pytester):
    """llama.cpp #27972's shape: the tokens are exact, every reported logprob 0.0 with drafting on.
    The one-sample cell's logprob check fails it (an exact check: no false-failure probability
    beyond the float bound's)."""
    result = certify(pytester, "losscheck.selftest.logprob_bugs:logprobs_zero_when_speculating", ONLY_T1)
    outcomes(result, BUG_MISSED, failed=1)
    result.stdout.fnmatch_lines(["*logprobs: *"])


def test_an_old_signature_engine_is_certified_behind_the_shim_with_a_deprecation_warning(pytester):
    result = certify(pytester, "bb:old_signature", "engine-k4-greedy")
    outcomes(result, "0 (no statistics)", passed=1)
    result.stdout.fnmatch_lines(
        [
            "*engine-k4-greedy PASS*",
            "*DeprecationWarning: --losscheck-engine='bb:old_signature' returned OldSignature, whose generate(prompts, "
            "n, params, seed, max_new_tokens, speculative) is the old engine contract: write generate(self, "
            "request: losscheck.engines.GenerationRequest)*",
        ]
    )


def test_an_engine_that_drops_top_p_when_speculating_fails_blamed_on_speculation(pytester):
    result = certify(pytester, "bb:drops_top_p", "engine-k4-T1-topp0.9")
    outcomes(result, BUG_MISSED, failed=1)
    result.stdout.fnmatch_lines(["*speculation changes the engine's output law*"])
    result.stdout.fnmatch_lines(["*FAILED*engine-k4-T1-topp0.9*"])


ONLY_T1 = "engine-k4-T1 and not topk and not topp and not T1.5 and not two"


def test_a_planted_residual_bug_fails_through_the_draft_model_blamed_on_speculation(pytester):
    """losscheck's loop with the recovered token drawn from p, behind the black-box interface: the
    round filter over its draft model rejects it (rounds.residual_is_p) and the second stage's
    speculation-off rows confirm speculation is to blame."""
    import json

    result = certify(pytester, "losscheck.selftest.engines:residual_is_p", ONLY_T1, "--losscheck-out=reports")
    outcomes(result, BUG_MISSED, failed=1)
    (cert_path,) = (pytester.path / "reports").glob("*/certificate.json")
    (record,) = json.loads(cert_path.read_text())["cells"]
    attribution = record["attribution"]
    # the class's own test rejects (others may too), and its row score is compared in the second stage
    assert attribution["finding"] == "speculation" and "rounds.residual_is_p" in attribution["scores"]
    assert any(f.startswith("rounds.residual_is_p (p = ") for f in attribution["first_stage_failed"])
    assert record["phases"]["generate attribution (off)"] >= 0 and "generate pilot (on)" in record["phases"]


def test_one_sample_cells_are_sized_by_the_bug_classes_they_judge(pytester):
    """The pooled tests alone (detect TV 0.1) size the cell for a few hundred rows; the classes it
    judges (laws of p alone, and the verifier's through the engine's draft model) size it for more,
    and an engine that runs its target 1.1x hotter when speculating — the catalogue's
    target_temperature_1.1 — fails. The record gives each class's power and curve from the tested
    sample's own p and q, and names the classes it has no power against."""
    import json

    from losscheck.plan.profiles import get_profile
    from losscheck.stats import sample_size

    result = certify(pytester, "bb:hotter", ONLY_T1, "--losscheck-out=reports")
    outcomes(result, BUG_MISSED, failed=1)
    (cert_path,) = (pytester.path / "reports").glob("*/certificate.json")
    cert = json.loads(cert_path.read_text())
    (record,) = cert["cells"]
    profile = get_profile("ci")
    half = cert["alpha"]["per_test"] / 2  # the speculative side's share
    pooled = sample_size.pit_sequences(half, profile.power, 0.1, profile.pit_bins, record["horizon"])
    assert record["sequences"] > pooled * 1.5, (record["sequences"], pooled)
    classes = record["bug_classes"]
    rounds = {"residual_is_p", "bonus_from_previous_slot", "top_p_one_side"}
    assert set(classes) == {"target_temperature_1.1", "per_request_params_mixed"} | rounds
    for name in ("target_temperature_1.1", *rounds):
        assert classes[name]["covered"] and classes[name]["power"] >= 0.99 and classes[name]["curve"]["0.99"] <= 1
    # and at T = 1 with nothing processed the draft model has no other q: the q-contract classes
    q_contract = {"q_raw_in_verify", "q_raw_in_draft"}
    assert (
        set(record["classes_not_judged"]) == {"stale_q", "drafter_misreports_one_id", "draft_noise_reused"} | q_contract
    )
    counted = record["engine_counters"]  # the engine's own counts of the cell's speculative calls
    assert counted["drafts"] > record["sequences"] and counted["drafted"] == 4 * counted["drafts"]
    assert len(counted["accepted_per_position"]) == 4 and sum(counted["accepted_per_position"]) == counted["accepted"]
    summary = (cert_path.parent / "summary.md").read_text()
    assert "not claimed for them: `stale_q` (its law reads the previous round's q" in summary


def test_an_engine_without_its_draft_model_is_certified_without_the_verifier_classes(pytester):
    import json

    result = certify(pytester, "bb:no_draft_model", ONLY_T1, "--losscheck-out=reports")
    outcomes(result, HONEST_FAILS, passed=1)
    (cert_path,) = (pytester.path / "reports").glob("*/certificate.json")
    (record,) = json.loads(cert_path.read_text())["cells"]
    assert set(record["bug_classes"]) == {"target_temperature_1.1", "per_request_params_mixed"}
    assert "teacher-force" in record["classes_not_judged"]["residual_is_p"]
    assert not any(r["name"].startswith("rounds.") for r in record["verdict"]["results"])


def test_an_engine_without_a_loadable_target_is_compared_with_itself_two_sample(pytester):
    # both sides sampled: a coarser detectable TV keeps the cell small (an honest engine passes at any size)
    result = certify(pytester, "bb:unloadable", "engine-k4-T1-topp0.9-two-sample", tv=0.2)
    outcomes(result, HONEST_FAILS, passed=1)
    result.stdout.fnmatch_lines(["*engine-k4-T1-topp0.9-two-sample*two-sample*PASS*"])


def test_a_lossless_engine_whose_reference_differs_passes_on_its_second_stage_not_blamed(pytester):
    """Speculation on and off truncate alike, by another rule than losscheck's copy assumes: the
    first stage rejects against the reference, the second finds no difference between the sides,
    and the cell passes on it, its record saying the reference differs, its class claims the
    second stage's own power (a class it cannot reach withdrawn by name)."""
    import json

    result = certify(pytester, "bb:other_top_p", "engine-k4-T1-topp0.9", "--losscheck-out=reports")
    outcomes(result, HONEST_FAILS, passed=1)
    (cert_path,) = (pytester.path / "reports").glob("*/certificate.json")
    (record,) = json.loads(cert_path.read_text())["cells"]
    assert record["attribution"]["finding"] == "reference" and record["attribution"]["first_stage_failed"]
    claims = record["bug_classes"]
    assert all(c["power"] == c["second_stage_power"] for c in claims.values()), claims
    assert any(c["covered"] for c in claims.values()), claims
    assert all(c["power"] >= 0.99 for c in claims.values() if c["covered"]), claims
    assert all(c["withdrawn"] for c in claims.values() if c["reach"] == "covered" and c["power"] < 0.99), claims
    assert all(r["name"].startswith("attribution.") for r in record["verdict"]["results"])
    summary = (cert_path.parent / "summary.md").read_text()
    assert "engine-k4-T1-topp0.9: the reference differs from the engine, judged two-sample" in summary
