"""`--engine vllm-serve` without vLLM: the Prometheus counters, the server's command-line flags,
the completion request, and the stream's reader against a local HTTP server that speaks vLLM's
server-sent events."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.engines.counters import EngineCounters
from losscheck.engines.vllm_server import Server, ServerStream, _server_args, parse_metrics
from losscheck.perf.engine_serving import drive, engine_trace_problems
from losscheck.perf.workload import Request

METRICS = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} DRAFTS
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 14.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="3"} 0.0
"""


def test_the_servers_counters_read_from_prometheus_text():
    counted = parse_metrics(METRICS.replace("DRAFTS", "10.0"))
    assert counted == EngineCounters(drafts=10, drafted=40, accepted=14, accepted_per_position=(8, 4, 2, 0))
    assert parse_metrics('vllm:num_requests_running{engine="0"} 0.0\n') is None  # drafting off: none


def test_engine_args_become_server_flags():
    args = _server_args({"max_model_len": 256, "enforce_eager": True, "enable_prefix_caching": False, "x": None})
    assert args == ["--max-model-len", "256", "--enforce-eager"]
    assert _server_args({"served_model_name": "m", "hf_overrides": {"a": 1}}) == [
        "--served-model-name",
        "m",
        "--hf-overrides",
        '{"a": 1}',
    ]


class _Fake(BaseHTTPRequestHandler):
    """`/v1/completions` streams ids 7, 7 8, then 9 (finished) as vLLM's events; `/metrics` counts
    one more draft per request seen."""

    seen = 0
    bodies: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        type(self).seen += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for ids, reason in (([7], None), ([7, 8], None), ([9], "length")):
            choice = {"index": 0, "text": "", "finish_reason": reason, "token_ids": ids}
            self.wfile.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(METRICS.replace("DRAFTS", f"{10 + type(self).seen}.0").encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server(tmp_path: Path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    server = Server.__new__(Server)  # a started server's state, without starting vLLM
    server.model, server.port, server.log = "m", httpd.server_address[1], tmp_path / "log"
    server.url = f"http://127.0.0.1:{server.port}"
    _Fake.seen, _Fake.bodies = 0, []
    yield server
    httpd.shutdown()


def test_the_stream_reads_every_event_of_requests_in_flight(fake_server):
    stream = ServerStream(fake_server, speculative=True)
    requests = [Request([0, 3, i], 4, "low") for i in range(3)]
    trace = drive(stream, requests, [0.0] * 3, 2, SamplingParams(temperature=0.5), [11, 12, 13])
    assert [r.tokens for r in trace.requests] == [[7, 7, 8, 9]] * 3
    assert all([n for _, n in r.events] == [1, 2, 1] for r in trace.requests)
    assert trace.counters is not None and trace.counters.drafts == 3  # one draft per request, /metrics before and after
    assert engine_trace_problems(trace, eos=1, k=4) == []
    # requests in flight reach the server in the order its threads take them: find the first by prompt
    (first,) = [body for body in _Fake.bodies if body["prompt"] == [0, 3, 0]]
    assert first["stream"] is True and first["return_token_ids"] is True
    assert (first["temperature"], first["seed"], first["max_tokens"], first["n"]) == (0.5, 11, 4, 1)
    assert first["repetition_penalty"] == 1.0 and first["min_p"] == 0.0  # every other knob neutral, explicitly


def test_a_greedy_request_carries_no_seed(fake_server):
    body = json.loads(fake_server.body((0, 1), GREEDY, 5, 3, stream=False))
    assert body["temperature"] == 0 and body["seed"] is None and body["stream"] is False


def test_the_served_parameters_reach_the_completion_request(fake_server):
    fake_server.eos, fake_server.vocab = 1, 4
    params = SamplingParams(logit_bias={3: 2.0}, banned_ids=(2,), min_tokens=2, repetition_penalty=1.5)
    body = json.loads(fake_server.body((0, 1), params, 5, 3, stream=False))
    assert body["logit_bias"] == {"3": 2.0}  # the OpenAI API keys a bias by the id as a string
    assert body["allowed_token_ids"] == [0, 1, 3] and body["stop_token_ids"] == [1]
    assert (body["min_tokens"], body["repetition_penalty"]) == (2, 1.5)
