"""Latency, throughput and speedup figures of a run, against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from losscheck.core.generation import LoopStats
from losscheck.perf.metrics import (
    Latencies,
    percentiles,
    round_breakdown,
    speedup,
    throughput,
)
from losscheck.perf.serving import RequestTrace, ServeTrace
from losscheck.perf.workload import Request


def trace_of(requests: list[RequestTrace], wall: float = 2.0) -> ServeTrace:
    return ServeTrace(
        2,
        requests,
        LoopStats.empty(4),
        wall,
        rounds=4,
        round_s=1.6,
        draft_s=0.4,
        verify_s=1.0,
        prefill_s=0.2,
        memory={},
    )


def two_requests() -> list[RequestTrace]:
    # Request 0: admitted at 0, 5 tokens in events at 0.5 (1), 0.8 (3), 1.0 (1).
    a = RequestTrace(Request([0], 5, "low"), 0.0, [(0.5, 1), (0.8, 3), (1.0, 1)], 1.0, [7] * 5)
    # Request 1: admitted at 1.0, one token at 1.5.
    b = RequestTrace(Request([0], 1, "low"), 1.0, [(1.5, 1)], 1.5, [7])
    return [a, b]


def test_latencies_follow_their_definitions():
    lat = Latencies.of(trace_of(two_requests()))
    assert lat.ttft == pytest.approx([0.5, 0.5])
    assert lat.e2e == pytest.approx([1.0, 0.5])
    assert lat.tpot == pytest.approx([(1.0 - 0.5) / 4])  # one-token requests have no TPOT
    assert lat.itl == pytest.approx([0.3, 0.2])  # gaps between emission events, not per token


def test_a_request_without_tokens_is_an_error_not_a_zero():
    empty = RequestTrace(Request([0], 3, "low"), 0.0)
    with pytest.raises(ValueError, match="emitted no token"):
        Latencies.of(trace_of([empty]))


def test_throughput_and_round_breakdown():
    trace = trace_of(two_requests(), wall=2.0)
    assert throughput(trace) == pytest.approx(6 / 2.0)
    b = round_breakdown(trace)
    assert b["round_s"] == pytest.approx(0.4) and b["draft_s"] == pytest.approx(0.1)
    assert b["overhead_s"] == pytest.approx((1.6 - 0.4 - 1.0) / 4)
    assert b["overhead_fraction"] == pytest.approx(0.2 / 1.6)
    assert b["prefill_fraction"] == pytest.approx(0.1)


def test_percentiles_are_numpys_and_nan_when_empty():
    xs = [3.0, 1.0, 2.0, 10.0, 4.0]
    assert percentiles(xs) == {f"p{q}": pytest.approx(np.percentile(xs, q)) for q in (50, 95, 99)}
    assert all(math.isnan(v) for v in percentiles([]).values())


def test_speedup_is_the_ratio_of_geometric_means_with_a_welch_interval():
    spec, base = [200.0, 220.0, 210.0], [100.0, 104.0, 98.0]
    s = speedup(spec, base, level=0.9)
    assert s.ratio == pytest.approx(math.exp(np.mean(np.log(spec)) - np.mean(np.log(base))))
    # Welch's interval on log throughputs, worked out from its formula.
    a, b = np.log(spec), np.log(base)
    va, vb = a.var(ddof=1) / 3, b.var(ddof=1) / 3
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)
    half = stats.t.ppf(0.95, df) * math.sqrt(va + vb)
    assert (s.low, s.high) == pytest.approx(
        (math.exp(a.mean() - b.mean() - half), math.exp(a.mean() - b.mean() + half))
    )
    assert s.low < s.ratio < s.high


def test_paired_runs_take_the_interval_on_their_log_ratios():
    spec, base = [200.0, 150.0, 260.0], [100.0, 80.0, 125.0]  # load moved both sides of each pair
    s = speedup(spec, base, paired=True)
    d = np.log(spec) - np.log(base)
    half = stats.t.ppf(0.975, 2) * d.std(ddof=1) / math.sqrt(3)
    assert (s.ratio, s.low, s.high) == pytest.approx(
        (math.exp(d.mean()), math.exp(d.mean() - half), math.exp(d.mean() + half))
    )
    assert s.high - s.low < speedup(spec, base).high - speedup(spec, base).low  # pairing removes the shared drift
    with pytest.raises(ValueError, match="as many"):
        speedup([1.0, 2.0], [1.0], paired=True)


def test_speedup_interval_covers_the_true_ratio_at_its_level():
    # Runs with 5% log-normal noise around a true speedup of 1.5: the 95% interval covers it in
    # about 95% of 400 replications (binomial 99.9% band: 0.91-0.98).
    rng = np.random.default_rng(0)
    covered = 0
    for _ in range(400):
        spec = 150 * np.exp(rng.normal(0, 0.05, 4))
        base = 100 * np.exp(rng.normal(0, 0.05, 4))
        s = speedup(spec.tolist(), base.tolist())
        covered += s.low <= 1.5 <= s.high
    assert 0.91 <= covered / 400 <= 0.98, covered


def test_one_run_a_side_has_no_interval_and_bad_input_is_named():
    s = speedup([2.0], [1.0])
    assert s.ratio == pytest.approx(2.0) and math.isnan(s.low) and math.isnan(s.high)
    with pytest.raises(ValueError, match="positive"):
        speedup([0.0, 1.0], [1.0, 1.0])
