"""The greedy phase of a black-box engine cell: speculation on == off, token for token."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from losscheck.cells.engine.handle import as_generation, engine_of, min_horizon, request, with_engine_facts
from losscheck.cells.outcome import CellOutcome
from losscheck.cells.record import SampleFacts
from losscheck.core.divergence import find_divergences
from losscheck.core.sampling import GREEDY
from losscheck.plan.cell import OWN_TARGET
from losscheck.run.context import CellContext

if TYPE_CHECKING:
    from losscheck.cells.engine.phases import EngineDraws


def engine_greedy(ctx: CellContext) -> EngineDraws:
    """Speculation on == off, token for token, on every prompt of every tier: one round, every
    tier's speculative and plain requests."""
    cell, engine = ctx.cell, engine_of(ctx)
    max_new = max(ctx.profile.greedy_max_new, min_horizon(engine))
    # Margins need the engine's target: in fp32 every divergence fails, below it a margin within
    # the precision's round-off is a near-tie; without the target (two-sample mode) none is.
    scorable = cell.target != OWN_TARGET
    tolerance = cell.precision.tolerance if scorable and cell.precision.reduced else 0.0
    tiers = ctx.prompt_tiers
    asked = [
        request(ctx, prompts=ctx.prompts(tier), n=1, params=GREEDY, horizon=max_new, speculative=side)
        for side in (True, False)
        for tier in tiers
    ]
    drawn = yield tuple(asked)
    vocab, eos = ctx.engine_vocab()
    outcome = CellOutcome(cell, strict=ctx.strict)
    for t, tier in enumerate(tiers):
        on, off = (as_generation(drawn[s * len(tiers) + t][:, 0], eos, engine.k, GREEDY, vocab) for s in (0, 1))
        # the target is loaded only where on and off differ: a margin to read
        model = ctx.engine_target().model if scorable and not torch.equal(on.tokens, off.tokens) else None
        outcome.divergences += find_divergences(model, tier, ctx.prompts(tier), on, off, tolerance)
    prompts = sum(len(ctx.prompts(tier)) for tier in tiers)
    outcome.facts = with_engine_facts(
        ctx, SampleFacts(prompts=prompts, max_new_tokens=max_new, near_tie_margin=tolerance)
    )
    return outcome
