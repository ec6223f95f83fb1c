"""Requests in flight, admitted as a serving engine admits them: continuous batching at round
granularity, driving `Engine.step`.

A rung of concurrency `c` runs `c` rows. Every request arrives at time zero and waits in a queue
(a closed loop, like a benchmark client with a concurrency limit). Whenever rows finish — EOS or
their own budget — at the end of a round, the next queued requests take those rows before the
next round: their prompts are prefilled into the target's cache rows (one target pass), the rows'
tokens, lengths and budgets are replaced, and the drafter forgets the rows. Nothing waits for a
whole batch to drain. Rows left without a request once the queue is empty stay in the batch,
finished, as in `Engine.generate`.

Terms. *Admitted*: the request took a row; its latencies count from here, as a client behind a
concurrency limit counts from sending. *Emission event*: a round in which the request emitted at
least one token (a streaming client's chunk; a speculative round emits several tokens at once).
Every clock read follows a device synchronisation, so a round's time includes its kernels.

An admission prefills the admitted rows alone (`losscheck.core.ragged.forward_rows`: a pass over them into a cache of
their own, copied into their cache rows), for the target and for an autoregressive drafter. For a
target that is not an `HFTarget`, and at the first admission (before the cache is allocated), one
pass goes over every row: the admitted rows' prompts at slot 0, junk for each other row at its
pending slot onwards, which the target's cache layout (`losscheck.core.engine`) allows: it keeps only
the slots before a row's pending token, and the next round overwrites that slot before reading it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from losscheck.core.contract import Drafter, Target
from losscheck.core.engine import Engine
from losscheck.core.generation import LoopStats
from losscheck.core.precision import synchronize
from losscheck.core.sampling import SamplingParams
from losscheck.errors import LosscheckError
from losscheck.perf.workload import Request
from losscheck.serving.batching import ContinuousBatcher, forget_rows  # noqa: F401  (forget_rows: re-exported)


class Timed:
    """`inner` with the methods `methods` timed into `seconds` (the device synchronised before
    both clock reads, so queued kernels count); every other attribute is `inner`'s."""

    def __init__(self, inner: Any, methods: Sequence[str], device: torch.device) -> None:
        self.inner = inner
        self.__wrapped__ = inner  # what the scheduler's per-row bookkeeping acts on (`inspect.unwrap`)
        self.seconds = 0.0
        self._device = device
        for name in methods:
            setattr(self, name, self._timed(getattr(inner, name)))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            synchronize(self._device)
            started = time.perf_counter()
            out = method(*args, **kwargs)
            synchronize(self._device)
            self.seconds += time.perf_counter() - started
            return out

        return timed

    def __getattr__(self, name: str) -> Any:  # only called for attributes not set above
        return getattr(self.inner, name)


@dataclass
class RequestTrace:
    """One request's life, in seconds since the run started."""

    request: Request
    admitted: float
    events: list[tuple[float, int]] = field(default_factory=list)  # (round end, tokens emitted)
    finished: float = float("nan")
    tokens: list[int] = field(default_factory=list)  # the generated ids

    @property
    def output_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class ServeTrace:
    """What one run of a workload at one concurrency measured."""

    concurrency: int
    requests: list[RequestTrace]
    stats: LoopStats  # acceptance counters of the decode rounds
    wall_s: float  # first admission to last completion
    rounds: int
    round_s: float  # decode rounds (Engine.step), all of them
    draft_s: float  # of which the drafter's propose + commit
    verify_s: float  # of which the target's forward passes
    prefill_s: float  # admissions: prompt prefill and row set-up, between rounds
    memory: dict[str, int | None]

    @property
    def overhead_s(self) -> float:
        """Engine time inside rounds outside the drafter and the target forwards (drafts'
        validation, verification, commit, bookkeeping)."""
        return self.round_s - self.draft_s - self.verify_s


def serve(
    target: Target,
    drafter: Drafter | None,
    k: int,
    requests: Sequence[Request],
    concurrency: int,
    params: SamplingParams,
    generator: torch.Generator,
) -> ServeTrace:
    """Run `requests` with at most `concurrency` in flight (a closed loop: every request is queued
    at time zero) through losscheck's one scheduler (`ContinuousBatcher`), timing it; `drafter=None`
    is the baseline."""
    if concurrency < 1:
        raise LosscheckError(f"concurrency must be >= 1, got {concurrency}")
    device = target.device
    timed_target = Timed(target, ("forward",), device)
    timed_drafter = Timed(drafter, ("propose", "commit"), device) if drafter is not None else None
    engine = Engine(timed_target, timed_drafter, k)  # proxies of both (Timed forwards every attribute)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock = _Clock(requests, device, timed_target, timed_drafter)
    gen = ContinuousBatcher(engine, concurrency).generate(
        [r.prompt for r in requests], [r.max_new for r in requests], params, generator, observer=clock
    )
    wall = clock.last - clock.started
    for i, trace in enumerate(clock.traces):
        trace.tokens = gen.row(i)
    memory = {
        "target_weights_bytes": module_bytes(target),
        "drafter_weights_bytes": module_bytes(drafter) if drafter is not None else 0,
        "target_kv_bytes": cache_bytes(target),
        "drafter_kv_bytes": cache_bytes(drafter) if drafter is not None else 0,
        "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    return ServeTrace(
        concurrency,
        clock.traces,
        gen.stats,
        wall,
        clock.rounds,
        clock.round_s,
        clock.draft_s,
        clock.verify_s,
        clock.prefill_s,
        memory,
    )


class _Clock:
    """Times a run of the scheduler (`losscheck.serving.batching.Observer`): admissions (prefill
    and row set-up), rounds, and each request's admission, emission events and end. Every clock
    read follows a device synchronisation. The drafter's and the target's timed seconds count
    inside rounds only (an admission's prefill runs the target too, and is the prefill's time)."""

    def __init__(self, requests: Sequence[Request], device: torch.device, target: Timed, drafter: Timed | None) -> None:
        self.requests, self.device = requests, device
        self.target, self.drafter = target, drafter
        self.traces: list[RequestTrace] = []
        self.rounds, self.round_s, self.prefill_s = 0, 0.0, 0.0
        self.draft_s = self.verify_s = 0.0
        self._timed0 = (0.0, 0.0)
        synchronize(device)
        self.started = self.last = self._t0 = time.perf_counter()

    def _now(self) -> float:
        synchronize(self.device)
        self.last = time.perf_counter()
        return self.last

    def admitting(self, requests: list[int]) -> None:
        self._t0 = self._now()
        for i in requests:  # a closed loop admits in request order
            assert i == len(self.traces)
            self.traces.append(RequestTrace(self.requests[i], self._t0 - self.started))

    def admitted(self) -> None:
        self.prefill_s += self._now() - self._t0

    def _timed(self) -> tuple[float, float]:
        return self.target.seconds, self.drafter.seconds if self.drafter is not None else 0.0

    def stepping(self) -> None:
        self._t0 = self._now()
        self._timed0 = self._timed()

    def stepped(self, emitted: dict[int, int], finished: list[int]) -> None:
        now = self._now()
        self.round_s += now - self._t0
        (target, drafter), (target0, drafter0) = self._timed(), self._timed0
        self.verify_s += target - target0
        self.draft_s += drafter - drafter0
        self.rounds += 1
        for i, count in emitted.items():
            self.traces[i].events.append((now - self.started, count))
        for i in finished:
            self.traces[i].finished = now - self.started


def module_bytes(model_owner: Any) -> int | None:
    """Bytes of the parameters and buffers of the module a target or drafter runs (found as
    itself, `.model` or `.lm.model`); None when there is none to measure."""
    for owner in (
        model_owner,
        getattr(model_owner, "model", None),
        getattr(getattr(model_owner, "lm", None), "model", None),
    ):
        if isinstance(owner, torch.nn.Module):
            tensors = [*owner.parameters(), *owner.buffers()]
            return sum(t.numel() * t.element_size() for t in tensors)
    return None


def cache_bytes(model_owner: Any) -> int | None:
    """Bytes of the ragged KV cache a target or drafter holds (`.lm.cache`), as allocated for the
    run; None when it keeps none that losscheck knows."""
    cache = getattr(getattr(model_owner, "lm", None), "cache", None)
    if cache is None or not hasattr(cache, "keys"):
        return None
    tensors = [*cache.keys.values(), *cache.values.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def request_problems(requests: Sequence[RequestTrace], eos: int | None) -> list[str]:
    """What is inconsistent in the requests of a run: a request that emitted nothing or more than its
    budget, stopped short without EOS, or whose emission events do not add up to its tokens."""
    problems = []
    for i, r in enumerate(requests):
        n, budget = r.output_tokens, r.request.max_new
        if not 1 <= n <= budget:
            problems.append(f"request {i} emitted {n} tokens with a budget of {budget}")
        elif n < budget and (eos is None or r.tokens[-1] != eos):
            problems.append(f"request {i} stopped after {n} of {budget} tokens without EOS")
        if sum(count for _, count in r.events) != n:
            problems.append(f"request {i}: emission events add up to {sum(c for _, c in r.events)} tokens, it has {n}")
    return problems


def trace_problems(trace: ServeTrace, k: int, eos: int | None) -> list[str]:
    """What is inconsistent in a run's accounting (empty when nothing): every request finished
    within its budget, stopping short only at EOS; its emission events add up to its tokens; τ
    lies in [1, k + 1]; the drafter and target times fit inside the rounds."""
    problems = request_problems(trace.requests, eos)
    tau = trace.stats.acceptance_length
    if not 1 <= tau <= k + 1:
        problems.append(f"acceptance length {tau:.3f} outside [1, {k + 1}]")
    if trace.draft_s + trace.verify_s > trace.round_s * (1 + 1e-6):
        problems.append(
            f"drafter {trace.draft_s:.4f} s + target {trace.verify_s:.4f} s exceed the rounds' {trace.round_s:.4f} s"
        )
    return problems
