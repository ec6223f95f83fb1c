"""Planted bugs in vLLM's rejection sampler, for testing the tests (tests/engines/test_vllm.py).

Each is a subclass of `vllm.v1.sample.rejection_sampler.RejectionSampler` whose `forward` hands
vLLM's own code one wrong value, in one line marked `# BUG:`; everything else is vLLM's. Each
models a real bug class of speculative verifiers:

- `RecoveredFromTarget`: at a rejection the recovered token is drawn from the target's `p`
  instead of the residual `norm(max(0, p - q))` (the draft probabilities are zeroed for the
  recovered-token draw only);
- `AcceptAll`: the acceptance test is off, every draft with `q > 0` is kept (the uniforms are 0);
- `InvertedRatio`: the acceptance test compares `q(x) / p(x)` with the uniform (target and draft
  probabilities swapped in the accept kernel);
- `BonusFromLastDraft`: the bonus token is sampled from the last draft position's logits instead of
  the position after the block (an off-by-one in the bonus index);
- `MixedRequests`: each request reads the next request's temperature (per-request parameters
  shifted by one row in a mixed batch).

`losscheck.engines.vllm_verifier.VLLMRejectionVerifier(sampler=BUG())` makes any of them a losscheck
`Verifier`. They run with vLLM's sampler as it is on the platform; on vLLM's CPU build pair them
with the CPU build's sampler fixes (`cpu_fixes=True`), which the correct path needs too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from unittest import mock

import torch

from losscheck.engines.vllm_verifier import platform_kernels

platform_kernels()  # the CPU build's kernels must replace Triton's before the module below binds them

from vllm.v1.sample import rejection_sampler as rs  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

_sample_recovered = rs.sample_recovered_tokens
_uniforms = rs.generate_uniform_probs
_accept_kernel = rs._rejection_random_sample


class _Planted(rs.RejectionSampler):
    def __init__(self) -> None:
        super().__init__(Sampler())


class RecoveredFromTarget(_Planted):
    def forward(self, metadata: Any, draft_probs: Any, logits: torch.Tensor, sampling_metadata: Any) -> Any:
        def recovered(max_spec_len, num_draft, cu, drafts, probs, target_probs, *args, **kwargs):
            # greedy drafts (no draft probabilities) recover from p less the draft token: zeros too
            probs = torch.zeros_like(target_probs if probs is None else probs)  # BUG: residual of p - 0 = p, not p - q
            return _sample_recovered(max_spec_len, num_draft, cu, drafts, probs, target_probs, *args, **kwargs)

        with mock.patch.object(rs, "sample_recovered_tokens", recovered):
            return super().forward(metadata, draft_probs, logits, sampling_metadata)


class AcceptAll(_Planted):
    def forward(self, metadata: Any, draft_probs: Any, logits: torch.Tensor, sampling_metadata: Any) -> Any:
        def uniforms(*args, **kwargs):
            return torch.zeros_like(_uniforms(*args, **kwargs))  # BUG: u = 0, so p(x) / q(x) >= u always

        with mock.patch.object(rs, "generate_uniform_probs", uniforms):
            return super().forward(metadata, draft_probs, logits, sampling_metadata)


class InvertedRatio(_Planted):
    def forward(self, metadata: Any, draft_probs: Any, logits: torch.Tensor, sampling_metadata: Any) -> Any:
        def accept(out, cu, drafts, probs, target_probs, *args, **kwargs):
            probs, target_probs = target_probs, probs  # BUG: accepts when q(x) / p(x) >= u
            return _accept_kernel(out, cu, drafts, probs, target_probs, *args, **kwargs)

        with mock.patch.object(rs, "_rejection_random_sample", accept):
            return super().forward(metadata, draft_probs, logits, sampling_metadata)


class BonusFromLastDraft(_Planted):
    def forward(self, metadata: Any, draft_probs: Any, logits: torch.Tensor, sampling_metadata: Any) -> Any:
        metadata = replace(metadata, bonus_logits_indices=metadata.bonus_logits_indices - 1)  # BUG: off by one
        return super().forward(metadata, draft_probs, logits, sampling_metadata)


class MixedRequests(_Planted):
    def forward(self, metadata: Any, draft_probs: Any, logits: torch.Tensor, sampling_metadata: Any) -> Any:
        temperature = sampling_metadata.temperature.roll(1)  # BUG: request b reads request b-1's temperature
        return super().forward(metadata, draft_probs, logits, replace(sampling_metadata, temperature=temperature))


BUGS: dict[str, type[rs.RejectionSampler]] = {
    "recovered-from-target": RecoveredFromTarget,
    "accept-all": AcceptAll,
    "inverted-ratio": InvertedRatio,
    "bonus-from-last-draft": BonusFromLastDraft,
    "mixed-requests": MixedRequests,
}


def _plant(worker: Any, bug: str) -> None:
    """On a vLLM worker (`LLM.collective_rpc`): its model runner verifies with the planted `bug`,
    the CPU sampler fixes still in place."""
    worker.model_runner.rejection_sampler = BUGS[bug]()


class PlantedEngineFactory:
    """`losscheck.engines.vllm`'s fixed CPU engine for `method`, its speculative `LLM` verifying
    with the planted `bug` (the baseline `LLM` untouched): a black-box engine with a verifier bug,
    for showing which drafting makes the black-box cells catch it."""

    def __init__(self, method: str, bug: str) -> None:
        self.method, self.bug = method, bug

    def __call__(self, target: Any) -> Any:
        from losscheck.engines.vllm import CPUEngineFactory

        engine = CPUEngineFactory(self.method, cpu_fixes=True)(target)
        make = engine.make_llm

        def make_llm(spec: dict[str, Any] | None) -> Any:
            llm = make(spec)
            if spec is not None:
                llm.collective_rpc(_plant, args=(self.bug,))
            return llm

        engine.make_llm = make_llm
        engine.name = f"vllm-cpu+{self.bug}({self.method}, k={engine.k})"
        return engine


# --losscheck-engine=losscheck.selftest.vllm_bugs:NAME
cpu_draft_model_recovered_from_target = PlantedEngineFactory("draft_model", "recovered-from-target")
cpu_draft_probabilistic_recovered_from_target = PlantedEngineFactory("draft_probabilistic", "recovered-from-target")
cpu_draft_tempered2_recovered_from_target = PlantedEngineFactory("draft_tempered2", "recovered-from-target")
cpu_draft_model_bonus_from_last_draft = PlantedEngineFactory("draft_model", "bonus-from-last-draft")
