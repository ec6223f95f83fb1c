"""A shard's certificate and `losscheck merge`, from hand-made manifests and records (no models):
shards of one plan join into the verdict one run of the scope would have, and anything that is
not one plan's shards is refused with what differs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from losscheck import cli
from losscheck.errors import LosscheckError
from losscheck.plan.shard import Shard, share
from losscheck.report import certificate
from losscheck.report.document import Certificate
from losscheck.report.merge import ShardRun, merge
from losscheck.run.options import Options
from tests.support import assert_valid_certificate, manifest_record
from tests.unit.report.test_certificate import record

# By estimated cost, two shards: A-k4-T1 alone, the two greedy cells together.
MATRIX = [
    {"cell": "A-k4-greedy", "mode": "greedy", "argument": "greedy_cell", "estimated_s": 1.2},
    {"cell": "A-k4-T1", "mode": "pit", "argument": "sampling_cell", "estimated_s": 3.5},
    {"cell": "A-k8-greedy", "mode": "greedy", "argument": "greedy_cell", "estimated_s": 1.5},
]
CELLS = [m["cell"] for m in MATRIX]


def shard_cert(
    index: int,
    count: int = 2,
    seed: int = 1,
    alpha: float = 0.01,
    failed: tuple[str, ...] = (),
    worker: str = "gw0",
    **manifest: object,
) -> Certificate:
    """Shard `index`/`count`'s certificate: its share of MATRIX ran, the cells `failed` failed."""
    found = manifest_record(MATRIX, worker, **manifest)
    shard = Shard(index, count)
    records = [record(cell, passed=cell not in failed) for cell in share(found.matrix, shard)]
    meta = certificate.run_meta(Options(seed=seed, alpha=alpha), ["-m", "lossless", f"--losscheck-shard={shard}"])
    return certificate.build(meta, [found], records, 1 if failed else 0, False, shard)


def runs(*certs: Certificate) -> list[ShardRun]:
    return [ShardRun(f"reports/{i}", cert, Path.cwd()) for i, cert in enumerate(certs, 1)]


def test_a_shard_is_partial_names_its_share_and_the_merge_that_completes_it(tmp_path):
    first, second = shard_cert(1), shard_cert(2)
    assert first.verdict == second.verdict == "PARTIAL"
    assert first.shard is not None and second.shard is not None
    assert (first.shard.cells, second.shard.cells) == (("A-k4-T1",), ("A-k8-greedy", "A-k4-greedy"))
    assert first.shard.plan == second.shard.plan and len(first.shard.plan) == 64
    assert "shard 1/2 certifies 1 of them, the other shards the 2 not run; `losscheck merge`" in first.reason
    assert "- shard 1/2 of plan" in certificate.markdown(first)
    written = assert_valid_certificate(
        json.loads((certificate.write_run(tmp_path, first) / "certificate.json").read_text())
    )
    assert written["shard"]["index"] == 1 and written["merged"] == []
    older = {k: v for k, v in written.items() if k not in ("shard", "merged")}  # a certificate from before shards
    assert Certificate.from_json(older).shard is None


def test_shards_of_one_plan_merge_into_the_verdict_of_the_whole_scope(tmp_path):
    joined = merge(runs(shard_cert(2, worker="main"), shard_cert(1, worker="main")))
    assert joined.verdict == "PASS" and joined.counts.passed == 3 and not joined.problems
    assert [m.cell for m in joined.matrix] == CELLS and joined.shard is None
    assert [(m.shard.index, m.run) for m in joined.merged] == [(1, "reports/2"), (2, "reports/1")]
    assert set(joined.environment.workers) == {"shard 1/2 main", "shard 2/2 main"}
    assert joined.environment.accelerator == "cpu (x86_64)"  # what the runners share stays
    summary = certificate.markdown(joined)
    assert "merged by `losscheck merge` from 2 shards" in summary and "- command:" not in summary
    run = certificate.write_run(tmp_path, joined)
    assert_valid_certificate(json.loads((run / "certificate.json").read_text()))
    assert certificate.load(run).merged == joined.merged


def test_the_merged_certificate_keeps_what_differs_by_runner_with_each_shard():
    other = dataclasses.replace(
        shard_cert(2), environment=dataclasses.replace(shard_cert(2).environment, device="cuda")
    )
    joined = merge(runs(shard_cert(1), other))
    assert joined.environment.device is None
    assert [m.environment.device for m in joined.merged] == ["cpu", "cuda"]


def test_a_failed_cell_in_a_shard_fails_the_merged_certificate():
    joined = merge(runs(shard_cert(1, failed=("A-k4-T1",)), shard_cert(2)))
    assert joined.verdict == "FAIL" and joined.counts.failed == 1 and joined.pytest_exit_status == 1


def test_a_cell_a_shard_left_unrun_leaves_the_merge_partial():
    partial = dataclasses.replace(shard_cert(2), cells=shard_cert(2).cells[:1])
    joined = merge(runs(shard_cert(1), partial))
    assert joined.verdict == "PARTIAL" and joined.counts.not_run == 1


def test_a_shard_without_cells_is_not_needed():
    """Four shards of three cells: the fourth holds none, runs nothing and writes no certificate."""
    joined = merge(runs(*(shard_cert(i, count=4) for i in (1, 2, 3))))
    assert joined.verdict == "PASS" and [m.shard.index for m in joined.merged] == [1, 2, 3]


@pytest.mark.parametrize(
    ("certs", "says"),
    [
        pytest.param(lambda: [shard_cert(1)], r"^shard 2/2 is missing: 2 cells of the plan are in none", id="missing"),
        pytest.param(lambda: [shard_cert(1, count=3)], r"^shards 2/3, 3/3 are missing: 2 cells", id="missing-two"),
        pytest.param(lambda: [shard_cert(1), shard_cert(1)], r"reports/1 and reports/2 are both shard 1/2", id="twice"),
        pytest.param(
            lambda: [shard_cert(1), shard_cert(2, count=3)],
            r"are shards of different counts \(1/2 vs 2/3\): run every shard with the same N in --shard I/N",
            id="count",
        ),
        pytest.param(
            lambda: [shard_cert(1), certificate.build(certificate.run_meta(Options(seed=1), []), [], [], 0, False)],
            r"reports/2 is not a shard's certificate \(run without --shard\)",
            id="unsharded",
        ),
        pytest.param(
            lambda: [merge(runs(shard_cert(1), shard_cert(2)))], r"reports/1 is a merged certificate", id="merged"
        ),
    ],
)
def test_shards_that_are_not_one_plans_are_refused_naming_what_differs(certs, says):
    with pytest.raises(LosscheckError, match=says):
        merge(runs(*certs()))


# shard 2/2 run differently from shard 1/2: what it changes -> what the refusal says
PLANNED_DIFFERENTLY = {
    "seed": (
        {"seed": 2},
        r"reports/1 and reports/2 were run with different seeds \(1 vs 2\): run every shard with the same --seed",
    ),
    "alpha": ({"alpha": 0.05}, r"different alphas \(0.01 vs 0.05\): run every shard with the same --alpha"),
    "models": (
        {"targets": {"main": {"path": "t", "sha256": "c" * 64}}},
        r"reports/1 and reports/2 were planned differently \(plan fingerprint [0-9a-f]{12}… vs [0-9a-f]{12}…",
    ),
    "scope": (
        {"scope": {"declared": "--scope=greedy", "out": []}},
        r"planned differently .*run every shard with the same losscheck, models, --scope",
    ),
}


@pytest.mark.parametrize(("change", "says"), PLANNED_DIFFERENTLY.values(), ids=PLANNED_DIFFERENTLY)
def test_shards_run_with_different_settings_are_refused_naming_the_setting(change, says):
    with pytest.raises(LosscheckError, match=says):
        merge(runs(shard_cert(1), shard_cert(2, **change)))


def test_a_shards_model_paths_stay_pointing_at_the_models(tmp_path):
    """A shard's certificate gives model paths relative to its run directory; the merged one,
    written elsewhere, relative to its own."""
    models = tmp_path / "models" / "t"
    saved = certificate.write_run(tmp_path / "shards" / "a", shard_cert(1, targets={"main": {"path": str(models)}}))
    other = certificate.write_run(tmp_path / "shards" / "b", shard_cert(2, targets={"main": {"path": str(models)}}))
    joined = merge([ShardRun(str(run), certificate.load(run), run) for run in (saved, other)])
    written = certificate.write_run(tmp_path / "merged", joined)
    path = certificate.load(written).targets["main"]["path"]
    assert isinstance(path, str) and (written / path).resolve() == models.resolve()


def test_merge_exits_with_the_verdict_and_refuses_with_exit_status_2(tmp_path, capsys):
    shards = [str(certificate.write_run(tmp_path / f"shard{i}", shard_cert(i))) for i in (1, 2)]
    out = tmp_path / "merged"
    assert cli.main(["merge", *shards, "--out", str(out)]) == cli.EXIT_PASS
    printed = capsys.readouterr().out
    assert "losscheck verdict: PASS — 3 passed" in printed and str(out) in printed
    assert cli.main(["merge", shards[0], "--out", str(out)]) == cli.EXIT_USAGE
    assert "losscheck merge: error: shard 2/2 is missing: 2 cells" in capsys.readouterr().err
