"""Hugging Face assisted generation behind the black-box interface.

Speculation on: `model.generate(assistant_model=...)`, which with `do_sample=True` verifies the
assistant's candidates by standard speculative sampling (`transformers.generation.utils.
_speculative_sampling`); off: plain `model.generate`. A DFlash assistant (a transformers DFlash
checkpoint, `losscheck.drafters.dflash_config`) runs with `speculation_type="dflash"`: transformers'
`DFlashTokenCandidateGenerator` drafts `block_size - 1` candidates a round from the target's hidden
states, through the target's own embedding and LM head. A target whose checkpoint carries MTP
layers (config `num_mtp_layers`) drafts with them, no assistant, with `use_mtp=True`
(`MTPCandidateGenerator`: one candidate per MTP layer). Assisted generation runs one row per call
(batch size 1 is all it supports), so speculative rows are drawn one after another; with
speculation off a prompt's rows are drawn in one batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from losscheck.engines.registry import EngineSpec, needs_assistant, option, register
from losscheck.engines.served import GRAMMAR_UNSUPPORTED
from losscheck.errors import OptionError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from losscheck.core.contract import Target
    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.counters import EngineCounters
    from losscheck.engines.request import GenerationRequest
    from losscheck.engines.stream import Emission

# `HFAssistedEngine._generate`'s answer: ids [P, n, L], their logprobs (when asked) and the top ids
# and theirs [P, n, L, N] (when asked)
HFAnswer = tuple["torch.Tensor", "torch.Tensor | None", "tuple[torch.Tensor, torch.Tensor] | None"]


def __getattr__(name: str) -> Any:
    """`DTYPE_PRECISION`, the dtype -> precision table this module once exported (deprecated:
    `dtype_precision(dtype)` imports torch only when called)."""
    if name == "DTYPE_PRECISION":
        import warnings

        import torch

        warnings.warn(
            "losscheck.engines.hf.DTYPE_PRECISION is deprecated; call losscheck.engines.hf.dtype_precision(dtype)",
            DeprecationWarning,
            stacklevel=2,
        )
        return {dtype: dtype_precision(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_precision(dtype: torch.dtype) -> str:
    """losscheck's name of a model's torch dtype: fp32, bf16 or fp16."""
    from losscheck.core.precision import DTYPE_NAMES, torch_dtype

    return {torch_dtype(name): name for name in DTYPE_NAMES}[dtype]


# transformers' order differs from vLLM's (min-p last, after top-k and top-p) and it has no
# presence or frequency penalty: what losscheck's reference cannot judge, refused by name
# what the adapter passes to transformers' own processors (`losscheck.engines.served`: the rest is refused)
HF_SERVES = frozenset(
    {"min_p", "repetition_penalty", "logit_bias", "banned_ids", "min_tokens", "stop_ids", "stop_strings"}
)
HF_UNSUPPORTED = {
    "presence_penalty": "transformers has no presence penalty",
    "frequency_penalty": "transformers has no frequency penalty",
    **GRAMMAR_UNSUPPORTED,
}
STOPS_BEFORE_MIN = (
    "transformers matches stop strings from the first token, vLLM (and losscheck's reference) from min_tokens on; "
    "certify stop strings alone"
)
MIN_P_ORDER = (
    "transformers applies min-p after top-k and top-p, vLLM (and losscheck's reference) before them; "
    "certify min-p alone"
)


def sampling_config(params: SamplingParams, engine: str = "hf", eos: int | None = None) -> dict[str, Any]:
    """losscheck's request as `transformers.GenerationConfig` keyword arguments, each parameter
    passed to transformers' own processor, every other knob neutral explicitly: temperature, top-k
    (0 = off in both), top-p, min-p, `repetition_penalty` (over prompt and output, as vLLM's),
    `sequence_bias` {(id,): bias} for the logit bias, `bad_words_ids` [[id]] for the banned ids,
    `min_new_tokens` (EOS and the stop ids masked until then; the stop ids join EOS in
    `eos_token_id`, `HFAssistedEngine.generation_config`). Presence and frequency penalties and
    min-p with top-k or top-p raise `UnsupportedParameter` naming the parameter.

    Assisted generation processes the target's logits of every candidate position with that
    position's prefix (transformers 5.24 `generation/utils.py`, `_assisted_decoding`), and hands
    the assistant the same processor list (`generation/candidate_generator.py`,
    `AssistedCandidateGenerator.__init__` and `_prepare_generation_args`: only the min-length
    processor is dropped; min-new-tokens, counted from the target's prompt, stays), so the draft
    distribution q is processed as the target's p is."""
    from losscheck.engines.served import UnsupportedParameter, refuse

    refuse(params, engine, HF_SERVES, HF_UNSUPPORTED, eos)
    if params.min_p and (params.top_k or params.top_p < 1) and not params.greedy:
        raise UnsupportedParameter(f"engine {engine!r} cannot serve min_p={params.min_p!r} here: {MIN_P_ORDER}")
    if params.stop_strings is not None and params.min_tokens:
        raise UnsupportedParameter(f"engine {engine!r} cannot serve stop_strings with min_tokens: {STOPS_BEFORE_MIN}")
    sampling: dict[str, Any] = (
        {"do_sample": False}
        if params.greedy
        else {
            "do_sample": True,
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "min_p": params.min_p or None,
        }
    )
    return sampling | {
        "repetition_penalty": params.repetition_penalty,
        "sequence_bias": {(i,): bias for i, bias in params.logit_bias} or None,
        "bad_words_ids": [[i] for i in params.banned_ids] or None,
        "min_new_tokens": params.min_tokens,
    }


def stop_criteria(params: SamplingParams) -> dict[str, Any]:
    """`generate`'s keyword arguments for the request's stop strings: transformers' own
    `StopStringCriteria` with the vocabulary's tokenizer, as a stopping criterion. Not as the
    config's `stop_strings`: assisted generation hands its config to the assistant's `generate`
    without the tokenizer, which then raises (transformers 5.25 `candidate_generator.py`,
    `_prepare_generation_args`; docs/black-box-engines.md)."""
    if params.stop_strings is None:
        return {}
    from transformers import StoppingCriteriaList, StopStringCriteria

    from losscheck.core.stops import hf_tokenizer

    tokenizer = hf_tokenizer(params.stop_strings.vocabulary)
    return {
        "stopping_criteria": StoppingCriteriaList([StopStringCriteria(tokenizer, list(params.stop_strings.strings))])
    }


class HFAssistedEngine:
    """A Hugging Face causal LM (`model`) with `assistant` drafting `k` candidates per round."""

    reproducible_seeds = True  # the global generator seeded with the request's seed, rows drawn in order
    serves = HF_SERVES
    first_token = "round"  # assisted decoding verifies its first candidates with the prompt's forward

    def __init__(
        self,
        model: PreTrainedModel,
        assistant: PreTrainedModel | None,
        k: int,
        eos: int,
        name: str = "hf-assisted",
        ensemble_weight: float | None = None,  # transformers' static ensemble verification: lossy by design
        # "dflash": a DFlash assistant (speculation_type="dflash"); "mtp": the target's own MTP layers
        # (use_mtp=True, `assistant` None); None: an assistant causal LM
        speculation: str | None = None,
    ) -> None:
        self.model, self.assistant, self.k, self.eos = model, assistant, k, eos
        self.ensemble_weight, self.speculation = ensemble_weight, speculation
        if speculation not in (None, "dflash", "mtp"):
            raise OptionError(f"speculation={speculation!r}: HFAssistedEngine takes None, 'dflash' or 'mtp'")
        if (assistant is None) != (speculation == "mtp"):
            raise OptionError(
                "an MTP engine drafts with the target's own layers and takes no assistant; others need one"
            )
        if speculation == "mtp" and k != mtp_layers(model):
            raise OptionError(
                f"the target's {mtp_layers(model)} MTP layer(s) draft one candidate each a round, not {k}"
            )
        if speculation == "dflash" and assistant is not None and k != int(assistant.config.block_size) - 1:
            raise OptionError(
                f"a DFlash assistant drafts block_size - 1 = {int(assistant.config.block_size) - 1} candidates a "
                f"round in transformers, not {k}"
            )
        self.precision: str | None = dtype_precision(next(model.parameters()).dtype)
        self.name = f"{name}(k={k})"

    def generation_config(self, params: SamplingParams, max_new_tokens: int, speculative: bool = True) -> Any:
        """Exactly the request (`sampling_config`): no model-default top-k or penalties, a fixed
        block of `k` candidates (no schedule, no confidence early-stop: the declared k is the block
        drafted); `speculative` False for plain decoding (the MTP switch lives in the config)."""
        from transformers import GenerationConfig

        # The candidate generator reads its block from the *assistant's* generation config (with
        # transformers' defaults where unset: 20 candidates and a 0.4 confidence cut-off), not
        # from the config passed to `generate`: the block is fixed there, on every call. A DFlash
        # assistant's block is its config's block_size.
        if self.speculation is None and speculative and self.assistant is not None:
            assistant = self.assistant.generation_config
            assistant.num_assistant_tokens, assistant.num_assistant_tokens_schedule = self.k, "constant"
            assistant.assistant_confidence_threshold = 0.0
        return GenerationConfig(
            speculation_type="dflash" if self.speculation == "dflash" else None,
            use_mtp=speculative and self.speculation == "mtp",
            max_new_tokens=max_new_tokens,
            eos_token_id=self.ends(params),
            pad_token_id=self.eos,
            num_assistant_tokens=self.k,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
            assistant_ensemble_weight=self.ensemble_weight,
            **sampling_config(params, self.name, self.eos),
        )

    def ends(self, params: SamplingParams) -> int | list[int]:
        """transformers' `eos_token_id`: EOS, and the request's stop ids beside it (each ends a row
        and is kept, the row padded with EOS after it)."""
        stops = [i for i in params.stop_ids if i != self.eos]
        return [self.eos, *stops] if stops else self.eos

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        return self._generate(request, logprobs=False)[0]

    def generate_logprobs(self, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """`generate`'s answer and each token's log-probability [P, n, L]: the log-softmax of the
        scores transformers returns (`output_scores`: the logits after the request's processors)."""
        tokens, logprobs, _ = self._generate(request, logprobs=True)
        assert logprobs is not None
        return tokens, logprobs

    def generate_top_logprobs(
        self, request: GenerationRequest
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`generate_logprobs`' answer and the `request.top_logprobs` most probable ids at each
        position with their log-probabilities [P, n, L, N]: the top of the same log-softmaxed scores."""
        tokens, logprobs, top = self._generate(request, logprobs=True)
        assert logprobs is not None and top is not None
        return tokens, logprobs, *top

    def _generate(self, request: GenerationRequest, logprobs: bool) -> HFAnswer:
        import torch

        from losscheck.engines import request_lengths

        speculative, n = request.speculative, request.n
        config = self.generation_config(request.params, request.max_new_tokens, speculative)
        config.output_scores = config.return_dict_in_generate = logprobs
        assistant = {"assistant_model": self.assistant} if speculative and self.assistant is not None else {}
        device = next(self.model.parameters()).device
        words = stop_criteria(request.params)
        out = torch.full(request.shape, self.eos, dtype=torch.long)  # [P, n, L]
        reported = torch.zeros(request.shape) if logprobs else None  # [P, n, L]
        top_shape = (*request.shape, request.top_logprobs)
        top_ids = torch.zeros(top_shape, dtype=torch.long) if request.top_logprobs else None  # [P, n, L, N]
        top_values = torch.zeros(top_shape) if request.top_logprobs else None
        # HF samples from the global generator: seed it inside a fork, leaving the caller's state alone.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(request.seed)
            for i, prompt in enumerate(request.prompts):
                ids = torch.tensor([list(prompt)], device=device)  # [1, P]
                # assisted generation takes one row per call; plain generation takes a prompt's n at once
                for start, rows in _batches(n, 1 if speculative else n):
                    batch = ids.expand(rows, -1)  # [rows, P]
                    # `generate` comes from GenerationMixin, which every *ForCausalLM has and
                    # transformers' PreTrainedModel type lacks
                    answer = self.model.generate(  # type: ignore[operator]
                        batch, attention_mask=torch.ones_like(batch), generation_config=config, **assistant, **words
                    )
                    sequences = answer.sequences if logprobs else answer
                    new = sequences[:, len(prompt) :].cpu()  # [rows, generated]; rows that end early pad with eos
                    out[i, start : start + rows, : new.shape[1]] = new
                    if reported is not None:
                        scores = torch.stack(answer.scores, 1).float().log_softmax(-1).cpu()  # [rows, generated, V]
                        chosen = scores.gather(-1, new[..., None]).squeeze(-1)  # [rows, generated]
                        reported[i, start : start + rows, : new.shape[1]] = chosen
                        if top_ids is not None and top_values is not None:
                            best = scores.topk(request.top_logprobs, dim=-1)  # [rows, generated, N]
                            top_ids[i, start : start + rows, : new.shape[1]] = best.indices
                            top_values[i, start : start + rows, : new.shape[1]] = best.values
        if reported is not None:  # nothing after a row's end
            ends = request_lengths(out, self.eos, request.params, self.model.config.vocab_size)[..., None]
            generated = torch.arange(request.max_new_tokens) < ends  # [P, n, L]
            reported = torch.where(generated, reported, 0.0)
        top = None if top_ids is None or top_values is None else (top_ids, top_values)
        return out, reported, top

    def draft_model(self) -> PreTrainedModel | None:
        """The assistant: transformers draws its candidates from the assistant's logits processed by
        the request's processors, so teacher-forcing it gives the q the verifier reads. None for a
        DFlash assistant: its q at a position depends on where the round began (the block's
        anchor), which a teacher-forced causal LM cannot give; its cells judge the target-side
        classes and name the drafter-side ones not judged. None for MTP layers too: they read the
        target's states, not tokens alone."""
        return None if self.speculation is not None else self.assistant

    def with_k(self, k: int) -> HFAssistedEngine:
        """The same model and assistant drafting `k` candidates a round (a perf run's k sweep)."""
        name = self.name.partition("(")[0]
        return HFAssistedEngine(
            self.model,
            self.assistant,
            k,
            self.eos,
            name=name,
            ensemble_weight=self.ensemble_weight,
            speculation=self.speculation,
        )

    def stream(self, speculative: bool) -> HFStream:
        """The engine timed token by token (`losscheck.engines.stream`)."""
        return HFStream(self, speculative)


class HFStream:
    """`HFAssistedEngine` one request at a time (assisted generation's batch size is 1): a step runs
    one queued request's `generate` with a streamer that reads the clock at every chunk. Assisted
    generation hands the streamer each round's tokens at once (accepted drafts and the token after
    them), so the chunks are the rounds: the counters come from them (drafts = rounds, accepted =
    chunk size - 1), with no drafted count (HF shortens the last blocks to fit the budget)."""

    concurrent = False
    counters_source = "the emission chunks (assisted generation streams each round's tokens at once)"

    def __init__(self, engine: HFAssistedEngine, speculative: bool) -> None:
        from collections import deque

        self.engine, self.speculative = engine, speculative
        self._queue: deque[tuple[int, tuple[int, ...], int, SamplingParams, int]] = deque()
        self._per_position = [0] * engine.k
        self._rounds = self._emitted = 0

    def add(
        self, request: int, prompt: tuple[int, ...], max_new_tokens: int, params: SamplingParams, seed: int
    ) -> None:
        self._queue.append((request, prompt, max_new_tokens, params, seed))

    def busy(self) -> bool:
        return bool(self._queue)

    def step(self) -> list[Emission]:
        import torch

        from losscheck.engines.stream import Emission

        if not self._queue:
            return []
        request, prompt, budget, params, seed = self._queue.popleft()
        engine = self.engine
        device = next(engine.model.parameters()).device
        ids = torch.tensor([list(prompt)], device=device)  # [1, P]
        clock = _Clock()
        assistant = {"assistant_model": engine.assistant} if self.speculative and engine.assistant is not None else {}
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            engine.model.generate(  # type: ignore[operator]  # GenerationMixin's, see `generate`
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=engine.generation_config(params, budget, self.speculative),
                streamer=clock,
                **assistant,
            )
        chunks = _until_eos(clock.chunks, engine.eos, budget)
        if self.speculative:
            self._count(chunks)
        last = len(chunks) - 1
        return [Emission(request, at, tokens, i == last) for i, (at, tokens) in enumerate(chunks)]

    def _count(self, chunks: list[tuple[float, tuple[int, ...]]]) -> None:
        self._rounds += len(chunks)
        for _, tokens in chunks:
            self._emitted += len(tokens)
            accepted = len(tokens) - 1
            self._per_position += [0] * (accepted - len(self._per_position))  # a longer block shows as such
            for j in range(accepted):
                self._per_position[j] += 1

    def counters(self) -> EngineCounters | None:
        from losscheck.engines.counters import EngineCounters

        if not self.speculative:
            return None
        per = tuple(self._per_position)
        return EngineCounters(drafts=self._rounds, accepted=sum(per), accepted_per_position=per, emitted=self._emitted)


class _Clock:
    """A transformers streamer (`BaseStreamer`'s two methods) keeping each chunk of new ids with the
    time it arrived; the first `put` is the prompt."""

    def __init__(self) -> None:
        self.chunks: list[tuple[float, tuple[int, ...]]] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        import time

        now = time.perf_counter()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.chunks.append((now, tuple(int(t) for t in value.reshape(-1))))

    def end(self) -> None:
        pass


def _until_eos(
    chunks: list[tuple[float, tuple[int, ...]]], eos: int, budget: int
) -> list[tuple[float, tuple[int, ...]]]:
    """`chunks` cut after the first EOS and at `budget` ids in all."""
    kept: list[tuple[float, tuple[int, ...]]] = []
    left = budget
    for at, tokens in chunks:
        if left <= 0:
            break
        tokens = tokens[:left]
        if eos in tokens:
            kept.append((at, tokens[: tokens.index(eos) + 1]))
            break
        kept.append((at, tokens))
        left -= len(tokens)
    return [(at, tokens) for at, tokens in kept if tokens]


def _batches(n: int, size: int) -> list[tuple[int, int]]:
    """(first row, rows) of each batch of at most `size` covering `n` rows."""
    return [(start, min(size, n - start)) for start in range(0, n, size)]


BUNDLED_ASSISTANTS = ("drafter_a", "text_drafter_a")  # the bundled targets' family-A drafters


def _bundled_parts(target: Target) -> tuple[PreTrainedModel, PreTrainedModel, int]:
    """The target's model, the bundled family-A drafter of its vocabulary (the tiny target's, or
    the text target's), and its EOS id."""
    import json

    from losscheck import bundled
    from losscheck.core.target import load_causal_lm

    model = target.model  # type: ignore[attr-defined]
    weight = next(model.parameters())
    fixtures = bundled.fixtures_dir()
    vocab = {
        name: json.loads((fixtures / name / "config.json").read_text())["vocab_size"] for name in BUNDLED_ASSISTANTS
    }
    matching = [name for name, size in vocab.items() if size == target.vocab_size]
    if not matching:
        raise OptionError(
            f"the bundled assistants have vocabularies {vocab}, the target {target.vocab_size}: use "
            "--engine hf --assistant DIR with a drafter of the target's vocabulary"
        )
    assistant = load_causal_lm(fixtures / matching[0], dtype_precision(weight.dtype), device=weight.device)
    return model, assistant, target.eos_id if target.eos_id is not None else 0


def hf_assisted(target: Target) -> HFAssistedEngine:
    """`--losscheck-engine=losscheck.engines.hf:hf_assisted`: the target with the bundled drafter A
    of its vocabulary as assistant (`fixtures/drafter_a`, or `fixtures/text_drafter_a` for the text
    target), k = 4."""
    model, assistant, eos = _bundled_parts(target)
    return HFAssistedEngine(model, assistant, 4, eos)


def load_dflash(directory: Path, target: Target, option: str) -> PreTrainedModel:
    """The DFlash checkpoint in `directory` (transformers' `AutoModel`), in the target's dtype and
    on its device, checked against it (`option` names where it was given)."""
    from types import SimpleNamespace

    from transformers import AutoModel

    from losscheck.drafters import dflash_config

    model = target.model  # type: ignore[attr-defined]
    weight = next(model.parameters())
    try:
        declared = SimpleNamespace(**dflash_config.read(directory))
        dflash_config.check_config(
            declared, directory, target.hidden_size, target.vocab_size, int(getattr(target, "num_layers", 0))
        )
    except OptionError as exc:
        raise OptionError(f"{option}: {exc}") from exc
    assistant = AutoModel.from_pretrained(directory, dtype=weight.dtype, local_files_only=True, use_safetensors=True)
    return assistant.to(weight.device).eval()


def hf_dflash(target: Target) -> HFAssistedEngine:
    """`--losscheck-engine=losscheck.engines.hf:hf_dflash`: the bundled target with the bundled
    DFlash checkpoint (`fixtures/dflash`) through transformers' DFlash candidate generator, its
    block of 8."""
    from losscheck import bundled

    assistant = load_dflash(bundled.fixtures_dir() / "dflash", target, "the bundled DFlash checkpoint")
    eos = target.eos_id if target.eos_id is not None else 0
    block = int(assistant.config.block_size)
    return HFAssistedEngine(target.model, assistant, block - 1, eos, name="hf-dflash", speculation="dflash")  # type: ignore[attr-defined]


def mtp_layers(model: PreTrainedModel) -> int:
    """How many MTP layers the checkpoint of `model` declares (config `num_mtp_layers`; 0: none)."""
    return int(getattr(model.config.get_text_config(), "num_mtp_layers", None) or 0)


def hf_mtp(target: Target) -> HFAssistedEngine:
    """`--losscheck-engine=losscheck.engines.hf:hf_mtp`: the target drafting with its own MTP layers
    through transformers' `generate(..., use_mtp=True)`, one candidate per layer (the bundled
    `fixtures/mtp_target`: k = 1)."""
    model = target.model  # type: ignore[attr-defined]
    if not mtp_layers(model):
        raise OptionError(
            f"target {target.name!r} has no MTP layers (config.json sets no num_mtp_layers); hf_mtp drafts with a "
            "target checkpoint's own MTP layers (the bundled one: --target fixtures/mtp_target)"
        )
    eos = target.eos_id if target.eos_id is not None else 0
    return HFAssistedEngine(model, None, mtp_layers(model), eos, name="hf-mtp", speculation="mtp")


def tempered(assistant: PreTrainedModel, factor: float) -> PreTrainedModel:
    """`assistant` drafting at `factor` times the request's temperature: its LM head's output is
    divided by `factor` (a forward hook, so tied embeddings are untouched). HF computes the draft
    distribution q from these logits with the request's processors, so the assistant stays an
    honest drafter — the black-box form of the `tempered` stress drafter
    (`losscheck.drafters.stress`): it rejects more often, which is where verifier bugs show."""
    assistant.get_output_embeddings().register_forward_hook(lambda module, args, out: out / factor)
    return assistant


def hf_assisted_stress(target: Target) -> HFAssistedEngine:
    """`--losscheck-engine=losscheck.engines.hf:hf_assisted_stress`: `hf_assisted` with the
    assistant tempered by 2 (a stress cell for a black-box engine)."""
    model, assistant, eos = _bundled_parts(target)
    return HFAssistedEngine(model, tempered(assistant, 2.0), 4, eos, name="hf-assisted-tempered2")


# --- the shipped adapter: --engine hf --assistant DIR [--engine-arg num_assistant_tokens=N] -----------
@dataclass(frozen=True)
class HFOptions:
    num_assistant_tokens: int = option(4, minimum=1, help="the candidates the assistant drafts per round")
    assistant_ensemble_weight: float | None = option(
        None, help="w in (0, 1): transformers' static ensemble verification, lossy by design (losscheck.engines.lossy)"
    )
    use_mtp: bool = option(
        False,
        help="draft with the target's own MTP layers (config num_mtp_layers), no --assistant: generate(use_mtp=True)",
    )


def _build(target: Target, request: EngineSpec, options: HFOptions) -> HFAssistedEngine:
    from losscheck.core.target import load_causal_lm
    from losscheck.drafters.dflash_config import is_dflash_dir

    model = target.model  # type: ignore[attr-defined]
    eos = target.eos_id if target.eos_id is not None else 0
    if options.use_mtp:
        if not mtp_layers(model):
            raise OptionError(
                f"{request.prefix}engine-arg use_mtp=true: target {target.name!r} has no MTP layers (config.json sets "
                "no num_mtp_layers)"
            )
        layers = mtp_layers(model)
        return HFAssistedEngine(
            model, None, layers, eos, name=f"hf-mtp[{Path(request.target).name}]", speculation="mtp"
        )
    assert request.assistant is not None
    weight = next(model.parameters())
    directory = Path(request.assistant).expanduser()
    if is_dflash_dir(directory):
        option = f"{request.prefix}assistant={request.assistant!r}"
        dflash = load_dflash(directory, target, option)
        block = int(dflash.config.block_size)
        if "num_assistant_tokens" in request.args and options.num_assistant_tokens != block - 1:
            raise OptionError(
                f"{request.prefix}engine-arg num_assistant_tokens={options.num_assistant_tokens}: {option} is a DFlash "
                f"checkpoint, which drafts block_size - 1 = {block - 1} candidates a round; leave it out"
            )
        name = f"hf-dflash[{directory.name}]"
        weight_w = options.assistant_ensemble_weight
        return HFAssistedEngine(
            model, dflash, block - 1, eos, name=name, ensemble_weight=weight_w, speculation="dflash"
        )
    assistant = load_causal_lm(directory, dtype_precision(weight.dtype), device=weight.device)
    vocab = int(assistant.config.vocab_size)
    if vocab != target.vocab_size:
        raise OptionError(
            f"{request.prefix}assistant={request.assistant!r} has a vocabulary of {vocab} tokens, the target "
            f"{target.vocab_size}; assisted generation here drafts in the target's token ids"
        )
    name = f"hf-assisted[{Path(request.assistant).name}]"
    weight = options.assistant_ensemble_weight
    return HFAssistedEngine(model, assistant, options.num_assistant_tokens, eos, name=name, ensemble_weight=weight)


def _inputs(request: EngineSpec, engine: str) -> None:
    if request.args.get("use_mtp") is True:
        if request.assistant is not None:
            raise OptionError(
                f"{request.prefix}engine-arg use_mtp=true drafts with the target's own MTP layers; leave "
                f"{request.prefix}assistant out"
            )
        return
    needs_assistant("the assistant model directory")(request, engine)
    weight = request.args.get("assistant_ensemble_weight")
    if isinstance(weight, (int, float)) and not isinstance(weight, bool) and not 0 < weight < 1:
        raise OptionError(
            f"{request.prefix}engine-arg assistant_ensemble_weight={weight!r}: need a number in (0, 1) "
            "(transformers refuses others; leave it out for lossless verification)"
        )


register(
    "hf",
    "Hugging Face assisted generation: --assistant DIR (a causal LM, or a DFlash checkpoint), or the target's MTP "
    "layers: --engine-arg use_mtp=true",
    options=HFOptions,
    inputs=_inputs,
    build=_build,
    package="transformers",
)
