"""`VLLMEngine`: a `vllm.LLM` with a `speculative_config` (speculation on) and the same model
without one (off), behind the black-box interface; its stream for the perf tier (`VLLMStream`),
vLLM's spec-decode counters, and `vllm_engine`, which builds one from a model path.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from losscheck.engines import DraftModel
from losscheck.engines.counters import EngineCounters
from losscheck.engines.pool import Instances, Policy
from losscheck.engines.stream import Emission
from losscheck.engines.vllm.cpu_fixes import cpu_setup, worker_environment
from losscheck.engines.vllm.sampling import (
    LOGPROBS_MODE,
    VLLM_DTYPE,
    VLLM_SERVES,
    refused,
    sampling_kwargs,
    to_logprobs,
    to_prompt_logprobs,
    to_tensor,
    to_top_logprobs,
)
from losscheck.errors import OptionError

if TYPE_CHECKING:
    import torch

    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.request import GenerationRequest

_streams = itertools.count()  # numbers the streams of the process, so request ids never repeat in an LLM


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
        return to_tensor(self._outputs(request, False), *request.shape, self.eos, self.name, *_ends(request.params))

    def generate_logprobs(self, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """`generate`'s ids and the logprob vLLM reports for each (`logprobs_mode` processed: the
        law after the request's processing, the one `generate` samples from)."""
        outputs = self._outputs(request, True)
        tokens = to_tensor(outputs, *request.shape, self.eos, self.name, *_ends(request.params))
        return tokens, to_logprobs(outputs, tokens, self.eos, self.name, request.params, self.vocab)

    def generate_top_logprobs(
        self, request: GenerationRequest
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`generate_logprobs`' answer and the `request.top_logprobs` most probable ids at each
        position with their logprobs (vLLM's `logprobs=N`, the entries of rank 1..N)."""
        outputs = self._outputs(request, True)
        tokens = to_tensor(outputs, *request.shape, self.eos, self.name, *_ends(request.params))
        logprobs = to_logprobs(outputs, tokens, self.eos, self.name, request.params, self.vocab)
        return tokens, logprobs, *to_top_logprobs(outputs, tokens, request.top_logprobs, self.name)

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], speculative: bool) -> list[torch.Tensor]:
        """Each prompt's tokens' log p given the tokens before them (vLLM's `prompt_logprobs=0`,
        from the target's raw logits), one greedy token generated, drafting on or off."""
        from vllm import SamplingParams as VLLMSamplingParams

        from losscheck.core.sampling import GREEDY

        asked = VLLMSamplingParams(**(sampling_kwargs(GREEDY, 0, 1, self.eos, self.vocab) | {"prompt_logprobs": 0}))
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llms.get(speculative).generate(requests, [asked] * len(requests), use_tqdm=False)
        return [to_prompt_logprobs(out, prompt, self.name) for out, prompt in zip(outputs, prompts, strict=True)]

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
                **sampling_kwargs(
                    request.params,
                    request.row_seed(i, j),
                    budget,
                    *processing,
                    logprobs=logprobs,
                    top=request.top_logprobs,
                )
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
        setup = {**cpu_setup(cpu_fixes), **llm_kwargs, "logprobs_mode": LOGPROBS_MODE}
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


def _ends(params: SamplingParams) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(stop ids, stop strings) of a request: where `to_tensor` lets a row end early."""
    return params.stop_ids, params.stop_strings.strings if params.stop_strings is not None else ()
