"""The shipped adapters `--engine vllm` and `--engine vllm+cpu-fixes`: their options
(`VLLMOptions`), the checks of the command line, the engine they build, and the axes of a vLLM
certificate (`VLLM_AXES`), registered in `losscheck.engines.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from losscheck.engines.pool import Policy
from losscheck.engines.registry import AxisValue, EngineAxis, EngineSpec, arg_axis, option, register, rest, with_args
from losscheck.engines.vllm.engine import VLLMEngine, vllm_engine
from losscheck.engines.vllm.sampling import PRECISION_OF
from losscheck.errors import OptionError

if TYPE_CHECKING:
    from losscheck.core.contract import Target


# --engine vllm|vllm+cpu-fixes --speculative-config JSON [--engine-arg K=V]
@dataclass(frozen=True)
class VLLMOptions:
    losscheck_instances: Policy | None = option(
        None,
        help="one-at-a-time: the speculative and the plain LLM never alive together, for one GPU; keep-all: "
        "both alive; default: keep-all on a CPU, else what the memory plan gives the machine's accelerators",
    )
    dtype: str | None = option(
        None,
        choices=tuple(PRECISION_OF),
        help="the precision losscheck scores the samples in; default: the run's base precision",
    )
    losscheck_reference: str | None = option(
        None,
        choices=tuple(PRECISION_OF),
        help="the precision losscheck loads its copy of the target in to score the samples, when it is not "
        "the engine's (a bf16 engine against an fp32 reference: the GPU case); default: the engine's dtype",
    )
    losscheck_warm_prefix: bool = option(
        False, help="every distinct prompt of a call served once before it, so its requests hit the prefix cache"
    )
    losscheck_in_flight: int | None = option(
        None,
        minimum=1,
        help="rows kept in flight, each added as an earlier one finishes (a server's mixed batches); "
        "default: every row of a call added at once",
    )
    losscheck_eagle3: str | None = option(
        None,
        help="a local EAGLE-3 checkpoint of the target (speculators or vLLM format): the method axis's eagle3 "
        "value; without it the axis has no eagle3 variant",
    )
    llm: dict[str, Any] = rest("any other keyword argument of vllm.LLM")


def needs_speculative_config(request: EngineSpec, engine: str) -> None:
    opt = request.prefix
    config = request.speculative_config
    if config is None:
        raise OptionError(
            f"{opt}engine={engine} needs {opt}speculative-config=JSON, e.g. "
            '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\''
        )
    k = config.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise OptionError(f"{opt}speculative-config: num_speculative_tokens must be an int >= 1, got {k!r}")
    if request.assistant is not None:
        raise OptionError(f"{opt}assistant is Hugging Face's; {opt}engine={engine} takes {opt}speculative-config")


def run_precision(target: Target, dtype: str | None) -> str:
    """losscheck's precision of an engine's `--engine-arg dtype=...` (either name), else the
    precision losscheck loaded the target in (the run's base precision)."""
    from losscheck.engines.hf import dtype_precision

    if dtype is not None:
        return PRECISION_OF[dtype]
    return dtype_precision(next(target.model.parameters()).dtype)  # type: ignore[attr-defined]


def _builder(cpu_fixes: bool) -> Callable[[Target, EngineSpec, VLLMOptions], VLLMEngine]:
    def build(target: Target, request: EngineSpec, options: VLLMOptions) -> VLLMEngine:
        assert request.speculative_config is not None
        precision = run_precision(target, options.dtype)
        eos = target.eos_id if target.eos_id is not None else 0
        config, policy = request.speculative_config, options.losscheck_instances
        if policy is None:
            from losscheck.engines.hardware import chosen_policy

            draft = config.get("model") if isinstance(config.get("model"), str) else None
            reference = PRECISION_OF[options.losscheck_reference] if options.losscheck_reference else precision
            tp = int(options.llm.get("tensor_parallel_size", 1))
            policy = chosen_policy(request.target, draft, precision, reference, tp)
        warm, in_flight = options.losscheck_warm_prefix, options.losscheck_in_flight
        vocab = target.vocab_size
        engine = vllm_engine(
            request.target, config, eos, precision, cpu_fixes, policy, warm, in_flight, vocab, **options.llm
        )
        if cpu_fixes:
            engine.name = engine.name.replace("vllm(", "vllm+cpu-fixes(", 1)
        if options.losscheck_reference is not None:  # the LLM keeps its dtype; losscheck scores in this one
            engine.logprob_precision = engine.precision  # what its reported logprobs are computed in
            engine.precision = PRECISION_OF[options.losscheck_reference]
        return engine

    return build


# --- the axes of a vLLM certificate: each value one variant of the engine as named ---------------------
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}  # drafts from the context itself
CHUNK_TOKENS = 16  # a step's token budget under chunked prefill: below most prompts, a few decodes


def _vary_k(request: EngineSpec, k: AxisValue) -> EngineSpec | None:
    config = request.speculative_config or {}
    varied = {**config, "num_speculative_tokens": k}
    return None if varied == config else replace(request, speculative_config=varied)


def _vary_method(request: EngineSpec, method: AxisValue) -> EngineSpec | None:
    """n-gram drafts from the context itself; EAGLE-3 from the checkpoint `losscheck_eagle3` names
    (none named: no such variant)."""
    config = request.speculative_config or {}
    k = config["num_speculative_tokens"]
    if config.get("method") == method:
        return None
    if method == "eagle3":
        where = request.args.get("losscheck_eagle3")
        return None if where is None else replace(request, speculative_config=eagle3_config(where, k))
    assert method == "ngram", method
    return replace(request, speculative_config={**NGRAM, "num_speculative_tokens": k})


def eagle3_config(checkpoint: str, k: int) -> dict[str, Any]:
    return {"method": "eagle3", "model": str(checkpoint), "num_speculative_tokens": k}


def _vary_split(request: EngineSpec, ranks: AxisValue) -> EngineSpec | None:
    # the mp executor: one worker process per rank (vLLM's CPU build has no other; a GPU's default)
    return with_args(request, tensor_parallel_size=ranks, distributed_executor_backend="mp")


STAGGERED_IN_FLIGHT = 16  # the arrivals axis: rows in flight, as a client with a concurrency limit

VLLM_AXES = (
    EngineAxis("k", (2,), _vary_k, "num_speculative_tokens 2: another block length, the bonus slot earlier"),
    arg_axis(
        "dtype",
        ("bf16",),
        "dtype",
        "the LLM in bf16 (draft model too), scored by losscheck's copy of the target in bf16",
    ),
    EngineAxis(
        "prefix",
        ("warm",),
        lambda request, _: with_args(request, enable_prefix_caching=True, losscheck_warm_prefix=True),
        "prefix caching on and warm: every prompt served once before each call, whose requests then "
        "start from cached KV blocks (target and draft model)",
    ),
    EngineAxis(
        "chunked_prefill",
        ("on",),
        lambda request, _: with_args(
            request, enable_chunked_prefill=True, max_num_batched_tokens=CHUNK_TOKENS, max_num_seqs=CHUNK_TOKENS
        ),
        f"chunked prefill with a {CHUNK_TOKENS}-token step budget: prompts prefilled in chunks beside "
        "decoding requests, speculative steps cut to the budget",
    ),
    EngineAxis(
        "method",
        ("ngram", "eagle3"),
        _vary_method,
        "n-gram speculation (prompt lookup 1-3): no draft model; EAGLE-3 from the checkpoint "
        "--engine-arg losscheck_eagle3=DIR names (a head on the target's hidden states)",
    ),
    EngineAxis(
        "tensor_parallel",
        (2,),
        _vary_split,
        "the target and draft model split over 2 ranks (tensor_parallel_size 2, a worker process each): "
        "partial sums reduced across ranks in every verification step",
    ),
    arg_axis(
        "max_num_seqs",
        (1,),
        "max_num_seqs",
        "one sequence a step: every verification batch k + 1 rows of one request, against the named "
        "engine's steps over many requests at once",
    ),
    EngineAxis(
        "arrivals",
        ("staggered",),
        lambda request, _: with_args(request, losscheck_in_flight=STAGGERED_IN_FLIGHT),
        f"rows arriving while others decode: {STAGGERED_IN_FLIGHT} in flight, each added as one finishes, so "
        "steps mix new prefills with drafting requests (a server's batches)",
    ),
)

register(
    "vllm",
    "vllm.LLM with --speculative-config JSON",
    options=VLLMOptions,
    inputs=needs_speculative_config,
    build=_builder(cpu_fixes=False),
    package="vllm",
    axes=VLLM_AXES,
)
register(
    "vllm+cpu-fixes",
    "vllm with losscheck's fixes of vLLM 0.32's CPU sampler (docs/vllm.md)",
    options=VLLMOptions,
    inputs=needs_speculative_config,
    build=_builder(cpu_fixes=True),
    package="vllm",
    axes=VLLM_AXES,
)
