"""The black-box engine contract: what an engine is (`BlackBoxEngine`: `generate(request)` → ids
[P, n, L]), what it may add (its counters, its reported logprobs, its draft model and that
model's law), and the error for what it returned wrong (`EngineOutputError`).
Docs: docs/black-box-engines.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from losscheck.engines.counters import EngineCounters
from losscheck.engines.request import GenerationRequest
from losscheck.errors import LosscheckError

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch


class EngineOutputError(LosscheckError):
    """A black-box engine returned malformed ids (shape, dtype, ids outside the vocabulary) or
    inconsistent counters."""


@runtime_checkable
class BlackBoxEngine(Protocol):
    """Anything that samples continuations of prompts, with its speculation switched on or off.

    name       shown in reports and error messages.
    k          block length: tokens drafted per round (the largest, if the engine adapts it);
               sampled cells run horizons of at least 2k + 2 so that the bonus token and the
               second round are reached.
    precision  dtype its target runs in, one of "fp32", "bf16", "fp16": losscheck loads
               `--losscheck-target` in it to score the samples (one-sample mode). None when
               losscheck cannot load the engine's target (another checkpoint, quantised, too
               large): its samples are then compared with its own samples with drafting off
               (two-sample mode, several times the rows).
    """

    name: str
    k: int
    precision: str | None

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        """The request's continuations → LongTensor [len(request.prompts), request.n,
        request.max_new_tokens], EOS-padded (`GenerationRequest` states the law of each row)."""
        ...


@runtime_checkable
class ReportsCounters(Protocol):
    """An engine that keeps its own speculative-decoding counters (optional)."""

    def counters(self) -> EngineCounters | None:
        """The counters of every speculative call so far (they only grow), or None when the engine
        has none to give now (e.g. its statistics logging is off)."""
        ...


@runtime_checkable
class ReportsLogprobs(Protocol):
    """An engine that reports each sampled token's log-probability (optional): its one-sample
    cells and `losscheck.cells.engine.logprobs.engine_logprob_check` compare them with the
    reference target's. An engine whose reference scores in another precision than it computes in
    (vLLM's `losscheck_reference`) names its own in an attribute `logprob_precision`: the check's
    bound is then that precision's round-off."""

    def generate_logprobs(self, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """`generate`'s answer and, beside it, float [len(request.prompts), request.n,
        request.max_new_tokens]: each token's log-probability under the target's law after the
        request's processing (temperature, top-k, top-p) at its position; 0 after a row's end."""
        ...


@runtime_checkable
class ReportsTopLogprobs(Protocol):
    """An engine that reports, beside each sampled token's log-probability, the N most probable ids
    at each position and theirs (optional; vLLM's `logprobs=N`, Hugging Face's scores): the
    one-sample cells ask for `TOP_LOGPROBS` of them and check them against the reference target's
    processed law (`losscheck.cells.logprob_check`)."""

    def generate_top_logprobs(
        self, request: GenerationRequest
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`generate_logprobs`' answer and, beside it, LongTensor [P, n, L, N] the N =
        `request.top_logprobs` most probable ids at each position, most probable first, and float
        [P, n, L, N] their log-probabilities under the same processed law (-inf for ids the
        processing removed); anything after a row's end (not read)."""
        ...


@runtime_checkable
class ReportsPromptLogprobs(Protocol):
    """An engine that reports its prompts' log-probabilities (optional; vLLM's `prompt_logprobs`):
    `losscheck.cells.engine.logprobs.engine_prompt_logprob_check` compares them, speculation on and
    off, with the reference target's raw law (no sampling processing: prompt positions are not
    sampled)."""

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], speculative: bool) -> list[torch.Tensor]:
        """float [len(prompt) - 1] per prompt: log p(prompt[t] | prompt[:t]) for t = 1 .. under the
        target's raw law, with drafting on or off."""
        ...


DraftLaw = Literal["processed", "temperature", "greedy"]
"""How an engine's drafts are drawn from its draft model's logits: `processed`, from the logits
processed by the request's sampling parameters (Hugging Face assisted generation, losscheck's loop);
`temperature`, from softmax(logits / T) alone (vLLM's `draft_sample_method: probabilistic`);
`greedy`, its argmax, a point mass the verifier reads as q (vLLM's default)."""


@dataclass(frozen=True)
class DraftModel:
    """The drafter an engine runs, teacher-forceable: a Hugging Face causal LM over the target's
    token ids, and how the engine's q is formed from its logits."""

    model: Any
    law: DraftLaw = "processed"


@runtime_checkable
class RunsDraftModel(Protocol):
    """An engine whose drafter losscheck can teacher-force (optional): then its one-sample cells
    judge the verifier's bug classes too (`losscheck.stats.hidden_rounds`)."""

    def draft_model(self) -> Any:
        """The drafter the engine runs: a `DraftModel`, or a bare Hugging Face causal LM (its q its
        logits processed by the request's sampling parameters); None when it has none losscheck can
        load (n-gram, heads inside the engine)."""
        ...
