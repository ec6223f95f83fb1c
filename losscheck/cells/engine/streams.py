"""A black-box engine's random streams across requests: independent under distinct seeds, and
reproducible under one seed where the adapter promises it.

The sampled cells read one request's rows; a stream shared by *requests* (restarted per request,
or a per-request seed ignored on the speculative path) leaves every request's law intact and
shows only across requests. `stream_check` draws `requests` requests of one prompt, `rows` rows
each, under distinct seeds derived from the run seed, scores every row with one teacher-forced
pass of the reference target, and runs the `streams` family (`losscheck.stats.streams`):

- `streams.reproducible`: the first request replayed with its seed, speculation on, and one
  speculation-off request drawn twice, give the same ids — checked where the adapter declares
  `reproducible_seeds = True`, and stated as not tested otherwise. An event of probability 0
  under H0 for such an adapter: it spends no α.
- `streams.repeats`: rows, in request order, repeating an earlier row's output against the
  summed probability of the distinct earlier outputs (Poisson-binomial upper tail).
- `streams.serial`: consecutive rows' first-token PITs, by Pearson's test on disjoint pairs of
  normal scores.
- `streams.greedy_fallback`: tokens at their top token against their top probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from losscheck.cells.scoring import teacher_forced_probs
from losscheck.core.sampling import SamplingParams, derive_seed, make_generator
from losscheck.engines import BlackBoxEngine, GenerationRequest, request_lengths
from losscheck.errors import LosscheckError
from losscheck.stats import registry
from losscheck.stats.gof import impossible_event
from losscheck.stats.registry import STREAMS, StatTest, register
from losscheck.stats.result import TestResult
from losscheck.stats.streams import (
    StreamValues,
    greedy_fallback,
    output_logp,
    outputs,
    precision_slack,
    repeat_law,
    repeats,
    serial,
    top_tokens,
)

if TYPE_CHECKING:
    from losscheck.core.target import HFTarget


@dataclass(frozen=True)
class StreamSample:
    """What the `streams` family reads: the rows' stream values and the replays.

    values      the rows' `StreamValues`, request-major
    replays     (what was replayed, ids first time, ids again) per replay; empty: the adapter
                promises no reproducibility
    promise     the adapter's `reproducible_seeds` (None: not declared)
    """

    values: StreamValues
    replays: tuple[tuple[str, torch.Tensor, torch.Tensor], ...]
    promise: bool | None


def stream_check(
    engine: BlackBoxEngine,
    target: HFTarget,
    prompt: Sequence[int],
    params: SamplingParams,
    seed: int,
    *,
    requests: int = 16,
    rows: int = 4,
    horizon: int = 8,
    alpha: float = 0.01,
    power: float = 0.9,
    tolerance: float = 0.0,
) -> list[TestResult]:
    """The `streams` family on `requests` requests of `prompt` (`rows` rows each, `horizon`
    tokens) drawn from `engine` with speculation on under distinct seeds derived from `seed`,
    scored by `target` (the engine's reference, logits within `tolerance` of the engine's), `alpha`
    split over the family's α-spending tests."""
    if params.greedy:
        raise LosscheckError("stream_check needs a sampled request (temperature > 0): greedy rows repeat by design")
    if requests < 2 or rows < 1 or horizon < 1:
        raise LosscheckError(
            f"stream_check needs at least 2 requests of at least 1 row of at least 1 token; got "
            f"requests={requests}, rows={rows}, horizon={horizon}"
        )
    prompt = tuple(prompt)

    def ask(seed_of: int, speculative: bool = True) -> torch.Tensor:
        request = GenerationRequest(
            prompts=(prompt,),
            n=rows,
            params=params,
            seed=seed_of,
            max_new_tokens=horizon,
            speculative=speculative,
            purpose="streams",
        )
        return engine.generate(request)[0]  # [rows, L]

    seeds = [derive_seed(seed, "streams", r) for r in range(requests)]
    tokens = torch.cat([ask(s) for s in seeds])  # [requests * rows, L], request-major
    promise = getattr(engine, "reproducible_seeds", None)
    replays: tuple[tuple[str, torch.Tensor, torch.Tensor], ...] = ()
    if promise:
        off_seed = derive_seed(seed, "streams", "off")
        replays = (
            ("the first request replayed with its seed, speculation on", tokens[:rows], ask(seeds[0])),
            ("a speculation-off request drawn twice with one seed", ask(off_seed, False), ask(off_seed, False)),
        )
    values = _stream_values(target, prompt, tokens, params, tolerance, seed)
    sample = StreamSample(values, replays, promise)
    return registry.run_family(STREAMS, sample, alpha, power)


def _stream_values(
    target: HFTarget, prompt: tuple[int, ...], tokens: torch.Tensor, params: SamplingParams, tolerance: float, seed: int
) -> StreamValues:
    """The stream values of rows `tokens` [N, L] (EOS-padded) continuing `prompt`."""
    from losscheck.stats.pit import randomized_pit

    eos = target.eos_id if target.eos_id is not None else -1
    n, horizon = tokens.shape
    generated = (
        torch.arange(horizon)[None, :] < request_lengths(tokens, eos, params, target.vocab_size)[:, None]
    )  # [N, L]
    forced = teacher_forced_probs(target, [list(prompt)] * n, tokens.to(target.device), params, tolerance)
    p = forced.probs.double().cpu()  # [N, L, V]
    tested = generated & ~forced.left_out.cpu()  # [N, L]
    top, at_top = top_tokens(p, tokens)
    logp = output_logp(p, tokens, generated, forced.left_out.cpu())  # [N]
    hit, law = repeat_law([(prompt, output) for output in outputs(tokens, generated)], logp)
    v = torch.rand(n, 1, generator=make_generator(seed, "streams", "pit-v"), dtype=torch.float64)  # [N, 1]
    first_u = randomized_pit(p[:, :1], tokens[:, :1], v)[:, 0]  # [N]
    return StreamValues(
        top=top,
        at_top=at_top,
        tested=tested,
        repeats=hit,
        repeat_law=law,
        first_u=torch.where(tested[:, 0], first_u, math.nan),
        slack=precision_slack(tolerance, params.temperature),
    )


def _reproducible(sample: StreamSample, power: float) -> TestResult:
    name, expected = "streams.reproducible", "one seed, the same ids (speculation on and off)"
    if not sample.promise:
        said = "does not declare" if sample.promise is None else "declares no"
        return TestResult.untestable(
            name, expected, f"not tested: the adapter {said} reproducible seeds", 0.0, power, effects=("mass",)
        )
    differ = [what for what, first, again in sample.replays if not torch.equal(first, again)]
    observed = "; ".join(f"{what}: the ids differ" for what in differ) or f"{len(sample.replays)} replays identical"
    return impossible_event(name, expected, observed, len(differ), len(sample.replays), power)


register(
    StatTest(
        "streams.reproducible", STREAMS, "pooled", lambda s, _a, power: _reproducible(s, power), spends_alpha=False
    )
)
register(
    StatTest("streams.repeats", STREAMS, "pooled", lambda s, a, power: repeats(s.values, a, power, "streams.repeats"))
)
register(
    StatTest("streams.serial", STREAMS, "stratified", lambda s, a, power: serial(s.values, a, power, "streams.serial"))
)
register(
    StatTest(
        "streams.greedy_fallback",
        STREAMS,
        "pooled",
        lambda s, a, power: greedy_fallback(s.values, a, power, "streams.greedy_fallback"),
    )
)
