"""A small OpenAI-compatible completions server for testing `--engine openai` without an engine.

`FakeOpenAI` serves `/v1/models` and `/v1/completions` on 127.0.0.1 (an ephemeral port, a thread)
from a deterministic toy generator: a Markov chain over `vocab` ids whose next-token logits depend
on the last id only, sampled at the request's temperature, top-k and top-p. What it can do is set
by its `Behaviour` (a server without per-request seeds, one that refuses token-id prompts, one that
answers text only), so each capability the adapter probes has a server that lacks it. It stops by
itself after `max_requests` requests or `lifetime_s` seconds, whichever comes first, and when its
`with` block ends.
"""

from __future__ import annotations

import json
import math
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Behaviour:
    vocab: int = 64
    eos: int = 0
    seeds: bool = True  # a per-request seed reproduces its samples (else one shared, unseeded stream)
    token_prompts: bool = True  # takes `prompt: [ids]` (else HTTP 400; text prompts need `encode`)
    ids: bool = True  # answers with `token_ids` when asked `return_token_ids` (else text only)
    encode: Callable[[str], list[int]] | None = field(default=None, compare=False)  # text prompts → ids
    model: str = "toy-markov"
    table_seed: int = 7  # the chain's logits


class ToyChain:
    """Next-token logits [vocab] of the last id, fixed by `table_seed`."""

    def __init__(self, vocab: int, table_seed: int) -> None:
        rng = random.Random(table_seed)
        self.logits = [[rng.gauss(0.0, 2.0) for _ in range(vocab)] for _ in range(vocab)]  # [vocab, vocab]

    def law(self, last: int, temperature: float, top_k: int, top_p: float) -> list[float]:
        """The next id's probabilities: softmax(logits / T), then top-k, then top-p."""
        logits = [x / temperature for x in self.logits[last]]
        order = sorted(range(len(logits)), key=lambda i: -logits[i])
        kept = order[:top_k] if top_k > 0 else order
        top = max(logits)
        weights = {i: math.exp(logits[i] - top) for i in kept}
        total = sum(weights.values())
        out, mass = [0.0] * len(logits), 0.0
        for i in kept:  # highest first: the smallest set whose mass reaches top-p
            if mass >= top_p:
                break
            out[i] = weights[i] / total
            mass += out[i]
        norm = sum(out)
        return [p / norm for p in out]

    def generate(self, prompt: Sequence[int], request: dict[str, Any], rng: random.Random, eos: int) -> list[int]:
        temperature = float(request.get("temperature", 1.0))
        top_k, top_p = int(request.get("top_k", -1)), float(request.get("top_p", 1.0))
        out, last = [], prompt[-1]
        for _ in range(int(request.get("max_tokens", 16))):
            if temperature == 0:
                nxt = max(range(len(self.logits)), key=lambda i: self.logits[last][i])
            else:
                law = self.law(last, temperature, top_k, top_p)
                nxt = rng.choices(range(len(law)), weights=law)[0]
            out.append(nxt)
            last = nxt
            if nxt == eos and not request.get("ignore_eos", False):
                break
            if nxt in (request.get("stop_token_ids") or ()):  # vLLM's: the row ends on it, keeping it
                break
        return out


# the vLLM extensions the toy chain does not implement: a request setting one away from neutral is refused
_NEUTRAL = {
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "logit_bias": None,
    "allowed_token_ids": None,
}


class FakeOpenAI:
    """The server; `url` its base URL, `requests` the completion requests it has answered."""

    def __init__(self, behaviour: Behaviour = Behaviour(), max_requests: int = 2000, lifetime_s: float = 120.0) -> None:
        self.behaviour, self.max_requests = behaviour, max_requests
        self.chain = ToyChain(behaviour.vocab, behaviour.table_seed)
        self.requests: list[dict[str, Any]] = []
        self._unseeded = random.Random()  # one stream for every request: what a seedless server gives
        self._lock = threading.Lock()
        self._http = _Server(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._timer.cancel()
        if self._thread.is_alive():
            self._http.shutdown()
        self._http.server_close()

    def complete(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, answer) of one completion request."""
        b = self.behaviour
        with self._lock:
            self.requests.append(request)
            if len(self.requests) > self.max_requests:
                threading.Thread(target=self.stop, daemon=True).start()
                return 503, {"error": {"message": f"the fake server's {self.max_requests} requests are spent"}}
        prompt = request.get("prompt")
        if isinstance(prompt, list):
            if not b.token_prompts:
                return 400, {"error": {"message": "prompt must be a string"}}
        elif isinstance(prompt, str) and b.encode is not None:
            prompt = b.encode(prompt)
        else:
            return 400, {"error": {"message": "prompt must be a list of token ids"}}
        if not prompt or any(not isinstance(i, int) or not 0 <= i < b.vocab for i in prompt):
            return 400, {"error": {"message": f"prompt ids must be in [0, {b.vocab})"}}
        refused = [k for k, neutral in _NEUTRAL.items() if request.get(k, neutral) != neutral]
        if refused:
            return 400, {"error": {"message": f"unsupported parameter {refused[0]}"}}
        seed = request.get("seed")
        if b.seeds and seed is not None:
            ids = self.chain.generate(prompt, request, random.Random(seed), b.eos)
        else:
            with self._lock:
                ids = self.chain.generate(prompt, request, self._unseeded, b.eos)
        choice: dict[str, Any] = {"index": 0, "text": " ".join(f"t{i}" for i in ids), "finish_reason": "length"}
        if b.ids and request.get("return_token_ids"):
            choice["token_ids"] = ids
        return 200, {"object": "text_completion", "model": b.model, "choices": [choice]}


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # a certification call keeps many rows in flight
    daemon_threads = True


def _handler(server: FakeOpenAI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _send(self, status: int, answer: dict[str, Any]) -> None:
            body = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": server.behaviour.model, "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._send(*server.complete(request))

    return Handler
