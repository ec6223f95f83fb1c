"""The engine handle of a black-box engine cell: the cell's engine, its requests and what its
answers become (`Generation`s, facts), its draft model and where its rows' first token comes from.
Every phase of the engine cell (`losscheck.cells.engine`) reads its engine through these."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from losscheck.cells.record import SampleFacts
from losscheck.core.generation import Generation, LoopStats
from losscheck.core.sampling import SamplingParams, derive_seed
from losscheck.engines import BlackBoxEngine, DraftModel, GenerationRequest, request_lengths
from losscheck.errors import LosscheckError, flag
from losscheck.plan import profiles
from losscheck.run.context import CellContext
from losscheck.run.memo import EngineDrafter
from losscheck.stats import registry

if TYPE_CHECKING:
    from losscheck.core.target import HFTarget
    from losscheck.stats.hidden_rounds import FirstToken

NO_SLOTS = frozenset({registry.SLOTS})  # an engine reports no slots: no slot test and no α share for one
# A one-sample cell's power sums (what confirms its design) read this many tokens of its tested
# sample, the first rows of every prompt: per-token effects are estimated there, the tests read all.
CONFIRM_TOKENS = 4_096


def engine_of(ctx: CellContext) -> BlackBoxEngine:
    """The cell's engine; `LosscheckError` naming the flag when the run has none."""
    if ctx.engine is None:
        raise LosscheckError(f"black-box cells need {flag('engine')}=pkg.mod:factory")
    return ctx.engine


def min_horizon(engine: BlackBoxEngine) -> int:
    """Two full rounds and the bonus slot of the second: 2k + 2 generated tokens."""
    return profiles.min_horizon(engine.k)


def request(
    ctx: CellContext,
    *,
    prompts: list[list[int]],
    n: int,
    horizon: int,
    speculative: bool,
    params: SamplingParams | None = None,
    purpose: str = "",
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> GenerationRequest:
    """A request for `n` continuations of each prompt, whose answer is a validated LongTensor
    [len(prompts), n, horizon] (EOS-padded; with `logprobs`, then their reported log-probabilities),
    seeded from the run seed, the cell, the side and the `purpose` ("pilot": a sample of its own,
    never tested); `params` the cell's unless given."""
    side = "speculative" if speculative else "baseline"
    seed = derive_seed(ctx.seed, ctx.cell.id, *((side, purpose) if purpose else (side,)))
    return GenerationRequest(
        prompts=tuple(map(tuple, prompts)),
        n=n,
        params=ctx.cell.params if params is None else params,
        seed=seed,
        max_new_tokens=horizon,
        speculative=speculative,
        purpose=purpose or "sample",
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def pilot_request(
    ctx: CellContext, prompts: list[list[int]], horizon: int, speculative: bool
) -> tuple[GenerationRequest, int]:
    """A cell's pilot of one side at its parameters (a seed of its own, never tested): one row per
    prompt, at least the profile's `engine_pilot_sequences` rows; with its rows per prompt."""
    per_prompt = max(1, math.ceil(ctx.profile.engine_pilot_sequences / len(prompts)))
    asked = request(
        ctx,
        prompts=prompts,
        n=per_prompt,
        horizon=horizon,
        speculative=speculative,
        purpose="pilot",
    )
    return asked, per_prompt


def as_generation(tokens: torch.Tensor, eos: int, k: int, params: SamplingParams, vocab: int) -> Generation:
    """EOS-padded engine rows `tokens` [N, L] as a `Generation`, each ending at its first EOS or stop
    id of `params`, or the token that completes a stop string (no loop counters: a black box
    reports none; `vocab` the target's vocabulary size)."""
    return Generation(tokens, request_lengths(tokens, eos, params, vocab), LoopStats.empty(k), params)


def with_engine_facts(ctx: CellContext, facts: SampleFacts) -> SampleFacts:
    """`facts` with the engine's name, block length and the cell's test mode."""
    engine = engine_of(ctx)
    return dataclasses.replace(facts, engine=engine.name, engine_k=engine.k, mode=ctx.cell.mode)


def generation(
    ctx: CellContext,
    tokens: torch.Tensor,
    target: HFTarget,
    logprobs: torch.Tensor | None = None,
    top_ids: torch.Tensor | None = None,
    top_logprobs: torch.Tensor | None = None,
) -> Generation:
    """Engine samples [P, m, L] as one `Generation` on the target's device, with the engine's
    reported `logprobs` [P, m, L] of them when it gave them, and its top ids and their
    log-probabilities [P, m, L, N] when asked."""
    vocab, eos = ctx.engine_vocab()
    gen = as_generation(tokens.flatten(0, 1), eos, engine_of(ctx).k, ctx.cell.params, vocab)
    gen.tokens, gen.lengths = gen.tokens.to(target.device), gen.lengths.to(target.device)
    if logprobs is not None:
        gen.logprobs = logprobs.flatten(0, 1)
    if top_ids is not None and top_logprobs is not None:
        gen.top_ids, gen.top_logprobs = top_ids.flatten(0, 1), top_logprobs.flatten(0, 1)
    return gen


def draft_model_of(ctx: CellContext) -> DraftModel | None:
    """The engine's draft model, wrapped as a teacher-forceable target, once per run, on the CPU
    until a cell scores (then on the run's device beside the reference target,
    `CellContext.hold_draft`); None: it gives none."""
    from losscheck.cells.engine.rounds import as_target
    from losscheck.engines import draft_model

    engine = engine_of(ctx)

    def load() -> DraftModel | None:
        given = draft_model(engine, ctx.engine_vocab()[0])
        if given is None:
            return None
        model = given.model
        if next(model.parameters()).device.type != "cpu":  # the engine's own module: losscheck moves a copy
            model = copy.deepcopy(model)
        held = ctx.hold_draft(as_target(model.to("cpu"), f"{engine.name} draft model"))
        return dataclasses.replace(given, model=held)

    return ctx.memo(EngineDrafter(engine.name), load)


def first_token(engine: BlackBoxEngine) -> FirstToken | None:
    """Where `engine` says its rows' first token comes from (`first_token`; None: not said, and
    the round filter mixes both)."""
    from losscheck.stats.hidden_rounds import FIRST_TOKEN

    first = getattr(engine, "first_token", None)
    if first is not None and first not in FIRST_TOKEN:
        raise LosscheckError(
            f"engine {engine.name!r}: first_token = {first!r}; declare one of {FIRST_TOKEN} or leave it out"
        )
    return first
