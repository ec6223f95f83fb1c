"""SGLang's offline engine behind the black-box interface (`--engine sglang`, docs/sglang.md):
`sglang.Engine` with speculative decoding on, and the same target's engine without it.

Written against SGLang's offline API: `sglang.Engine(model_path=TARGET, skip_tokenizer_init=True,
random_seed=S, dtype=D, **speculative)` — `speculative` SGLang's own server arguments as
`--speculative-config` gives them (`speculative_algorithm` STANDALONE, EAGLE, EAGLE3, NGRAM, …,
`speculative_draft_model_path`, `speculative_num_steps`, `speculative_eagle_topk`,
`speculative_num_draft_tokens`) — and `generate(input_ids=[ids, ...], sampling_params=[{...}, ...])`
answering one dict per row: its `output_ids` and a `meta_info` with the request's own counters
(`spec_verify_ct` verification rounds, `spec_num_proposed_drafts`, `spec_num_correct_drafts`,
`completion_tokens`). Every row of a call is one request with its own `sampling_seed`, so rows are
independent and reproducible; one `generate` call carries all of them (SGLang batches them itself).

SGLang's CPU engine verifies with the target's argmax whatever the temperature (its
`_verify_uses_greedy` is true whenever the CPU engine is on): there a sampled cell FAILs, by design
of that build, not by losscheck's. No CPU build of its kernels installs from the package index
(2026-12-04), so this adapter is tested here against a fake with SGLang's surface
(`losscheck.selftest.fake_sglang`); on a GPU runner it drives the real engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from losscheck.engines import EngineOutputError, row_by_row
from losscheck.engines.counters import EngineCounters
from losscheck.engines.pool import Instances, Policy
from losscheck.engines.registry import EngineSpec, option, register, rest
from losscheck.engines.served import GRAMMAR_UNSUPPORTED
from losscheck.errors import OptionError

if TYPE_CHECKING:
    import torch

    from losscheck.core.contract import Target
    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.request import GenerationRequest

# SGLang's dtype names for losscheck's precisions
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# what the adapter passes to SGLang (`losscheck.engines.served`: the rest is refused)
SGLANG_SERVES = frozenset(
    {"min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "stop_ids"}
)
SGLANG_UNSUPPORTED = {
    "logit_bias": "SGLang's logit bias under speculation is not verified here (no build of it runs on this platform)",
    "banned_ids": "SGLang has no banned-id list; a -inf logit bias is not verified here either",
    **GRAMMAR_UNSUPPORTED,
}
# Keys of `--speculative-config` (SGLang's server arguments); each needs one of these
ALGORITHM, DRAFT, STEPS, TOPK, DRAFT_TOKENS = (
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
)


def sampling_params(params: SamplingParams, seed: int, max_new_tokens: int, eos: int) -> dict[str, Any]:
    """losscheck's request as one SGLang `sampling_params` dict. Every knob is sent, neutral ones
    too, so that no generation-config default of the model's can creep in; EOS and the request's
    stop ids are the stop ids (the engine runs without a tokenizer); what SGLang cannot serve here is refused by name
    (`SGLANG_UNSUPPORTED`)."""
    from losscheck.engines.served import refuse

    refuse(params, "sglang", SGLANG_SERVES, SGLANG_UNSUPPORTED, eos)
    return {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": params.min_tokens,
        "temperature": params.temperature,  # 0: greedy
        "top_k": params.top_k if params.top_k else -1,  # -1: off
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop_token_ids": list(dict.fromkeys([eos, *params.stop_ids])),  # each ends its row, kept
        "ignore_eos": False,
        "sampling_seed": seed,
    }


def block_length(config: dict[str, Any], opt: str = "--") -> int:
    """The tokens drafted per round a speculative config asks for: `speculative_num_steps` (a chain
    of that many drafts; with `speculative_eagle_topk` > 1 a tree of that depth)."""
    if not isinstance(config.get(ALGORITHM), str):
        raise OptionError(
            f"{opt}speculative-config for --engine=sglang needs {ALGORITHM!r} (STANDALONE with "
            f'{DRAFT!r}, EAGLE, EAGLE3, NGRAM, ...), e.g. \'{{"{ALGORITHM}": "STANDALONE", "{DRAFT}": DIR, '
            f'"{STEPS}": 4, "{TOPK}": 1, "{DRAFT_TOKENS}": 5}}\''
        )
    steps = config.get(STEPS)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise OptionError(f"{opt}speculative-config: {STEPS} must be an int >= 1, got {steps!r}")
    return steps


class SGLangEngine:
    """`make_engine(speculative)` builds an `sglang.Engine` with the speculative config or without
    it; `instances` keeps them under the memory policy (`losscheck.engines.pool`)."""

    serves = SGLANG_SERVES
    first_token = "prefill"  # the prefill samples the first token; verification rounds follow it

    def __init__(
        self, make_engine: Callable[[bool], Any], k: int, eos: int, precision: str, policy: Policy, name: str
    ) -> None:
        self.k, self.eos = k, eos
        self.precision: str | None = precision
        self.name = f"{name}(k={k})"
        self.instances: Instances[bool, Any] = Instances(make_engine, policy, release=_shutdown)
        self._counters = EngineCounters(drafts=0, drafted=0, accepted=0, emitted=0)

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        rows = [(i, j) for i in range(len(request.prompts)) for j in range(request.n)]
        budget = request.max_new_tokens
        params = [sampling_params(request.params, request.row_seed(i, j), budget, self.eos) for i, j in rows]
        answers = self.instances.get(request.speculative).generate(
            input_ids=[list(request.prompts[i]) for i, _ in rows], sampling_params=params
        )
        if not isinstance(answers, Sequence) or len(answers) != len(rows):
            got = len(answers) if isinstance(answers, Sequence) else type(answers).__name__
            raise EngineOutputError(f"engine {self.name!r}: generate answered {got} results for {len(rows)} requests")
        by_row = dict(zip(rows, answers, strict=True))
        if request.speculative:
            for (i, j), answer in by_row.items():
                self._count(answer, f"prompt {i}, row {j}")
        return row_by_row(request, self.eos, lambda i, j: _output_ids(by_row[i, j], self.name)[:budget])

    def _count(self, answer: dict[str, Any], where: str) -> None:
        """Add one speculative request's counters from its `meta_info`: SGLang's rounds are its
        verification steps, which emit every token after the prefill's (`completion_tokens` - 1);
        a request without them adds nothing (an SGLang that does not report them)."""
        meta = answer.get("meta_info") or {}
        if "spec_verify_ct" not in meta:
            return
        try:
            rounds, tokens = int(meta["spec_verify_ct"]), int(meta["completion_tokens"])
            drafted, accepted = meta.get("spec_num_proposed_drafts"), meta.get("spec_num_correct_drafts")
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineOutputError(f"engine {self.name!r} ({where}): meta_info {meta!r} is not SGLang's") from exc
        one = EngineCounters(
            drafts=rounds,
            drafted=None if drafted is None else int(drafted),
            accepted=None if accepted is None else int(accepted),
            emitted=max(tokens - 1, 0),
        )
        self._counters = self._counters.plus(one)

    def counters(self) -> EngineCounters:
        """The speculative requests' counters so far, from each request's `meta_info`."""
        return self._counters


def _output_ids(answer: Any, name: str) -> list[int]:
    ids = answer.get("output_ids") if isinstance(answer, dict) else None
    if not isinstance(ids, list):
        raise EngineOutputError(
            f"engine {name!r}: a result without a list of output_ids ({type(answer).__name__}); SGLang answers "
            "ids only when built with skip_tokenizer_init=True, as this adapter builds it"
        )
    return [int(t) for t in ids]


def _shutdown(_: bool, engine: Any) -> None:
    engine.shutdown()  # its scheduler and detokenizer are processes of their own


# --- the shipped adapter: --engine sglang --speculative-config JSON [--engine-arg KEY=VALUE ...] ------
@dataclass(frozen=True)
class SGLangOptions:
    losscheck_instances: Policy = option(
        Policy.ONE_AT_A_TIME,
        help="one-at-a-time (default: each engine reserves mem_fraction_static of a GPU); keep-all: both alive",
    )
    dtype: str | None = option(
        None, choices=tuple(DTYPES), help="the precision of the engine and of losscheck's scoring; default: the run's"
    )
    random_seed: int = option(0, help="the engine's own seed (each request's sampling_seed is losscheck's)")
    losscheck_engine_class: str = option(
        "sglang:Engine",
        help="MOD:NAME of the class with SGLang's offline surface (a fork's; losscheck.selftest.fake_sglang:Engine, "
        "the tests' stand-in)",
    )
    engine: dict[str, Any] = rest("any other keyword argument of sglang.Engine (mem_fraction_static, tp_size, ...)")


def _inputs(request: EngineSpec, engine: str) -> None:
    """`--speculative-config` of SGLang's speculative arguments, and no `--assistant`."""
    opt = request.prefix
    if request.speculative_config is None:
        raise OptionError(
            f"{opt}engine={engine} needs {opt}speculative-config=JSON of SGLang's speculative server arguments, "
            f'e.g. \'{{"{ALGORITHM}": "STANDALONE", "{DRAFT}": DIR, "{STEPS}": 4, "{TOPK}": 1, "{DRAFT_TOKENS}": 5}}\''
        )
    block_length(request.speculative_config, opt)
    if request.assistant is not None:
        raise OptionError(f"{opt}assistant is Hugging Face's; {opt}engine={engine} takes {opt}speculative-config")


def _engine_class(path: str) -> Callable[..., Any]:
    """The class `MOD:NAME` names, imported now, so that a missing SGLang is a usage error."""
    import pkgutil

    try:
        found = pkgutil.resolve_name(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise OptionError(
            f"--engine-arg losscheck_engine_class={path!r}: {exc} (SGLang's own: pip install sglang on a GPU runner)"
        ) from exc
    if not callable(found):
        raise OptionError(f"--engine-arg losscheck_engine_class={path!r} is a {type(found).__name__}, not a class")
    return found


def _build(target: Target, request: EngineSpec, options: SGLangOptions) -> SGLangEngine:
    from losscheck.engines.vllm import run_precision

    config = request.speculative_config
    assert config is not None  # `_inputs` checked it
    k = block_length(config, request.prefix)
    precision = run_precision(target, options.dtype)
    eos = target.eos_id if target.eos_id is not None else 0

    engine_class = _engine_class(options.losscheck_engine_class)

    def make_engine(speculative: bool) -> Any:
        spec = config if speculative else {}
        kwargs = {"skip_tokenizer_init": True, "random_seed": options.random_seed, "dtype": DTYPES[precision]}
        return engine_class(model_path=request.target, **kwargs, **spec, **options.engine)

    name = f"sglang[{config[ALGORITHM]}]"
    return SGLangEngine(make_engine, k, eos, precision, options.losscheck_instances, name)


register(
    "sglang",
    "SGLang's offline sglang.Engine with --speculative-config JSON of its speculative server arguments "
    "(docs/sglang.md)",
    options=SGLangOptions,
    inputs=_inputs,
    build=_build,
    package="sglang",
)
