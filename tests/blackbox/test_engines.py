"""The black-box engine contract: declared attributes, validated output, planned cells, and
losscheck's own loop and Hugging Face assisted generation behind it."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from losscheck import bundled
from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.engines import EngineOutputError, check_engine, checked_samples, lengths
from losscheck.errors import OptionError
from losscheck.plan.matrix import OWN_TARGET, SAMPLING_VARIANTS, engine_cells

EOS, V = 1, 64


def engine(**attrs):
    base = {"name": "fake", "k": 4, "precision": "fp32", "generate": lambda *a: None}
    return SimpleNamespace(**{**base, **attrs})


@pytest.mark.parametrize(
    "attrs, message",
    [
        ({"generate": None}, "without a generate"),
        ({"k": 0}, "k = 0; declare the block length"),
        ({"k": True}, "k = True"),
        ({"precision": "int8"}, "precision = 'int8'"),
        ({"name": None}, "without a name"),
    ],
)
def test_an_engine_missing_a_declaration_is_an_option_error_naming_its_source(attrs, message):
    with pytest.raises(OptionError, match=message) as info:
        check_engine(engine(**attrs), "--losscheck-engine='m:f'")
    assert "--losscheck-engine='m:f' returned SimpleNamespace" in str(info.value)


def test_a_valid_engine_passes_with_precision_none_meaning_two_sample():
    e = engine(precision=None)
    assert check_engine(e, "x") is e


@pytest.mark.parametrize(
    "out, message",
    [
        ([[1]], "returned list"),
        (torch.zeros(2, 3, 5), "dtype torch.float32"),
        (
            torch.zeros(2, 3, 4, dtype=torch.long),
            r"shape \(2, 3, 4\), expected \[prompts, n, max_new_tokens\] = \(2, 3, 5\)",
        ),
        (torch.full((2, 3, 5), V, dtype=torch.long), r"ids in \[64, 64\], outside the target's vocabulary \[0, 64\)"),
        (torch.tensor([5, EOS, 7, EOS, EOS]).expand(2, 3, 5), "ids other than EOS"),
    ],
)
def test_malformed_engine_output_is_an_error_naming_the_engine(out, message):
    with pytest.raises(EngineOutputError, match=message) as info:
        checked_samples(engine(), out, 2, 3, 5, V, EOS)
    assert "engine 'fake'" in str(info.value)


def test_eos_padded_rows_pass_and_their_lengths_count_the_eos():
    out = torch.tensor([[[5, 6, 7], [8, EOS, EOS]], [[EOS, EOS, EOS], [9, 9, EOS]]], dtype=torch.int32)
    ok = checked_samples(engine(), out, 2, 2, 3, V, EOS)
    assert ok.dtype == torch.long
    assert lengths(ok, EOS).tolist() == [[3, 2], [1, 3]]


def test_engine_cells_run_at_the_engines_k_in_its_precision_or_two_sample():
    sampled, greedy = engine_cells(engine(k=3, precision="bf16"))
    assert [c.params for c in sampled] == list(SAMPLING_VARIANTS) and greedy[0].params == GREEDY
    assert {c.mode for c in sampled} == {"one-sample"} and greedy[0].mode == "engine-greedy"
    assert sampled[0].id == "engine-k3-T1-bf16" and {c.precision.target for c in sampled + greedy} == {"bf16"}
    sampled, greedy = engine_cells(engine(precision=None))
    assert {c.mode for c in sampled} == {"two-sample"} and {c.target for c in sampled + greedy} == {OWN_TARGET}
    assert sampled[0].id == "engine-k4-T1-two-sample" and greedy[0].id == "engine-k4-greedy-two-sample"


PROMPTS = [[0, 3, 53, 39], [0, 3]]


@pytest.mark.parametrize("factory", ["losscheck.engines.spec_loop:spec_loop", "losscheck.engines.hf:hf_assisted"])
def test_adapters_return_the_contracts_shape_and_greedy_on_equals_off(target, factory):
    from losscheck.run.loading import load_object

    e = check_engine(load_object(factory, "test")(target), factory)
    assert e.k == 4 and e.precision == "fp32"
    sampled = e.generate(PROMPTS, 3, SamplingParams(), 7, 10, True)
    checked_samples(e, sampled, 2, 3, 10, V, EOS)
    assert torch.equal(sampled, e.generate(PROMPTS, 3, SamplingParams(), 7, 10, True))  # the seed decides
    assert not torch.equal(sampled, e.generate(PROMPTS, 3, SamplingParams(), 8, 10, True))
    on, off = (e.generate(PROMPTS, 1, GREEDY, 0, 12, s) for s in (True, False))
    assert torch.equal(on, off)


def test_hf_generation_config_is_exactly_the_request(target):
    from losscheck.engines.hf import hf_assisted

    config = hf_assisted(target).generation_config(SamplingParams(temperature=0.3, top_p=0.9), 10)
    assert (config.do_sample, config.temperature, config.top_k, config.top_p) == (True, 0.3, 0, 0.9)
    assert (config.num_assistant_tokens, config.num_assistant_tokens_schedule) == (4, "constant")
    assert config.assistant_confidence_threshold == 0.0 and config.eos_token_id == EOS
    assert hf_assisted(target).generation_config(GREEDY, 10).do_sample is False


def test_the_planted_residual_bug_changes_only_speculative_rows_and_is_removed_afterwards(target):
    import transformers.generation.utils as hf_utils

    from losscheck.engines.hf import hf_assisted
    from losscheck.selftest.hf import hf_assisted_residual_from_p

    correct, buggy = hf_assisted(target), hf_assisted_residual_from_p(target)
    before = hf_utils._speculative_sampling
    args = (PROMPTS, 4, SamplingParams(), 3, 12)
    assert not torch.equal(correct.generate(*args, True), buggy.generate(*args, True))
    assert torch.equal(correct.generate(*args, False), buggy.generate(*args, False))
    assert hf_utils._speculative_sampling is before


def test_a_tempered_assistant_drafts_from_logits_divided_by_its_factor():
    from losscheck.core.target import load_causal_lm
    from losscheck.engines.hf import tempered

    assistant = load_causal_lm(bundled.fixtures_dir() / "drafter_a")
    ids = torch.tensor([[1, 5, 9, 3]])
    plain = assistant(ids).logits
    stressed = tempered(assistant, 2.0)(ids).logits
    assert torch.allclose(stressed, plain / 2, atol=1e-6)


@pytest.mark.parametrize(
    "request_args, message",
    [
        ({}, "--losscheck-engine=openvino needs --losscheck-assistant=DIR"),
        ({"assistant": "d", "args": {"num_assistant_tokens": 0}}, "num_assistant_tokens=0: need an int >= 1"),
        ({"assistant": "d", "args": {"enable_prefix_caching": "no"}}, "enable_prefix_caching='no': need true or false"),
        ({"assistant": "d", "speculative_config": {}}, "--losscheck-speculative-config is vLLM's"),
    ],
)
def test_the_openvino_adapter_checks_its_options_before_loading_anything(request_args, message):
    from losscheck.engines.named import ADAPTERS, EngineRequest
    from losscheck.errors import OptionError

    with pytest.raises(OptionError, match=re.escape(message)):
        ADAPTERS["openvino"].check(EngineRequest(target="t", **request_args))
