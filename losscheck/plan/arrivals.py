"""How the requests of an engine perf run arrive (`--losscheck-perf-arrivals`).

closed           every request is waiting at time zero; the rung's concurrency is how many are in
                 flight (a benchmark client behind a concurrency limit; vLLM's `bench serve
                 --max-concurrency` with an infinite rate).
poisson:RATE     an open loop: arrivals of a Poisson process of RATE requests per second (gaps
                 exponential, seeded), still capped at the rung's concurrency in flight.
gamma:RATE@B     an open loop of RATE requests per second whose gaps are gamma-distributed with
                 shape B (`vllm bench serve --request-rate RATE --burstiness B`: B < 1 burstier,
                 B > 1 more even, B = 1 is poisson:RATE, and is named so), capped the same way.
burst:SIZE@SEC   SIZE requests at once every SEC seconds, capped the same way.

A request's latencies count from its admission (when it is handed to the engine), as the closed
loop's do; the time it waited for a free slot is not latency the engine caused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from losscheck.errors import OptionError, flag

KINDS = ("closed", "poisson", "gamma", "burst")


@dataclass(frozen=True)
class Arrivals:
    kind: str  # one of KINDS
    rate: float = 0.0  # poisson, gamma: requests per second
    burstiness: float = 1.0  # gamma: the gaps' shape (vLLM's `--burstiness`)
    size: int = 0  # burst: requests per burst
    period: float = 0.0  # burst: seconds between bursts

    @property
    def label(self) -> str:
        if self.kind == "poisson":
            return f"poisson:{self.rate:g}"
        if self.kind == "gamma":
            return f"gamma:{self.rate:g}@{self.burstiness:g}"
        if self.kind == "burst":
            return f"burst:{self.size}@{self.period:g}"
        return "closed"

    def times(self, n: int, rng: np.random.Generator) -> list[float]:
        """Arrival times of `n` requests in seconds from the start, non-decreasing."""
        if self.kind == "poisson":
            return np.cumsum(rng.exponential(1.0 / self.rate, size=n)).tolist()
        if self.kind == "gamma":  # mean gap 1 / rate, as vLLM draws them
            return np.cumsum(rng.gamma(self.burstiness, 1.0 / (self.rate * self.burstiness), size=n)).tolist()
        if self.kind == "burst":
            return [float(i // self.size * self.period) for i in range(n)]
        return [0.0] * n


CLOSED = Arrivals("closed")


def open_loop(rate: float, burstiness: float = 1.0) -> Arrivals:
    """vLLM's `--request-rate RATE --burstiness B` as an arrival process: Poisson at B = 1."""
    if not rate > 0 or not burstiness > 0:
        raise OptionError(f"a request rate and burstiness must be > 0, got {rate:g} and {burstiness:g}")
    return Arrivals("poisson", rate=rate) if burstiness == 1 else Arrivals("gamma", rate=rate, burstiness=burstiness)


def parse_arrivals(text: str) -> tuple[Arrivals, ...]:
    """ "closed,poisson:4,burst:8@2" → arrival processes; a bad entry is an `OptionError` naming it."""
    found = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, spec = part.partition(":")
        try:
            if kind == "closed" and not spec:
                found.append(CLOSED)
            elif kind == "poisson":
                rate = float(spec)
                if not rate > 0:
                    raise ValueError
                found.append(Arrivals("poisson", rate=rate))
            elif kind == "gamma":
                per_second, _, shape = spec.partition("@")
                if not float(per_second) > 0 or not float(shape) > 0:
                    raise ValueError
                found.append(open_loop(float(per_second), float(shape)))
            elif kind == "burst":
                size, _, period = spec.partition("@")
                burst = Arrivals("burst", size=int(size), period=float(period))
                if burst.size < 1 or not burst.period > 0:
                    raise ValueError
                found.append(burst)
            else:
                raise ValueError
        except ValueError:
            raise OptionError(
                f"{flag('perf-arrivals')} entry {part!r} is not closed, poisson:RATE (requests/s > 0), "
                "gamma:RATE@BURSTINESS (both > 0) or burst:SIZE@SECONDS (SIZE >= 1, SECONDS > 0), "
                "e.g. closed,poisson:4,gamma:4@0.5,burst:8@2"
            ) from None
    if not found:
        raise OptionError(f"{flag('perf-arrivals')} needs at least one arrival process, e.g. closed")
    return tuple(found)


def parse_concurrency(text: str) -> tuple[int, ...]:
    """ "1,2,4" → (1, 2, 4), sorted and distinct; an `OptionError` for anything but ints >= 1."""
    return _positive_ints(text, "perf-concurrency", "1,4,16")


def parse_block_lengths(text: str) -> tuple[int, ...]:
    """ "2,4,6" → the block lengths of an engine's k sweep (`--losscheck-perf-k`)."""
    return _positive_ints(text, "perf-k", "2,4,6")


def _positive_ints(text: str, option: str, example: str) -> tuple[int, ...]:
    try:
        values = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise OptionError(f"{flag(option)}={text!r}: need a comma-separated list of ints >= 1, e.g. {example}")
    return tuple(values)
