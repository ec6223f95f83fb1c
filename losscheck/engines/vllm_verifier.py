"""vLLM's rejection sampler as a losscheck `Verifier` (`losscheck.core.verify`).

`vllm.v1.sample.rejection_sampler.RejectionSampler` decides a batch of drafted blocks from
vLLM's own flat layout; this module builds that layout from losscheck's tensors and reads the
decision back, so that the sampler vLLM ships can be checked against the exact law of a round
(tests/engines/test_vllm.py) or run inside losscheck's loop in place of `verify_block`.

Layout, for B rows of k drafts (every row drafts k tokens here):

- `logits` [B*(k+1), V]: row b's k+1 scored positions laid end to end; the first k of each row are
  the *target* positions (`target_logits_indices`), the last the *bonus* position
  (`bonus_logits_indices`);
- `draft_token_ids` [B*k] and `draft_probs` [B*k, V] (None: point-mass drafts, as vLLM's ngram and
  argmax drafters report), flattened the same way;
- the output [B, k+1]: accepted drafts, then the recovered or bonus token, then -1
  (`PLACEHOLDER_TOKEN_ID`) for the slots after it.

vLLM applies temperature, top-k and top-p to the raw target logits itself (its
`apply_sampling_constraints` and `Sampler`), from `SamplingMetadata`; losscheck's `q` is already the
drafter's processed distribution, which is what vLLM expects of `draft_probs`. Every row's random
draws (acceptance uniforms, the recovered tokens' exponentials, the bonus token's) come from the
one `generator` the loop passes: vLLM reads a per-request generator from `SamplingMetadata.generators`,
and each row is given the same one, so the draws are a sequence from it and traceable to the run seed.

On vLLM's CPU build (0.32) the sampler has two platform bugs, which this module fixes in a
separately named verifier (`rejection_sampler_cpu_fixed`; docs/vllm.md has the evidence):

1. `expand_batch_to_tokens`, which spreads each request's temperature, top-k and top-p over its
   draft positions, runs the CPU platform's override of the Triton `expand_kernel`
   (`vllm.utils.cpu_triton_utils._expand_kernel_impl`); that override hands the C++ op int64
   copies of its tensors and never copies the result back, so a float32 or int32 tensor comes back
   as uninitialised memory: the target's logits are divided by garbage temperatures and cut by
   garbage top-k / top-p. `expand_batch_to_tokens` below is the same function in plain torch.
2. At a step where no request has drafts the sampler still applies top-k to its (empty) target
   logits, and the CPU's top-k path (`apply_top_k_only`) takes the max of an empty tensor and
   raises; the step, the `LLM.generate` call and every later one in the process fail.
   `apply_top_k_top_p` below returns empty logits as they are.

`cpu_fixed()` puts both in vLLM's place for a block, `install_cpu_fixes()` for the process.

vLLM is imported when a verifier is built; this module loads without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from losscheck.core.sampling import SamplingParams
from losscheck.core.verify import BlockOutcome

PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: an output slot after the stopping slot


@dataclass(frozen=True)
class Layout:
    """vLLM's flat indices for B rows of k drafts each."""

    batch: int
    k: int
    target_indices: torch.Tensor = field(init=False)  # [B*k] int32: row b's draft positions in the flat logits
    bonus_indices: torch.Tensor = field(init=False)  # [B] int32: row b's bonus position

    def __post_init__(self) -> None:
        flat = torch.arange(self.batch * (self.k + 1), dtype=torch.int32).view(self.batch, self.k + 1)
        object.__setattr__(self, "target_indices", flat[:, : self.k].reshape(-1).contiguous())
        object.__setattr__(self, "bonus_indices", flat[:, self.k].contiguous())


def spec_decode_metadata(drafts: torch.Tensor) -> Any:
    """vLLM's `SpecDecodeMetadata` for `drafts` [B, k]: k drafts per row, each row's k+1 logits in
    order."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    batch, k = drafts.shape
    layout = Layout(batch, k)
    device = drafts.device
    counts = torch.full((batch,), k, dtype=torch.int32)
    return SpecDecodeMetadata(
        draft_token_ids=drafts.reshape(-1).to(torch.int32).contiguous(),  # [B*k]
        num_draft_tokens=[k] * batch,
        cu_num_draft_tokens=counts.cumsum(0, dtype=torch.int32).to(device),  # [B]
        cu_num_sampled_tokens=(counts + 1).cumsum(0, dtype=torch.int32).to(device),  # [B]
        target_logits_indices=layout.target_indices.to(device),  # [B*k]
        bonus_logits_indices=layout.bonus_indices.to(device),  # [B]
        logits_indices=torch.arange(batch * (k + 1), dtype=torch.int32, device=device),  # [B*(k+1)]
    )


def sampling_metadata(
    params: list[SamplingParams], vocab_size: int, generator: torch.Generator, device: torch.device
) -> Any:
    """vLLM's `SamplingMetadata` for one request per row with `params[b]`: temperature (0 greedy),
    top-k (0 off), top-p (1 off), every other processor off; each row draws from `generator`.

    As vLLM's input batch does: a greedy row's temperature is 0 (`GREEDY_TEMPERATURE`), top-k off
    is the vocabulary size, and the top-k / top-p tensors are None when no row uses them."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    batch = len(params)
    greedy = [p.greedy for p in params]
    all_greedy, all_random = all(greedy), not any(greedy)
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)  # [B]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    no_penalty = torch.zeros(batch, dtype=torch.float32, device=device)
    return SamplingMetadata(
        temperature=None if all_greedy else temperature,
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=None if all(p == 1.0 for p in top_p) else torch.tensor(top_p, dtype=torch.float32, device=device),
        top_k=None if all(k == vocab_size for k in top_k) else torch.tensor(top_k, dtype=torch.int32, device=device),
        generators={} if all_greedy else dict.fromkeys(range(batch), generator),
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=no_penalty,
        presence_penalties=no_penalty,
        repetition_penalties=no_penalty + 1.0,
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def block_outcome(output: torch.Tensor, k: int) -> BlockOutcome:
    """vLLM's output token ids [B, k+1] (-1 after the stopping slot) → losscheck's `BlockOutcome`."""
    emitted = (output != PLACEHOLDER).long()  # [B, k+1]
    accepted = emitted.cumprod(-1).sum(-1) - 1  # [B]: drafts kept = emitted tokens - 1
    tokens = output.long().clamp_min(0)  # [B, k+1]; slots after the stop are junk, as BlockOutcome allows
    return BlockOutcome(accepted=accepted, tokens=tokens)


def platform_kernels() -> None:
    """Let vLLM's platform replace the sampler's Triton kernels, as a vLLM worker does when it
    starts (on the CPU build: C++ implementations, `vllm.utils.cpu_triton_utils`); without it the
    Triton kernels cannot launch on a CPU. Once per process: vLLM's registry already holding
    overrides (a worker built here, or an earlier call) means it was done."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    if not getattr(dispatcher, "_registry", None):
        current_platform.register_triton_kernel_overrides()


def expand_batch_to_tokens(
    x: torch.Tensor,  # [B] one value per request
    cu_num_tokens: torch.Tensor,  # [B] cumulative draft tokens per request
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """What vLLM's `rejection_sampler.expand_batch_to_tokens` computes, in torch: request b's value
    repeated over its draft positions, `replace_from` replaced by `replace_to` → [num_tokens],
    `x`'s dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))  # [B]
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)  # [B]
    return x.repeat_interleave(counts, output_size=num_tokens)  # [num_tokens]


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's `apply_top_k_top_p` for the rejection sampler's target logits [num_tokens, V], with an
    empty batch (a step without drafts) returned as it is."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p as vllm_apply

    return logits if logits.shape[0] == 0 else vllm_apply(logits, k, p)


CPU_FIXES = {"expand_batch_to_tokens": expand_batch_to_tokens, "apply_top_k_top_p": apply_top_k_top_p}


def install_cpu_fixes() -> None:
    """`CPU_FIXES` in place of vLLM's functions in its rejection sampler for the rest of the process
    (what a fixed engine does: its LLM lives as long as the process)."""
    from vllm.v1.sample import rejection_sampler

    for name, fixed in CPU_FIXES.items():
        setattr(rejection_sampler, name, fixed)


@contextmanager
def cpu_fixed() -> Iterator[None]:
    """`CPU_FIXES` in place of vLLM's functions in its rejection sampler, inside the block only."""
    from vllm.v1.sample import rejection_sampler

    with contextlib.ExitStack() as stack:
        for name, fixed in CPU_FIXES.items():
            stack.enter_context(mock.patch.object(rejection_sampler, name, fixed))
        yield


class VLLMRejectionVerifier:
    """A `Verifier` running `sampler` (a vLLM `RejectionSampler`; default: vLLM's own, over vLLM's
    `Sampler` for the bonus token); `cpu_fixes`: with `cpu_fixed()` around each call.
    `decide` takes one request per row (a mixed batch, as vLLM serves one) instead of the loop's
    one `params`."""

    def __init__(self, sampler: Any = None, cpu_fixes: bool = False) -> None:
        platform_kernels()
        self.cpu_fixes = cpu_fixes
        if sampler is None:
            from vllm.v1.sample.rejection_sampler import RejectionSampler
            from vllm.v1.sample.sampler import Sampler

            sampler = RejectionSampler(Sampler())
        self.sampler = sampler
        self.__qualname__ = f"vllm:{type(sampler).__name__}{'+cpu-fixes' if cpu_fixes else ''}"

    def __call__(
        self,
        logits: torch.Tensor,  # [B, k+1, V] raw target logits
        drafts: torch.Tensor,  # [B, k]
        q: torch.Tensor | None,  # [B, k, V] processed draft distributions, or None (point mass)
        params: SamplingParams,
        generator: torch.Generator,
    ) -> BlockOutcome:
        return self.decide(logits, drafts, q, [params] * drafts.shape[0], generator)

    def decide(
        self,
        logits: torch.Tensor,  # [B, k+1, V]
        drafts: torch.Tensor,  # [B, k]
        q: torch.Tensor | None,  # [B, k, V] or None
        params: list[SamplingParams],  # one request per row
        generator: torch.Generator,
    ) -> BlockOutcome:
        batch, k = drafts.shape
        vocab = logits.shape[-1]
        flat = logits.float().reshape(batch * (k + 1), vocab).contiguous()  # [B*(k+1), V]
        draft_probs = None if q is None else q.float().reshape(batch * k, vocab).contiguous()  # [B*k, V]
        with cpu_fixed() if self.cpu_fixes else contextlib.nullcontext():
            out = self.sampler(
                spec_decode_metadata(drafts),
                draft_probs,
                flat,
                sampling_metadata(params, vocab, generator, logits.device),
            )
        return block_outcome(out.sampled_token_ids, k)  # [B, k+1]


def rejection_sampler(target: object = None) -> VLLMRejectionVerifier:
    """`losscheck.engines.vllm_verifier:rejection_sampler`: vLLM's `RejectionSampler` as a `Verifier`.
    `target` is accepted and unused, so the factory can be called with or without the loaded target."""
    return VLLMRejectionVerifier()


def rejection_sampler_cpu_fixed(target: object = None) -> VLLMRejectionVerifier:
    """`losscheck.engines.vllm_verifier:rejection_sampler_cpu_fixed`: `rejection_sampler` with the CPU
    build's two sampler bugs fixed (`CPU_FIXES`; the module docstring says what they are)."""
    return VLLMRejectionVerifier(cpu_fixes=True)
