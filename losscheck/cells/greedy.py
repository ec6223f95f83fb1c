"""Greedy cells: speculative output equals plain target decoding, token for token."""

from __future__ import annotations

from functools import partial

from losscheck.cells.ends import end_problems
from losscheck.cells.outcome import CellOutcome, oracle_problems, with_rule
from losscheck.cells.record import SampleFacts
from losscheck.core.divergence import find_divergences
from losscheck.core.generation import Generation
from losscheck.core.sampling import GREEDY, make_generator
from losscheck.plan.cell import ENGINE, ORACLE
from losscheck.run.context import CellContext
from losscheck.run.memo import GreedyBaseline
from losscheck.serving.axis import Call, requests, rounds_differently


def run_greedy(ctx: CellContext) -> CellOutcome:
    """Spec output == baseline output, token for token, on every prompt of every tier."""
    cell, target = ctx.cell, ctx.target
    max_new = ctx.profile.greedy_max_new
    # In fp32 every divergence fails; in reduced precision, or served in a way that reduces in
    # another order (a split), one within the target's round-off is a near-tie.
    reduced = cell.precision.reduced or rounds_differently(cell.serving)
    tolerance = cell.precision.tolerance if reduced else 0.0
    outcome = CellOutcome(cell, strict=ctx.strict)
    server, serving = ctx.served()
    tiers = ctx.prompt_tiers
    asked = {tier: requests(server, serving, ctx.prompts(tier), max_new, GREEDY, tier) for tier in tiers}
    specs = server.generate([Call(asked[tier], max_new, GREEDY, (cell.id, tier)) for tier in tiers])
    for i, (tier, spec) in enumerate(zip(tiers, specs)):
        ctx.progress.update(cell.id, "prompt tiers", i, len(tiers))
        prompts = asked[tier]
        key = GreedyBaseline(cell.target, cell.precision.target, tuple(map(tuple, prompts)))
        base = ctx.memo(key, partial(_baseline, ctx, prompts, max_new, tier))
        outcome.divergences += find_divergences(target.model, tier, prompts, spec, base, tolerance)
        outcome.problems += [f"ends: {tier} prompts: {p}" for p in end_problems(spec, target.eos_id, target.vocab_size)]
        outcome.acceptance[tier] = spec.stats
    rejected = sum(int((s.reached - s.accepted).sum()) for s in outcome.acceptance.values())
    idle = sum(s.zero_drafts for s in outcome.acceptance.values())
    drafted = cell.drafter not in (ORACLE, ENGINE)  # the oracle never rejects; an engine's rounds are its own
    outcome.facts = with_rule(
        ctx,
        SampleFacts(
            prompts=sum(map(len, asked.values())),
            max_new_tokens=max_new,
            near_tie_margin=tolerance,
            rollbacks=rejected if drafted else None,
            zero_draft_rounds=idle if drafted else None,
            recurrent_state=True if getattr(target, "stateful", False) else None,
        ),
    )
    outcome.problems += oracle_problems(cell, outcome.acceptance)
    outcome.serving_facts = server.facts()
    return outcome


def _baseline(ctx: CellContext, prompts: list[list[int]], max_new: int, tier: str) -> Generation:
    """Plain decoding of `prompts` (greedy: the generator is never drawn from)."""
    generator = make_generator(ctx.seed, ctx.cell.id, tier, device=ctx.target.device)
    return ctx.baseline_engine().generate(prompts, max_new, GREEDY, generator)
