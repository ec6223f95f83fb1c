"""The SGLang adapter's mapping without SGLang or weights: each request's sampling parameters, the
refusals by name, the answers' shape checked, the counters read from each request's meta_info,
and one engine alive at a time, shut down before the next is built."""

from __future__ import annotations

import pytest

from losscheck.core.sampling import SamplingParams
from losscheck.engines import EngineOutputError, GenerationRequest
from losscheck.engines.pool import Policy
from losscheck.engines.served import UnsupportedParameter
from losscheck.engines.sglang import SGLangEngine, block_length, sampling_params
from losscheck.errors import OptionError

EOS = 1


def test_every_knob_is_sent_with_the_rows_own_seed_and_eos_as_the_stop():
    params = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.2, min_tokens=3)
    sent = sampling_params(params, seed=11, max_new_tokens=9, eos=EOS)
    assert sent == {
        "max_new_tokens": 9,
        "min_new_tokens": 3,
        "temperature": 0.7,
        "top_k": -1,  # off
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop_token_ids": [EOS],
        "ignore_eos": False,
        "sampling_seed": 11,
    }
    assert sampling_params(SamplingParams(top_k=8), 0, 1, EOS)["top_k"] == 8


@pytest.mark.parametrize("params", [SamplingParams(logit_bias=((3, 2.0),)), SamplingParams(banned_ids=(3,))])
def test_what_is_not_verified_against_sglang_is_refused_by_name(params):
    with pytest.raises(UnsupportedParameter, match="engine 'sglang' cannot serve"):
        sampling_params(params, 0, 4, EOS)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"speculative_num_steps": 4}, "needs 'speculative_algorithm'"),
        ({"speculative_algorithm": "EAGLE3", "speculative_num_steps": True}, "must be an int >= 1, got True"),
    ],
)
def test_a_speculative_config_without_an_algorithm_or_a_block_is_refused(config, message):
    with pytest.raises(OptionError, match=message):
        block_length(config)
    assert block_length({"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3}) == 3


def test_the_command_line_without_a_speculative_config_or_with_an_assistant_is_one_usage_error():
    from losscheck.run.loading import check_engine_options
    from losscheck.run.options import Options

    with pytest.raises(
        OptionError, match="--losscheck-engine=sglang needs --losscheck-speculative-config=JSON of SGLang"
    ):
        check_engine_options(Options(engine="sglang"))
    config = '{"speculative_algorithm": "STANDALONE", "speculative_num_steps": 0}'
    with pytest.raises(OptionError, match="speculative_num_steps must be an int >= 1, got 0"):
        check_engine_options(Options(engine="sglang", speculative_config=config))
    good = '{"speculative_algorithm": "NGRAM", "speculative_num_steps": 4}'
    with pytest.raises(OptionError, match="--losscheck-assistant is Hugging Face's"):
        check_engine_options(Options(engine="sglang", speculative_config=good, assistant="d"))
    check_engine_options(Options(engine="sglang", speculative_config=good))  # accepted


class Stub:
    """SGLang's surface answering fixed rows; `meta` the speculative side's meta_info per request."""

    built: list[bool] = []

    def __init__(self, speculative: bool, answer: object = None) -> None:
        self.speculative, self.answer, self.closed = speculative, answer, False
        Stub.built.append(speculative)

    def generate(self, input_ids, sampling_params):
        if self.answer is not None:
            return self.answer
        meta = {"completion_tokens": 3}
        if self.speculative:
            meta |= {"spec_verify_ct": 2, "spec_num_proposed_drafts": 8, "spec_num_correct_drafts": 1}
        return [{"output_ids": [5, 6, EOS], "meta_info": meta} for _ in input_ids]

    def shutdown(self):
        self.closed = True


def _request(speculative: bool) -> GenerationRequest:
    return GenerationRequest(
        prompts=((2, 3), (4,)), n=2, params=SamplingParams(), seed=7, max_new_tokens=5, speculative=speculative
    )


def test_rows_are_padded_counted_and_one_engine_lives_at_a_time():
    Stub.built = []
    alive: list[Stub] = []

    def make(speculative: bool) -> Stub:
        alive.append(Stub(speculative))
        return alive[-1]

    engine = SGLangEngine(make, 4, EOS, "bf16", Policy.ONE_AT_A_TIME, "sglang[EAGLE3]")
    out = engine.generate(_request(True))
    assert out.shape == (2, 2, 5) and out[1, 1].tolist() == [5, 6, EOS, EOS, EOS]
    counted = engine.counters()
    assert (counted.drafts, counted.drafted, counted.accepted, counted.emitted) == (8, 32, 4, 8)  # 4 requests
    engine.generate(_request(False))
    assert Stub.built == [True, False] and alive[0].closed and not alive[1].closed
    assert engine.counters() == counted  # the plain side counts nothing


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ([{"output_ids": [5]}], "answered 1 results for 4 requests"),
        ([{"text": "hi"}] * 4, "without a list of output_ids"),
    ],
)
def test_a_malformed_answer_is_an_engine_output_error(answer, message):
    engine = SGLangEngine(lambda s: Stub(s, answer), 4, EOS, "fp32", Policy.KEEP_ALL, "sglang[X]")
    with pytest.raises(EngineOutputError, match=message):
        engine.generate(_request(False))
