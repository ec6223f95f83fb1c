"""Named settings profiles: sample sizes and detectable effect chosen together."""

from __future__ import annotations

from dataclasses import dataclass, replace

from losscheck.core.limits import ENGINE_BATCH
from losscheck.errors import OptionError, flag


def min_horizon(k: int) -> int:
    """The shortest horizon whose sequences reach a bonus slot and a second round at block length `k`."""
    return 2 * k + 2


@dataclass(frozen=True)
class Profile:
    name: str
    greedy_max_new: int = 64  # tokens generated per prompt in greedy cells
    horizon: int = 16  # L: generated tokens per sequence tested in PIT cells (at least 2k + 2)
    exact_horizon: int = 4  # L for exact enumeration on the small-vocabulary target (V**L sequences)
    detect_tv: float = 0.02  # the binned TV exact and two-sample engine cells must detect
    # PIT cells of losscheck's own loop are sized by their bug classes' power (a pilot measures
    # it, `losscheck.stats.bugclass`): the tested tokens their best test needs for every class it
    # can reach within `max_pit_tokens`, at least `min_pit_tokens`
    pilot_sequences: int = 128
    engine_pilot_sequences: int = 48  # a black-box one-sample cell's pilot: at least one row per prompt
    min_pit_tokens: int = 2_000
    max_pit_tokens: int = 20_000
    # a one-sample engine cell's floor, its first look (below one row a prompt: over part of the
    # prompts): lower than a PIT cell's, as each look is an engine draw and the cell may stop there
    # under H0 (near Wald's bound, 110-240 tokens on the text pair at T 1 and T 1.5); its rule-out
    # e-values hold at any stopping time, and its claims are its pilot's and tested rows' own power
    engine_min_tokens: int = 200
    # False: a PIT cell draws its fixed-sample design in one look and never stops early (the
    # baseline the sequential stop's power is measured against, `losscheck.selftest.curve --fixed`)
    early_stop: bool = True
    pooled_tv: float | None = None  # also require the pooled PIT tests to detect this binned TV
    power: float = 0.99  # at this power, under the per-test alpha
    batch: int = ENGINE_BATCH  # most rows one engine call (or teacher-forced pass) runs at once
    pit_bins: int = 10  # fixed equal-width bins of the PIT chi-square test
    two_sample_horizon: int = 4  # L for black-box engines (two-sample mode needs ~2x the samples)
    two_sample_bins: int = 20  # most pooled-frequency bins per position in two-sample mode

    def pit_horizon(self, k: int) -> int:
        """Tokens a sampled cell of block length `k` tests per sequence: the profile's horizon, and
        at least 2k + 2, so that a sequence whose drafts are all kept reaches a bonus slot and a
        second round (where bonus-token and rollback bugs act)."""
        return max(self.horizon, min_horizon(k))

    def with_detect_tv(self, tv: float | None) -> Profile:
        """The profile under `--losscheck-detect-tv`: every sampled cell, the PIT cells included,
        sized to detect binned TV `tv`."""
        return self if tv is None else replace(self, detect_tv=tv, pooled_tv=tv)


PROFILES = {
    "ci": Profile("ci"),
    "thorough": Profile(
        "thorough",
        greedy_max_new=128,
        horizon=32,
        exact_horizon=4,
        detect_tv=0.01,
        max_pit_tokens=200_000,
        pooled_tv=0.01,
    ),
}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise OptionError(f"{flag('profile')}={name!r} is not one of {sorted(PROFILES)}")
    return PROFILES[name]
