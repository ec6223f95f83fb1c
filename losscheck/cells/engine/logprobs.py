"""A black-box engine's reported log-probabilities, speculation on and off, against the reference.

Engines that return logprobs with their samples (`losscheck.engines.ReportsLogprobs`) must report,
for every token, log p(x) under the target's processed law at its position — with drafting on as
with it off. `engine_logprob_check` draws `rows` continuations of each prompt on both sides,
teacher-forces the reference target over them and compares each reported value with it
(`losscheck.cells.logprob_check`: exact up to 2τ/T plus float32 rounding, at the positions every
cut-off implementation draws alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from losscheck.cells.logprob_check import LogprobCheck
from losscheck.cells.scoring import teacher_forced_probs
from losscheck.core.sampling import SamplingParams, derive_seed
from losscheck.engines import (
    BlackBoxEngine,
    EngineOutputError,
    GenerationRequest,
    ReportsLogprobs,
    ReportsPromptLogprobs,
    ReportsTopLogprobs,
    checked_logprobs,
    checked_samples,
    checked_top_logprobs,
    request_lengths,
)
from losscheck.errors import LosscheckError

if TYPE_CHECKING:
    from losscheck.core.target import HFTarget


def engine_logprob_check(
    engine: BlackBoxEngine,
    target: HFTarget,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    seed: int,
    *,
    rows: int = 4,
    horizon: int = 16,
    tolerance: float = 0.0,
    top: int = 0,
) -> dict[str, LogprobCheck]:
    """The check of each side ("speculative", "plain") of `engine` on `rows` rows of each of
    `prompts`, `horizon` tokens, scored by `target` (the engine's reference, logits within
    `tolerance` of the engine's); `top` > 0: the `top` most probable ids it reports at each
    position too (`ReportsTopLogprobs`)."""
    if params.greedy:
        raise LosscheckError("engine_logprob_check needs a sampled request (temperature > 0): greedy reports no law")
    if not isinstance(engine, ReportsLogprobs):
        raise LosscheckError(f"engine {getattr(engine, 'name', engine)!r} reports no logprobs (no generate_logprobs)")
    if top > target.vocab_size:
        raise LosscheckError(
            f"top={top} logprobs asked of a target with {target.vocab_size} ids; ask for at most that many"
        )
    if top and not isinstance(engine, ReportsTopLogprobs):
        raise LosscheckError(
            f"engine {getattr(engine, 'name', engine)!r} reports no top logprobs (no generate_top_logprobs)"
        )
    eos = target.eos_id if target.eos_id is not None else -1
    checks = {}
    for side, speculative in (("speculative", True), ("plain", False)):
        request = GenerationRequest(
            prompts=tuple(tuple(p) for p in prompts),
            n=rows,
            params=params,
            seed=derive_seed(seed, "logprobs", side),
            max_new_tokens=horizon,
            speculative=speculative,
            purpose="logprobs",
            logprobs=True,
            top_logprobs=top,
        )
        if top:
            assert isinstance(engine, ReportsTopLogprobs)
            tokens, reported, ids, values = engine.generate_top_logprobs(request)
            top_ids, top_values = checked_top_logprobs(engine, ids, values, request, target.vocab_size)
        else:
            tokens, reported = engine.generate_logprobs(request)
        tokens = checked_samples(engine, tokens, request, target.vocab_size, eos).flatten(0, 1)  # [N, L]
        reported = checked_logprobs(engine, reported, request)
        rows_of = [list(p) for p in request.prompts for _ in range(rows)]
        forced = teacher_forced_probs(target, rows_of, tokens.to(target.device), params, tolerance)
        generated = (torch.arange(horizon) < request_lengths(tokens, eos, params, target.vocab_size)[:, None]).to(
            forced.probs.device
        )
        check = LogprobCheck(tolerance, params.temperature)
        check.observe(reported.flatten(0, 1), tokens, generated & ~forced.ambiguous, forced.probs)
        if top:
            check.observe_top(
                top_ids.flatten(0, 1), top_values.flatten(0, 1), generated & ~forced.ambiguous, forced.probs
            )
        checks[side] = check
    return checks


def engine_prompt_logprob_check(
    engine: BlackBoxEngine, target: HFTarget, prompts: Sequence[Sequence[int]], *, tolerance: float = 0.0
) -> dict[str, LogprobCheck]:
    """The check of each side ("speculative", "plain") of `engine`'s reported prompt logprobs
    (`ReportsPromptLogprobs`): each prompt token's log p given the tokens before it, against the
    reference `target`'s raw law (one forward of each prompt; logits within `tolerance`)."""
    name = getattr(engine, "name", engine)
    if not isinstance(engine, ReportsPromptLogprobs):
        raise LosscheckError(f"engine {name!r} reports no prompt logprobs (no prompt_logprobs)")
    checks = {}
    for side, speculative in (("speculative", True), ("plain", False)):
        reported = engine.prompt_logprobs([list(p) for p in prompts], speculative)
        if len(reported) != len(prompts):
            raise EngineOutputError(
                f"engine {name!r}: prompt_logprobs gave {len(reported)} rows for {len(prompts)} prompts"
            )
        check = LogprobCheck(tolerance)
        for i, (prompt, values) in enumerate(zip(prompts, reported, strict=True)):
            values = torch.as_tensor(values, dtype=torch.float64)
            if tuple(values.shape) != (len(prompt) - 1,) or values.isnan().any():
                raise EngineOutputError(
                    f"engine {name!r}: prompt {i}'s logprobs have shape {tuple(values.shape)}, expected "
                    f"({len(prompt) - 1},) without NaN: one for each prompt token after the first"
                )
            ids = torch.tensor([list(prompt)], device=target.device)  # [1, P]
            with torch.no_grad():
                probs = target.model(ids).logits[:, :-1].double().softmax(-1)  # [1, P-1, V] predicting tokens 1..
            read = torch.ones(1, len(prompt) - 1, dtype=torch.bool)
            check.observe(values[None], ids[:, 1:], read, probs)
        checks[side] = check
    return checks
