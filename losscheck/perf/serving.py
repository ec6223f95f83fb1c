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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from losscheck.core.contract import Drafter, Target
from losscheck.core.engine import Batch, Engine, pad_prompts
from losscheck.core.generation import LoopStats
from losscheck.core.precision import synchronize
from losscheck.core.ragged import RaggedLM, forward_rows
from losscheck.core.sampling import SamplingParams
from losscheck.core.target import HFTarget
from losscheck.errors import LosscheckError
from losscheck.perf.workload import Request
from losscheck.serving.batching import admit_drafter_rows, forget_rows  # noqa: F401  (forget_rows: re-exported)


class Timed:
    """`inner` with the methods `methods` timed into `seconds` (the device synchronised before
    both clock reads, so queued kernels count); every other attribute is `inner`'s."""

    def __init__(self, inner: Any, methods: Sequence[str], device: torch.device) -> None:
        self.inner = inner
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
    """Run `requests` with at most `concurrency` in flight; `drafter=None` is the baseline."""
    if concurrency < 1:
        raise LosscheckError(f"concurrency must be >= 1, got {concurrency}")
    prompts = [r.prompt for r in requests]
    pad_prompts(prompts, target.vocab_size)  # validates ids and emptiness, naming the prompt
    if min(r.max_new for r in requests) < 1:
        raise LosscheckError("every request needs an output budget >= 1")
    device = target.device
    timed_target = Timed(target, ("forward",), device)
    timed_drafter = Timed(drafter, ("propose", "commit"), device) if drafter is not None else None
    engine = Engine(timed_target, timed_drafter, k)  # type: ignore[arg-type]  # proxies of both
    longest, most = max(map(len, prompts)), max(r.max_new for r in requests)
    if longest + most > target.max_positions:
        raise LosscheckError(
            f"a prompt of {longest} tokens plus an output budget of {most} exceeds the target's "
            f"{target.max_positions} positions; shorten the prompts or lower the profile's max_new"
        )
    # Room for a row's longest life plus the junk a prefill writes past its pending slot.
    capacity = 2 * longest + most + engine.k + 1
    batch = _empty_batch(concurrency, capacity, target, drafter)
    target.reset(concurrency, capacity)
    if drafter is not None:
        drafter.reset(concurrency, capacity)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    queue = deque(range(len(requests)))
    row_of: list[int | None] = [None] * concurrency  # request index in each row
    traces: list[RequestTrace | None] = [None] * len(requests)
    stats = LoopStats.empty(engine.k)
    rounds, round_s, prefill_s = 0, 0.0, 0.0
    synchronize(device)
    started = time.perf_counter()
    while True:
        free = [b for b, i in enumerate(row_of) if i is None]
        admitted = [(b, queue.popleft()) for b in free[: len(queue)]]
        if admitted:
            t0 = time.perf_counter()
            for b, i in admitted:
                row_of[b] = i
                traces[i] = RequestTrace(requests[i], t0 - started)
            _admit(batch, target, drafter, [b for b, _ in admitted], [requests[i] for _, i in admitted])
            synchronize(device)
            prefill_s += time.perf_counter() - t0
        if bool(batch.done.all()):
            break
        before = batch.lengths
        t0 = time.perf_counter()
        engine.step(batch, params, generator, stats)
        synchronize(device)
        now = time.perf_counter()
        round_s += now - t0
        rounds += 1
        emitted, done = (batch.lengths - before).tolist(), batch.done.tolist()
        for b, i in enumerate(row_of):
            if i is None:
                continue
            trace = traces[i]
            assert trace is not None
            if emitted[b]:
                trace.events.append((now - started, emitted[b]))
            if done[b]:
                trace.finished = now - started
                start = int(batch.prompt_lengths[b])
                trace.tokens = batch.tokens[b, start : int(batch.lengths[b])].tolist()
                row_of[b] = None
    wall = time.perf_counter() - started
    memory = {
        "target_weights_bytes": module_bytes(target),
        "drafter_weights_bytes": module_bytes(drafter) if drafter is not None else 0,
        "target_kv_bytes": cache_bytes(target),
        "drafter_kv_bytes": cache_bytes(drafter) if drafter is not None else 0,
        "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    drafted = timed_drafter.seconds if timed_drafter is not None else 0.0
    done_traces = [t for t in traces if t is not None]
    return ServeTrace(
        concurrency, done_traces, stats, wall, rounds, round_s, drafted, timed_target.seconds, prefill_s, memory
    )


def _empty_batch(rows: int, capacity: int, target: Target, drafter: Drafter | None) -> Batch:
    """`rows` finished rows with no request: the state before the first admission."""
    device = target.device
    ones = torch.ones(rows, dtype=torch.long, device=device)
    hidden = None
    if drafter is not None and drafter.uses_hidden:
        hidden = torch.zeros(rows, capacity, target.hidden_size, device=device)
    tokens = torch.zeros(rows, capacity, dtype=torch.long, device=device)
    done = torch.ones(rows, dtype=torch.bool, device=device)
    return Batch(tokens, ones, ones.clone(), hidden, done, torch.zeros_like(ones))


def _admit(batch: Batch, target: Target, drafter: Drafter | None, rows: list[int], requests: list[Request]) -> None:
    """Put `requests` into the finished `rows` of `batch` and prefill their prompts."""
    device = batch.tokens.device
    pending = batch.lengths - 1  # [B] the slot each other row's junk starts at (see module doc)
    lengths, prompt_lengths = batch.lengths.clone(), batch.prompt_lengths.clone()
    budget, done = torch.as_tensor(batch.budget, device=device).clone(), batch.done.clone()
    read = max(len(r.prompt) for r in requests) - 1  # prompt tokens before each pending one
    index = torch.tensor(rows, device=device)  # [n]
    ids = torch.zeros(len(rows), max(read, 0), dtype=torch.long, device=device)  # [n, read], right-padded
    for j, (b, request) in enumerate(zip(rows, requests)):
        prompt = torch.tensor(request.prompt, device=device)
        batch.tokens[b, : len(prompt)] = prompt
        ids[j, : len(prompt) - 1] = prompt[:-1]
        lengths[b] = prompt_lengths[b] = len(prompt)
        budget[b], done[b] = request.max_new, False
    # New tensors, not in-place writes: a drafter may hold the old lengths.
    batch.lengths, batch.prompt_lengths, batch.budget, batch.done = lengths, prompt_lengths, budget, done
    if read > 0:
        if isinstance(target, HFTarget) and _allocated(target.lm):
            states = target.checked(forward_rows(target.lm, index, ids, torch.zeros_like(index)))[1]  # [n, read, H]
        else:  # any Target, or the first admission: one pass over every row, junk for the others
            every = torch.zeros(len(done), read, dtype=torch.long, device=device)  # [B, read]
            every[index] = ids
            states = target.forward(every, pending.index_fill(0, index, 0))[1][index]
        if batch.hidden is not None:
            batch.hidden[index, :read] = states.float()
    if drafter is not None:
        admit_drafter_rows(drafter, batch, index)


def _allocated(lm: RaggedLM) -> bool:
    """The ragged cache holds its buffers (allocated by the first forward of the batch)."""
    return lm.cache is not None and bool(lm.cache.keys)


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


def trace_problems(trace: ServeTrace, k: int, eos: int | None) -> list[str]:
    """What is inconsistent in a run's accounting (empty when nothing): every request finished
    within its budget, stopping short only at EOS; its emission events add up to its tokens; τ
    lies in [1, k + 1]; the drafter and target times fit inside the rounds."""
    problems = []
    for i, r in enumerate(trace.requests):
        n, budget = r.output_tokens, r.request.max_new
        if not 1 <= n <= budget:
            problems.append(f"request {i} emitted {n} tokens with a budget of {budget}")
        elif n < budget and (eos is None or r.tokens[-1] != eos):
            problems.append(f"request {i} stopped after {n} of {budget} tokens without EOS")
        if sum(count for _, count in r.events) != n:
            problems.append(f"request {i}: emission events add up to {sum(c for _, c in r.events)} tokens, it has {n}")
    tau = trace.stats.acceptance_length
    if not 1 <= tau <= k + 1:
        problems.append(f"acceptance length {tau:.3f} outside [1, {k + 1}]")
    if trace.draft_s + trace.verify_s > trace.round_s * (1 + 1e-6):
        problems.append(
            f"drafter {trace.draft_s:.4f} s + target {trace.verify_s:.4f} s exceed the rounds' {trace.round_s:.4f} s"
        )
    return problems
