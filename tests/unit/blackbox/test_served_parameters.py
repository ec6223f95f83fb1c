"""The sampling parameters engines serve, on the adapters that need their engine only to run:
Hugging Face's generation config (`losscheck.engines.hf.sampling_config`), OpenVINO GenAI's
refusals (raised before `openvino_genai` is imported; its pass-through is tested in
tests/engines/test_openvino.py), and the `+served` cells of an engine's plan."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.engines.hf import sampling_config
from losscheck.engines.openvino import generation_config
from losscheck.engines.served import UnsupportedParameter, served
from losscheck.errors import OptionError
from losscheck.plan.matrix import SERVED_VARIANTS, engine_cells
from losscheck.plan.scope import parse_scope

EOS = 2


def test_served_names_what_a_request_sets_away_from_neutral():
    assert served(SamplingParams(temperature=0.5, top_k=3)) == []
    assert served(SamplingParams(min_p=0.1, banned_ids=(4,))) == ["min_p", "banned_ids"]


def test_hugging_face_gets_each_parameter_in_its_own_processor():
    def config(**params):
        return sampling_config(SamplingParams(**params), "hf", EOS)

    assert config(repetition_penalty=1.5)["repetition_penalty"] == 1.5
    assert config(min_p=0.1)["min_p"] == 0.1
    assert config(logit_bias={16: 2.0})["sequence_bias"] == {(16,): 2.0}
    assert config(banned_ids=(5, 7))["bad_words_ids"] == [[5], [7]]
    assert config(min_tokens=8)["min_new_tokens"] == 8
    neutral = config()
    assert (neutral["repetition_penalty"], neutral["min_new_tokens"], neutral["min_p"]) == (1.0, 0, None)
    assert neutral["sequence_bias"] is None and neutral["bad_words_ids"] is None
    assert sampling_config(GREEDY, "hf", EOS)["do_sample"] is False


def test_a_transformers_generation_config_takes_them():
    from transformers import GenerationConfig

    params = SamplingParams(repetition_penalty=1.5, logit_bias={16: 2.0}, banned_ids=(5,), min_tokens=8)
    config = GenerationConfig(max_new_tokens=16, eos_token_id=EOS, **sampling_config(params, "hf", EOS))
    assert config.sequence_bias == {(16,): 2.0} and config.bad_words_ids == [[5]] and config.min_new_tokens == 8


@pytest.mark.parametrize(
    ("params", "refusal"),
    [
        (SamplingParams(presence_penalty=1.0), "presence_penalty=1.0: transformers has no presence penalty"),
        (SamplingParams(frequency_penalty=0.5), "frequency_penalty=0.5: transformers has no frequency penalty"),
        (SamplingParams(min_p=0.1, top_k=8), "min_p=0.1 here: transformers applies min-p after top-k"),
    ],
)
def test_hugging_face_refuses_what_it_cannot_serve_by_name(params, refusal):
    with pytest.raises(UnsupportedParameter, match=refusal):
        sampling_config(params, "hf", EOS)


@pytest.mark.parametrize(
    ("params", "refusal"),
    [
        (SamplingParams(presence_penalty=1.0), "presence_penalty=1.0: OpenVINO GenAI's penalty reduces"),
        (SamplingParams(frequency_penalty=0.5), "frequency_penalty=0.5: OpenVINO GenAI's penalty reduces"),
        (SamplingParams(logit_bias={16: 2.0}), "logit_bias=.*no logit bias"),
        (SamplingParams(banned_ids=(5,)), "banned_ids=.*no logit bias or banned ids"),
        (SamplingParams(min_p=0.1, temperature=0.5), "min_p=0.1 here: .*not pinned"),
    ],
)
def test_openvino_refuses_what_it_cannot_serve_by_name(params, refusal):
    with pytest.raises(UnsupportedParameter, match=refusal):
        generation_config(params, 17, 16, EOS, 4)


def test_served_engine_cells_come_with_plus_served_only():
    engine = SimpleNamespace(k=4, precision="fp32")
    plain, _ = engine_cells(engine)  # type: ignore[arg-type]
    added, _ = engine_cells(engine, served=True)  # type: ignore[arg-type]
    assert [c.params for c in added] == [c.params for c in plain] + list(SERVED_VARIANTS)
    assert {c.id for c in added} - {c.id for c in plain} == {
        f"engine-k4-T1-{p}" for p in ("rep1.5", "pres1", "freq0.5", "minp0.1", "bias16+2", "ban5", "min8", "stop5")
    }
    scope = parse_scope("+served,-k")
    assert scope.extras == {"served"} and scope.out == ("k",) and not scope.whole
    with pytest.raises(OptionError, match=r"no extra '\+penalties'; the extras are \+served"):
        parse_scope("+penalties")


def test_a_grammar_is_refused_by_every_adapter_but_vllms_offline_api():
    """vLLM's offline API passes a grammar to its structured outputs (tests/engines/test_vllm.py
    certifies it); Hugging Face, llama.cpp, OpenVINO and the vLLM server refuse the cell by name."""
    from losscheck.core.grammar import Grammar
    from losscheck.core.sampling import SamplingParams
    from losscheck.engines import hf, llamacpp, openvino
    from losscheck.engines.served import NO_GRAMMAR, UnsupportedParameter, refuse

    params = SamplingParams(grammar=Grammar("regex", "([a-z][0-9])+"))
    for engine, unsupported in (
        ("hf", hf.HF_UNSUPPORTED),
        ("llamacpp", llamacpp.LLAMACPP_UNSUPPORTED),
        ("openvino", openvino.OPENVINO_UNSUPPORTED),
    ):
        with pytest.raises(UnsupportedParameter, match=f"engine '{engine}' cannot serve grammar='regex9c2771'"):
            refuse(params, engine, unsupported, 1)
    refuse(params, "vllm", {}, 1)  # passed through
    assert "vLLM" in NO_GRAMMAR
