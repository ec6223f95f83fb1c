"""Named sizes of a perf run (`--losscheck-perf-profile`), chosen together like the gate's
profiles: `quick` fits a CPU in a few minutes with the bundled models, `full` is for a GPU runner
with a real target."""

from __future__ import annotations

from dataclasses import dataclass

from losscheck.errors import OptionError, flag

LADDER = (1, 2, 4, 8, 16, 32)  # requests in flight (docs/perf.md)


@dataclass(frozen=True)
class PerfProfile:
    name: str
    concurrency: tuple[int, ...] = LADDER
    requests_per_slot: int = 2  # a rung serves concurrency * this many requests: every row is reused
    min_requests: int = 8  # ...and at least this many, so that low rungs have latency percentiles
    max_new: int = 24  # output budgets are uniform in [max_new // 2, max_new] (EOS may end sooner)
    short_max_new: int = 4  # the short-output workload of the sensitivity table
    k: int = 4  # block length of every drafter
    temperature: float = 1.0  # sampling, as served; 0 = greedy
    repeats: int = 3  # timed runs per rung, after one warm-up run
    max_overhead: float = 0.15  # engine time outside drafter and target forwards, fraction of a round, at concurrency 1


PERF_PROFILES = {
    "quick": PerfProfile("quick"),
    "full": PerfProfile("full", requests_per_slot=4, min_requests=32, max_new=256, short_max_new=16, repeats=5),
}


def get_perf_profile(name: str) -> PerfProfile:
    if name not in PERF_PROFILES:
        raise OptionError(f"{flag('perf-profile')}={name!r} is not one of {sorted(PERF_PROFILES)}")
    return PERF_PROFILES[name]


@dataclass(frozen=True)
class EngineSizes:
    """What an engine's perf run (`losscheck.perf.engine_suite`) adds to its profile: the ladder,
    and the length tiers timed at the lowest concurrency."""

    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # requests in flight, as a serving benchmark's
    long_input: int = 1024  # prompt tokens of the long-input tier (prompts repeated to this length)
    long_output: int = 512  # output budget of the long-output tier


ENGINE_SIZES = {
    # fits the bundled target's 256 positions (prompt + output) and a CPU in minutes
    "quick": EngineSizes(concurrency=(1, 4, 16), long_input=160, long_output=64),
    "full": EngineSizes(),
}


# --- the regression compare's failure thresholds (`--losscheck-perf-compare-fail`) -----------------
METRICS = ("speedup", "tau")
DEFAULT_COMPARE_FAIL = "speedup:10%,tau:5%"


@dataclass(frozen=True)
class Threshold:
    metric: str  # "speedup" (geometric-mean ratio) or "tau"
    max_drop: float  # fraction of the saved value it may fall by


def parse_thresholds(text: str) -> tuple[Threshold, ...]:
    """ "speedup:10%,tau:5%" → thresholds; a bad entry raises `OptionError` naming it."""
    found = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        metric, _, value = part.partition(":")
        if metric not in METRICS or not value.endswith("%"):
            raise OptionError(
                f"{flag('perf-compare-fail')} entry {part!r} is not METRIC:N% with METRIC one of "
                f"{list(METRICS)} (e.g. {DEFAULT_COMPARE_FAIL})"
            )
        try:
            drop = float(value[:-1]) / 100
        except ValueError:
            raise OptionError(f"{flag('perf-compare-fail')} entry {part!r}: {value!r} is not a percentage") from None
        if not 0 <= drop < 1:
            raise OptionError(f"{flag('perf-compare-fail')} entry {part!r}: the drop must be in [0%, 100%)")
        found.append(Threshold(metric, drop))
    if not found:
        raise OptionError(f"{flag('perf-compare-fail')} needs at least one METRIC:N%, e.g. {DEFAULT_COMPARE_FAIL}")
    return tuple(found)
