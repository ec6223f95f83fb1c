"""Calibration of the sampling gate (slow tier): a correct engine, many seeds.

Each run is a whole exact-mode cell (the bundled small target and its family-A drafter at the
exact cells' k, T=1) judged at level alpha = 0.05 — larger than the gate's per-test alpha so
that 200 runs say something about it. Under H0 the cell rejects with probability <= 0.05 (Bonferroni within the
cell), so the number of rejections is stochastically below Binomial(200, 0.05); we fail only if
it exceeds the binomial 0.999 quantile (a false failure of this test has probability < 0.001).
The joint chi-square p-values must look uniform: KS against U(0, 1) at level 0.001.

Run: pytest -m slow tests/quality/test_calibration.py -s   (prints the figures quoted in docs/statistics.md)
"""

from __future__ import annotations

import dataclasses

import pytest
from scipy import stats

from losscheck.cells.sampled import run_exact
from losscheck.core.sampling import SamplingParams
from losscheck.plan.matrix import Cell
from losscheck.plan.profiles import get_profile
from losscheck.plan.tiers import EXACT_K
from losscheck.run.context import CellContext
from losscheck.run.options import Options
from losscheck.run.session import Session

RUNS = 200
LEVEL = 0.05
DETECT_TV = 0.05  # smaller samples than the gate: calibration needs many runs, not power


@pytest.mark.slow
def test_correct_engine_rejects_at_the_nominal_rate_and_p_values_are_uniform():
    profile = dataclasses.replace(get_profile("ci"), detect_tv=DETECT_TV)
    cell = Cell("A", EXACT_K, SamplingParams(temperature=1.0), target="small")
    rejections, joint_p = 0, []
    first = Session(Options(alpha=LEVEL, profile=profile))
    first.n_statistical = 1  # the whole LEVEL goes to this one cell
    for seed in range(RUNS):
        outcome = run_exact(CellContext.of(first.derive(seed=seed), cell))
        rejections += not outcome.passed
        joint_p += [r.p_value for r in outcome.verdict.results if r.name == "exact.joint_chisquare"]
    bound = int(stats.binom.ppf(0.999, RUNS, LEVEL))
    ks = stats.kstest(joint_p, "uniform")
    print(
        f"\ncalibration: {rejections}/{RUNS} cells rejected at alpha={LEVEL} (binomial 0.999 bound {bound}); "
        f"KS of {len(joint_p)} joint chi-square p-values vs U(0,1): D={ks.statistic:.4f}, p={ks.pvalue:.3f}"
    )
    assert rejections <= bound, (
        f"{rejections}/{RUNS} rejections at level {LEVEL}; above the 0.999 bound {bound}; false-failure "
        f"probability {stats.binom.sf(bound, RUNS, LEVEL):.2g} (< 1e-3) at level exactly {LEVEL}, less below it"
    )
    assert ks.pvalue > 1e-3, (
        f"joint chi-square p-values are not uniform: KS D={ks.statistic:.4f}, p={ks.pvalue:.2g} <= 1e-3; "
        "false-failure probability 1e-3"
    )


NEW_RUNS = 200


def _rejections_within_the_binomial_bound(rejections: dict[str, int], what: str) -> None:
    bound = int(stats.binom.ppf(0.999, NEW_RUNS, LEVEL))
    print(
        f"\ncalibration of {what}: rejections of {NEW_RUNS} null runs at level {LEVEL} "
        f"(binomial 0.999 bound {bound}): {rejections}"
    )
    over = {name: n for name, n in rejections.items() if n > bound}
    assert not over, (
        f"{over} above the 0.999 bound {bound} of Binomial({NEW_RUNS}, {LEVEL}); false-failure probability "
        f"{stats.binom.sf(bound, NEW_RUNS, LEVEL):.2g} per test at level exactly {LEVEL}"
    )


@pytest.mark.slow
def test_slot_and_pair_tests_reject_at_the_nominal_rate():
    """Exact samples with EOS (a predictable mask) in rounds of random acceptance: each of the
    five PIT tests, judged at LEVEL alone, rejects within the binomial bound."""
    import torch

    from losscheck.stats.pit import pit_tests, randomized_pit
    from losscheck.stats.registry import budget_count

    rejections: dict[str, int] = {}
    for run in range(NEW_RUNS):
        gen = torch.Generator().manual_seed(run)
        n, length, vocab = 300, 16, 20
        probs = torch.softmax(2 * torch.randn(n, length, vocab, generator=gen, dtype=torch.float64), -1)
        tokens = torch.multinomial(probs.reshape(-1, vocab), 1, generator=gen).view(n, length)
        eos = tokens == 0
        mask = (eos.long().cumsum(1) - eos.long()) == 0
        # Slots of rounds that accept a random count: fixed before each token is drawn.
        accept = torch.randint(0, 5, (n, length), generator=gen)
        slots = torch.zeros(n, length, dtype=torch.long)
        for pos in range(1, length):
            slots[:, pos] = torch.where(slots[:, pos - 1] < accept[:, pos - 1], slots[:, pos - 1] + 1, 0)
        u = randomized_pit(probs, tokens, torch.rand(n, length, generator=gen, dtype=torch.float64))
        spare = torch.rand(n, length, generator=gen, dtype=torch.float64)
        results = pit_tests(u, mask, budget_count("pit") * LEVEL, 0.9, 1.0, slots=slots, spare=spare)
        for r in results[1:]:
            rejections[r.name] = rejections.get(r.name, 0) + (not r.passed)
    _rejections_within_the_binomial_bound(rejections, "the PIT tests (slot and pair included)")


@pytest.mark.slow
def test_conformance_tests_reject_at_the_nominal_rate():
    """The standard verifier on honest random rounds: each conformance test at LEVEL alone."""
    import torch

    from losscheck.cells.conformance import Recorder
    from losscheck.core.sampling import sample
    from losscheck.core.verify import verify_block
    from losscheck.stats.registry import budget_count

    rejections: dict[str, int] = {}
    for run in range(NEW_RUNS):
        gen = torch.Generator().manual_seed(10_000 + run)
        recorder = Recorder(verify_block, torch.Generator().manual_seed(20_000 + run))
        for _ in range(10):
            logits = 2 * torch.randn(100, 5, 8, generator=gen)
            # q near p (noise of sd 1 on the logits): rounds both reject and reach the bonus.
            q = torch.softmax(logits[:, :4] + torch.randn(100, 4, 8, generator=gen), -1)
            recorder(logits, sample(q, gen), q, SamplingParams(), gen)
        for r in recorder.tests(budget_count("conformance") * LEVEL, 0.9):
            rejections[r.name] = rejections.get(r.name, 0) + (not r.passed)
    _rejections_within_the_binomial_bound(rejections, "the conformance tests")


CELL_RUNS = 200
CELL_LEVELS = (0.05, 0.01)
# The tested sample's floor and cap (the gate's cells test 2,000 .. 20,000 tokens): many runs, not
# power, and looks at 250, 500, 1,000 and the design, so that runs stop at every look.
CELL_FLOOR, CELL_CAP = 250, 2_000


@pytest.mark.slow
def test_whole_pit_cells_of_the_real_loop_reject_at_the_nominal_rate():
    """Whole PIT cells of losscheck's own loop under H0 (drafter A, k=4, T=1, on the bundled
    target: slots, EOS and rounds as the engine makes them, the pilot, the design, the sequential
    looks and their stopping rule, every test of the cell and the conformance tests), many seeds.
    The whole level goes to the cell, and one set of runs serves both levels: a run rejects at
    level a when any test's p-value is below its own alpha scaled by a / the cell's budget (or an
    impossible event is seen) — at the budget, exactly what the cell does. Under H0 the count of
    rejections is stochastically below Binomial(runs, a); we fail only above its 0.999 quantile.
    It also prints the tested tokens against what the fixed-sample design would have tested."""
    from losscheck.cells.sampled import run_pit

    profile = dataclasses.replace(
        get_profile("ci"), pilot_sequences=32, min_pit_tokens=CELL_FLOOR, max_pit_tokens=CELL_CAP
    )
    cell = Cell("A", 4, SamplingParams(temperature=1.0))
    first = Session(Options(alpha=max(CELL_LEVELS), profile=profile, bundled="reference"))
    first.n_statistical = 1  # the whole level goes to this one cell
    budget = first.per_test_alpha
    rejections = dict.fromkeys(CELL_LEVELS, 0)
    underpowered, runs, tokens, fixed = 0, 0, 0, 0
    stops: dict[int, int] = {}
    for seed in range(CELL_RUNS):
        outcome = run_pit(CellContext.of(first.derive(seed=seed), cell))  # a shortfall never raises
        classes = outcome.facts.bug_classes or {}
        underpowered += any(c.withdrawn is not None for c in classes.values())  # a class fell short: withdrawn
        runs += 1
        results = outcome.verdict.results
        tested = next(r.n for r in results if r.name == "pit.support")
        tokens += tested
        assert outcome.facts.fixed_design_tokens is not None and outcome.facts.looks is not None
        fixed += outcome.facts.fixed_design_tokens
        stop = outcome.facts.looks.stopped_at
        stops[stop] = stops.get(stop, 0) + 1
        print(f"run {seed}: stopped at look {stop}, {tested} tokens tested", flush=True)  # with -s: progress
        for level in CELL_LEVELS:
            impossible = any(r.alpha == 0 and not r.passed for r in results)
            scaled = any(r.alpha > 0 and r.p_value < r.alpha * level / budget for r in results)
            rejections[level] += impossible or scaled
    bounds = {level: int(stats.binom.ppf(0.999, runs, level)) for level in CELL_LEVELS}
    print(
        f"\ncalibration of whole PIT cells: {runs} runs of ~{tokens / max(runs, 1):.0f} tested tokens "
        f"(the fixed-sample design: ~{fixed / max(runs, 1):.0f}; stopped at looks {dict(sorted(stops.items()))}; "
        f"{underpowered} withdrew a class); rejections {rejections} against binomial 0.999 bounds {bounds}"
    )
    for level in CELL_LEVELS:
        assert rejections[level] <= bounds[level], (
            f"{rejections[level]}/{runs} whole cells rejected at level {level}; above the 0.999 bound "
            f"{bounds[level]}; false-failure probability {stats.binom.sf(bounds[level], runs, level):.2g}"
        )
    assert underpowered <= int(stats.binom.ppf(0.999, CELL_RUNS, 0.01)), (
        f"{underpowered}/{CELL_RUNS} runs withdrew a class as underpowered: the design's margin "
        "(losscheck.stats.sample_size.DESIGN_MARGIN) leaves covered classes short more than 1% of the time"
    )
