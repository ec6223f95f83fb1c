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
    from losscheck.engines import hf, llamacpp, openvino, vllm
    from losscheck.engines.served import NO_GRAMMAR, refuse

    params = SamplingParams(grammar=Grammar("regex", "([a-z][0-9])+"))
    for engine, serves, why in (
        ("hf", hf.HF_SERVES, hf.HF_UNSUPPORTED),
        ("llamacpp", llamacpp.LLAMACPP_SERVES, llamacpp.LLAMACPP_UNSUPPORTED),
        ("openvino", openvino.OPENVINO_SERVES, openvino.OPENVINO_UNSUPPORTED),
    ):
        with pytest.raises(UnsupportedParameter, match=f"engine '{engine}' cannot serve grammar='regex9c2771'"):
            refuse(params, engine, serves, why, 1)
    refuse(params, "vllm", vllm.VLLM_SERVES, eos=1)  # passed through
    assert "vLLM" in NO_GRAMMAR


# one value away from neutral for every field beyond temperature, top-k and top-p
AWAY = {
    "min_p": 0.1,
    "repetition_penalty": 1.5,
    "presence_penalty": 1.0,
    "frequency_penalty": 0.5,
    "logit_bias": ((16, 2.0),),
    "banned_ids": (5,),
    "min_tokens": 8,
    "stop_ids": (5,),
    "grammar": "grammar",
    "stop_strings": "stop_strings",
}


def _adapters() -> dict[str, type]:
    from losscheck.engines.hf import HFAssistedEngine
    from losscheck.engines.llamacpp import LlamaCppEngine
    from losscheck.engines.openai_api import OpenAIEngine
    from losscheck.engines.openvino import OpenVINOEngine
    from losscheck.engines.sglang import SGLangEngine
    from losscheck.engines.spec_loop import SpecLoopEngine
    from losscheck.engines.vllm import VLLMEngine
    from losscheck.engines.vllm_server import VLLMServerEngine

    classes = (
        HFAssistedEngine,
        LlamaCppEngine,
        OpenAIEngine,
        OpenVINOEngine,
        SGLangEngine,
        SpecLoopEngine,
        VLLMEngine,
        VLLMServerEngine,
    )
    return {cls.__name__: cls for cls in classes}


def _away(name: str) -> SamplingParams:
    from losscheck.core.grammar import Grammar
    from losscheck.core.stops import StopStrings

    objects = {"grammar": Grammar("regex", "[a-z]+"), "stop_strings": StopStrings(("ab",))}
    return SamplingParams(**{name: objects.get(name, AWAY[name])})


def test_every_field_beyond_the_core_three_is_one_the_adapters_must_declare():
    from dataclasses import fields

    from losscheck.engines.served import CORE, SERVED

    assert tuple(f.name for f in fields(SamplingParams) if f.name not in CORE) == SERVED
    assert set(AWAY) == set(SERVED)
    for name in SERVED:
        assert served(_away(name)) == [name]


@pytest.mark.parametrize("adapter", sorted(_adapters()))
@pytest.mark.parametrize("field", sorted(AWAY))
def test_an_adapter_serves_exactly_the_fields_it_declares_and_refuses_the_rest_by_name(adapter, field):
    """Fail closed: every adapter × every field of `SamplingParams` beyond the core three."""
    from losscheck.engines.served import declared, refuse

    engine = _adapters()[adapter]
    serves = declared(engine)
    assert serves <= set(AWAY), serves - set(AWAY)
    params = _away(field)
    if field in serves:
        refuse(params, adapter, serves, eos=EOS)
    else:
        with pytest.raises(UnsupportedParameter, match=f"engine '{adapter}' cannot serve {field}="):
            refuse(params, adapter, serves, eos=EOS)


@pytest.mark.parametrize(
    ("mapping", "serves"),
    [
        ("hf", "HF_SERVES"),
        ("sglang", "SGLANG_SERVES"),
        ("vllm", "VLLM_SERVES"),
        ("completions", "COMPLETIONS_SERVES"),
    ],
)
def test_an_adapters_own_mapping_refuses_what_its_class_does_not_declare(mapping, serves):
    """The functions that turn a request into the engine's own arguments (runnable without the
    engine) refuse exactly the undeclared fields, before the engine sees the request."""
    import importlib

    from losscheck.engines import completions, hf, sglang, vllm

    declared_set = getattr(importlib.import_module(f"losscheck.engines.{mapping}"), serves)
    call = {
        "hf": lambda p: hf.sampling_config(p, "hf", EOS),
        "sglang": lambda p: sglang.sampling_params(p, 7, 16, EOS),
        "vllm": lambda p: vllm.sampling_kwargs(p, 7, 16, EOS, vocab=64),
        "completions": lambda p: completions.sampling_fields(p, 7, 16, EOS, 64, "served"),
    }[mapping]
    for field in AWAY:
        if field in declared_set and (mapping, field) == ("vllm", "grammar"):
            continue  # its structured-outputs parameters are vLLM's own class (tests/engines/test_vllm.py)
        if field in declared_set:
            call(_away(field))
        else:
            with pytest.raises(UnsupportedParameter, match=f"cannot serve {field}="):
                call(_away(field))


def test_a_field_added_to_the_parameters_later_is_refused_by_every_adapter():
    from dataclasses import dataclass

    from losscheck.engines.served import UNDECLARED, declared, refuse

    @dataclass(frozen=True)
    class Extended(SamplingParams):
        typical_p: float = 1.0

    assert served(Extended(typical_p=0.9)) == ["typical_p"]
    for name, engine in _adapters().items():
        with pytest.raises(UnsupportedParameter, match=f"cannot serve typical_p=0.9: {UNDECLARED[:30]}"):
            refuse(Extended(typical_p=0.9), name, declared(engine), eos=EOS)


def test_an_engine_that_declares_nothing_serves_only_the_core_three_and_eos():
    from losscheck.engines.served import declared, refuse

    anonymous = SimpleNamespace(name="mine", k=4, precision="fp32")
    assert declared(anonymous) == frozenset()
    refuse(SamplingParams(temperature=0.7, top_k=8, top_p=0.9, stop_ids=(EOS,)), "mine", declared(anonymous), eos=EOS)
    with pytest.raises(UnsupportedParameter, match="cannot serve min_p=0.1: the engine does not declare it"):
        refuse(SamplingParams(min_p=0.1), "mine", declared(anonymous), eos=EOS)
    with pytest.raises(UnsupportedParameter, match=r"cannot serve stop_ids=\[5\]: the adapter passes no stop ids"):
        refuse(SamplingParams(stop_ids=(5, EOS)), "mine", declared(anonymous), eos=EOS)


def test_openvino_refuses_stop_ids_with_min_tokens_before_importing_its_library():
    from losscheck.engines.openvino import generation_config

    with pytest.raises(UnsupportedParameter, match="cannot serve stop_ids with min_tokens: whether OpenVINO GenAI"):
        generation_config(SamplingParams(min_tokens=2, stop_ids=(5,)), 0, 16, EOS, 4)
