"""Continuous batching: requests admitted into rows freed mid-generation, as serving engines
schedule them, driving the public `Engine.step` / `Engine.prefill`.

Requests arrive at given rounds (staggered). Before every round, the arrived requests waiting in
the queue take the rows that are free (their request finished at EOS or at its budget): the rows'
tokens, lengths and budgets are replaced, their prompts prefilled alone (`Engine.prefill` of those
rows, through the prefix cache when the engine has one), and the drafter forgets them. Rows whose
request is still running are untouched, so a request shares its rounds with requests admitted
before and after it. Output is per request, in request order, as `Engine.generate` returns it.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from losscheck.core.contract import AdmitsRows, Drafter, ForgetsRows
from losscheck.core.engine import Batch, Engine, pad_prompts
from losscheck.core.generation import DraftQ, Generation, LoopStats
from losscheck.core.sampling import SamplingParams, make_generator
from losscheck.errors import LosscheckError
from losscheck.serving.axis import UNBOUNDED, Axis, Call, ServeContext, Server, Wrapped


def staggered_arrivals(n: int, rows: int, max_new: int, generator: torch.Generator) -> list[int]:
    """Arrival rounds of `n` requests: the first `rows` at round 0, the rest as a Poisson stream
    of `rows / ceil(max_new / 2)` requests per round, so that rows free up and take new requests
    at different rounds while others run (a request lasts max_new / (k + 1) to max_new rounds)."""
    rate = rows / max(1, -(-max_new // 2))
    gaps = torch.empty(max(n - rows, 0), dtype=torch.float64).exponential_(rate, generator=generator)
    return [0] * min(n, rows) + gaps.cumsum(0).floor().long().tolist()


class Observer(Protocol):
    """Watches a continuous-batching run (the perf tier times it): told before and after each
    admission and each round."""

    def admitting(self, requests: list[int]) -> None: ...

    def admitted(self) -> None: ...

    def stepping(self) -> None: ...

    def stepped(self, emitted: dict[int, int], finished: list[int]) -> None:
        """After a round: tokens emitted per request that emitted, and the requests that ended."""
        ...


class ContinuousBatcher:
    """Runs requests through `engine` in `rows` rows with continuous admission: the one scheduler
    of losscheck (the serving axis below, and the perf tier's closed loop)."""

    def __init__(self, engine: Engine, rows: int) -> None:
        if rows < 1:
            raise LosscheckError(f"continuous batching needs at least one row, got {rows}")
        self.engine = engine
        self.rows = rows

    def capacity(self, longest: int, max_new: int) -> int:
        """Slots per row: a request's longest life plus the junk a prefill writes past a row's
        pending slot (`Engine.prefill`)."""
        return 2 * longest + max_new + self.engine.k + 1

    def generate(
        self,
        prompts: Sequence[list[int]],
        max_new_tokens: int | Sequence[int],
        params: SamplingParams,
        generator: torch.Generator,
        arrivals: Sequence[int] | None = None,
        observer: Observer | None = None,
    ) -> Generation:
        """Up to `max_new_tokens` tokens (one budget, or one per request) for every prompt; request
        i arrives at round `arrivals[i]` (default: all at round 0, a closed loop)."""
        engine, target = self.engine, self.engine.target
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        arrivals = [0] * len(prompts) if arrivals is None else arrivals
        if len(budgets) != len(prompts) or min(budgets, default=1) < 1:
            raise LosscheckError(
                "continuous batching needs max_new_tokens >= 1 (an output budget >= 1 for every prompt), "
                f"got {max_new_tokens}"
            )
        if len(arrivals) != len(prompts):
            raise LosscheckError(f"{len(arrivals)} arrival rounds for {len(prompts)} prompts")
        pad_prompts(list(prompts), target.vocab_size)  # validates ids and emptiness, naming the prompt
        longest, most = max(map(len, prompts)), max(budgets)
        if longest + most > target.max_positions:
            raise LosscheckError(
                f"a prompt of {longest} tokens plus max_new_tokens={most} exceeds the target's "
                f"{target.max_positions} positions; shorten the prompt or the budget"
            )
        rows = min(self.rows, len(prompts))
        batch = self._empty(rows, self.capacity(longest, most), params)
        stats = LoopStats.empty(engine.k)
        out = torch.zeros(len(prompts), most, dtype=torch.long)
        slots = torch.zeros_like(out)
        draft_q = None
        if batch.q_ids is not None and batch.q_probs is not None:
            entries = batch.q_ids.shape[2]
            draft_q = DraftQ(
                torch.zeros(len(prompts), most, entries, dtype=torch.long), torch.zeros(len(prompts), most, entries)
            )
        logprobs = None if batch.logprob_of is None else torch.zeros(len(prompts), most)
        counts = torch.zeros(len(prompts), dtype=torch.long)
        queue = deque(sorted(range(len(prompts)), key=lambda i: arrivals[i]))
        request_of: list[int | None] = [None] * rows
        now = 0
        while queue or any(i is not None for i in request_of):
            free = [b for b, i in enumerate(request_of) if i is None]
            admitted = []
            while free and queue and arrivals[queue[0]] <= now:
                admitted.append((free.pop(0), queue.popleft()))
            if admitted:
                if observer is not None:
                    observer.admitting([i for _, i in admitted])
                for b, i in admitted:
                    request_of[b] = i
                self._admit(
                    batch,
                    [b for b, _ in admitted],
                    [prompts[i] for _, i in admitted],
                    [budgets[i] for _, i in admitted],
                )
                if observer is not None:
                    observer.admitted()
            if bool(batch.done.all()):
                now = arrivals[queue[0]]  # nothing running: the clock jumps to the next arrival
                continue
            before, owners = batch.lengths, list(request_of)
            if observer is not None:
                observer.stepping()
            engine.step(batch, params, generator, stats)
            now += 1
            finished = []
            for b in batch.done.nonzero().squeeze(1).tolist():
                i = request_of[b]
                if i is None:
                    continue
                start, end = int(batch.prompt_lengths[b]), int(batch.lengths[b])
                out[i, : end - start] = batch.tokens[b, start:end].cpu()
                assert batch.slot_of is not None  # `_empty` keeps the slots
                slots[i, : end - start] = batch.slot_of[b, start:end].cpu()
                if draft_q is not None and batch.q_ids is not None and batch.q_probs is not None:
                    draft_q.ids[i, : end - start] = batch.q_ids[b, start:end].cpu()
                    draft_q.probs[i, : end - start] = batch.q_probs[b, start:end].cpu()
                if logprobs is not None and batch.logprob_of is not None:
                    logprobs[i, : end - start] = batch.logprob_of[b, start:end].cpu()
                counts[i] = end - start
                request_of[b] = None
                finished.append(i)
            if observer is not None:
                emitted = (batch.lengths - before).tolist()
                observer.stepped(
                    {i: emitted[b] for b, i in enumerate(owners) if i is not None and emitted[b]}, finished
                )
        return Generation(out, counts, stats, params, slots=slots, draft_q=draft_q, logprobs=logprobs)

    def _empty(self, rows: int, capacity: int, params: SamplingParams) -> Batch:
        """`rows` finished rows with no request: the state before the first admission."""
        device = self.engine.target.device
        ones = torch.ones(rows, dtype=torch.long, device=device)
        tokens = torch.zeros(rows, capacity, dtype=torch.long, device=device)
        done = torch.ones(rows, dtype=torch.bool, device=device)
        return self.engine.new_batch(tokens, ones, done, torch.zeros_like(ones), params)

    def _place(self, batch: Batch, row: int, prompt: list[int]) -> int:
        """Write `prompt` into the freed `row`, from slot 0 (a fresh row) → the row's length."""
        batch.tokens[row, : len(prompt)] = torch.tensor(prompt, device=batch.tokens.device)
        return len(prompt)

    def _admit(self, batch: Batch, rows: list[int], prompts: list[list[int]], budgets: list[int]) -> None:
        """Put `prompts` into the finished `rows` of `batch` and prefill them."""
        device = batch.tokens.device
        lengths, prompt_lengths = batch.lengths.clone(), batch.prompt_lengths.clone()
        budget = torch.as_tensor(batch.budget, device=device).clone()
        done = batch.done.clone()
        for b, prompt, max_new in zip(rows, prompts, budgets):
            lengths[b] = prompt_lengths[b] = self._place(batch, b, prompt)
            budget[b], done[b] = max_new, False
        # New tensors, not in-place writes: a drafter may hold the old lengths.
        batch.lengths, batch.prompt_lengths, batch.budget, batch.done = lengths, prompt_lengths, budget, done
        index = torch.tensor(rows, device=device)
        self.engine.prefill(batch, index)
        if self.engine.drafter is not None:
            admit_drafter_rows(self.engine.drafter, batch, index)


def admit_drafter_rows(drafter: Drafter, batch: Batch, rows: torch.Tensor) -> None:
    """Make `drafter` treat `rows` [n] of `batch` as the new requests just put there, keeping the
    other rows' state: a drafter that `AdmitsRows` reads them now, any other forgets them. A
    proxy of a drafter (the perf tier's timer, a stress variant) names it as `__wrapped__`, as
    `functools.wraps` does."""
    drafter = inspect.unwrap(drafter)  # type: ignore[arg-type]  # any object with __wrapped__
    if isinstance(drafter, AdmitsRows):
        drafter.admit_rows(batch.tokens, batch.lengths, rows)
    else:
        forget_rows(drafter, rows)


def forget_rows(drafter: Drafter, rows: torch.Tensor) -> None:
    """Make `drafter` treat `rows` [n] as new requests, keeping the other rows' state: the
    `Drafter` protocol resets whole batches only, so continuous batching needs `ForgetsRows`."""
    drafter = inspect.unwrap(drafter)  # type: ignore[arg-type]  # see admit_drafter_rows
    if not isinstance(drafter, ForgetsRows):
        raise LosscheckError(
            f"drafter {drafter.name!r} ({type(drafter).__name__}) has no forget_rows(rows) method; continuous "
            "batching admits new requests into finished rows of a running batch, so a drafter must drop the state "
            "of those rows (rows: LongTensor [n]) as reset() does for all of them (a stateless drafter: a method "
            "that does nothing)"
        )
    drafter.forget_rows(rows)


# --- the serving axis ----------------------------------------------------------------------------
@runtime_checkable
class PlantsScheduler(Protocol):
    """A planted bug that replaces the continuous-batching scheduler (`losscheck.run.plant.Plant`)."""

    @property
    def scheduler(self) -> type[ContinuousBatcher] | None:
        """A planted scheduler class; None leaves the scheduler as it is."""
        ...


class ContinuouslyBatched(Wrapped):
    """Each call served by continuous batching: a quarter as many rows as requests (at least 4,
    at most the run's batch limit), arrivals staggered by a draw from the call's own stream."""

    def __init__(self, mode: str, inner: Server, context: ServeContext) -> None:
        super().__init__(inner)
        if inner.engine is None:
            raise LosscheckError("continuous batching schedules the engine in this process; this cell has none")
        self.context = context
        planted = context.plant.scheduler if isinstance(context.plant, PlantsScheduler) else None
        self.scheduler: type[ContinuousBatcher] = planted or ContinuousBatcher

    def call_rows(self, rows: int) -> int:
        return UNBOUNDED  # one stream of requests: the scheduler sizes its rows itself

    def generate(self, calls: Sequence[Call]) -> list[Generation]:
        assert self.engine is not None
        device = self.engine.target.device
        out = []
        for call in calls:
            n = len(call.prompts)
            rows = min(max(4, n // 4), self.context.max_rows)
            arrival_stream = make_generator(self.context.seed, self.context.cell_id, "arrivals", n)
            arrivals = staggered_arrivals(n, rows, call.max_new_tokens, arrival_stream)
            generator = call.generator(self.context.seed, device)
            scheduler = self.scheduler(self.engine, rows)
            out.append(scheduler.generate(call.prompts, call.max_new_tokens, call.params, generator, arrivals))
        return out


AXIS = Axis(
    name="batching",
    off="static",
    values=("continuous",),
    suffix=lambda mode: "cb",
    serve=ContinuouslyBatched,
    order=3,
    doc="continuous batching: staggered arrivals admitted into rows freed mid-generation",
    pairs=({"prefix": "warm"},),
)
