"""The committed timing reports read back as their records: the same JSON, the same Markdown.

A report's record is its only reader (the Markdown, the plots, the compare); a committed file
that no longer reads, or that renders otherwise, means the record changed under it.
"""

from __future__ import annotations

import json

import pytest

from losscheck.errors import LosscheckError
from losscheck.report import bench, families, perf, perf_run
from tests.support import ROOT

REPORTS = ROOT / "reports"


@pytest.mark.parametrize(
    ("data", "markdown_file", "read", "render"),
    [
        ("bench/bench.json", "bench/bench.md", bench.BenchResults.from_json, bench.markdown),
        ("families/table.json", "families/table.md", families.FamiliesTable.from_json, families.markdown),
        ("perf/perf.json", "perf/perf.md", perf_run.load, perf.markdown),
    ],
    ids=["bench", "families", "perf"],
)
def test_a_committed_report_reads_back_to_its_json_and_renders_its_markdown(data, markdown_file, read, render):
    raw = json.loads((REPORTS / data).read_text())
    record = read(REPORTS / data) if read is perf_run.load else read(raw)
    assert record.to_json() == raw
    assert render(record) == (REPORTS / markdown_file).read_text()


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_committed_engine_perf_report_reads_back_and_renders_its_markdown(engine):
    from losscheck.report import engine_perf
    from losscheck.report.engine_perf_record import EnginePerfFile

    folder = REPORTS / f"perf-engine-{engine}"
    raw = json.loads((folder / "perf.json").read_text())
    record = EnginePerfFile.from_json(raw)
    assert record.to_json() == raw
    assert engine_perf.markdown(record) == (folder / "perf.md").read_text()
    assert record.statement == engine_perf.statement(record) and record.statement.startswith("On ")


def test_bench_write_report_writes_what_it_renders(tmp_path):
    results = bench.BenchResults.from_json(json.loads((REPORTS / "bench" / "bench.json").read_text()))
    bench.write_report(results, tmp_path)
    assert bench.BenchResults.from_json(json.loads((tmp_path / "bench.json").read_text())) == results
    assert (tmp_path / "bench.md").read_text() == bench.markdown(results)


def test_a_malformed_bench_row_names_its_path():
    raw = json.loads((REPORTS / "bench" / "bench.json").read_text())
    raw["rows"][2]["speedup"] = "fast"
    with pytest.raises(LosscheckError, match=r"bench_results.rows\[2\].speedup: expected a number, found 'fast'"):
        bench.BenchResults.from_json(raw)
