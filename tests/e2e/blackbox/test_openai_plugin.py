"""`--engine openai` through the shipped certification tests (pytester, in process) against two
fake OpenAI-compatible servers of the self-test package, running in this process: the spec side
ignores per-request seeds, so its greedy cell runs and passes and its sampled cell is not run, the
reason named (the adapter's rows and probes in detail: tests/unit/blackbox/test_openai.py)."""

from __future__ import annotations

from losscheck.selftest.fake_openai import Behaviour, FakeOpenAI
from tests.support import run_shipped

pytest_plugins = ["pytester"]


def test_a_server_without_seeds_passes_greedy_and_its_sampled_cell_is_not_run_by_name(pytester):
    toy = {"vocab": 64, "eos": 1}  # the bundled target's vocabulary and EOS
    with FakeOpenAI(Behaviour(**toy, seeds=False)) as spec, FakeOpenAI(Behaviour(**toy)) as plain:  # type: ignore[arg-type]
        args = [f"base_url={spec.url}", f"plain_base_url={plain.url}", "k=4"]
        result = run_shipped(
            pytester,
            "-m",
            "lossless",
            "-rs",
            "-k",
            "engine-k4-greedy or engine-k4-T1-two",
            "--losscheck-engine=openai",
            *(f"--losscheck-engine-arg={a}" for a in args),
            in_process=True,
        )
    out = result.stdout.str()
    assert result.ret == 0, out[-3000:]
    result.assert_outcomes(passed=1, skipped=1)
    assert "engine-k4-greedy-two-sample  engine-greedy  PASS" in out
    reason = (
        f"cell engine-k4-T1-two-sample cannot run here: engine 'openai' cannot draw a sampled cell reproducibly "
        f"from {spec.url}: it ignores the per-request seed"
    )
    assert "engine-k4-T1-two-sample      ?              NOT RUN" in out
    assert reason in out and "losscheck verdict: PARTIAL" in out
