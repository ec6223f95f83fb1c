"""Planted bugs in the log-probabilities the engine reports (`losscheck.core.logprobs.emitted_logprobs`
is the correct rule): each reports something other than log p_j(x) for the token at slot j. The
tokens themselves are untouched, so only the cells' logprob check can see them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from losscheck.core.logprobs import emitted_logprobs

if TYPE_CHECKING:
    from losscheck.core.contract import Target
    from losscheck.core.target import HFTarget
    from losscheck.engines.request import GenerationRequest


def logprobs_zero(probs: torch.Tensor, tokens: torch.Tensor, draft_probs: torch.Tensor | None) -> torch.Tensor:
    """Every logprob 0.0 on the speculative path (the shape of llama.cpp #27972)."""
    return torch.zeros(tokens.shape, device=tokens.device)  # BUG: nothing computed


def logprobs_of_draft(probs: torch.Tensor, tokens: torch.Tensor, draft_probs: torch.Tensor | None) -> torch.Tensor:
    """An accepted draft reported with the drafter's log q(x), not the target's log p(x); the
    recovered and bonus tokens (which the draft did not propose) with log p."""
    reported = emitted_logprobs(probs, tokens, draft_probs)  # [B, k+1]
    if draft_probs is None:  # a deterministic drafter reports no q to mix up
        return reported
    k = draft_probs.shape[1]
    q = draft_probs.float() / draft_probs.float().sum(-1, keepdim=True)
    q_token = q.gather(-1, tokens[:, :k, None]).squeeze(-1)  # [B, k]
    drafted = torch.where(q_token > 0, q_token.log(), reported[:, :k])  # BUG: the draft's law
    return torch.cat([drafted, reported[:, k:]], dim=1)


def logprobs_of_next_position(
    probs: torch.Tensor, tokens: torch.Tensor, draft_probs: torch.Tensor | None
) -> torch.Tensor:
    """Logprobs read from a buffer a later write overwrote (logits not cloned: the shape of vLLM
    #30846): the token at slot j reported under the law at slot j + 1 (the last slot under its own)."""
    shifted = torch.cat([probs[:, 1:], probs[:, -1:]], dim=1)  # BUG: each slot's row holds the next one's
    return shifted.gather(-1, tokens[..., None]).squeeze(-1).log()


class LogprobsZeroWhenSpeculating:
    """A black-box engine wrapper (`losscheck.engines.ReportsLogprobs`) whose speculative calls
    report every logprob as 0.0 (the shape of llama.cpp #27972); its plain calls as they are."""

    def __init__(self, engine: Any) -> None:
        self.inner = engine
        self.name, self.k, self.precision = f"{engine.name}+zero-logprobs", engine.k, engine.precision

    def __getattr__(self, name: str) -> Any:  # the draft model, counters, pins: the engine's
        return getattr(self.inner, name)

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        return self.inner.generate(request)

    def generate_logprobs(self, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, reported = self.inner.generate_logprobs(request)
        return tokens, torch.zeros_like(reported) if request.speculative else reported  # BUG: zeros


def logprobs_zero_when_speculating(target: Target) -> LogprobsZeroWhenSpeculating:
    """losscheck's loop behind the black-box interface, its speculative logprobs all 0.0
    (`--losscheck-engine=losscheck.selftest.logprob_bugs:logprobs_zero_when_speculating`)."""
    from losscheck.engines.spec_loop import spec_loop

    return LogprobsZeroWhenSpeculating(spec_loop(target))


class TopLogprobsByScoring(LogprobsZeroWhenSpeculating):
    """A black-box engine wrapper that reports the top N of each position (`ReportsTopLogprobs`)
    by scoring its own sample once more, teacher-forced through `target`: the honest stand-in the
    one-sample cells' top-N path is tested with (losscheck's loop reports each token's logprob,
    not a top N)."""

    def __init__(self, engine: Any, target: HFTarget) -> None:
        super().__init__(engine)
        self.name, self.target = f"{engine.name}+top-logprobs", target

    def generate_logprobs(self, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.generate_logprobs(request)

    def generate_top_logprobs(
        self, request: GenerationRequest
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        from losscheck.cells.scoring import teacher_forced_probs

        tokens, reported = self.inner.generate_logprobs(request)
        rows = [list(prompt) for prompt in request.rows()]
        forced = teacher_forced_probs(self.target, rows, tokens.flatten(0, 1).to(self.target.device), request.params)
        best = forced.probs.double().topk(request.top_logprobs, dim=-1)  # [P*n, L, N]
        shape = (*request.shape, request.top_logprobs)
        return tokens, reported, best.indices.cpu().view(shape), best.values.log().cpu().view(shape)


def spec_loop_top_logprobs(target: HFTarget) -> TopLogprobsByScoring:
    """losscheck's loop behind the black-box interface, reporting top-5 logprobs by scoring
    (`--losscheck-engine=losscheck.selftest.logprob_bugs:spec_loop_top_logprobs`)."""
    from losscheck.engines.spec_loop import spec_loop

    return TopLogprobsByScoring(spec_loop(target), target)


def top_logprobs_of_next_position(target: HFTarget) -> TopLogprobsOfNextPosition:
    """`spec_loop_top_logprobs` whose speculative calls report each position's top N from the next
    position (`TopLogprobsOfNextPosition`)."""
    return TopLogprobsOfNextPosition(spec_loop_top_logprobs(target))


class TopLogprobsOfNextPosition(LogprobsZeroWhenSpeculating):
    """A black-box engine wrapper (`losscheck.engines.ReportsTopLogprobs`) whose speculative calls
    report each position's top ids and logprobs from the position after it (a logits buffer the next
    position overwrote: vLLM #30846's shape, on the top-N path); the sampled tokens' logprobs and its
    plain calls as they are."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.name = f"{engine.name}+top-logprobs-of-next-position"

    def generate_logprobs(self, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.generate_logprobs(request)

    def generate_top_logprobs(
        self, request: GenerationRequest
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, reported, ids, values = self.inner.generate_top_logprobs(request)
        if request.speculative:  # BUG: position t reports position t + 1's top ids and values
            ids, values = (
                torch.cat([ids[:, :, 1:], ids[:, :, -1:]], 2),
                torch.cat([values[:, :, 1:], values[:, :, -1:]], 2),
            )
        return tokens, reported, ids, values
