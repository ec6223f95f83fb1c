"""The engine adapter registry (`losscheck.engines.registry`): an adapter module registers itself
with a typed options record, which the generic parser reads and checks from the record's fields —
proven on a toy adapter registered here — and the shipped adapters' records read today's
command lines, build the engines they built, and load no engine library to be listed or checked."""

from __future__ import annotations

import enum
import re
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from losscheck.engines.pool import Policy
from losscheck.engines.registry import (
    EngineSpec,
    engine_args,
    needs_assistant,
    option,
    parse_options,
    register,
    rest,
)
from losscheck.errors import LosscheckError, OptionError


class Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


@dataclass(frozen=True)
class ToyOptions:
    rounds: int = option(4, minimum=1, help="drafting rounds")
    scale: float = option(1.0, minimum=0)
    warm: bool | None = option(None)
    mode: Mode = option(Mode.SAFE)
    dtype: str = option("fp32", choices=("fp32", "bf16"))


@dataclass(frozen=True)
class ToyRestOptions:
    rounds: int = option(4, minimum=1)
    extra: dict[str, Any] = rest("the toy engine's own keywords")


@pytest.fixture
def toy():
    """The adapter "toy", registered for one test: its build returns what it was given."""
    from losscheck.engines.named import ADAPTERS

    def build(target: Any, request: EngineSpec, options: ToyOptions) -> Any:
        return SimpleNamespace(target=target, request=request, options=options)

    adapter = register("toy", "a toy engine", options=ToyOptions, inputs=lambda request, name: None, build=build)
    yield adapter
    del ADAPTERS["toy"]


def toy_request(*pairs: str) -> EngineSpec:
    return EngineSpec(target="t", args=engine_args(pairs))


def test_a_registered_adapter_is_listed_and_gets_its_typed_options(toy):
    from losscheck.engines.named import ADAPTERS, SHIPPED
    from losscheck.run.loading import check_engine_options
    from losscheck.run.options import Options

    assert ADAPTERS["toy"] is toy and len(ADAPTERS) > len(SHIPPED)
    shipped = "hf, vllm, vllm+cpu-fixes, vllm-serve, openvino, llamacpp, openai, sglang"
    listed = f"no shipped adapter of that name ({shipped}, toy)"
    with pytest.raises(OptionError, match=re.escape(listed)):
        check_engine_options(Options(engine="no_such_engine"))
    check_engine_options(Options(engine="toy", engine_args=("rounds=2",)))  # checked by the generic parser
    request = toy_request("rounds=2", "scale=0.5", "warm=false", "mode=fast", "dtype=bf16")
    built = toy.build("the target", request)
    assert built.target == "the target" and built.request is request
    assert built.options == ToyOptions(rounds=2, scale=0.5, warm=False, mode=Mode.FAST, dtype="bf16")
    assert toy.parse(toy_request()) == ToyOptions()  # the declared defaults
    assert toy.parse(toy_request("scale=2", "warm=null")).scale == 2.0  # an int is a number; null: None


@pytest.mark.parametrize(
    "pair, message",
    [
        ("rounds=0", "--losscheck-engine-arg rounds=0: need an int >= 1 (drafting rounds)"),
        ("rounds=2.5", "--losscheck-engine-arg rounds=2.5: need an int >= 1"),
        ("rounds=true", "--losscheck-engine-arg rounds=True: need an int >= 1"),
        ("rounds=many", "--losscheck-engine-arg rounds='many': need an int >= 1"),
        ("scale=-1", "--losscheck-engine-arg scale=-1: need a number >= 0"),
        ("warm=yes", "--losscheck-engine-arg warm='yes': need true or false"),
        ("mode=slow", "--losscheck-engine-arg mode='slow': need one of ['fast', 'safe']"),
        ("dtype=fp8", "--losscheck-engine-arg dtype='fp8': need one of ['fp32', 'bf16']"),
        (
            "round=2",
            "--losscheck-engine-arg round=2: --losscheck-engine=toy takes rounds, scale, warm, mode, dtype only "
            "(rounds: an int >= 1, default 4; scale: a number >= 0, default 1.0; warm: true or false, default None; "
            "mode: one of ['fast', 'safe'], default 'safe'; dtype: one of ['fp32', 'bf16'], default 'fp32')",
        ),
    ],
)
def test_a_bad_option_of_a_registered_adapter_is_one_message(toy, pair, message):
    with pytest.raises(OptionError, match=re.escape(message)):
        toy.check(toy_request(pair))


def test_a_rest_field_takes_the_keys_the_others_do_not():
    options = parse_options(ToyRestOptions, engine_args(("rounds=2", "max_len=512", "name=x")), "toy", "--")
    assert options == ToyRestOptions(rounds=2, extra={"max_len": 512, "name": "x"})
    with pytest.raises(OptionError, match=re.escape("--engine-arg rounds=0: need an int >= 1")):
        parse_options(ToyRestOptions, {"rounds": 0}, "toy", "--")


def test_an_adapter_that_the_parser_cannot_read_is_refused_at_registration(toy):
    @dataclass(frozen=True)
    class Listed:
        ids: list[int] = option((1,))

    @dataclass
    class Mutable:
        rounds: int = option(4)

    @dataclass(frozen=True)
    class TwoRests:
        a: dict[str, Any] = rest()
        b: dict[str, Any] = rest()

    check = needs_assistant("the draft")
    register("toy", "again", options=ToyOptions, inputs=check, build=toy.make)  # a re-import replaces itself
    with pytest.raises(LosscheckError, match="already registered"):
        register("toy", "another", options=ToyOptions, inputs=check, build=lambda target, request, options: None)
    for options, message in [
        (Listed, r"Listed.ids: list\[int\] is no option type"),
        (Mutable, "is not a frozen dataclass"),
        (TwoRests, "more than one rest"),
    ]:
        with pytest.raises(LosscheckError, match=message):
            register("toy2", "bad", options=options, inputs=check, build=toy.make)


CONFIG = {"method": "draft_model", "model": "d", "num_speculative_tokens": 4}


@pytest.mark.parametrize(
    "name, request_args, pairs, expected",
    [
        (
            "hf",
            {"assistant": "d"},
            (),
            "HFOptions(num_assistant_tokens=4, assistant_ensemble_weight=None, use_mtp=False)",
        ),
        (
            "hf",
            {"assistant": "d"},
            ("num_assistant_tokens=8",),
            "HFOptions(num_assistant_tokens=8, assistant_ensemble_weight=None, use_mtp=False)",
        ),
        (
            "vllm",
            {"speculative_config": CONFIG},
            ("max_model_len=4096", "dtype=bfloat16", "losscheck_instances=one-at-a-time", "enforce_eager=true")
            + ("losscheck_reference=fp32",),
            "VLLMOptions(losscheck_instances=<Policy.ONE_AT_A_TIME: 'one-at-a-time'>, dtype='bfloat16', "
            "losscheck_reference='fp32', losscheck_warm_prefix=False, losscheck_in_flight=None, "
            "losscheck_eagle3=None, llm={'max_model_len': 4096, 'enforce_eager': True})",
        ),
        (
            "vllm+cpu-fixes",
            {"speculative_config": CONFIG},
            ("dtype=fp32",),
            "VLLMOptions(losscheck_instances=None, dtype='fp32', losscheck_reference=None, "
            "losscheck_warm_prefix=False, losscheck_in_flight=None, losscheck_eagle3=None, llm={})",
        ),
        (
            "openvino",
            {"assistant": "d"},
            ("enable_prefix_caching=false", "INFERENCE_NUM_THREADS=1", "num_assistant_tokens=3"),
            "OpenVINOOptions(num_assistant_tokens=3, enable_prefix_caching=False, target_weights='fp32', "
            "properties={'INFERENCE_NUM_THREADS': 1})",
        ),
        (
            "llamacpp",
            {"assistant": "d"},
            ("n_draft=2", "n_threads=2", "target_weights=q8_0"),
            "LlamaCppOptions(n_draft=2, n_threads=2, target_weights='q8_0')",
        ),
    ],
)
def test_each_shipped_adapter_reads_todays_engine_args(name, request_args, pairs, expected):
    from losscheck.engines.named import ADAPTERS

    assert repr(ADAPTERS[name].parse(EngineSpec(target="t", args=engine_args(pairs), **request_args))) == expected


@pytest.mark.parametrize(
    "name, request_args, message",
    [
        ("hf", {}, "--losscheck-engine=hf needs --losscheck-assistant=DIR: the assistant model directory"),
        ("hf", {"assistant": "d", "speculative_config": {}}, "--losscheck-speculative-config is vLLM's"),
        (
            "hf",
            {"assistant": "d", "args": {"k": 2}},
            "--losscheck-engine=hf takes num_assistant_tokens, assistant_ensemble_weight, use_mtp only",
        ),
        ("hf", {"assistant": "d", "args": {"num_assistant_tokens": 0}}, "num_assistant_tokens=0: need an int >= 1"),
        ("vllm", {}, "--losscheck-engine=vllm needs --losscheck-speculative-config=JSON"),
        ("vllm", {"speculative_config": {}}, "num_speculative_tokens must be an int >= 1, got None"),
        ("vllm", {"speculative_config": CONFIG, "assistant": "d"}, "--losscheck-assistant is Hugging Face's"),
        ("vllm", {"speculative_config": CONFIG, "args": {"dtype": "int8"}}, "dtype='int8': need one of ['float32'"),
        (
            "vllm+cpu-fixes",
            {"speculative_config": CONFIG, "args": {"losscheck_instances": "one"}},
            "losscheck_instances='one': need one of ['keep-all', 'one-at-a-time'] (one-at-a-time: the speculative",
        ),
        ("llamacpp", {}, "--losscheck-engine=llamacpp needs --losscheck-assistant=DIR: the draft model directory"),
        ("llamacpp", {"assistant": "d", "args": {"n_threads": 0}}, "n_threads=0: need an int >= 1"),
        (
            "llamacpp",
            {"assistant": "d", "args": {"n_thread": 2}},
            "--losscheck-engine=llamacpp takes n_draft, n_threads",
        ),
    ],
)
def test_each_shipped_adapter_refuses_a_bad_option_by_name(name, request_args, message):
    from losscheck.engines.named import ADAPTERS

    with pytest.raises(OptionError, match=re.escape(message)):
        ADAPTERS[name].check(EngineSpec(target="t", **request_args))


@pytest.mark.parametrize(
    "name, function, pairs, expected_args, expected_kwargs, expected_name",
    [
        (
            "vllm",
            "vllm_engine",
            ("dtype=bfloat16", "losscheck_instances=one-at-a-time", "max_model_len=512"),
            ("t", CONFIG, 2, "bf16", False, Policy.ONE_AT_A_TIME, False, None, 64),
            {"max_model_len": 512},
            "vllm(x)",
        ),
        (
            "vllm+cpu-fixes",
            "vllm_engine",
            ("dtype=fp32",),
            ("t", CONFIG, 2, "fp32", True, Policy.KEEP_ALL, False, None, 64),
            {},
            "vllm+cpu-fixes(x)",
        ),
        (
            "openvino",
            "openvino_engine",
            ("enable_prefix_caching=false", "INFERENCE_NUM_THREADS=1"),
            ("t", "dir/d", 4, 2, "openvino-genai[d]+prefix-caching=False"),
            {"prefix_caching": False, "weights": "fp32", "INFERENCE_NUM_THREADS": 1},
            None,
        ),
        (
            "llamacpp",
            "llamacpp_engine",
            ("n_draft=3",),
            ("t", "dir/d", 3, 2, "llama-cpp-python[d]", 1, "f32"),
            {},
            None,
        ),
    ],
)
def test_each_shipped_adapter_builds_the_engine_it_built(
    monkeypatch, name, function, pairs, expected_args, expected_kwargs, expected_name
):
    """The engine function each adapter calls, with the arguments today's options gave it (the
    engine library itself is not needed: the function is replaced); vllm+cpu-fixes renames vLLM's
    engine."""
    from losscheck.engines.named import ADAPTERS

    module = sys.modules[ADAPTERS[name].make.__module__]  # where its build function looks the engine up
    calls = []

    def fake(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return SimpleNamespace(name="vllm(x)")  # as vllm_engine names its engine

    monkeypatch.setattr(module, function, fake)
    model_option = {"speculative_config": CONFIG} if name.startswith("vllm") else {"assistant": "dir/d"}
    engine = ADAPTERS[name].build(
        SimpleNamespace(eos_id=2, vocab_size=64), EngineSpec("t", args=engine_args(pairs), **model_option)
    )
    assert calls == [(expected_args, expected_kwargs)]
    assert expected_name is None or engine.name == expected_name


def test_listing_and_checking_the_adapters_imports_no_engine_library_nor_torch():
    """In a fresh process, with an adapter's module imported before the registry is listed: the list
    keeps the shipped order all the same."""
    code = (
        "import sys\n"
        "import losscheck.engines.llamacpp\n"
        "from losscheck.engines.named import ADAPTERS, EngineSpec\n"
        "config = {'method': 'ngram', 'num_speculative_tokens': 4}\n"
        "ADAPTERS['vllm'].check(EngineSpec('t', speculative_config=config, args={'dtype': 'bf16'}))\n"
        "ADAPTERS['openvino'].check(EngineSpec('t', assistant='d', args={'enable_prefix_caching': False}))\n"
        "ADAPTERS['llamacpp'].check(EngineSpec('t', assistant='d', args={'n_draft': 2}))\n"
        "ADAPTERS['hf'].check(EngineSpec('t', assistant='d'))\n"
        "heavy = ('torch', 'numpy', 'transformers', 'vllm', 'openvino', 'openvino_genai', 'llama_cpp')\n"
        "print(list(ADAPTERS), [m for m in heavy if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert (
        out.strip() == "['hf', 'vllm', 'vllm+cpu-fixes', 'vllm-serve', 'openvino', 'llamacpp', 'openai', 'sglang'] []"
    )


def test_the_old_name_of_an_engine_spec_imports_with_a_warning():
    from losscheck.engines import registry

    with pytest.warns(DeprecationWarning, match="it is EngineSpec"):
        old = registry.EngineRequest
    assert old is registry.EngineSpec
    from losscheck.engines import named

    with pytest.warns(DeprecationWarning, match="it is EngineSpec"):
        assert named.EngineRequest is registry.EngineSpec
    with pytest.raises(AttributeError, match="no attribute 'EngineRequests'"):
        registry.EngineRequests  # noqa: B018
