"""Any running OpenAI-compatible completions server (`--engine openai`): vLLM, SGLang, TensorRT-LLM
or TGI as deployed, certified and timed as a black box (docs/openai.md).

The speculative side and the plain side are two servers of the same model, one with drafting on
(`--engine-arg base_url=URL`) and one with it off (`--engine-arg plain_base_url=URL`); each is
asked its model name (`/v1/models`) when the options are checked, so an unreachable URL is a usage
error naming it. Each row is one `/v1/completions` request (`losscheck.engines.completions`) with
its own seed. What a server can do is probed once per side, before any cell draws:

token-id prompts  `prompt: [ids]`; a server that refuses them gets the prompt as text, decoded by
                  the target's tokenizer, only where encoding that text gives the ids back exactly.
ids in the answer vLLM's `return_token_ids`, else `logprobs` with `return_tokens_as_token_ids`
                  ("token_id:N" tokens); a server that answers text only cannot be certified
                  (re-tokenising text is not what it emitted): a usage error.
per-request seed  two requests seeded alike must sample alike; a server that refuses or ignores
                  `seed` serves greedy cells only, its sampled cells not run with that reason
                  (every draw of a run derives from its seed, so a run can be replayed).

The engine's counters are vLLM's spec-decode counters where the server exports them (`/metrics`).
"""

from __future__ import annotations

import functools
import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from losscheck.engines import EngineOutputError
from losscheck.engines.completions import COMPLETIONS_SERVES, get_json, post, post_json, sampling_fields
from losscheck.engines.counters import EngineCounters
from losscheck.engines.registry import EngineSpec, option, register
from losscheck.errors import CellUnavailable, OptionError

if TYPE_CHECKING:
    import torch

    from losscheck.core.contract import Target
    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.request import GenerationRequest
    from losscheck.engines.vllm_server import ServerStream

NAME = "openai"
PROBE_TIMEOUT_S = 10.0  # an answer to /v1/models or a probe's few tokens
SEED_PROBE_TOKENS = 32  # two unseeded samples this long at T = 1.5 agree with negligible probability
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")
URLS = {
    "base_url": "the server with speculative decoding on, e.g. http://127.0.0.1:8000",
    "plain_base_url": "the same model served with speculative decoding off",
}


class ServerLacks(CellUnavailable):
    """A server lacks what a cell needs (a reproducible seed, token-id prompts): the cell is not run."""


class Tokenizer(Protocol):
    """What the text fallback reads of the target's tokenizer (a Hugging Face one has both)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Capabilities:
    """What one server does of what a certification asks (probed once, `probe`)."""

    token_prompts: bool  # takes `prompt: [ids]`
    ids_from: str  # "token_ids" (vLLM's return_token_ids) or "logprobs" ("token_id:N" tokens)
    no_seed: str | None  # None: a per-request seed reproduces its samples; else why it does not

    def lines(self, url: str) -> list[str]:
        return [
            f"{url}: token-id prompts {'yes' if self.token_prompts else 'no (text through the target tokenizer)'}; "
            f"ids from {self.ids_from}; per-request seed {'yes' if self.no_seed is None else 'no: ' + self.no_seed}"
        ]


@functools.lru_cache(maxsize=16)
def served_model(url: str, option: str) -> str:
    """The model `url` serves (`/v1/models`), or a usage error naming `option` and the URL."""
    try:
        models = get_json(f"{url.rstrip('/')}/v1/models", PROBE_TIMEOUT_S)
        return str(models["data"][0]["id"])
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise OptionError(
            f"{option}={url!r}: no server answers there ({reason}); start the OpenAI-compatible server or fix the URL"
        ) from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise OptionError(
            f"{option}={url!r}: {url.rstrip('/')}/v1/models is not an OpenAI model list; "
            "give the server's base URL (without /v1)"
        ) from None


class Side:
    """One server (speculation on or off): its model, what it can do, and its requests."""

    def __init__(self, url: str, option: str, eos: int, vocab: int, tokenizer: Callable[[], Tokenizer | None]) -> None:
        self.url, self.option, self.eos, self.vocab = url.rstrip("/"), option, eos, vocab
        self.model = served_model(url, option)
        self._tokenizer = tokenizer
        self.caps = self.probe()
        self.has_metrics = self._metrics() is not None

    # --- the probes ---------------------------------------------------------------------------------
    def probe(self) -> Capabilities:
        ids = [i % self.vocab for i in (1, 2, 3)]
        probe = {"model": self.model, "max_tokens": 4, "temperature": 0.0, "n": 1}
        try:
            answer = self._ask(probe | {"prompt": ids}, "token_ids")
            token_prompts = True
        except ServerLacks:  # refused: the prompt as text
            token_prompts = False
            answer = self._ask(probe | {"prompt": self.text(ids, exact=False)}, "token_ids")
        ids_from = "token_ids"
        if _ids(answer, "token_ids") is None:
            ids_from = "logprobs"
            answer = self._ask(probe | {"prompt": ids if token_prompts else self.text(ids, exact=False)}, "logprobs")
            if _ids(answer, "logprobs") is None:
                raise OptionError(
                    f"{self.option}={self.url!r}: the server answers text where token ids were asked "
                    f"(neither return_token_ids nor logprobs with return_tokens_as_token_ids): {_short(answer)}; "
                    "serve it with vLLM or SGLang, which return ids (docs/openai.md)"
                )
        return Capabilities(token_prompts, ids_from, self._seed_problem(ids, token_prompts, ids_from))

    def _seed_problem(self, ids: list[int], token_prompts: bool, ids_from: str) -> str | None:
        sampled = {
            "model": self.model,
            "prompt": ids if token_prompts else self.text(ids, exact=False),
            "max_tokens": SEED_PROBE_TOKENS,
            "temperature": 1.5,
            "ignore_eos": True,
            "n": 1,
            "seed": 20261204,
        }
        try:
            first, second = (_ids(self._ask(sampled, ids_from), ids_from) for _ in range(2))
        except ServerLacks as exc:
            return f"it refuses a request with a seed ({exc})"
        if first != second:
            return "it ignores the per-request seed (two requests seeded alike sampled differently)"
        return None

    def _ask(self, request: dict[str, Any], ids_from: str) -> Any:
        extra: dict[str, Any] = {"return_token_ids": True}
        if ids_from == "logprobs":
            extra = {"logprobs": 1, "return_tokens_as_token_ids": True}
        try:
            return post_json(f"{self.url}/v1/completions", request | extra, NAME, PROBE_TIMEOUT_S * 6)
        except CellUnavailable as exc:
            raise ServerLacks(str(exc)) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            raise OptionError(f"{self.option}={self.url!r}: the server stopped answering ({exc})") from None

    def _metrics(self) -> EngineCounters | None:
        from losscheck.engines.vllm_server import parse_metrics

        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=PROBE_TIMEOUT_S) as answer:
                return parse_metrics(answer.read().decode(errors="replace"))
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None

    # --- requests ------------------------------------------------------------------------------------
    def text(self, ids: Sequence[int], exact: bool = True) -> str:
        """`ids` as text for a server that takes no token-id prompts, where the round trip is exact
        (a probe's prompt need not be)."""
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise ServerLacks(
                f"the server at {self.url} takes no token-id prompts, and the target has no tokenizer "
                "to write them as text"
            )
        text = tokenizer.decode(list(ids))
        if exact and list(tokenizer.encode(text, add_special_tokens=False)) != list(ids):
            raise ServerLacks(
                f"the server at {self.url} takes no token-id prompts, and the prompt {list(ids)[:8]}... does not "
                "survive the target tokenizer's round trip (decode then encode gives other ids)"
            )
        return text

    def body(self, prompt: Sequence[int], params: SamplingParams, seed: int, max_new: int, stream: bool) -> bytes:
        """A `/v1/completions` request of one row (`losscheck.engines.completions`)."""
        if not params.greedy and self.caps.no_seed is not None:
            raise ServerLacks(
                f"engine {NAME!r} cannot draw a sampled cell reproducibly from {self.url}: {self.caps.no_seed}; "
                "every draw of a run derives from its seed"
            )
        fields = sampling_fields(params, seed, max_new, self.eos, self.vocab, NAME)
        request = {k: v for k, v in fields.items() if v is not None} | {"model": self.model, "n": 1}
        request["prompt"] = list(prompt) if self.caps.token_prompts else self.text(prompt)
        if self.caps.ids_from == "token_ids":
            request["return_token_ids"] = True
        else:
            request |= {"logprobs": 1, "return_tokens_as_token_ids": True}
        return json.dumps(request | {"stream": stream}).encode()

    def post(self, body: bytes) -> Any:
        return post(f"{self.url}/v1/completions", body, NAME, 600.0)

    def row(self, body: bytes) -> list[int]:
        with self.post(body) as answer:
            found = json.loads(answer.read())
        ids = _ids(found, self.caps.ids_from)
        if ids is None:
            raise EngineOutputError(f"engine {NAME!r}: {self.url} answered without token ids: {_short(found)}")
        return ids

    def counters(self) -> EngineCounters | None:
        return self._metrics() if self.has_metrics else None


def _ids(answer: Any, ids_from: str) -> list[int] | None:
    """The generated ids of a completion answer, or None where it holds text only."""
    try:
        choice = answer["choices"][0]
        if ids_from == "token_ids":
            ids = choice.get("token_ids")
            return [int(i) for i in ids] if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None
        tokens = [_TOKEN_ID.match(str(t)) for t in choice["logprobs"]["tokens"]]
        return [int(m.group(1)) for m in tokens if m] if all(tokens) else None
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


def _short(answer: Any) -> str:
    text = json.dumps(answer)
    return text if len(text) < 200 else text[:200] + "..."


class OpenAIEngine:
    """Two running servers behind the black-box contract: `generate` sends every row of a request
    at once (a thread each, up to `max_in_flight`) to the side it asks for."""

    serves = COMPLETIONS_SERVES

    def __init__(self, spec: Side, plain: Side, k: int, precision: str | None, max_in_flight: int) -> None:
        self.sides = {True: spec, False: plain}
        self.k, self.precision, self.max_in_flight = k, precision, max_in_flight
        self.eos = spec.eos
        self.name = f"openai({spec.model}, k={k})"
        self._counted: EngineCounters | None = None

    def capabilities(self) -> list[str]:
        """One line per server: what it does of what the cells ask."""
        return [line for side in self.sides.values() for line in side.caps.lines(side.url)]

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        from losscheck.engines.completions import RowOutput
        from losscheck.engines.vllm import to_tensor

        side = self.sides[request.speculative]
        rows = [(i, j) for i in range(len(request.prompts)) for j in range(request.n)]
        budget = request.max_new_tokens
        bodies = [side.body(request.prompts[i], request.params, request.row_seed(i, j), budget, False) for i, j in rows]
        before = side.counters() if request.speculative else None
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_in_flight, len(rows)))) as pool:
            outputs = [RowOutput(ids) for ids in pool.map(side.row, bodies)]
        after = side.counters() if before is not None else None
        if before is not None and after is not None:
            call = after.since(before)
            self._counted = call if self._counted is None else self._counted.plus(call)
        n_prompts, n, _ = request.shape
        return to_tensor(outputs, n_prompts, n, budget, self.eos, self.name, request.params.stop_ids)

    def stream(self, speculative: bool) -> ServerStream:
        from losscheck.engines.vllm_server import ServerStream

        side = self.sides[speculative]
        if side.caps.ids_from != "token_ids":
            raise ServerLacks(f"the server at {side.url} streams no token ids (return_token_ids); it cannot be timed")
        return ServerStream(side, speculative)

    def counters(self) -> EngineCounters | None:
        return self._counted


# --- the shipped adapter: --engine openai --engine-arg base_url=URL --engine-arg plain_base_url=URL ------
@dataclass(frozen=True)
class OpenAIOptions:
    base_url: str | None = option(None, help=URLS["base_url"])
    plain_base_url: str | None = option(None, help=URLS["plain_base_url"])
    k: int | None = option(None, minimum=1, help="tokens the server drafts per round (its num_speculative_tokens)")
    dtype: str | None = option(
        None,
        choices=("fp32", "bf16", "fp16"),
        help="the precision the server runs --target in: its samples are scored one-sample; default: two-sample",
    )
    max_in_flight: int = option(32, minimum=1, help="requests a certification call keeps in flight")


def _inputs(request: EngineSpec, engine: str) -> None:
    opt = request.prefix
    if request.assistant is not None or request.speculative_config is not None:
        raise OptionError(
            f"{opt}engine={engine} drives running servers, which draft as they were started; "
            f"drop {opt}assistant and {opt}speculative-config"
        )
    for key, what in URLS.items():
        url = request.args.get(key)
        if not isinstance(url, str) or not url:
            raise OptionError(f"{opt}engine={engine} needs {opt}engine-arg {key}=URL: {what}")
        served_model(url, f"{opt}engine-arg {key}")
    if "k" not in request.args:
        raise OptionError(f"{opt}engine={engine} needs {opt}engine-arg k=N: tokens the server drafts per round")


def _tokenizer(directory: str) -> Callable[[], Tokenizer | None]:
    @functools.lru_cache(maxsize=1)
    def load() -> Tokenizer | None:
        try:
            from transformers import AutoTokenizer

            return cast(Tokenizer, AutoTokenizer.from_pretrained(directory))
        except (OSError, ValueError):
            return None

    return load


def _build(target: Target, request: EngineSpec, options: OpenAIOptions) -> OpenAIEngine:
    assert options.base_url is not None and options.plain_base_url is not None and options.k is not None
    eos = target.eos_id if target.eos_id is not None else 0
    tokenizer = _tokenizer(request.target)
    opt = f"{request.prefix}engine-arg"
    spec = Side(options.base_url, f"{opt} base_url", eos, target.vocab_size, tokenizer)
    plain = Side(options.plain_base_url, f"{opt} plain_base_url", eos, target.vocab_size, tokenizer)
    return OpenAIEngine(spec, plain, options.k, options.dtype, options.max_in_flight)


register(
    NAME,
    "any running OpenAI-compatible completions server (vLLM, SGLang, TensorRT-LLM, TGI): "
    "--engine-arg base_url=URL plain_base_url=URL k=N",
    options=OpenAIOptions,
    inputs=_inputs,
    build=_build,
)
