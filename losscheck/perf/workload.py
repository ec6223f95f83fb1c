"""The requests of a rung: prompts drawn from the entropy tiers, output budgets from a fixed
distribution, both seeded.

Two ways a workload overstates a drafter's gain (the seeds' warning) are kept visible: output
budgets are a distribution, not one short length (a short-output workload is measured apart, in
the sensitivity table), and prompts are taken without replacement until the pool is exhausted,
so a rung repeats a prompt only when it needs more requests than there are prompts
(`distinct_prompts` records how many were distinct).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from losscheck.core.sampling import derive_seed
from losscheck.errors import LosscheckError


@dataclass(frozen=True)
class Request:
    prompt: list[int]  # token ids
    max_new: int  # output budget; the request ends sooner at EOS
    tier: str  # entropy tier of the prompt


def make_workload(
    prompt_sets: Mapping[str, Sequence[list[int]]], n: int, max_new: int, seed: int, *names: object
) -> list[Request]:
    """`n` requests over the tiers of `prompt_sets` (pooled, shuffled, taken in turn; reshuffled
    when exhausted), budgets uniform in [max(1, max_new // 2), max_new]; seeded by `seed` and
    the stream `names`."""
    if n < 1:
        raise LosscheckError(f"a workload needs at least one request, got n={n}")
    if max_new < 1:
        raise LosscheckError(f"output budget max_new must be >= 1, got {max_new}")
    pool = [(tier, list(p)) for tier, prompts in prompt_sets.items() for p in prompts]
    if not pool:
        raise LosscheckError("no prompts to build a workload from; the prompt sets are empty")
    rng = np.random.default_rng(derive_seed(seed, "perf-workload", *names))
    order: list[int] = []
    while len(order) < n:
        order += rng.permutation(len(pool)).tolist()
    budgets = rng.integers(max(1, max_new // 2), max_new, endpoint=True, size=n)
    return [Request(pool[i][1], int(b), pool[i][0]) for i, b in zip(order[:n], budgets)]


def distinct_prompts(requests: Sequence[Request]) -> int:
    return len({tuple(r.prompt) for r in requests})
