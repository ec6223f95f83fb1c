"""An engine's perf run, without an engine: arrival processes, the driver over a scripted stream,
the whole-call fallback, the accounting checks, the run file and its report."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from losscheck.core.sampling import SamplingParams
from losscheck.engines.counters import EngineCounters
from losscheck.engines.request import GenerationRequest
from losscheck.engines.stream import CallStream, Emission, open_stream
from losscheck.errors import LosscheckError, OptionError
from losscheck.perf.engine_serving import drive, engine_trace_problems
from losscheck.perf.workload import Request
from losscheck.plan.arrivals import CLOSED, Arrivals, parse_arrivals, parse_concurrency

EOS = 1
T1 = SamplingParams()


def test_arrivals_parse_and_name_themselves():
    found = parse_arrivals("closed, poisson:4,burst:8@2.5,gamma:4@0.5,gamma:3@1")
    gamma = Arrivals("gamma", rate=4.0, burstiness=0.5)
    assert found == (
        CLOSED,
        Arrivals("poisson", rate=4.0),
        Arrivals("burst", size=8, period=2.5),
        gamma,
        Arrivals("poisson", rate=3.0),
    )
    assert [a.label for a in found] == ["closed", "poisson:4", "burst:8@2.5", "gamma:4@0.5", "poisson:3"]
    assert parse_concurrency("16,1,4,4") == (1, 4, 16)


@pytest.mark.parametrize(
    "text",
    ["", "open", "poisson", "poisson:0", "poisson:x", "burst:0@1", "burst:4", "closed:2", "gamma:4", "gamma:4@0"],
)
def test_a_bad_arrival_process_is_named(text):
    with pytest.raises(OptionError, match="perf-arrivals"):
        parse_arrivals(text)


@pytest.mark.parametrize("text", ["", "0,1", "a", "-2"])
def test_a_bad_ladder_is_named(text):
    with pytest.raises(OptionError, match="perf-concurrency"):
        parse_concurrency(text)


def test_arrival_times():
    assert CLOSED.times(3, np.random.default_rng(0)) == [0.0, 0.0, 0.0]
    assert Arrivals("burst", size=2, period=1.5).times(5, np.random.default_rng(0)) == [0, 0, 1.5, 1.5, 3.0]
    times = Arrivals("poisson", rate=50.0).times(4000, np.random.default_rng(1))
    assert all(b >= a for a, b in zip(times, times[1:]))
    # mean gap 1/50 s: 4,000 exponential gaps put the mean within 5% (sd of the mean 1.6%)
    assert times[-1] / 4000 == pytest.approx(1 / 50, rel=0.05)
    assert times == Arrivals("poisson", rate=50.0).times(4000, np.random.default_rng(1))
    # gamma gaps of shape 0.25 (vLLM's burstiness): the same mean gap, a coefficient of variation of
    # 1/sqrt(0.25) = 2 against the exponential's 1; 4,000 gaps put each within 10%
    gaps = np.diff([0.0, *Arrivals("gamma", rate=50.0, burstiness=0.25).times(4000, np.random.default_rng(2))])
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.1) and gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)


def test_vllm_bench_flags_name_the_arrival_process():
    from losscheck import cli
    from losscheck.cli.perf import perf_args

    def arrivals(*argv: str) -> str:
        args = perf_args(cli.parser().parse_args(["perf", *argv]))
        return next(a for a in args if a.startswith("--losscheck-perf-arrivals="))

    assert arrivals("--request-rate", "4") == "--losscheck-perf-arrivals=poisson:4"
    assert arrivals("--request-rate", "4", "--burstiness", "0.5") == "--losscheck-perf-arrivals=gamma:4@0.5"
    assert cli.main(["perf", "--burstiness", "0.5"]) == cli.EXIT_USAGE
    assert cli.main(["perf", "--request-rate", "4", "--perf-arrivals", "burst:8@2"]) == cli.EXIT_USAGE
    assert cli.main(["perf", "--request-rate", "0"]) == cli.EXIT_USAGE


class ScriptedStream:
    """A concurrent stream that emits `chunk` tokens a step per running request (token 7, EOS
    never), as a speculative engine emitting τ = chunk per round would; counts its steps."""

    concurrent = True

    def __init__(self, chunk: int = 3, drop: bool = False, overrun: int = 0) -> None:
        self.chunk, self.drop, self.overrun = chunk, drop, overrun
        self.running: dict[int, int] = {}  # request -> tokens left
        self.added: list[tuple[int, int]] = []  # (request, seed)
        self.max_running = 0

    def add(self, request, prompt, max_new_tokens, params, seed):
        self.running[request] = max_new_tokens + self.overrun
        self.added.append((request, seed))

    def step(self):
        import time

        self.max_running = max(self.max_running, len(self.running))
        if self.drop:
            self.running.clear()
            return []
        now, out = time.perf_counter(), []
        for request, left in list(self.running.items()):
            n = min(self.chunk, left)
            self.running[request] = left - n
            out.append(Emission(request, now, (7,) * n, left == n))
            if left == n:
                del self.running[request]
        return out

    def busy(self):
        return bool(self.running)

    def counters(self):
        return EngineCounters(drafts=4, drafted=16, accepted=8, accepted_per_position=(4, 2, 1, 1))


def _requests(n, budget=7):
    return [Request([0, 2, i + 3], budget, "low") for i in range(n)]


def test_the_driver_keeps_the_concurrency_and_every_token():
    stream = ScriptedStream(chunk=3)
    trace = drive(stream, _requests(6), [0.0] * 6, 2, T1, list(range(100, 106)))
    assert stream.max_running == 2 and [seed for _, seed in stream.added] == list(range(100, 106))
    assert [r.output_tokens for r in trace.requests] == [7] * 6
    assert all([n for _, n in r.events] == [3, 3, 1] for r in trace.requests)
    assert engine_trace_problems(trace, EOS, k=4) == []
    assert trace.wall_s > 0 and trace.counters is not None and trace.counters.tau == 3.0


def test_an_open_loop_admits_no_request_before_it_arrives():
    arrivals = [0.0, 0.05, 0.10]
    trace = drive(ScriptedStream(), _requests(3), arrivals, 3, T1, [0, 1, 2])
    assert all(r.admitted >= a for r, a in zip(trace.requests, arrivals))
    assert trace.requests[2].admitted < 0.10 + 0.05  # admitted soon after it arrived


def test_the_accounting_checks_catch_an_engine_past_its_budget_and_a_bad_tau():
    trace = drive(ScriptedStream(overrun=2), _requests(2), [0.0, 0.0], 2, T1, [0, 1])
    problems = engine_trace_problems(trace, EOS, k=1)
    assert any("emitted 9 tokens with a budget of 7" in p for p in problems), problems
    assert any("acceptance length 3.000" in p and "outside [1, 2]" in p for p in problems), problems


def test_an_engine_that_drops_requests_is_an_error():
    with pytest.raises(LosscheckError, match=r"requests \[0, 1\] unanswered"):
        drive(ScriptedStream(drop=True), _requests(2), [0.0, 0.0], 2, T1, [0, 1])


def test_a_one_at_a_time_stream_is_not_timed_above_concurrency_1():
    engine = _Echo()
    with pytest.raises(LosscheckError, match="one request at a time"):
        drive(open_stream(engine, True, EOS), _requests(2), [0.0, 0.0], 2, T1, [0, 1])


class _Echo:
    """A black-box engine without a stream: row = 5, 6, 5, 6, ... then EOS after 5 tokens; counts
    one draft per call on the speculative side."""

    name, k, precision = "echo", 2, None

    def __init__(self) -> None:
        self.calls: list[GenerationRequest] = []

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        self.calls.append(request)
        out = torch.full(request.shape, EOS, dtype=torch.long)
        width = min(4, request.max_new_tokens)
        out[..., :width] = torch.tensor([5, 6, 5, 6][:width])
        return out

    def counters(self) -> EngineCounters:
        drafts = sum(r.speculative for r in self.calls)
        return EngineCounters(drafts=drafts, drafted=2 * drafts, accepted=drafts, accepted_per_position=(drafts, 0))


def test_an_engine_without_a_stream_is_timed_by_whole_calls():
    engine = _Echo()
    engine.generate(GenerationRequest(prompts=((0,),), n=1, params=T1, seed=0, max_new_tokens=3, speculative=True))
    stream = open_stream(engine, True, EOS)
    assert isinstance(stream, CallStream) and not stream.concurrent
    trace = drive(stream, _requests(3), [0.0] * 3, 1, T1, [4, 5, 6])
    assert [c.seed for c in engine.calls[1:]] == [4, 5, 6] and all(c.speculative for c in engine.calls[1:])
    assert [r.tokens for r in trace.requests] == [[5, 6, 5, 6, EOS]] * 3  # cut after EOS
    assert all(len(r.events) == 1 for r in trace.requests)  # one emission: the whole call
    assert trace.counters == EngineCounters(drafts=3, drafted=6, accepted=3, accepted_per_position=(3, 0))
    assert engine_trace_problems(trace, EOS, k=2) == []
    assert open_stream(engine, False, EOS).counters() is None


def test_the_run_file_round_trips_and_its_report_says_what_it_supports():
    import dataclasses

    from losscheck.perf.engine_suite import _record
    from losscheck.report.engine_perf import markdown, statement
    from losscheck.report.engine_perf_record import EnginePerfFile

    requests = _requests(4)
    runs = [drive(ScriptedStream(chunk=c), requests, [0.0] * 4, 2, T1, [0, 1, 2, 3]) for c in (1, 3, 1, 3)]
    rung = _record("ladder", CLOSED, 2, 4, requests, runs, paired=True)
    # the on runs' counters summed: 8 rounds, 16 of 32 drafts accepted, (8, 4, 2, 2) per position
    assert rung.counters == EngineCounters(drafts=8, drafted=32, accepted=16, accepted_per_position=(8, 4, 2, 2))
    assert rung.tau == 3.0 and rung.cumulative_acceptance == (1.0, 0.5, 0.25, 0.25)
    assert rung.conditional_acceptance == (1.0, 0.5, 0.5, 1.0) and rung.wasted_fraction == 0.5
    assert rung.speedup.ratio > 0 and math.isfinite(rung.speedup.ratio) and rung.k == 4
    engine = {"name": "scripted(k=4)", "k": 4, "package": {"scripted": "1.0"}}
    target = {"name": "target", "sha256": "ab" * 32}
    doc = dataclasses.replace(_engine_doc(rung), engine=engine, target=target)
    said = statement(doc)
    assert said.startswith("On cpu") and "scripted(k=4) (scripted 1.0)" in said and "at concurrency 2" in said
    assert f"{rung.speedup.ratio:.2f}x [{rung.speedup.low:.2f}, {rung.speedup.high:.2f}]" in said
    assert EnginePerfFile.from_json(doc.to_json()) == doc
    text = markdown(doc)
    assert "P(drafts 1..j all accepted)" in text and "P(draft j accepted | drafts 1..j-1 accepted)" in text
    assert "1.00 / 0.50 / 0.25 / 0.25" in text and "1.00 / 0.50 / 0.50 / 1.00" in text


def _engine_doc(rung, name: str = "scripted(k=4)"):
    """An engine perf run file holding `rung`, as `losscheck perf --engine` writes one."""
    from losscheck.plan.perf_profiles import ENGINE_SIZES
    from losscheck.report.engine_perf_record import SCHEMA, EnginePerfFile
    from losscheck.report.manifest import environment

    return EnginePerfFile(
        schema=SCHEMA, created="2026-12-06T00:00:00+00:00", statement="", environment=environment(torch.device("cpu")),
        engine={"name": name, "k": 4}, target={"name": "target"}, streamed=True, counters_source="scripted",
        profile="quick", sizes=ENGINE_SIZES["quick"], params=T1.label(), seed=1, rungs=(rung,),
    )  # fmt: skip


def test_an_engine_perf_run_exports_as_vllm_bench_results(tmp_path, capsys):
    """Each rung's side is a flat `vllm bench serve` result: its keys, in milliseconds, from the
    record's seconds; `losscheck export-perf` writes them, and refuses what is not an engine run."""
    import json

    from losscheck import cli
    from losscheck.perf.engine_suite import _record
    from losscheck.report import vllm_bench
    from losscheck.report.engine_perf import write_report

    requests = _requests(4)
    runs = [drive(ScriptedStream(chunk=c), requests, [0.0] * 4, 2, T1, [0, 1, 2, 3]) for c in (1, 3, 1, 3)]
    rung = _record("ladder", Arrivals("poisson", rate=4.0), 2, 4, requests, runs, paired=True)
    doc = _engine_doc(rung)
    on = vllm_bench.rung_result(doc, rung, speculative=True)
    assert on["request_rate"] == 4.0 and on["burstiness"] == 1.0 and on["max_concurrency"] == 2
    assert on["completed"] == on["num_prompts"] == 4
    assert on["median_ttft_ms"] == pytest.approx(rung.on.latency_s["ttft"]["p50"] * 1e3)
    assert on["p99_e2el_ms"] == pytest.approx(rung.on.latency_s["e2e"]["p99"] * 1e3)
    assert on["mean_tpot_ms"] == pytest.approx(rung.on.latency_s["tpot"]["mean"] * 1e3)
    assert {
        f"{s}_{m}_ms" for s in ("mean", "median", "std", "p95", "p99") for m in ("ttft", "tpot", "itl", "e2el")
    } <= set(on)
    import dataclasses

    bursty = vllm_bench.rung_result(doc, dataclasses.replace(rung, arrivals="gamma:4@0.5"), speculative=True)
    assert bursty["request_rate"] == 4.0 and bursty["burstiness"] == 0.5
    assert on["output_throughput"] == pytest.approx(sum(rung.on.throughput_tok_s) / 2)
    assert on["request_throughput"] == pytest.approx(4 / on["duration"])
    written = write_report(doc, tmp_path / "run")
    assert [p.name for p in written] == ["perf.json", "perf.md", "speedup.png", "throughput_latency.png"]
    assert all(p.stat().st_size > 1000 for p in written[2:])  # drawn, not empty
    from jsonschema import Draft202012Validator

    from losscheck.report import schema

    Draft202012Validator(schema.published("engine-perf.schema.json")).validate(
        json.loads((tmp_path / "run" / "perf.json").read_text())
    )
    assert cli.main(["export-perf", str(tmp_path / "run")]) == 0
    files = sorted(p.name for p in (tmp_path / "run" / "vllm-bench").iterdir())
    assert files == ["ladder-poisson4-c2-k4-off.json", "ladder-poisson4-c2-k4-on.json"]
    off = json.loads((tmp_path / "run" / "vllm-bench" / files[0]).read_text())
    assert off["losscheck"]["speculative"] is False and off["median_ttft_ms"] > 0
    (tmp_path / "loop.json").write_text(json.dumps({"schema": "losscheck.perf/1"}))
    assert cli.main(["export-perf", str(tmp_path / "loop.json")]) == 2
    assert cli.main(["export-perf", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "has schema 'losscheck.perf/1'; this reads losscheck.engine-perf/1" in err and "no such file" in err


def test_a_saved_engine_run_is_compared_rung_by_rung(tmp_path):
    """`--losscheck-perf-compare` with an engine: the same rung (workload, arrivals, concurrency,
    k) against each threshold; a speedup fallen past its limit fails; what is not an engine run
    is refused by name."""
    import dataclasses
    import json

    from losscheck.perf.engine_suite import _record
    from losscheck.report import engine_perf_run
    from losscheck.report.engine_perf import write_report
    from losscheck.report.engine_perf_record import EnginePerfFile
    from losscheck.report.perf_run import parse_thresholds

    requests = _requests(4)
    runs = [drive(ScriptedStream(chunk=c), requests, [0.0] * 4, 2, T1, [0, 1, 2, 3]) for c in (1, 3, 1, 3)]
    rung = _record("ladder", CLOSED, 2, 4, requests, runs, paired=True)
    doc = _engine_doc(rung)
    write_report(doc, tmp_path / "saved")
    saved = engine_perf_run.load(tmp_path / "saved" / "perf.json")
    assert saved == EnginePerfFile.from_json(doc.to_json())
    thresholds = parse_thresholds("speedup:10%,tau:5%")
    same = engine_perf_run.compare(doc, saved, thresholds)
    assert [(c.metric, c.failed) for c in same] == [("speedup", False), ("tau", False)]
    slower = dataclasses.replace(rung, speedup=dataclasses.replace(rung.speedup, ratio=rung.speedup.ratio * 0.8))
    found = engine_perf_run.compare(dataclasses.replace(doc, rungs=(slower,)), saved, thresholds)
    assert [(c.metric, c.failed) for c in found] == [("speedup", True), ("tau", False)]
    assert "REGRESSED" in found[0].line() and "ladder closed k4" in found[0].line()
    other = dataclasses.replace(rung, concurrency=4)
    assert engine_perf_run.compare(dataclasses.replace(doc, rungs=(other,)), saved, thresholds) == []
    (tmp_path / "loop.json").write_text(json.dumps({"schema": "losscheck.perf/1"}))
    with pytest.raises(OptionError, match=r"this reads losscheck.engine-perf/1, written by `losscheck perf --engine`"):
        engine_perf_run.load(tmp_path / "loop.json")
    with pytest.raises(OptionError, match="no such file"):
        engine_perf_run.load(tmp_path / "missing.json")
