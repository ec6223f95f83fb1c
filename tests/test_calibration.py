"""Calibration of the sampling gate (slow tier): a correct engine, many seeds.

Each run is a whole exact-mode cell (the bundled small target and its family-A drafter, k=4,
T=1) judged at level alpha = 0.05 — larger than the gate's per-test alpha so that 200 runs say
something about it. Under H0 the cell rejects with probability <= 0.05 (Bonferroni within the
cell), so the number of rejections is stochastically below Binomial(200, 0.05); we fail only if
it exceeds the binomial 0.999 quantile (a false failure of this test has probability < 0.001).
The joint chi-square p-values must look uniform: KS against U(0, 1) at level 0.001.

Run: pytest -m slow tests/test_calibration.py -s   (prints the figures quoted in the README)
"""

from __future__ import annotations

import dataclasses

import pytest
from scipy import stats

from losscheck.matrix import Cell
from losscheck.profiles import get_profile
from losscheck.runner import run_exact
from losscheck.sampling import SamplingParams
from losscheck.options import Options
from losscheck.session import Session

RUNS = 200
LEVEL = 0.05
DETECT_TV = 0.05  # smaller samples than the gate: calibration needs many runs, not power


@pytest.mark.slow
def test_correct_engine_rejects_at_the_nominal_rate_and_p_values_are_uniform():
    profile = dataclasses.replace(get_profile("ci"), detect_tv=DETECT_TV)
    cell = Cell("A", 4, SamplingParams(temperature=1.0), target="small")
    rejections, joint_p = 0, []
    first = Session(Options(alpha=LEVEL, profile=profile))
    first.n_statistical = 1  # the whole LEVEL goes to this one cell
    for seed in range(RUNS):
        outcome = run_exact(first.derive(seed=seed), cell)
        rejections += not outcome.passed
        joint_p += [r.p_value for r in outcome.verdict.results if r.name == "exact.joint_chisquare"]
    bound = int(stats.binom.ppf(0.999, RUNS, LEVEL))
    ks = stats.kstest(joint_p, "uniform")
    print(f"\ncalibration: {rejections}/{RUNS} cells rejected at alpha={LEVEL} (binomial 0.999 bound {bound}); "
          f"KS of {len(joint_p)} joint chi-square p-values vs U(0,1): D={ks.statistic:.4f}, p={ks.pvalue:.3f}")
    assert rejections <= bound, (
        f"{rejections}/{RUNS} rejections at level {LEVEL}; above the 0.999 bound {bound}; false-failure "
        f"probability {stats.binom.sf(bound, RUNS, LEVEL):.2g} (< 1e-3) at level exactly {LEVEL}, less below it"
    )
    assert ks.pvalue > 1e-3, (
        f"joint chi-square p-values are not uniform: KS D={ks.statistic:.4f}, p={ks.pvalue:.2g} <= 1e-3; "
        "false-failure probability 1e-3"
    )
