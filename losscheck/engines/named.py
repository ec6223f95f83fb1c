"""Shipped engine adapters, named on the command line the way their own CLIs name them.

`--engine hf --assistant DIR` is Hugging Face assisted generation with DIR as the assistant;
`--engine vllm --speculative-config JSON [--engine-arg KEY=VALUE …]` is `vllm.LLM(model=TARGET,
speculative_config=JSON, KEY=VALUE…)`, as `vllm serve` takes them (except
`losscheck_instances=one-at-a-time`, which keeps one LLM alive at a time, for one GPU); `vllm+cpu-fixes` is the same
with losscheck's fixes of vLLM 0.32's CPU sampler in place (docs/vllm.md); `--engine openvino
--assistant DIR [--engine-arg enable_prefix_caching=false] [--engine-arg PROPERTY=VALUE …]` is
OpenVINO GenAI's `LLMPipeline` with DIR as its draft model (docs/openvino.md); `--engine llamacpp
--assistant DIR [--engine-arg n_draft=N]` is llama-cpp-python's `Llama` with DIR as a greedy
`LlamaDraftModel` (docs/llamacpp.md). Anything else names
a factory by import path (`pkg.mod:factory`).

Each adapter is an `Adapter` in `ADAPTERS`: what it needs from the options (checked before any
model loads; `losscheck.run.loading` checks the model directories they name) and how it builds
the engine from the loaded target.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from losscheck.engines.pool import Policy
from losscheck.errors import OptionError

if TYPE_CHECKING:
    from losscheck.core.contract import Target
    from losscheck.engines import BlackBoxEngine


@dataclass(frozen=True)
class EngineRequest:
    """What the options say about a shipped adapter's engine."""

    target: str  # the target's model directory (the bundled target's when --target is not given)
    assistant: str | None = None  # --assistant DIR (hf)
    speculative_config: dict[str, Any] | None = None  # --speculative-config JSON (vllm)
    args: dict[str, Any] = field(default_factory=dict)  # --engine-arg KEY=VALUE, VALUE parsed as JSON where it parses
    prefix: str = "--losscheck-"  # how the messages name the options


@dataclass(frozen=True)
class Adapter:
    check: Callable[[EngineRequest], None]  # raises OptionError; loads nothing
    build: Callable[[Target, EngineRequest], BlackBoxEngine]
    summary: str


def engine_args(pairs: tuple[str, ...]) -> dict[str, Any]:
    """`KEY=VALUE` pairs as keyword arguments: VALUE as JSON where it parses (512, true, {"a": 1}),
    else the string."""
    args: dict[str, Any] = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        try:
            args[key.strip()] = json.loads(text)
        except ValueError:
            args[key.strip()] = text
    return args


def speculative_config(text: str | None, option: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise OptionError(f'{option}={text!r} is not JSON ({exc}); e.g. \'{{"method": "ngram", ...}}\'') from None
    if not isinstance(config, dict):
        raise OptionError(f"{option}={text!r} is a JSON {type(config).__name__}; pass a JSON object")
    return config


def _check_hf(request: EngineRequest) -> None:
    opt = request.prefix
    if request.assistant is None:
        raise OptionError(f"{opt}engine=hf needs {opt}assistant=DIR: the assistant model directory")
    unknown = sorted(set(request.args) - {"num_assistant_tokens"})
    if unknown:
        raise OptionError(f"{opt}engine-arg {unknown[0]}: {opt}engine=hf takes num_assistant_tokens=N only")
    k = request.args.get("num_assistant_tokens", 4)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise OptionError(f"{opt}engine-arg num_assistant_tokens={k!r}: need an int >= 1")
    if request.speculative_config is not None:
        raise OptionError(f"{opt}speculative-config is vLLM's; {opt}engine=hf takes {opt}assistant")


def _build_hf(target: Target, request: EngineRequest) -> BlackBoxEngine:
    from losscheck.core.target import load_causal_lm
    from losscheck.engines.hf import DTYPE_PRECISION, HFAssistedEngine

    assert request.assistant is not None
    model = target.model  # type: ignore[attr-defined]
    weight = next(model.parameters())
    assistant = load_causal_lm(
        Path(request.assistant).expanduser(), DTYPE_PRECISION[weight.dtype], device=weight.device
    )
    vocab = int(assistant.config.vocab_size)
    if vocab != target.vocab_size:
        raise OptionError(
            f"{request.prefix}assistant={request.assistant!r} has a vocabulary of {vocab} tokens, the target "
            f"{target.vocab_size}; assisted generation here drafts in the target's token ids"
        )
    eos = target.eos_id if target.eos_id is not None else 0
    k = int(request.args.get("num_assistant_tokens", 4))
    return HFAssistedEngine(model, assistant, k, eos, name=f"hf-assisted[{Path(request.assistant).name}]")


def _check_vllm(request: EngineRequest) -> None:
    opt = request.prefix
    config = request.speculative_config
    if config is None:
        raise OptionError(
            f"{opt}engine=vllm needs {opt}speculative-config=JSON, e.g. "
            '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\''
        )
    k = config.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise OptionError(f"{opt}speculative-config: num_speculative_tokens must be an int >= 1, got {k!r}")
    if request.assistant is not None:
        raise OptionError(f"{opt}assistant is Hugging Face's; {opt}engine=vllm takes {opt}speculative-config")
    dtype = request.args.get("dtype")
    if dtype is not None and _precision(dtype) is None:
        raise OptionError(f"{opt}engine-arg dtype={dtype!r}: losscheck scores float32, bfloat16 or float16 targets")
    policy = request.args.get(INSTANCES, Policy.KEEP_ALL.value)
    if policy not in {p.value for p in Policy}:
        raise OptionError(
            f"{opt}engine-arg {INSTANCES}={policy!r}: one of {[p.value for p in Policy]} "
            "(one-at-a-time: the speculative and the plain LLM never alive together, for one GPU)"
        )


INSTANCES = "losscheck_instances"  # --engine-arg of vllm: losscheck's, not passed to vllm.LLM


def _precision(dtype: Any) -> str | None:
    from losscheck.engines.vllm import VLLM_DTYPE

    names = {**{v: k for k, v in VLLM_DTYPE.items()}, **{k: k for k in VLLM_DTYPE}}
    return names.get(str(dtype))


def _vllm_builder(cpu_fixes: bool) -> Callable[[Target, EngineRequest], BlackBoxEngine]:
    def build(target: Target, request: EngineRequest) -> BlackBoxEngine:
        from losscheck.engines.hf import DTYPE_PRECISION
        from losscheck.engines.vllm import vllm_engine

        args = dict(request.args)
        dtype = args.pop("dtype", None)
        policy = Policy(args.pop(INSTANCES, Policy.KEEP_ALL.value))
        precision = _precision(dtype) if dtype is not None else DTYPE_PRECISION[next(target.model.parameters()).dtype]  # type: ignore[attr-defined]
        assert request.speculative_config is not None
        eos = target.eos_id if target.eos_id is not None else 0
        engine = vllm_engine(request.target, request.speculative_config, eos, precision, cpu_fixes, policy, **args)
        if cpu_fixes:
            engine.name = engine.name.replace("vllm(", "vllm+cpu-fixes(", 1)
        return engine

    return build


OPENVINO_ARGS = ("num_assistant_tokens", "enable_prefix_caching")  # the rest are OpenVINO properties


def _check_assistant(request: EngineRequest, engine: str) -> None:
    """An engine that drafts with a model directory: `--assistant` given, no vLLM speculative config."""
    opt = request.prefix
    if request.assistant is None:
        raise OptionError(f"{opt}engine={engine} needs {opt}assistant=DIR: the draft model directory")
    if request.speculative_config is not None:
        raise OptionError(f"{opt}speculative-config is vLLM's; {opt}engine={engine} takes {opt}assistant")


def _check_openvino(request: EngineRequest) -> None:
    opt = request.prefix
    _check_assistant(request, "openvino")
    k = request.args.get("num_assistant_tokens", 4)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise OptionError(f"{opt}engine-arg num_assistant_tokens={k!r}: need an int >= 1")
    caching = request.args.get("enable_prefix_caching")
    if caching is not None and not isinstance(caching, bool):
        raise OptionError(f"{opt}engine-arg enable_prefix_caching={caching!r}: need true or false")


def _build_openvino(target: Target, request: EngineRequest) -> BlackBoxEngine:
    from losscheck.engines.openvino import openvino_engine

    assert request.assistant is not None
    properties = {key: value for key, value in request.args.items() if key not in OPENVINO_ARGS}
    k = int(request.args.get("num_assistant_tokens", 4))
    caching = request.args.get("enable_prefix_caching")
    name = f"openvino-genai[{Path(request.assistant).name}]" + ("" if caching is None else f"+prefix-caching={caching}")
    eos = target.eos_id if target.eos_id is not None else 0
    return openvino_engine(request.target, request.assistant, k, eos, name, prefix_caching=caching, **properties)


def _check_llamacpp(request: EngineRequest) -> None:
    opt = request.prefix
    _check_assistant(request, "llamacpp")
    for key, value in request.args.items():
        if key not in ("n_draft", "n_threads") or isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptionError(
                f"{opt}engine-arg {key}={value!r}: {opt}engine=llamacpp takes n_draft, n_threads (ints >= 1)"
            )


def _build_llamacpp(target: Target, request: EngineRequest) -> BlackBoxEngine:
    from losscheck.engines.llamacpp import llamacpp_engine

    assert request.assistant is not None
    k, threads = request.args.get("n_draft", 4), request.args.get("n_threads", 1)
    eos = target.eos_id if target.eos_id is not None else 0
    name = f"llama-cpp-python[{Path(request.assistant).name}]"
    return llamacpp_engine(request.target, request.assistant, k, eos, name, threads)


ADAPTERS: dict[str, Adapter] = {
    "hf": Adapter(_check_hf, _build_hf, "Hugging Face assisted generation: --assistant DIR"),
    "vllm": Adapter(_check_vllm, _vllm_builder(False), "vllm.LLM with --speculative-config JSON"),
    "vllm+cpu-fixes": Adapter(
        _check_vllm, _vllm_builder(True), "vllm with losscheck's fixes of vLLM 0.32's CPU sampler (docs/vllm.md)"
    ),
    "openvino": Adapter(
        _check_openvino,
        _build_openvino,
        "OpenVINO GenAI's LLMPipeline with --assistant DIR as draft model (docs/openvino.md)",
    ),
    "llamacpp": Adapter(
        _check_llamacpp, _build_llamacpp, "llama-cpp-python's Llama, --assistant DIR as draft model (docs/llamacpp.md)"
    ),
}
