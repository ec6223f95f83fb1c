"""Black-box engines: implementations that only return generated ids (`--losscheck-engine`).

An engine is certified against **itself with drafting off** (docs/statistics.md), never against
losscheck's own decoder: greedy output with speculation on must equal it with speculation off,
token for token; sampled output is tested one-sample by teacher-forced PIT when losscheck can load
the engine's target (`precision` names its dtype), else two-sample, on against off
(`precision = None`).

One adapter per module: `spec_loop` (losscheck's own loop), `hf` (Hugging Face assisted
generation), `vllm` (vLLM's `LLM` with a speculative config), `openvino` (OpenVINO GenAI's
`LLMPipeline` with a draft model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from losscheck.core.precision import DTYPE_NAMES
from losscheck.core.sampling import SamplingParams
from losscheck.errors import LosscheckError, OptionError


class EngineOutputError(LosscheckError):
    """A black-box engine returned malformed ids (shape, dtype, ids outside the vocabulary)."""


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

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        seed: int,
        max_new_tokens: int,
        speculative: bool,
    ) -> torch.Tensor:
        """`n` independent continuations of each prompt → LongTensor [len(prompts), n, max_new_tokens].

        prompts      token ids of the target's vocabulary, one list per prompt (non-empty).
        params       temperature (0 = greedy), top-k (0 = off), top-p (1 = off), applied in that
                     order to the target's logits; no other processing (no repetition penalty,
                     no model-default top-k).
        seed         every random draw of the call derives from it; another seed, independent samples.
        speculative  True: drafting on; False: the same engine with drafting off (the baseline).
        Row [i, j] is the j-th continuation of prompts[i]: exactly `max_new_tokens` ids, except that
        a row that emits the target's EOS stops there and is padded with EOS after it.
        """
        ...


def check_engine(engine: object, source: str) -> BlackBoxEngine:
    """`engine` if it has the protocol's attributes with valid values; else an error naming `source`."""
    where = f"{source} returned {type(engine).__name__}"
    if not callable(getattr(engine, "generate", None)):
        raise OptionError(
            f"{where} without a generate(prompts, n, params, seed, max_new_tokens, speculative) "
            "method (see losscheck/engines/__init__.py, BlackBoxEngine)"
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
    return engine  # type: ignore[return-value]


def row_by_row(
    prompts: list[list[int]], n: int, max_new_tokens: int, eos: int, row: Callable[[int, int], Sequence[int]]
) -> torch.Tensor:
    """What `generate` returns, LongTensor [len(prompts), n, max_new_tokens], for an engine that
    samples one continuation at a time: `row(i, j)` is the j-th continuation of `prompts[i]`, its
    new ids (at most `max_new_tokens`; ending at EOS or not), padded here with `eos`. Not called
    when `max_new_tokens` is 0."""
    out = torch.full((len(prompts), n, max_new_tokens), eos, dtype=torch.long)  # [P, n, L]
    if max_new_tokens == 0:
        return out
    for i in range(len(prompts)):
        for j in range(n):
            new = list(row(i, j))
            if len(new) > max_new_tokens:
                raise EngineOutputError(
                    f"continuation {j} of prompt {i} has {len(new)} new ids, more than max_new_tokens="
                    f"{max_new_tokens}; stop the engine at the budget"
                )
            out[i, j, : len(new)] = torch.tensor(new, dtype=torch.long)
    return out


def checked_samples(
    engine: BlackBoxEngine, out: object, n_prompts: int, n: int, max_new_tokens: int, vocab_size: int, eos: int
) -> torch.Tensor:
    """The engine's `out` as LongTensor [n_prompts, n, max_new_tokens] on the CPU, validated: shape,
    integer dtype, ids in [0, vocab_size), nothing but EOS after a row's first EOS."""
    name = f"engine {engine.name!r}"
    if not isinstance(out, torch.Tensor):
        raise EngineOutputError(
            f"{name}: generate returned {type(out).__name__}, expected a LongTensor "
            f"[{n_prompts}, {n}, {max_new_tokens}]"
        )
    if out.dtype.is_floating_point or out.dtype.is_complex or out.dtype == torch.bool:
        raise EngineOutputError(f"{name}: generate returned dtype {out.dtype}, expected integer token ids (torch.long)")
    if tuple(out.shape) != (n_prompts, n, max_new_tokens):
        raise EngineOutputError(
            f"{name}: generate returned shape {tuple(out.shape)}, expected "
            f"[prompts, n, max_new_tokens] = ({n_prompts}, {n}, {max_new_tokens})"
        )
    out = out.long().cpu()
    if out.numel() and (out.min() < 0 or out.max() >= vocab_size):
        raise EngineOutputError(
            f"{name}: generate returned ids in [{int(out.min())}, {int(out.max())}], outside "
            f"the target's vocabulary [0, {vocab_size})"
        )
    is_eos = (out == eos).long()  # [P, n, L]
    if ((is_eos.cumsum(-1) - is_eos > 0) & (out != eos)).any():  # an EOS strictly before a non-EOS
        raise EngineOutputError(
            f"{name}: a row has ids other than EOS ({eos}) after its first EOS; pad finished rows with EOS"
        )
    return out


def lengths(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """Generated tokens per row of EOS-padded `tokens` [..., L] (its first EOS included) → [...]."""
    is_eos = tokens == eos  # [..., L]
    return torch.where(is_eos.any(-1), is_eos.long().argmax(-1) + 1, tokens.shape[-1])
