"""OpenVINO GenAI behind the black-box interface: `openvino_genai.LLMPipeline` with a draft model
(speculation on) and the same target's pipeline without one (off, the baseline).

Written against OpenVINO GenAI's documented Python API: `LLMPipeline(target_ir, "CPU",
draft_model=openvino_genai.draft_model(draft_ir, "CPU"))`, `generate(openvino.Tensor(int64 ids
[1, P]), GenerationConfig(...))` returning `EncodedResults` whose `tokens[0]` are the generated ids.
Each continuation is its own call with its own `rng_seed` (derived from the call's seed), so rows
are independent and reproducible. Both pipelines run with `INFERENCE_PRECISION_HINT = f32` and an
f32 KV cache: the engine's precision is "fp32", and losscheck scores its samples with its own fp32
copy of the target (one-sample PIT).

The pipeline runs OpenVINO IR, not safetensors: `ir_dir` exports a Hugging Face directory once
(`optimum-cli export openvino --task text-generation-with-past --weight-format fp32`) into a cache
keyed by the directory's files, `$LOSSCHECK_OPENVINO_CACHE` or `~/.cache/losscheck/openvino`; a
directory that already holds `openvino_model.xml` is used as it is. `python -m
losscheck.engines.openvino export DIR...` fills the cache ahead of a run (`tox -e openvino` does).
`target_weights="int8"` (the `quantization` axis) exports the target with `--weight-format int8`
(NNCF's 8-bit weight compression) instead: weights losscheck cannot load, so that engine declares
no precision and is certified two-sample.

An engine that fails is an error, never retried: a `RuntimeError` from `generate` becomes an
`OpenVINOEngineError` naming the engine, the row and its seed, and the pipeline is dropped, since
after a failure OpenVINO GenAI 2026.4 keeps answering without drafting. A speculative call that
drafted nothing is an error too: a certificate of that pipeline would certify plain decoding. With
its default scheduler (prefix caching on) speculative sampling fails that way on about half the
requests (`Check 'content_length <= ...' failed`, sequence_group.cpp); `prefix_caching=False`
builds the pipelines with a `SchedulerConfig` that turns prefix caching off (docs/openvino.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from losscheck.engines import row_by_row
from losscheck.engines.counters import EngineCounters
from losscheck.engines.export import model_key
from losscheck.engines.pool import Instances, Policy
from losscheck.engines.registry import (
    QUANTIZATION,
    EngineSpec,
    arg_axis,
    needs_assistant,
    option,
    register,
    rest,
)
from losscheck.engines.served import GRAMMAR_UNSUPPORTED
from losscheck.errors import LosscheckError, OptionError

if TYPE_CHECKING:
    import torch

    from losscheck.core.contract import Target
    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.request import GenerationRequest

# fp32 weights, activations and KV cache: the precision the engine declares
F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
IR_FILE = "openvino_model.xml"


class OpenVINOEngineError(LosscheckError):
    """OpenVINO GenAI failed on a request or stopped drafting: an engine failure, not a verdict."""


# --- IR: the exported model directories -------------------------------------------------------------
def cache_root() -> Path:
    return Path(os.environ.get("LOSSCHECK_OPENVINO_CACHE") or Path.home() / ".cache" / "losscheck" / "openvino")


WEIGHT_FORMATS = ("fp32", "int8")  # optimum-cli's --weight-format values the adapter exports


def export(model_dir: Path, out: Path, weights: str = "fp32") -> None:
    """`optimum-cli export openvino` of the Hugging Face directory `model_dir` into `out` (weight
    format `weights`), written beside `out` and moved into place, so a concurrent reader never sees
    half an IR."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    command = [sys.executable, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(model_dir)]
    command += ["--task", "text-generation-with-past", "--weight-format", weights, str(work)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (work / IR_FILE).is_file():
        shutil.rmtree(work, ignore_errors=True)
        raise OptionError(
            f"exporting {model_dir} to OpenVINO IR failed (exit status {done.returncode}; "
            f"`{' '.join(command)}`):\n{done.stderr[-3000:]}\noptimum-intel[openvino] must be installed "
            "(tox -e openvino has it), and a torchvision built for another torch breaks it: pip uninstall torchvision"
        )
    try:
        work.rename(out)
    except OSError:  # another process put it there first
        shutil.rmtree(work, ignore_errors=True)


def ir_dir(model_dir: str | Path, weights: str = "fp32") -> Path:
    """OpenVINO IR of `model_dir`: the directory itself when it holds IR, else its cached export in
    weight format `weights`."""
    path = Path(model_dir).expanduser()
    if (path / IR_FILE).is_file():
        if weights != "fp32":
            raise OptionError(f"{path} is OpenVINO IR already; export int8 weights from its Hugging Face directory")
        return path
    if not (path / "config.json").is_file():
        raise OptionError(f"{path} is neither a Hugging Face model directory (config.json) nor OpenVINO IR ({IR_FILE})")
    out = cache_root() / (model_key(path) + ("" if weights == "fp32" else f"-{weights}"))
    if not (out / IR_FILE).is_file():
        export(path, out, weights)
    return out


# --- the engine ---------------------------------------------------------------------------------------
# OpenVINO GenAI's presence and frequency penalties "reduce absolute log prob" (its GenerationConfig
# docs): a negative logit moves up, where OpenAI's and vLLM's subtract; it has no logit bias
ABSOLUTE = "OpenVINO GenAI's penalty reduces a logit's absolute value, the OpenAI definition subtracts"
# what the adapter passes to OpenVINO GenAI (`losscheck.engines.served`: the rest is refused)
OPENVINO_SERVES = frozenset({"min_p", "repetition_penalty", "min_tokens", "stop_ids"})
OPENVINO_UNSUPPORTED = dict.fromkeys(("presence_penalty", "frequency_penalty"), ABSOLUTE) | {
    "logit_bias": "OpenVINO GenAI's GenerationConfig has no logit bias",
    "banned_ids": "OpenVINO GenAI's GenerationConfig has no logit bias or banned ids",
    **GRAMMAR_UNSUPPORTED,
}
STOPS_AND_MIN = (
    "whether OpenVINO GenAI masks stop ids other than EOS before min_new_tokens is not pinned; certify each alone"
)
MIN_P_ORDER = (
    "where OpenVINO GenAI applies min-p against temperature, top-k and top-p is not pinned; certify it at T = 1 alone"
)


def generation_config(params: SamplingParams, seed: int, max_new_tokens: int, eos: int, k: int | None) -> Any:
    """losscheck's request as an `openvino_genai.GenerationConfig`: temperature (0: greedy), top-k,
    top-p, min-p (at T = 1 alone: `MIN_P_ORDER`), `repetition_penalty` (over prompt and output, as
    vLLM's) and `min_new_tokens` (EOS masked until then). Every other processing knob is set to its
    neutral value explicitly, so no generation_config.json default can creep in; what it cannot
    serve raises `UnsupportedParameter` (`OPENVINO_UNSUPPORTED`). `k` drafts per round, a constant
    block (no confidence threshold), or None without a draft model."""
    from losscheck.engines.served import UnsupportedParameter, refuse

    refuse(params, "openvino", OPENVINO_SERVES, OPENVINO_UNSUPPORTED, eos)
    if params.min_p and not params.greedy and (params.temperature != 1 or params.top_k or params.top_p < 1):
        raise UnsupportedParameter(f"engine 'openvino' cannot serve min_p={params.min_p!r} here: {MIN_P_ORDER}")
    stops = {eos, *params.stop_ids}
    if params.min_tokens and stops != {eos}:
        raise UnsupportedParameter(f"engine 'openvino' cannot serve stop_ids with min_tokens: {STOPS_AND_MIN}")
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = params.min_tokens
    config.ignore_eos = False
    config.eos_token_id = eos
    config.stop_token_ids = stops  # EOS and the request's stop ids: a row ends on one and keeps it
    config.repetition_penalty = params.repetition_penalty
    config.presence_penalty = 0.0
    config.frequency_penalty = 0.0
    config.min_p = params.min_p
    config.num_return_sequences = 1
    config.do_sample = not params.greedy
    if not params.greedy:
        config.temperature = params.temperature
        config.top_p = params.top_p
        if params.top_k:  # off: OpenVINO's default, the largest size_t
            config.top_k = params.top_k
        config.rng_seed = seed
    if k is not None:
        config.num_assistant_tokens = k
        config.assistant_confidence_threshold = 0.0
    return config


class OpenVINOEngine:
    """`make_pipeline(speculative)` builds an `LLMPipeline` (with the draft model or without it);
    each side is built on first use and kept until it fails."""

    serves = OPENVINO_SERVES
    first_token = "prefill"  # the prefill emits the first token (`_count`); rounds follow it

    def __init__(self, make_pipeline: Callable[[bool], Any], k: int, eos: int, name: str = "openvino-genai") -> None:
        self.k, self.eos = k, eos
        self.precision: str | None = "fp32"
        self.name = f"{name}(k={k})"
        self.pipelines: Instances[bool, Any] = Instances(make_pipeline, Policy.KEEP_ALL)
        # spec-decode counters summed over the speculative calls (`counters`)
        self._counters = EngineCounters(drafts=0, drafted=0, accepted=0, emitted=0)

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        import numpy as np
        import openvino

        speculative, budget = request.speculative, request.max_new_tokens

        def row(i: int, j: int) -> list[int]:
            ids = openvino.Tensor(np.asarray([request.prompts[i]], dtype=np.int64))  # [1, P]
            row_seed = request.row_seed(i, j)
            where = f"prompt {i}, row {j}, rng_seed {row_seed}"
            config = generation_config(request.params, row_seed, budget, self.eos, self.k if speculative else None)
            result = self._call(speculative, ids, config, where)
            new = list(result.tokens[0])[:budget]
            if speculative:
                self._count(result, len(new), where)
            return new

        return row_by_row(request, self.eos, row)

    def _call(self, speculative: bool, ids: Any, config: Any, where: str) -> Any:
        try:
            return self.pipelines.get(speculative).generate(ids, config)
        except RuntimeError as exc:
            # after this failure the pipeline answers without drafting: never reuse it
            self.pipelines.discard(speculative)
            side = "speculation on" if speculative else "speculation off"
            temperature = config.temperature if config.do_sample else 0.0
            raise OpenVINOEngineError(
                f"engine {self.name!r} failed ({side}, {where}, temperature {temperature:g}, "
                f"{config.max_new_tokens} new tokens): {exc}. Not retried: an engine failure is part of the "
                "certificate (docs/openvino.md)"
            ) from exc

    def _count(self, result: Any, generated: int, where: str) -> None:
        """Add one speculative call's counters. A round is one target step after the prefill (the
        prefill emits the first token), so tau = (generated - 1) / rounds; the engine's own drafted
        and accepted counts are kept beside it, though they read 0 on some rows that did draft
        (docs/openvino.md). A row of more than k + 1 tokens with one target step per token and no
        draft counted is an error: the pipeline has stopped drafting (one step per token alone is a
        row whose every round rejected its first draft)."""
        metrics = result.extended_perf_metrics
        steps = len(metrics.main_model_metrics.raw_metrics.m_batch_sizes)
        drafted, accepted = int(metrics.get_num_draft_tokens()), int(metrics.get_num_accepted_tokens())
        if generated > self.k + 1 and steps >= generated and drafted == 0:
            self.pipelines.discard(True)
            raise OpenVINOEngineError(
                f"engine {self.name!r} drafted nothing ({where}: {generated} tokens in {steps} target steps): "
                "the pipeline is decoding without speculation, which this certificate cannot certify as "
                "speculative decoding (docs/openvino.md)"
            )
        one = EngineCounters(
            drafts=max(steps - 1, 0), drafted=drafted, accepted=accepted, emitted=max(generated - 1, 0)
        )
        self._counters = self._counters.plus(one)

    def counters(self) -> EngineCounters:
        """The speculative calls' counters so far: drafting rounds (target steps after the prefill),
        the tokens they emitted (tau = emitted / rounds), and the engine's own drafted and accepted
        counts (`extended_perf_metrics`)."""
        return self._counters


def openvino_engine(
    target_dir: str | Path,
    draft_dir: str | Path,
    k: int,
    eos: int,
    name: str = "openvino-genai",
    device: str = "CPU",
    prefix_caching: bool | None = None,
    weights: str = "fp32",
    **properties: Any,
) -> OpenVINOEngine:
    """An `OpenVINOEngine` over the target and draft Hugging Face (or IR) directories, `k` drafts per
    round; `properties` are OpenVINO properties of both models (e.g. INFERENCE_NUM_THREADS=1), over
    the fp32 ones. `prefix_caching` None: the pipeline's own scheduler (prefix caching on, as users
    run it); True / False: a `SchedulerConfig` with it on / off, and nothing else changed.
    `weights` "int8": the target exported with int8 weights (a two-sample engine)."""
    target_ir, draft_ir = ir_dir(target_dir, weights), ir_dir(draft_dir)
    props = {**F32, **properties}

    def make_pipeline(speculative: bool) -> Any:
        import openvino_genai

        scheduler = {}
        if prefix_caching is not None:
            config = openvino_genai.SchedulerConfig()
            config.enable_prefix_caching = prefix_caching
            scheduler = {"scheduler_config": config}
        draft = {"draft_model": openvino_genai.draft_model(str(draft_ir), device, **props)} if speculative else {}
        return openvino_genai.LLMPipeline(str(target_ir), device, **draft, **scheduler, **props)

    engine = OpenVINOEngine(make_pipeline, k, eos, name=name)
    if weights != "fp32":
        engine.precision = None  # weights losscheck cannot load
    return engine


# --- factories: the bundled fixtures ------------------------------------------------------------------
K = 4


def _bundled(target_name: str, drafter: str, prefix_caching: bool | None = None) -> Callable[[Any], OpenVINOEngine]:
    def factory(target: Any) -> OpenVINOEngine:
        from losscheck import bundled

        eos = target.eos_id if target.eos_id is not None else 0
        fixtures = bundled.fixtures_dir()
        name = f"openvino-genai[{drafter}]" + ("" if prefix_caching is None else "+no-prefix-caching")
        return openvino_engine(fixtures / target_name, fixtures / drafter, K, eos, name, prefix_caching=prefix_caching)

    caching = "" if prefix_caching is None else ", prefix caching off"
    factory.__doc__ = (
        f"`fixtures/{target_name}` with `fixtures/{drafter}` as draft model, k = {K}, fp32{caching} (certify "
        f"it with --losscheck-target at `fixtures/{target_name}`)."
    )
    return factory


# --losscheck-engine=losscheck.engines.openvino:NAME. As shipped: the pipeline's own scheduler, whose
# prefix caching fails speculative sampling (docs/openvino.md); `_no_prefix_caching`: the same with
# a SchedulerConfig that turns it off.
DRAFTERS = {
    "drafter_a": ("target", "drafter_a"),
    "drafter_a32": ("target", "drafter_a32"),  # drafter A's recipe at head_dim 32
    "drafter_a32_tempered2": ("target", "drafter_a32_tempered2"),  # the stress drafter: q at twice T
    "text_drafter_a": ("text_target", "text_drafter_a"),  # the text fixtures, vocabulary 8,192
}
bundled_drafter_a = _bundled(*DRAFTERS["drafter_a"])
bundled_drafter_a32 = _bundled(*DRAFTERS["drafter_a32"])
bundled_drafter_a32_tempered2 = _bundled(*DRAFTERS["drafter_a32_tempered2"])
text_drafter_a = _bundled(*DRAFTERS["text_drafter_a"])
bundled_drafter_a_no_prefix_caching = _bundled(*DRAFTERS["drafter_a"], prefix_caching=False)
bundled_drafter_a32_no_prefix_caching = _bundled(*DRAFTERS["drafter_a32"], prefix_caching=False)
bundled_drafter_a32_tempered2_no_prefix_caching = _bundled(*DRAFTERS["drafter_a32_tempered2"], prefix_caching=False)
text_drafter_a_no_prefix_caching = _bundled(*DRAFTERS["text_drafter_a"], prefix_caching=False)


# --- the shipped adapter: --engine openvino --assistant DIR [--engine-arg KEY=VALUE ...] ---------------
@dataclass(frozen=True)
class OpenVINOOptions:
    num_assistant_tokens: int = option(4, minimum=1, help="the tokens the draft model proposes per round")
    enable_prefix_caching: bool | None = option(
        None, help="a SchedulerConfig with the prefix cache on or off; default: the pipeline's own scheduler"
    )
    target_weights: str = option(
        "fp32",
        choices=WEIGHT_FORMATS,
        help="the target's exported weights: fp32 (one-sample) or int8 (NNCF; two-sample against its own plain side)",
    )
    properties: dict[str, Any] = rest("any other key: an OpenVINO property of both models")


def _build(target: Target, request: EngineSpec, options: OpenVINOOptions) -> OpenVINOEngine:
    assert request.assistant is not None
    caching = options.enable_prefix_caching
    name = f"openvino-genai[{Path(request.assistant).name}]" + ("" if caching is None else f"+prefix-caching={caching}")
    weights = options.target_weights
    name += "" if weights == "fp32" else f"[{weights}]"
    eos = target.eos_id if target.eos_id is not None else 0
    k, properties = options.num_assistant_tokens, options.properties
    return openvino_engine(
        request.target, request.assistant, k, eos, name, prefix_caching=caching, weights=weights, **properties
    )


OPENVINO_AXES = (
    arg_axis("k", (2,), "num_assistant_tokens", "num_assistant_tokens 2: another block length"),
    arg_axis(
        QUANTIZATION,
        ("int8",),
        "target_weights",
        "the target exported with int8 weights (NNCF): two-sample, its speculative rows against its own plain rows",
    ),
)


register(
    "openvino",
    "OpenVINO GenAI's LLMPipeline with --assistant DIR as draft model (docs/openvino.md)",
    options=OpenVINOOptions,
    inputs=needs_assistant("the draft model directory"),
    build=_build,
    package="openvino_genai",
    axes=OPENVINO_AXES,
)


def main(argv: list[str] | None = None) -> int:
    """`python -m losscheck.engines.openvino export DIR...`: fill the IR cache, one line per model."""
    from losscheck.engines.export import export_main

    return export_main("losscheck.engines.openvino", ir_dir, argv)


if __name__ == "__main__":
    raise SystemExit(main())
