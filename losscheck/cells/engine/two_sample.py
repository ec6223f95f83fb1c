"""The two-sample phase of a black-box engine cell: speculative samples against the same engine's
samples with drafting off, sized through a proxy (`losscheck.cells.engine.proxy`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from losscheck.cells.engine.attribution import attribution_tests, row_scores
from losscheck.cells.engine.handle import engine_of, generation, min_horizon, request, with_engine_facts
from losscheck.cells.engine.proxy import proxy_confirmed, proxy_design
from losscheck.cells.outcome import CellOutcome
from losscheck.cells.record import SampleFacts
from losscheck.run.context import CellContext
from losscheck.stats.result import combine

if TYPE_CHECKING:
    from losscheck.cells.engine.phases import EngineDraws
    from losscheck.stats.result import TestResult


def two_sample(ctx: CellContext) -> EngineDraws:
    """The engine's speculative samples against its own samples with drafting off, independent seeds,
    the same number of rows from each prompt on both sides. No reference reproduces the engine's
    target (its weights or numerics are not ones losscheck loads), but losscheck's copy of it in
    fp32 is a *proxy* (`losscheck.cells.engine.proxy`): a pilot of the plain side, scored by it,
    sizes the cell by the target-side bug classes; α is split in halves between the per-position
    χ² tests and a U test of the rows' surprisal under the proxy, whose level holds whatever the
    proxy is; the tested plain rows confirm the design."""
    from losscheck.stats.two_sample import two_sample_tests

    cell, engine, profile = ctx.cell, engine_of(ctx), ctx.profile
    horizon = max(profile.two_sample_horizon, min_horizon(engine))
    prompts = ctx.all_prompts()
    alpha_positions = ctx.alpha / 2
    design = yield from proxy_design(ctx, prompts, horizon)
    n, target_tv = design.rows, design.detectable_tv
    per_prompt = math.ceil(n / len(prompts))
    drawn = yield tuple(
        request(ctx, prompts=prompts, n=per_prompt, horizon=horizon, speculative=side) for side in (True, False)
    )
    on, off = (tokens.flatten(0, 1) for tokens in drawn)  # [P*m, L] each
    vocab, bins = ctx.engine_vocab()[0], profile.two_sample_bins
    results = two_sample_tests(on, off, vocab, alpha_positions, profile.power, target_tv, max_bins=bins)
    results += _surprisal_test(ctx, prompts, drawn, ctx.alpha - alpha_positions)
    proxy = ctx.engine_target().identity.get("precision")
    facts = SampleFacts(sequences=len(on), prompts=len(prompts), horizon=horizon, proxy_precision=proxy)
    facts = proxy_confirmed(ctx, facts, design, prompts, drawn[1], horizon)
    return CellOutcome(cell, verdict=combine(cell.id, results, ctx.alpha), facts=with_engine_facts(ctx, facts))


def _surprisal_test(
    ctx: CellContext, prompts: list[list[int]], drawn: tuple[torch.Tensor, ...], alpha: float
) -> list[TestResult]:
    """The U test of the rows' surprisal under the proxy, speculative rows against plain rows
    `drawn` ([P, m, L] each) at level `alpha` (`losscheck.cells.engine.attribution`)."""

    target = ctx.engine_target()
    rows = [p for p in prompts for _ in range(drawn[0].shape[1])]
    sides = [
        row_scores(ctx, f"{ctx.cell.id}-proxy-{i}", target, rows, generation(ctx, tokens, target), 0.0)
        for i, tokens in enumerate(drawn)
    ]
    return attribution_tests(sides[0], sides[1], ("surprisal",), alpha, ctx.profile.power)
