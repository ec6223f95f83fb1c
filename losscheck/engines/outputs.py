"""An engine's outputs checked and shaped: its samples and logprobs against the request
(`checked_samples`, `checked_logprobs`), its counters (`engine_counters`), the rows' lengths to
their ends (`lengths`), and `row_by_row` for an engine that samples one continuation at a time.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from losscheck.engines.contract import BlackBoxEngine, EngineOutputError, ReportsCounters
from losscheck.engines.counters import EngineCounters
from losscheck.engines.request import GenerationRequest

if TYPE_CHECKING:
    import torch

    from losscheck.core.sampling import SamplingParams


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
    if request.params.stop_strings is not None:
        ends = request_lengths(out, eos, request.params, vocab_size)  # [P, n]
        after = torch.arange(max_new_tokens) >= ends[..., None]  # [P, n, L]
        leaked = (after & (out != eos)).any(-1)  # [P, n]
        if leaked.any():
            p, row = (int(i) for i in leaked.nonzero()[0])
            raise EngineOutputError(
                f"{name}: {int(leaked.sum())} rows go on after the token that completed a stop string of "
                f"{list(request.params.stop_strings.strings)} (prompt {p}, row {row}: token {int(ends[p, row]) - 1}); "
                "a row ends there, padded with EOS"
            )
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


def checked_top_logprobs(
    engine: object, ids: object, values: object, request: GenerationRequest, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An engine's reported top ids and their log-probabilities (`ReportsTopLogprobs`) for
    `request` as LongTensor and float64 [P, n, L, N] on the CPU, validated: shapes, dtypes, ids in
    the vocabulary, no NaN. Whether they are the target's top N is the logprob check's to judge."""
    import torch

    name = f"engine {getattr(engine, 'name', engine)!r}"
    shape = (*request.shape, request.top_logprobs)
    for what, out, floating in (("ids", ids, False), ("log-probabilities", values, True)):
        if not isinstance(out, torch.Tensor) or out.dtype.is_floating_point != floating or tuple(out.shape) != shape:
            got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            kind = "float" if floating else "integer"
            raise EngineOutputError(
                f"{name}: generate_top_logprobs returned top {what} as {got}, expected a {kind} tensor "
                f"[prompts, n, max_new_tokens, top_logprobs] = {list(shape)}"
            )
    assert isinstance(ids, torch.Tensor) and isinstance(values, torch.Tensor)
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise EngineOutputError(
            f"{name}: generate_top_logprobs returned top ids outside the vocabulary [0, {vocab_size})"
        )
    if values.isnan().any():
        raise EngineOutputError(f"{name}: generate_top_logprobs returned NaN; report -inf for impossible tokens")
    return ids.long().cpu(), values.double().cpu()


def lengths(tokens: torch.Tensor, eos: int, stops: Sequence[int] = ()) -> torch.Tensor:
    """Generated tokens per row of EOS-padded `tokens` [..., L] → [...]: up to its first end, EOS
    or one of the request's stop ids `stops` (the end included, as the engine emitted it)."""
    import torch

    ends = _ends(tokens, eos, stops)  # [..., L]
    return torch.where(ends.any(-1), ends.long().argmax(-1) + 1, tokens.shape[-1])


def request_lengths(tokens: torch.Tensor, eos: int, params: SamplingParams, vocab: int) -> torch.Tensor:
    """`lengths` of EOS-padded `tokens` [..., L] under a request's `params`: at its first EOS or
    stop id, or at the token that completes one of its stop strings (`losscheck.core.stops`, a
    Python loop over the rows; `vocab` the target's vocabulary size, what the strings decode)."""
    ends = lengths(tokens, eos, params.stop_ids)
    if params.stop_strings is None:
        return ends
    from losscheck.core.stops import first_stop

    decode = params.stop_strings.decode(vocab)
    flat, found = tokens.reshape(-1, tokens.shape[-1]).tolist(), ends.reshape(-1).clone()
    for b, row in enumerate(flat):
        at = first_stop(decode, row[: int(found[b])], 0, params.stop_strings.strings, params.min_tokens)
        if at is not None:
            found[b] = at + 1
    return found.reshape(ends.shape)


def _ends(tokens: torch.Tensor, eos: int, stops: Sequence[int]) -> torch.Tensor:
    """Where `tokens` [..., L] hold EOS or a stop id → bool [..., L]."""
    import torch

    return torch.isin(tokens, torch.tensor([eos, *stops], dtype=tokens.dtype, device=tokens.device))
