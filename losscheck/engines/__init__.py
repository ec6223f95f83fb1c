"""Black-box engines: implementations that only return generated ids (`--losscheck-engine`).

An engine is certified against **itself with drafting off** (docs/statistics.md), never against
losscheck's own decoder: greedy output with speculation on must equal it with speculation off,
token for token; sampled output is tested one-sample by teacher-forced PIT when losscheck can load
the engine's target (`precision` names its dtype), else two-sample, on against off
(`precision = None`).

The contract (docs/black-box-engines.md): `generate(request: GenerationRequest)` → LongTensor
[P, n, L] (`losscheck.engines.request`), and optionally `counters()` → `EngineCounters`
(`losscheck.engines.counters`), the engine's own draft and accept counts, which the certificate
records per cell. An adapter written against the old six-argument `generate` is wrapped
(`LegacyEngine`) with a DeprecationWarning. `losscheck.engines.pool` keeps an adapter's instances
(speculation on and off) under an explicit memory policy.

One adapter per module: `spec_loop` (losscheck's own loop), `hf` (Hugging Face assisted
generation), `vllm` (vLLM's `LLM` with a speculative config), `openvino` (OpenVINO GenAI's
`LLMPipeline` with a draft model), `llamacpp` (llama-cpp-python with a draft model).

Imports nothing heavy: the certificate's records read `EngineCounters` without torch.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from losscheck.core.precision import DTYPE_NAMES
from losscheck.engines.counters import EngineCounters
from losscheck.engines.request import GenerationRequest
from losscheck.errors import LosscheckError, OptionError

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlackBoxEngine",
    "DraftLaw",
    "DraftModel",
    "EngineCounters",
    "EngineOutputError",
    "GenerationRequest",
    "LegacyEngine",
    "ReportsCounters",
    "RunsDraftModel",
    "check_engine",
    "checked_logprobs",
    "checked_samples",
    "draft_model",
    "engine_counters",
    "lengths",
    "row_by_row",
]


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
    cells and `losscheck.cells.engine_logprobs.engine_logprob_check` compare them with the
    reference target's. An engine whose reference scores in another precision than it computes in
    (vLLM's `losscheck_reference`) names its own in an attribute `logprob_precision`: the check's
    bound is then that precision's round-off."""

    def generate_logprobs(self, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """`generate`'s answer and, beside it, float [len(request.prompts), request.n,
        request.max_new_tokens]: each token's log-probability under the target's law after the
        request's processing (temperature, top-k, top-p) at its position; 0 after a row's end."""
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


def draft_model(engine: object, vocab_size: int) -> DraftModel | None:
    """The engine's draft model (`RunsDraftModel`) when it gives one, checked against the target's
    vocabulary; None when it gives none."""
    if not isinstance(engine, RunsDraftModel):
        return None
    given = engine.draft_model()
    if given is None:
        return None
    drafted = given if isinstance(given, DraftModel) else DraftModel(given)
    model, name = drafted.model, getattr(engine, "name", type(engine).__name__)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or not hasattr(model, "forward"):
        raise OptionError(
            f"engine {name!r}: draft_model() returned {type(model).__name__}; return a Hugging Face causal LM "
            "(a model with .config.vocab_size and forward), a DraftModel of one, or None"
        )
    if drafted.law not in ("processed", "temperature", "greedy"):
        raise OptionError(
            f"engine {name!r}: draft_model() names the draft law {drafted.law!r}; "
            "use 'processed', 'temperature' or 'greedy' (losscheck.engines.DraftLaw)"
        )
    if vocab != vocab_size:
        raise OptionError(
            f"engine {name!r}: its draft model has a vocabulary of {vocab} tokens, the target {vocab_size}; "
            "teacher-forcing it for q needs the target's token ids (return None from draft_model to certify "
            "without the verifier's bug classes)"
        )
    return drafted


OLD_SIGNATURE = "generate(prompts, n, params, seed, max_new_tokens, speculative)"


class LegacyEngine:
    """An engine written against the old contract, `generate(prompts, n, params, seed,
    max_new_tokens, speculative)`, behind the new one."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.name: str = engine.name  # type: ignore[attr-defined]  # check_engine read them
        self.k: int = engine.k  # type: ignore[attr-defined]
        self.precision: str | None = engine.precision  # type: ignore[attr-defined]

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        prompts = [list(prompt) for prompt in request.prompts]
        args = (request.n, request.params, request.seed, request.max_new_tokens, request.speculative)
        return self.engine.generate(prompts, *args)  # type: ignore[attr-defined]

    def counters(self) -> EngineCounters | None:
        return engine_counters(self.engine)


def _takes_old_signature(generate: Callable[..., object]) -> bool:
    """Whether a bound `generate` needs more than one positional argument (the old contract)."""
    try:
        parameters = inspect.signature(generate).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): assume the current contract
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is inspect.Parameter.empty for p in parameters) > 1


def check_engine(engine: object, source: str) -> BlackBoxEngine:
    """`engine` if it has the protocol's attributes with valid values (an old-contract engine
    wrapped in `LegacyEngine`, with a DeprecationWarning); else an error naming `source`."""
    where = f"{source} returned {type(engine).__name__}"
    generate = getattr(engine, "generate", None)
    if not callable(generate):
        raise OptionError(
            f"{where} without a generate(request: GenerationRequest) method "
            "(see losscheck/engines/__init__.py, BlackBoxEngine)"
        )
    k = getattr(engine, "k", None)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise OptionError(f"{where} with k = {k!r}; declare the block length (tokens drafted per round) as an int >= 1")
    precision = getattr(engine, "precision", "missing")
    if precision is not None and precision not in DTYPE_NAMES:
        raise OptionError(
            f"{where} with precision = {precision!r}; declare the dtype its target runs in, "
            f"one of {list(DTYPE_NAMES)}, or None when losscheck cannot load that target"
        )
    if not isinstance(getattr(engine, "name", None), str):
        raise OptionError(f"{where} without a name (str)")
    if _takes_old_signature(generate):
        warnings.warn(
            f"{where}, whose {OLD_SIGNATURE} is the old engine contract: write "
            "generate(self, request: losscheck.engines.GenerationRequest) -> LongTensor [P, n, L] "
            "(docs/black-box-engines.md). It is wrapped for now; the old form will be removed.",
            DeprecationWarning,
            stacklevel=2,
        )
        return LegacyEngine(engine)
    return engine  # type: ignore[return-value]


def engine_counters(engine: object) -> EngineCounters | None:
    """The engine's counters when it keeps them, validated; None when it has none."""
    if not isinstance(engine, ReportsCounters):
        return None
    counters = engine.counters()
    name = getattr(engine, "name", type(engine).__name__)
    if counters is not None and not isinstance(counters, EngineCounters):
        raise EngineOutputError(
            f"engine {name!r}: counters() returned {type(counters).__name__}; return "
            "losscheck.engines.EngineCounters or None"
        )
    if counters is not None and counters.problems():
        raise EngineOutputError(f"engine {name!r}: inconsistent counters: {'; '.join(counters.problems())}")
    return counters


def row_by_row(request: GenerationRequest | list[list[int]], *args: Any) -> torch.Tensor:
    """`row_by_row(request, eos, row)`: what `generate` returns, LongTensor [P, n, max_new_tokens],
    for an engine that samples one continuation at a time: `row(i, j)` is the j-th continuation of
    `request.prompts[i]`, its new ids (at most `max_new_tokens`; ending at EOS or not), padded here
    with `eos`. Not called when the budget is 0. The old form `row_by_row(prompts, n,
    max_new_tokens, eos, row)` still works, with a DeprecationWarning."""
    import torch

    if not isinstance(request, GenerationRequest):
        warnings.warn(
            "row_by_row(prompts, n, max_new_tokens, eos, row) is the old form: pass the engine's "
            "request, row_by_row(request, eos, row)",
            DeprecationWarning,
            stacklevel=2,
        )
        from losscheck.core.sampling import GREEDY

        n, budget, *rest = args
        prompts = tuple(map(tuple, request))  # the request's other fields: row_by_row reads none
        request = GenerationRequest(
            prompts=prompts, n=n, params=GREEDY, seed=0, max_new_tokens=budget, speculative=True
        )
        args = tuple(rest)
    eos: int = args[0]
    row: Callable[[int, int], Sequence[int]] = args[1]

    out = torch.full(request.shape, eos, dtype=torch.long)  # [P, n, L]
    if request.max_new_tokens == 0:
        return out
    for i in range(len(request.prompts)):
        for j in range(request.n):
            new = list(row(i, j))
            if len(new) > request.max_new_tokens:
                raise EngineOutputError(
                    f"continuation {j} of prompt {i} has {len(new)} new ids, more than max_new_tokens="
                    f"{request.max_new_tokens}; stop the engine at the budget"
                )
            out[i, j, : len(new)] = torch.tensor(new, dtype=torch.long)
    return out


def checked_samples(
    engine: BlackBoxEngine, out: object, request: GenerationRequest, vocab_size: int, eos: int
) -> torch.Tensor:
    """The engine's `out` for `request` as LongTensor [P, n, max_new_tokens] on the CPU, validated:
    shape, integer dtype, ids in [0, vocab_size), nothing but EOS after a row's first end (EOS, or
    one of the request's stop ids, which the row keeps as its last token)."""
    import torch

    name = f"engine {engine.name!r}"
    n_prompts, n, max_new_tokens = request.shape
    if not isinstance(out, torch.Tensor):
        raise EngineOutputError(
            f"{name}: generate returned {type(out).__name__}, expected a LongTensor "
            f"[{n_prompts}, {n}, {max_new_tokens}]"
        )
    if out.dtype.is_floating_point or out.dtype.is_complex or out.dtype == torch.bool:
        raise EngineOutputError(f"{name}: generate returned dtype {out.dtype}, expected integer token ids (torch.long)")
    if tuple(out.shape) != request.shape:
        raise EngineOutputError(
            f"{name}: generate returned shape {tuple(out.shape)}, expected "
            f"[prompts, n, max_new_tokens] = {request.shape}"
        )
    out = out.long().cpu()
    if out.numel() and (out.min() < 0 or out.max() >= vocab_size):
        raise EngineOutputError(
            f"{name}: generate returned ids in [{int(out.min())}, {int(out.max())}], outside "
            f"the target's vocabulary [0, {vocab_size})"
        )
    stops = request.params.stop_ids
    ended = _ends(out, eos, stops).long()  # [P, n, L]
    if ((ended.cumsum(-1) - ended > 0) & (out != eos)).any():  # an end strictly before a non-EOS
        where = f"its first EOS ({eos})" if not [i for i in stops if i != eos] else f"its first EOS ({eos}) or stop id"
        raise EngineOutputError(f"{name}: a row has ids other than EOS after {where}; pad finished rows with EOS")
    return out


def checked_logprobs(engine: object, out: object, request: GenerationRequest) -> torch.Tensor:
    """An engine's reported log-probabilities `out` for `request` (`ReportsLogprobs`) as float64
    [P, n, max_new_tokens] on the CPU, validated: shape and floating dtype, no NaN. Their values
    are the logprob check's to judge (`losscheck.cells.logprob_check`)."""
    import torch

    name = f"engine {getattr(engine, 'name', engine)!r}"
    if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
        what = type(out).__name__ if not isinstance(out, torch.Tensor) else f"a {out.dtype} tensor"
        raise EngineOutputError(f"{name}: generate_logprobs returned {what} as logprobs, expected a float tensor")
    if tuple(out.shape) != request.shape:
        raise EngineOutputError(
            f"{name}: generate_logprobs returned logprobs of shape {tuple(out.shape)}, expected "
            f"[prompts, n, max_new_tokens] = {request.shape}"
        )
    if out.isnan().any():
        raise EngineOutputError(f"{name}: generate_logprobs returned NaN logprobs; report -inf for impossible tokens")
    return out.double().cpu()


def lengths(tokens: torch.Tensor, eos: int, stops: Sequence[int] = ()) -> torch.Tensor:
    """Generated tokens per row of EOS-padded `tokens` [..., L] → [...]: up to its first end, EOS
    or one of the request's stop ids `stops` (the end included, as the engine emitted it)."""
    import torch

    ends = _ends(tokens, eos, stops)  # [..., L]
    return torch.where(ends.any(-1), ends.long().argmax(-1) + 1, tokens.shape[-1])


def _ends(tokens: torch.Tensor, eos: int, stops: Sequence[int]) -> torch.Tensor:
    """Where `tokens` [..., L] hold EOS or a stop id → bool [..., L]."""
    import torch

    return torch.isin(tokens, torch.tensor([eos, *stops], dtype=tokens.dtype, device=tokens.device))
