"""Shards end to end: two `losscheck certify --shard I/2` runs of one scope, side by side in
processes of their own, each PARTIAL with its share; `losscheck merge` joins them into the PASS of
the whole scope, whose cells are the plan's, the scope in the certificate's first lines. (The
assignment, the shard's accounting and every refusal of the merge: tests/unit/test_shard.py and
tests/unit/report/test_merge.py; a scoped run's PASS and exit 0 without shards:
tests/e2e/test_examples.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from losscheck import cli
from losscheck.plan.scope import parse_scope
from tests.e2e.test_scope import GREEDY_SCOPE  # the bundled reference set's greedy cells at fp32
from tests.support import assert_valid_certificate


@pytest.mark.e2e
def test_two_shards_merge_into_the_pass_of_the_whole_scope(tmp_path):
    from losscheck.plan.matrix import entries
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    # side by side, as on two runners: one torch thread each, or the two contend for the same cores
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    shards = [
        subprocess.Popen(
            [sys.executable, "-m", "losscheck.cli", "certify", f"--scope={GREEDY_SCOPE}", "--shard", f"{i}/2"]
            + ["-n", "0", "--out", str(tmp_path / f"shard{i}")],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (1, 2)
    ]
    outputs = [shard.communicate(timeout=600)[0] for shard in shards]
    for i, (shard, output) in enumerate(zip(shards, outputs), 1):
        assert shard.returncode == cli.EXIT_PARTIAL, output[-3000:]
        assert f"shard {i}/2: " in output and f"shard {i}/2 certifies" in output
        assert "plan: " in output and "[1/" in output  # the plan up front, a line per cell
    runs = [next((tmp_path / f"shard{i}").iterdir()) for i in (1, 2)]
    held = [assert_valid_certificate(json.loads((run / "certificate.json").read_text()))["shard"] for run in runs]

    assert cli.main(["merge", *map(str, runs), "--out", str(tmp_path / "merged")]) == cli.EXIT_PASS
    (merged,) = (tmp_path / "merged").iterdir()
    cert = assert_valid_certificate(json.loads((merged / "certificate.json").read_text()))
    plan = Session(Options(bundled="reference", scope=parse_scope(GREEDY_SCOPE)), skeleton=True).plan
    planned = [e.cell for e in entries(plan)]
    assert cert["verdict"] == "PASS" and cert["scope"]["declared"] == GREEDY_SCOPE and cert["scope"]["out"]
    assert (merged / "summary.md").read_text().splitlines()[2].startswith(f"scope: {GREEDY_SCOPE}")
    assert sorted(m["cell"] for m in cert["matrix"]) == sorted(planned) == sorted(held[0]["cells"] + held[1]["cells"])
    assert all(m["status"] == "passed" for m in cert["matrix"]) and held[0]["cells"] and held[1]["cells"]
    assert [s["index"] for s in cert["merged"]] == [1, 2]
