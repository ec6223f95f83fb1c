"""The llama.cpp adapter's row loop over a stand-in binding (no llama_cpp needed): each row is
seeded on its own, stops at EOS or the budget, and lands in its place padded with EOS. The real
binding is certified in `tox -e llamacpp` (tests/engines/test_llamacpp.py)."""

from __future__ import annotations

import random
from collections.abc import Iterator

from losscheck.core.sampling import GREEDY, derive_seed
from losscheck.engines.llamacpp import SEEDS, LlamaCppEngine
from tests.support import engine_request

EOS = 1


class FakeLlama:
    """Emits ids drawn from its seed, forever: 2..9, and EOS where the draw is 0."""

    def __init__(self) -> None:
        self.seeds: list[int] = []

    def set_seed(self, seed: int) -> None:
        self.seeds.append(seed)

    def generate(self, prompt: list[int], **sampler: object) -> Iterator[int]:
        rng = random.Random(self.seeds[-1])
        while True:
            draw = rng.randrange(10)
            yield EOS if draw in (0, 1) else draw


def test_rows_are_seeded_apart_and_stop_at_eos_or_the_budget():
    llama = FakeLlama()
    engine = LlamaCppEngine(lambda speculative: (llama, None), k=2, eos=EOS)
    prompts = [[3, 4], [5]]
    out = engine.generate(engine_request(prompts, 3, GREEDY, 7, 6, False))  # [P, n, L]
    assert out.shape == (2, 3, 6)
    assert llama.seeds == [derive_seed(7, i, j) % SEEDS for i in range(2) for j in range(3)]
    for i in range(2):
        for j in range(3):
            rng, expected = random.Random(derive_seed(7, i, j) % SEEDS), []
            while len(expected) < 6 and (not expected or expected[-1] != EOS):
                draw = rng.randrange(10)
                expected.append(EOS if draw in (0, 1) else draw)
            assert out[i, j].tolist() == expected + [EOS] * (6 - len(expected))
    assert len({tuple(row) for row in out.view(6, 6).tolist()}) > 1  # the rows differ


def test_served_parameters_reach_the_sampler_chain_or_are_refused_by_name():
    import numpy as np
    import pytest

    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.llamacpp import sampler_args
    from losscheck.engines.served import UnsupportedParameter

    assert sampler_args(SamplingParams(min_p=0.1), EOS)["min_p"] == 0.1
    assert sampler_args(SamplingParams(), EOS)["logits_processor"] is None
    bias = sampler_args(SamplingParams(logit_bias={3: 2.0}, banned_ids=(4,)), EOS)["logits_processor"]
    scores = bias(np.zeros(2, dtype=np.intc), np.zeros(6, dtype=np.float32))
    assert scores.tolist() == [0, 0, 0, 2.0, -np.inf, 0]
    for name, value in (("repetition_penalty", 1.5), ("presence_penalty", 1.0), ("frequency_penalty", 0.5)):
        with pytest.raises(UnsupportedParameter, match=f"{name}=.*repeat_last_n"):
            sampler_args(SamplingParams(**{name: value}), EOS)
    with pytest.raises(UnsupportedParameter, match="min_tokens=8: .*no min-tokens"):
        sampler_args(SamplingParams(min_tokens=8), EOS)
    with pytest.raises(UnsupportedParameter, match="min_p=0.1 here: .*before temperature"):
        sampler_args(SamplingParams(min_p=0.1, temperature=0.5), EOS)
