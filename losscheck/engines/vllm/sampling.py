"""losscheck's request in vLLM's terms: `vllm.SamplingParams` keyword arguments (`sampling_kwargs`),
the parameters vLLM serves itself (`VLLM_SERVES`), its dtypes, and its outputs read back as token
ids (`to_tensor`) and logprobs (`to_logprobs`). Needs no vLLM to import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from losscheck.engines import EngineOutputError

if TYPE_CHECKING:
    import torch

    from losscheck.core.sampling import SamplingParams

VLLM_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# the logprobs vLLM reports: of the processed law (temperature, penalties, top-k / top-p applied),
# the one losscheck's logprob check compares them with (`losscheck.cells.logprob_check`)
LOGPROBS_MODE = "processed_logprobs"
# what `sampling_kwargs` passes to vLLM's own mechanisms (`losscheck.engines.served`: the rest is refused)
VLLM_SERVES = frozenset(
    {
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "banned_ids",
        "min_tokens",
        "stop_ids",
        "grammar",
        "stop_strings",
    }
)
PRECISION_OF = {**{v: k for k, v in VLLM_DTYPE.items()}, **{k: k for k in VLLM_DTYPE}}  # either name → losscheck's


def sampling_kwargs(
    params: SamplingParams,
    seed: int,
    max_new_tokens: int,
    eos: int | None = None,
    vocab: int | None = None,
    logprobs: bool = False,
    top: int = 0,
) -> dict[str, Any]:
    """losscheck's request as keyword arguments of `vllm.SamplingParams`, each parameter passed to
    vLLM's own field (`losscheck.core.history` follows vLLM V1's order, so the semantics are the
    same); every knob the request leaves neutral is set neutral explicitly, so no model
    generation-config default (repetition penalty, min-p, top-k) can creep in. Logprobs are off
    unless `logprobs` (then the sampled token's and the `top` most probable: `logprobs=top`), and
    ids are not detokenized.

    Banned ids become `allowed_token_ids`, every other id of the `vocab`: a mask vLLM applies to the
    target's logits at every position, drafts included (`RejectionSampler.apply_logits_processors`),
    where a -inf logit bias would be refused (vLLM takes finite biases and, with speculation on, no
    bias at all) and `bad_words` needs a tokenizer. Min tokens names EOS as a stop id: vLLM built
    without a tokenizer knows no EOS, and its min-tokens processor masks the stop ids. The
    request's stop ids join EOS in `stop_token_ids`: vLLM ends the row at one and keeps it. Stop
    strings are vLLM's `stop`, which needs the LLM built with a tokenizer (`tokenizer=DIR`; the
    bundled target's is `losscheck.core.grammar.write_bundled_tokenizer`'s) and detokenizing on:
    vLLM keeps the token that completed the string and drops the ones after it."""
    from losscheck.engines.served import UnsupportedParameter, refuse

    refuse(params, "vllm", VLLM_SERVES, eos=eos)
    if vocab is not None:
        params.check_vocab(vocab, "the engine's target")
    allowed = None
    if params.banned_ids:
        if vocab is None:
            raise UnsupportedParameter("engine 'vllm' cannot serve banned_ids without the target's vocabulary size")
        banned = set(params.banned_ids)
        allowed = [i for i in range(vocab) if i not in banned]
    # EOS and the stop ids end a row (kept as its last token); min tokens masks every one of them
    stops = list(dict.fromkeys([*([eos] if eos is not None else []), *params.stop_ids])) or None
    if not (params.min_tokens or [i for i in params.stop_ids if i != eos]):
        stops = None  # EOS ends a row anyway
    structured = None
    if params.grammar is not None:  # vLLM's structured outputs (its xgrammar backend by default)
        from vllm.sampling_params import StructuredOutputsParams

        kind = {"regex": "regex", "json": "json"}[params.grammar.kind]
        structured = StructuredOutputsParams(**{kind: params.grammar.source})
    return {
        "n": 1,
        "temperature": params.temperature,  # 0: greedy
        "top_k": params.top_k if params.top_k else -1,  # -1: off (older vLLM refuses 0)
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "logit_bias": dict(params.logit_bias) or None,
        "allowed_token_ids": allowed,
        "seed": None if params.greedy else seed,
        "max_tokens": max_new_tokens,
        "min_tokens": params.min_tokens,
        "stop_token_ids": stops,
        "structured_outputs": structured,
        "ignore_eos": False,
        "logprobs": top if logprobs else None,
        "prompt_logprobs": None,
        "stop": list(params.stop_strings.strings) if params.stop_strings is not None else None,
        "detokenize": params.stop_strings is not None,  # vLLM matches stop strings on its text
    }


def refused(exc: BaseException) -> bool:
    """Whether `exc` is vLLM refusing a request's parameters (`VLLMValidationError`: e.g. min-p
    and logit bias with speculation on, `vllm/sampling_params.py`, `_validate_spec_decode`)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return False
    return isinstance(exc, VLLMValidationError)


def to_tensor(
    outputs: Sequence[Any],
    n_prompts: int,
    n: int,
    max_new_tokens: int,
    eos: int,
    name: str,
    stops: Sequence[int] = (),
    strings: Sequence[str] = (),
) -> torch.Tensor:
    """`RequestOutput`s of `n_prompts` x `n` requests (prompt-major) → LongTensor [n_prompts, n, max_new_tokens],
    EOS-padded. A row that stops early on anything but EOS, one of the request's stop ids `stops`
    (which vLLM keeps as its last token) or one of its stop `strings` (vLLM's `stop_reason`) is an
    error (a stop id of the model's generation config): losscheck cannot tell what the model would
    have emitted next. A row that
    goes on after EOS (vLLM built without a tokenizer does not know the EOS id) is cut after its
    first EOS: what a row holds up to its EOS has the same law either way."""
    import torch

    if len(outputs) != n_prompts * n:
        raise EngineOutputError(f"engine {name!r}: vLLM returned {len(outputs)} outputs for {n_prompts * n} requests")
    out = torch.full((n_prompts * n, max_new_tokens), eos, dtype=torch.long)  # [P*n, L]
    for row, request in enumerate(outputs):
        ids = list(request.outputs[0].token_ids)[:max_new_tokens]
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
        on_string = getattr(request.outputs[0], "stop_reason", None) in strings
        if len(ids) < max_new_tokens and not on_string and (not ids or (ids[-1] != eos and ids[-1] not in stops)):
            raise EngineOutputError(
                f"engine {name!r}: request {row} stopped after {len(ids)} of {max_new_tokens} tokens on "
                f"{ids[-1] if ids else 'nothing'}, not on EOS {eos}; give the model a single EOS id "
                "(generation_config.json eos_token_id) or build the LLM with that stop id removed"
            )
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.view(n_prompts, n, max_new_tokens)


def to_logprobs(
    outputs: Sequence[Any], tokens: torch.Tensor, eos: int, name: str, params: SamplingParams, vocab: int | None
) -> torch.Tensor:
    """The sampled tokens' logprobs of `RequestOutput`s (requests made with `logprobs=0`) for their
    ids `tokens` [P, n, L] (`to_tensor`'s) → float64 [P, n, L], 0 after a row's end (that of the
    request's `params`; `vocab` the target's vocabulary size, which its stop strings decode)."""
    import torch

    from losscheck.engines import lengths, request_lengths

    flat = tokens.flatten(0, 1)  # [P*n, L]
    if params.stop_strings is not None and vocab is None:
        raise EngineOutputError(f"engine {name!r}: stop strings need the target's vocabulary size (the engine's vocab)")
    ends = lengths(flat, eos, params.stop_ids) if vocab is None else request_lengths(flat, eos, params, vocab)
    out = torch.zeros(flat.shape, dtype=torch.float64)
    for row, (request, length) in enumerate(zip(outputs, ends.tolist(), strict=True)):
        reported = request.outputs[0].logprobs
        if reported is None or len(reported) < length:
            raise EngineOutputError(
                f"engine {name!r}: request {row} reported {0 if reported is None else len(reported)} logprobs "
                f"for {length} tokens"
            )
        for t in range(length):
            entry = reported[t].get(int(flat[row, t]))
            if entry is None:
                raise EngineOutputError(f"engine {name!r}: request {row} reported no logprob of its token {t}")
            out[row, t] = entry.logprob
    return out.view(tokens.shape)


def to_top_logprobs(
    outputs: Sequence[Any], tokens: torch.Tensor, top: int, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `top` most probable ids at each position and their logprobs, as vLLM reports them
    beside the sampled token's (requests made with `logprobs=top`: the entries of rank 1..top), for
    rows `tokens` [P, n, L] → LongTensor and float64 [P, n, L, top]; zeros where vLLM reported no
    position (after a row's end)."""
    import torch

    flat = tokens.flatten(0, 1)  # [P*n, L]
    ids = torch.zeros((*flat.shape, top), dtype=torch.long)
    values = torch.zeros((*flat.shape, top), dtype=torch.float64)
    for row, request in enumerate(outputs):
        for t, entries in enumerate((request.outputs[0].logprobs or [])[: flat.shape[1]]):
            ranked = sorted((entry.rank, token, entry.logprob) for token, entry in entries.items() if entry.rank <= top)
            if len(ranked) != top:
                raise EngineOutputError(
                    f"engine {name!r}: request {row} reported {len(ranked)} ids of rank 1..{top} at token {t}, "
                    f"expected {top}"
                )
            ids[row, t] = torch.tensor([token for _, token, _ in ranked])
            values[row, t] = torch.tensor([value for _, _, value in ranked], dtype=torch.float64)
    return ids.view(*tokens.shape, top), values.view(*tokens.shape, top)


def to_prompt_logprobs(output: Any, prompt: Sequence[int], name: str) -> torch.Tensor:
    """A `RequestOutput`'s prompt logprobs (a request made with `prompt_logprobs=0`) of its
    `prompt`'s tokens after the first → float64 [len(prompt) - 1]."""
    import torch

    entries = list(output.prompt_logprobs or [])[1:]  # vLLM's first entry, the first token's, is None
    if len(entries) != len(prompt) - 1:
        raise EngineOutputError(f"engine {name!r}: {len(entries)} prompt logprobs for a prompt of {len(prompt)} tokens")
    values = []
    for t, (token, entry) in enumerate(zip(prompt[1:], entries, strict=True)):
        found = (entry or {}).get(int(token))
        if found is None:
            raise EngineOutputError(f"engine {name!r}: no prompt logprob of prompt token {t + 1} ({token})")
        values.append(found.logprob)
    return torch.tensor(values, dtype=torch.float64)
