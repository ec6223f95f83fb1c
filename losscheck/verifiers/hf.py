"""Hugging Face assisted generation's verification step as a `Verifier`.

`speculative_sampling` (`--losscheck-verifier=losscheck.verifiers.hf:speculative_sampling`, or
`losscheck verifier-tier --verifier losscheck.verifiers.hf:speculative_sampling`) wraps
transformers' `transformers.generation.utils._speculative_sampling(candidate_input_ids,
candidate_logits, candidate_length, new_logits, assistant_ensemble_weight=None)`, the acceptance
and residual step of assisted generation with `do_sample=True`, with its math untouched. What the
adapter supplies around it:

- `new_logits` [1, k+1, V]: the target's raw logits through transformers' own logits warpers,
  built as `GenerationMixin._get_logits_processor` builds them for sampling (temperature when it
  is not 1, top-k when it is not 0, top-p when it is below 1, in that order, keeping >= 1 token);
- `candidate_logits` [1, k, V]: `log q`, whose softmax (the first thing the function takes) is
  the draft distribution q again; a point-mass drafter (q None) gives the log of its one-hot;
- one call per row: the function is written for batch size 1 (it reduces the accepted count over
  the whole tensor and branches on it in Python), as assisted generation calls it;
- randomness: it draws from torch's global generator (`torch.rand_like`, `torch.multinomial`);
  the adapter seeds that from the `Verifier`'s generator inside `torch.random.fork_rng`, so a run
  is reproducible from its seed and the caller's global RNG state is left as it was;
- output: its `(valid_tokens [1, n+1], n_matches)` become `BlockOutcome(accepted=n, tokens)`.

Greedy rounds do not reach `_speculative_sampling` in transformers: `_assisted_decoding` keeps
the candidates while they equal the target's argmax, inline. That rule is restated here
(`_greedy`), so a greedy check of this adapter tests the restatement, not transformers code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from losscheck.core.sampling import SamplingParams
from losscheck.core.verify import BlockOutcome, Verifier, point_mass


def _warpers(params: SamplingParams) -> list:
    """transformers' sampling logits warpers for `params`, as `_get_logits_processor` adds them."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers: list = []
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    if params.min_p:  # after top-p in transformers, before top-k in losscheck and vLLM: alone, the same
        warpers.append(MinPLogitsWarper(min_p=params.min_p, min_tokens_to_keep=1))
    return warpers


def _greedy(logits: torch.Tensor, drafts: torch.Tensor) -> BlockOutcome:
    """`_assisted_decoding`'s greedy rule: keep drafts while they equal the argmax; then its argmax."""
    best = logits.argmax(-1)  # [B, k+1]
    k = drafts.shape[1]
    accepted = (drafts == best[:, :k]).long().cumprod(-1).sum(-1)  # [B]
    tokens = torch.cat([drafts, best[:, k:]], 1)  # [B, k+1]
    rows = torch.arange(len(drafts), device=drafts.device)
    tokens[rows, accepted] = best[rows, accepted]
    return BlockOutcome(accepted=accepted, tokens=tokens)


@contextmanager
def _seeded_global_rng(generator: torch.Generator, device: torch.device) -> Iterator[None]:
    """torch's global generator (of `device`'s type) seeded from `generator`, restored after."""
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator, device=generator.device))
    accelerator = device.type != "cpu"
    devices = [device.index or 0] if accelerator else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if accelerator else "cuda"):
        torch.manual_seed(seed)
        yield


@contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread while the per-row loop runs: on [1, k+1, V] tensors the thread pool only
    adds wake-ups (20 times slower on two busy cores, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def verify_with_speculative_sampling(
    logits: torch.Tensor,  # [B, k+1, V] raw target logits
    drafts: torch.Tensor,  # [B, k]
    q: torch.Tensor | None,  # [B, k, V] draft distributions, None: point mass
    params: SamplingParams,
    generator: torch.Generator,
) -> BlockOutcome:
    """The `Verifier` `speculative_sampling` returns (module docstring)."""
    from transformers.generation.utils import _speculative_sampling

    if params.greedy:
        return _greedy(logits, drafts)
    batch, k = drafts.shape
    vocab = logits.shape[-1]
    new_logits = logits.float().reshape(batch * (k + 1), vocab)  # [B·(k+1), V]
    for warp in _warpers(params):  # the warpers read no input ids for these three
        new_logits = warp(None, new_logits)
    new_logits = new_logits.view(batch, k + 1, vocab)
    q = point_mass(drafts, vocab) if q is None else q
    candidate_logits = q.float().log()  # [B, k, V]; softmax(log q) = q / sum(q)
    accepted = torch.zeros(batch, dtype=torch.long, device=drafts.device)
    tokens = torch.zeros(batch, k + 1, dtype=torch.long, device=drafts.device)
    with _seeded_global_rng(generator, logits.device), _one_thread():
        for b in range(batch):
            valid, n_matches = _speculative_sampling(
                drafts[b : b + 1], candidate_logits[b : b + 1], k, new_logits[b : b + 1]
            )
            n = int(n_matches)
            accepted[b] = n
            tokens[b, : n + 1] = valid[0]
    return BlockOutcome(accepted=accepted, tokens=tokens)


def speculative_sampling() -> Verifier:
    """`losscheck.verifiers.hf:speculative_sampling`: transformers' `_speculative_sampling` as a
    `Verifier` (module docstring)."""
    import transformers.generation.utils  # noqa: F401  # without transformers: an error naming the option now

    return verify_with_speculative_sampling
