"""The runnable examples (`examples/`), each certified over a small declared scope, from the
repository root as a user runs them: `losscheck certify ... --scope=...` must PASS (exit 0). The
example engine decodes without a KV cache, row by row: it is certified on two of the bundled
prompts per tier (`--prompts`), as its greedy cell took 26 s on all 48 (2026-12-05)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, few_prompts

# The own drafter: its greedy cells and its quick-tier sampled cells of temperature, top-k and top-p
# on the bundled target (the served parameters' cells are the loop's, tested in tests/cells).
DRAFTER_SCOPE = "-slow,-split,-prefix,-batching,-precision,-stress,-edge,-oracle,-served"


def certify(*args: str, out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "losscheck.cli", "certify", *args, "-n", "0", "--out", str(out)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.e2e
def test_the_own_drafter_example_is_certified(tmp_path):
    done = certify("--drafter", "examples.prompt_lookup_drafter:factory", f"--scope={DRAFTER_SCOPE}", out=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"losscheck verdict: PASS of --scope={DRAFTER_SCOPE}" in done.stdout
    assert "user-k4-T1 " in done.stdout and "user-k8-greedy " in done.stdout  # sampled and greedy cells ran
    assert "PytestAssertRewriteWarning" not in done.stdout + done.stderr  # pytest's, not the user's business


@pytest.mark.e2e
def test_the_own_engine_example_is_certified(tmp_path):
    scope = ("--scope=engine-greedy", "--prompts", str(few_prompts(tmp_path / "prompts.jsonl")))
    done = certify("--engine", "examples.speculative_engine:factory", *scope, out=tmp_path / "reports")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "losscheck verdict: PASS of --scope=engine-greedy — 1 passed" in done.stdout
