"""`--engine sglang` through the shipped certification tests (pytester, in process) against the
self-test package's stand-in with SGLang's offline surface (`losscheck.selftest.fake_sglang`; no
build of SGLang runs on a CPU here): greedy and one-sample T = 1 pass, the per-request counters
reach the certificate (the adapter's mapping and its option errors: the unit tests)."""

from __future__ import annotations

import json

from losscheck import bundled
from tests.support import run_shipped

pytest_plugins = ["pytester"]

FAKE = "losscheck_engine_class=losscheck.selftest.fake_sglang:Engine"


def _config(k: int = 4) -> str:
    return json.dumps(
        {
            "speculative_algorithm": "STANDALONE",
            "speculative_draft_model_path": str(bundled.fixtures_dir() / "drafter_a"),
            "speculative_num_steps": k,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": k + 1,
        }
    )


def test_the_sglang_adapter_certifies_greedy_and_t1_with_the_requests_counters(pytester):
    result = run_shipped(
        pytester,
        "-m",
        "lossless",
        "-k",
        "engine-k4-greedy] or engine-k4-T1]",
        "--losscheck-engine=sglang",
        f"--losscheck-speculative-config={_config()}",
        f"--losscheck-engine-arg={FAKE}",
        f"--losscheck-out={pytester.path / 'out'}",
        in_process=True,
    )
    out = result.stdout.str()
    assert result.ret == 0, out[-3000:]
    result.assert_outcomes(passed=2)
    assert "engine-k4-greedy  engine-greedy  PASS" in out and "engine-k4-T1      one-sample     PASS" in out
    (certificate,) = (pytester.path / "out").glob("*/certificate.json")
    record = json.loads(certificate.read_text())
    assert record["engine"]["name"].startswith("sglang[STANDALONE](k=4)")
    counted = [cell["engine_counters"] for cell in record["cells"]]
    assert len(counted) == 2
    for c in counted:  # every round drafts k = 4 and emits what it accepted and one more, or fewer at a row's end
        assert c["drafted"] == 4 * c["drafts"] and 0 < c["accepted"] <= c["drafted"]
        assert c["accepted"] < c["emitted"] <= c["accepted"] + c["drafts"]
