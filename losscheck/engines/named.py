"""The shipped engine adapters, named on the command line the way their own CLIs name them.

`--engine hf --assistant DIR` is Hugging Face assisted generation with DIR as the assistant;
`--engine vllm --speculative-config JSON [--engine-arg KEY=VALUE …]` is `vllm.LLM(model=TARGET,
speculative_config=JSON, KEY=VALUE…)`, as `vllm serve` takes them (except
`losscheck_instances=one-at-a-time`, which keeps one LLM alive at a time, for one GPU);
`vllm+cpu-fixes` is the same with losscheck's fixes of vLLM 0.32's CPU sampler in place
(docs/vllm.md); `--engine openvino --assistant DIR [--engine-arg enable_prefix_caching=false]
[--engine-arg PROPERTY=VALUE …]` is OpenVINO GenAI's `LLMPipeline` with DIR as its draft model
(docs/openvino.md); `--engine llamacpp --assistant DIR [--engine-arg n_draft=N]` is
llama-cpp-python's `Llama` with DIR as a greedy `LlamaDraftModel` (docs/llamacpp.md); `--engine
openai --engine-arg base_url=URL --engine-arg plain_base_url=URL --engine-arg k=N` is any running
OpenAI-compatible completions server, drafting on and off (docs/openai.md); `--engine sglang
--speculative-config JSON` is `sglang.Engine(model_path=TARGET, **JSON)`, JSON SGLang's own
speculative arguments (docs/sglang.md). Anything
else names a factory by import path (`pkg.mod:factory`).

Each adapter module registers itself (`losscheck.engines.registry`) when imported; importing this
module imports the shipped ones, `SHIPPED` (listed in that order), none of which imports its engine library (or torch)
before it builds an engine. `ADAPTERS` is the registry: the shipped adapters and any other
module's that registered itself.
"""

from __future__ import annotations

import importlib

from losscheck.engines.registry import ADAPTERS, Adapter, EngineSpec, engine_args, speculative_config

SHIPPED = (
    "losscheck.engines.hf",
    "losscheck.engines.vllm",
    "losscheck.engines.vllm_server",
    "losscheck.engines.openvino",
    "losscheck.engines.llamacpp",
    "losscheck.engines.openai_api",
    "losscheck.engines.sglang",
)


def _discover() -> None:
    """Import the shipped adapters' modules and list their adapters first, in `SHIPPED` order
    whichever was imported first, then any other module's in registration order."""
    for module in SHIPPED:
        importlib.import_module(module)

    def rank(adapter: Adapter) -> int:  # a shipped module's place; a package's covers its modules
        where = adapter.make.__module__
        found = [i for i, module in enumerate(SHIPPED) if where == module or where.startswith(module + ".")]
        return found[0] if found else len(SHIPPED)

    ordered = sorted(ADAPTERS.values(), key=rank)
    ADAPTERS.clear()
    ADAPTERS.update((adapter.name, adapter) for adapter in ordered)


_discover()

__all__ = ["ADAPTERS", "SHIPPED", "Adapter", "EngineSpec", "engine_args", "speculative_config"]


def __getattr__(name: str) -> object:
    if name == "EngineRequest":  # the old name of EngineSpec, exported here too (docs/deprecations.md)
        from losscheck.engines import registry

        return getattr(registry, name)  # warns
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
