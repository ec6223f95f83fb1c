"""An own engine, certified by losscheck as a black box: standard speculative sampling written
from scratch over two Hugging Face causal LMs (the target losscheck loaded, and the bundled
drafter A as the draft model), one row at a time, without a KV cache.

losscheck sees only `generate` (a `GenerationRequest` in, ids out) and compares the engine with itself with drafting
off; the target's copy that losscheck loads scores the samples (one-sample PIT, `precision`).

    losscheck certify --engine examples.speculative_engine:factory --scope=engine-greedy
    losscheck certify --engine examples.speculative_engine:factory     # and its five sampled cells

(from the repository root; `tests/e2e/test_examples.py` certifies it over the scope in examples/README.md).
"""

from __future__ import annotations

import torch

from losscheck import SamplingParams, Target, process_logits
from losscheck.engines import GenerationRequest, row_by_row


class SpeculativeEngine:
    name = "example-speculative-engine"
    k = 4  # drafts per round
    precision = "fp32"  # the dtype the target runs in: losscheck scores the samples in it

    def __init__(self, target_model: torch.nn.Module, draft_model: torch.nn.Module, eos: int) -> None:
        self.target, self.draft, self.eos = target_model, draft_model, eos

    @torch.no_grad()
    def generate(self, request: GenerationRequest) -> torch.Tensor:
        rng = torch.Generator().manual_seed(request.seed)  # one stream for every row, drawn in row order

        def row(i: int, j: int) -> list[int]:  # the j-th continuation of prompt i
            prompt = list(request.prompts[i])
            return self._row(prompt, request.params, request.max_new_tokens, rng, request.speculative)

        return row_by_row(request, self.eos, row)  # padded with EOS: [P, n, max_new_tokens]

    def _dist(self, model: torch.nn.Module, ids: list[int], params: SamplingParams, last: int) -> torch.Tensor:
        """The processed next-token distributions after each of the last `last` positions -> [last, V]."""
        logits = model(torch.tensor([ids])).logits[0, -last:]  # [last, V]
        return process_logits(logits, params)

    def _row(
        self, prompt: list[int], params: SamplingParams, budget: int, rng: torch.Generator, speculative: bool
    ) -> list[int]:
        ids, new = list(prompt), []
        while len(new) < budget and (not new or new[-1] != self.eos):
            if not speculative:  # drafting off: plain sampling from the target
                p = self._dist(self.target, ids, params, 1)[0]
                token = int(torch.multinomial(p, 1, generator=rng))
                ids, new = ids + [token], new + [token]
                continue
            k = min(self.k, budget - len(new))
            drafts, qs = [], []
            for _ in range(k):  # the draft model proposes k tokens, each sampled from its q
                q = self._dist(self.draft, ids + drafts, params, 1)[0]
                drafts.append(int(torch.multinomial(q, 1, generator=rng)))
                qs.append(q)
            p = self._dist(self.target, ids + drafts, params, k + 1)  # [k + 1, V]: after each draft, and the bonus
            emitted = []
            for m, (x, q) in enumerate(zip(drafts, qs)):
                # accept with probability min(1, p/q); at the first rejection sample the residual
                if torch.rand((), generator=rng) * q[x] < p[m, x]:
                    emitted.append(x)
                    if x == self.eos:
                        break
                    continue
                residual = torch.clamp(p[m] - q, min=0)
                emitted.append(int(torch.multinomial(residual / residual.sum(), 1, generator=rng)))
                break
            else:  # every draft accepted: the bonus token from the target's next distribution
                emitted.append(int(torch.multinomial(p[k], 1, generator=rng)))
            emitted = emitted[: budget - len(new)]
            if self.eos in emitted:
                emitted = emitted[: emitted.index(self.eos) + 1]
            ids, new = ids + emitted, new + emitted
        return new


def factory(target: Target) -> SpeculativeEngine:
    from losscheck import bundled
    from losscheck.core.target import load_causal_lm

    draft = load_causal_lm(bundled.fixtures_dir() / "drafter_a")
    eos = target.eos_id if target.eos_id is not None else 0
    return SpeculativeEngine(target.model, draft, eos)  # type: ignore[attr-defined]
