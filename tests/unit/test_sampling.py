"""Logits processing and seeded sampling."""

from __future__ import annotations

import pytest
import torch

from losscheck.core.sampling import SamplingParams, derive_seed, make_generator, process_logits, sample
from losscheck.errors import OptionError
from tests.support import assert_follows


def test_greedy_is_the_one_hot_argmax():
    probs = process_logits(torch.tensor([[0.1, 3.0, 2.9]]), SamplingParams(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 4.0])
    got = process_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(got, torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_the_k_most_probable():
    probs = process_logits(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingParams(top_k=2))
    assert (probs > 0).tolist() == [False, True, True, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p_including_the_crossing_token():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert (process_logits(logits, SamplingParams(top_p=0.8)) > 0).tolist() == [True, True, False, False]
    assert (process_logits(logits, SamplingParams(top_p=0.81)) > 0).tolist() == [True, True, True, False]
    assert (process_logits(logits, SamplingParams(top_p=0.1)) > 0).tolist() == [True, False, False, False]


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1}, {"temperature": float("nan")}, {"top_k": -2}, {"top_p": 0}, {"top_p": 1.5}]
)
def test_bad_parameters_are_rejected_with_a_message(kwargs):
    with pytest.raises(OptionError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_sample_follows_probs():
    """200k draws of a fixed 5-token law; chi-square at alpha = 1e-6 (seeded)."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    draws = sample(probs.expand(200_000, -1), make_generator(1, "t"))
    assert_follows(draws, probs, 1e-6, "200k draws vs probs")  # and never the zero-probability token


def test_same_seed_same_tokens_bitwise_and_streams_differ():
    probs = torch.softmax(torch.randn(1000, 50, generator=torch.Generator().manual_seed(0)), -1)
    a = sample(probs, make_generator(7, "cell", 1))
    b = sample(probs, make_generator(7, "cell", 1))
    c = sample(probs, make_generator(7, "cell", 2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert derive_seed(7, "x") != derive_seed(8, "x")
