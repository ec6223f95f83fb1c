"""`GenerationRequest`: one call of a black-box engine, as a frozen record.

An engine adapter takes one request and returns the ids; the record grows fields (per-row
sampling parameters, stop ids, history-dependent processing) without breaking an adapter that
reads only the fields it knows, as vLLM's `SamplingParams` does. Every field is keyword-only, so
two ints (the seed and the budget) cannot be swapped by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from losscheck.errors import OptionError

if TYPE_CHECKING:
    from losscheck.core.sampling import SamplingParams


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """`n` independent continuations of each prompt.

    prompts         token ids of the target's vocabulary, one non-empty tuple per prompt (lists
                    are accepted and stored as tuples).
    n               continuations per prompt.
    params          temperature (0 = greedy), top-k (0 = off), top-p (1 = off), applied in that
                    order to the target's logits; no other processing (no repetition penalty,
                    no model-default top-k).
    seed            every random draw of the call derives from it; another seed, independent
                    samples (`row_seed` gives one per row).
    max_new_tokens  the budget of each continuation.
    speculative     True: drafting on; False: the same engine with drafting off (the baseline).
    purpose         what the draws are for in the cell ("pilot", "sample", "attribution"): the
                    record's phase timings name it; an adapter has no reason to read it.
    logprobs        True: the cell also wants each token's reported log-probability; the run then
                    calls `ReportsLogprobs.generate_logprobs` instead of `generate` (asked only of
                    engines that implement it; `losscheck.cells.engine.phases`).
    top_logprobs    with `logprobs`, N > 0: also the N most probable ids at each position and their
                    log-probabilities; the run then calls `ReportsTopLogprobs.generate_top_logprobs`.

    The answer is LongTensor [len(prompts), n, max_new_tokens]: row [i, j] is the j-th
    continuation of prompts[i], exactly `max_new_tokens` ids, except that a row that emits the
    target's EOS stops there and is padded with EOS after it.
    """

    prompts: tuple[tuple[int, ...], ...]
    n: int
    params: SamplingParams
    seed: int
    max_new_tokens: int
    speculative: bool
    purpose: str = ""
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        from losscheck.core.sampling import SamplingParams

        prompts = tuple(tuple(prompt) for prompt in self.prompts)
        for i, prompt in enumerate(prompts):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
                raise OptionError(
                    f"GenerationRequest.prompts[{i}] = {list(prompt)!r}: need a non-empty list of ids >= 0"
                )
        object.__setattr__(self, "prompts", prompts)
        for name, least in (("n", 1), ("seed", 0), ("max_new_tokens", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise OptionError(f"GenerationRequest.{name} = {value!r}: need an int >= {least}")
        if not isinstance(self.params, SamplingParams):
            raise OptionError(f"GenerationRequest.params is a {type(self.params).__name__}; pass a SamplingParams")
        for name in ("speculative", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(f"GenerationRequest.{name} = {getattr(self, name)!r}: need True or False")
        top = self.top_logprobs
        if isinstance(top, bool) or not isinstance(top, int) or top < 0 or (top and not self.logprobs):
            raise OptionError(
                f"GenerationRequest.top_logprobs = {top!r}: need an int >= 0, and logprobs=True when it is > 0"
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        """The answer's shape: (prompts, n, max_new_tokens)."""
        return len(self.prompts), self.n, self.max_new_tokens

    def rows(self) -> list[tuple[int, ...]]:
        """The prompt of every continuation, prompt-major: row i * n + j is prompts[i]."""
        return [prompt for prompt in self.prompts for _ in range(self.n)]

    def row_seed(self, i: int, j: int) -> int:
        """A 63-bit seed of its own for continuation j of prompt i, derived from `seed`."""
        from losscheck.core.sampling import derive_seed

        return derive_seed(self.seed, i, j)
