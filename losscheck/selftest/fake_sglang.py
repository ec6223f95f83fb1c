"""A stand-in with SGLang's offline surface, for testing `--engine sglang` without SGLang (no CPU
build of its kernels installs here): `--engine-arg losscheck_engine_class=losscheck.selftest.fake_sglang:Engine`.

`Engine(model_path=..., skip_tokenizer_init=True, random_seed=..., dtype=..., speculative_algorithm=
"STANDALONE", speculative_draft_model_path=DIR, speculative_num_steps=K, ...)` is losscheck's own
loop over the Hugging Face target at `model_path` with DIR as a family-A drafter drafting K tokens a
round (speculation off without `speculative_algorithm`); `generate(input_ids=[...],
sampling_params=[...])` answers SGLang's shape, one dict per request: `output_ids` (EOS included
where the row stopped) and `meta_info` with `completion_tokens` and, speculating, the request's
`spec_verify_ct`, `spec_num_proposed_drafts` and `spec_num_correct_drafts`. Requests of equal
sampling parameters are one batch of the loop, drawn from one generator seeded by their
`sampling_seed`s together (the same requests, the same answer).
"""

from __future__ import annotations

import json
from typing import Any


class Engine:
    def __init__(self, model_path: str, **kwargs: Any) -> None:
        from losscheck.core.engine import Engine as Loop
        from losscheck.core.target import HFTarget
        from losscheck.drafters.autoregressive import from_path

        if kwargs.get("skip_tokenizer_init") is not True:
            raise ValueError("the fake answers output_ids only: build it with skip_tokenizer_init=True")
        precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[kwargs.get("dtype", "float32")]
        target = HFTarget.from_pretrained(model_path, precision)
        self.eos = target.eos_id if target.eos_id is not None else 0
        self.speculative = kwargs.get("speculative_algorithm") is not None
        if self.speculative:
            drafter = from_path(kwargs["speculative_draft_model_path"], target, precision)
            self.loop = Loop(target, drafter, int(kwargs["speculative_num_steps"]))
        else:
            self.loop = Loop(target)
        self.closed = False

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.closed:
            raise RuntimeError("generate after shutdown")
        batches: dict[str, list[int]] = {}  # the requests of equal parameters, by the parameters
        for i, sp in enumerate(sampling_params):
            batches.setdefault(json.dumps({**sp, "sampling_seed": None}, sort_keys=True), []).append(i)
        out: list[dict[str, Any]] = [{} for _ in input_ids]
        for rows in batches.values():
            for i, answer in zip(rows, self._batch([input_ids[i] for i in rows], [sampling_params[i] for i in rows])):
                out[i] = answer
        return out

    def _batch(self, prompts: list[list[int]], sps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        import torch

        from losscheck.core.sampling import SamplingParams, derive_seed

        sp = sps[0]
        if sp["stop_token_ids"][0] != self.eos or sp["ignore_eos"]:
            raise ValueError(f"the fake stops at EOS {self.eos} first: {sp}")
        params = SamplingParams(
            temperature=sp["temperature"],
            top_k=max(sp["top_k"], 0),
            top_p=sp["top_p"],
            min_p=sp["min_p"],
            repetition_penalty=sp["repetition_penalty"],
            presence_penalty=sp["presence_penalty"],
            frequency_penalty=sp["frequency_penalty"],
            min_tokens=sp["min_new_tokens"],
            stop_ids=tuple(sp["stop_token_ids"][1:]),
        )
        seed = derive_seed(0, "fake-sglang", *(int(s["sampling_seed"]) for s in sps))
        generator = torch.Generator(device=self.loop.target.device).manual_seed(seed)
        got = self.loop.generate(prompts, sp["max_new_tokens"], params, generator)
        answers = []
        for r in range(len(prompts)):
            tokens = got.tokens[r, : int(got.lengths[r])].tolist()
            meta: dict[str, Any] = {"completion_tokens": len(tokens)}
            if self.speculative:
                meta |= self._spec_meta(got, r)
            answers.append({"output_ids": tokens, "meta_info": meta})
        return answers

    def _spec_meta(self, got: Any, row: int) -> dict[str, int]:
        """Row `row`'s counters from its tokens' slots: a round starts at slot 0 and drafts k tokens;
        the tokens past each round's first are its accepted drafts."""
        n = int(got.lengths[row])
        rounds = int((got.slots[row, :n] == 0).sum())
        k = self.loop.k
        return {"spec_verify_ct": rounds, "spec_num_proposed_drafts": k * rounds, "spec_num_correct_drafts": n - rounds}

    def shutdown(self) -> None:
        self.closed = True
