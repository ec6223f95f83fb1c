"""The vLLM adapter's parameter mapping and output assembly, without vLLM: a fake `LLM` that
records what it was asked and answers with given ids."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.engines import EngineOutputError
from losscheck.engines.vllm import VLLMEngine, sampling_kwargs, to_logprobs, to_tensor, vllm_engine
from losscheck.errors import OptionError
from tests.support import engine_request as request

EOS = 1
SPEC = {"method": "draft_model", "model": "drafter", "num_speculative_tokens": 3}


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, SimpleNamespace]] | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    outputs: list[Completion]


class FakeLLM:
    """Answers request r with `rows[r]` and records the requests and sampling parameters."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows, self.calls = rows, []

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append((prompts, sampling_params, use_tqdm))
        return [RequestOutput([Completion(self.rows[r])]) for r in range(len(prompts))]


def test_sampling_parameters_map_exactly_and_neutralise_everything_else():
    kw = sampling_kwargs(SamplingParams(temperature=0.7, top_k=8, top_p=0.9), seed=123, max_new_tokens=10)
    assert kw == {
        "n": 1,
        "temperature": 0.7,
        "top_k": 8,
        "top_p": 0.9,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logit_bias": None,
        "allowed_token_ids": None,
        "seed": 123,
        "max_tokens": 10,
        "min_tokens": 0,
        "stop_token_ids": None,
        "structured_outputs": None,
        "ignore_eos": False,
        "logprobs": None,
        "prompt_logprobs": None,
        "stop": None,
        "detokenize": False,
    }
    off = sampling_kwargs(SamplingParams(), 5, 4)
    assert off["top_k"] == -1 and off["top_p"] == 1.0 and off["temperature"] == 1.0
    greedy = sampling_kwargs(GREEDY, 5, 4)
    assert greedy["temperature"] == 0.0 and greedy["seed"] is None


def test_each_served_parameter_reaches_its_vllm_field():
    def kw(**params):
        return sampling_kwargs(SamplingParams(**params), 5, 4, eos=EOS, vocab=8)

    assert kw(min_p=0.1)["min_p"] == 0.1
    assert kw(repetition_penalty=1.5)["repetition_penalty"] == 1.5
    assert kw(presence_penalty=1.0)["presence_penalty"] == 1.0
    assert kw(frequency_penalty=0.5)["frequency_penalty"] == 0.5
    assert kw(logit_bias={3: 2.0, 6: -1.0})["logit_bias"] == {3: 2.0, 6: -1.0}
    # banned ids: every other id allowed, a mask vLLM applies at draft positions too
    assert kw(banned_ids=(2, 5))["allowed_token_ids"] == [0, 1, 3, 4, 6, 7]
    # min tokens: EOS named as a stop id, which vLLM's min-tokens processor masks
    assert (kw(min_tokens=8)["min_tokens"], kw(min_tokens=8)["stop_token_ids"]) == (8, [EOS])
    assert kw(stop_ids=(EOS,))["stop_token_ids"] is None  # EOS ends a row anyway
    assert kw(stop_ids=(3, EOS))["stop_token_ids"] == [EOS, 3]  # a stop id ends it too (vLLM keeps it)


def test_what_vllm_cannot_serve_here_is_refused_by_name():
    from losscheck.engines.served import UnsupportedParameter
    from losscheck.errors import CellUnavailable, OptionError

    with pytest.raises(UnsupportedParameter, match="banned_ids without the target's vocabulary size") as refused:
        sampling_kwargs(SamplingParams(banned_ids=(2,)), 5, 4, eos=EOS)
    assert isinstance(refused.value, CellUnavailable)  # the cell is not run, with the reason
    with pytest.raises(OptionError, match="outside the vocabulary"):
        sampling_kwargs(SamplingParams(logit_bias={9: 1.0}), 5, 4, eos=EOS, vocab=8)


def test_the_engine_passes_its_eos_and_vocabulary_to_each_request():
    llm = FakeLLM([[2, EOS]])
    engine = VLLMEngine(lambda spec: llm, SPEC, EOS, "fp32", sampling_params=dict, vocab=4)
    engine.generate(request([[0, 3]], 1, SamplingParams(banned_ids=(2,), min_tokens=1), 7, 2, True))
    (sent,) = llm.calls[0][1]
    assert sent["allowed_token_ids"] == [0, 1, 3] and sent["stop_token_ids"] == [EOS]


def test_each_continuation_is_its_own_seeded_request_and_rows_come_back_prompt_major():
    rows = [[5, 6, 7], [8, EOS], [9, 9, 9], [EOS]]  # prompt 0: rows 0-1, prompt 1: rows 2-3
    llms = {}

    def make(spec):
        llms[spec is not None] = FakeLLM(rows)
        return llms[spec is not None]

    engine = VLLMEngine(make, SPEC, EOS, "bf16", sampling_params=dict)
    out = engine.generate(request([[0, 3], [0, 4, 4]], 2, SamplingParams(top_p=0.9), 42, 3, True))
    assert engine.k == 3 and list(llms) == [True]  # the baseline LLM is not built until asked for
    assert out.tolist() == [[[5, 6, 7], [8, EOS, EOS]], [[9, 9, 9], [EOS, EOS, EOS]]]
    prompts, sampling, use_tqdm = llms[True].calls[0]
    assert prompts == [{"prompt_token_ids": [0, 3]}] * 2 + [{"prompt_token_ids": [0, 4, 4]}] * 2
    assert len({s["seed"] for s in sampling}) == 4 and all(s["top_p"] == 0.9 and s["n"] == 1 for s in sampling)
    assert not use_tqdm
    again = engine.generate(request([[0, 3], [0, 4, 4]], 2, SamplingParams(top_p=0.9), 42, 3, True))
    assert [s["seed"] for s in llms[True].calls[1][1]] == [s["seed"] for s in sampling]  # same seed, same requests
    engine.generate(request([[0, 3]], 1, GREEDY, 42, 3, False))
    assert list(llms) == [True, False] and torch.equal(out, again)


def test_speculation_off_builds_the_llm_without_a_speculative_config():
    seen = []
    engine = VLLMEngine(lambda spec: seen.append(spec) or FakeLLM([[2, 2]]), SPEC, EOS, None, sampling_params=dict)
    engine.generate(request([[0]], 1, GREEDY, 0, 2, False))
    engine.generate(request([[0]], 1, GREEDY, 0, 2, True))
    assert seen == [None, SPEC]


@dataclass
class Metric:
    name: str
    value: int = 0
    values: tuple[int, ...] = ()


class CountingLLM(FakeLLM):
    """A fake LLM that refuses to start beside another live one (one GPU's memory) and, when
    speculative, counts one draft of 3 tokens per request with the first 2 accepted."""

    live: set[int] = set()

    def __init__(self, speculative: bool, exclusive: bool = True) -> None:
        super().__init__([[2, 2]] * 8)
        assert not (exclusive and CountingLLM.live), "a second LLM started while another was alive"
        CountingLLM.live.add(id(self))
        self.speculative, self.requests = speculative, 0
        self.llm_engine = SimpleNamespace(engine_core=self)  # where vLLM's LLM keeps its shutdown

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.requests += len(prompts)
        return super().generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self):
        r = self.requests if self.speculative else 0
        names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        return [Metric(f"vllm:spec_decode_{n}", v) for n, v in zip(names, (r, 3 * r, 2 * r))] + [
            Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=(r, r, 0))
        ]

    def shutdown(self):
        CountingLLM.live.discard(id(self))


def test_one_at_a_time_never_keeps_two_llms_and_counters_survive_a_release():
    from losscheck.engines.counters import EngineCounters
    from losscheck.engines.pool import Policy

    built = []

    def make(spec):
        built.append(CountingLLM(spec is not None))
        return built[-1]

    CountingLLM.live = set()
    engine = VLLMEngine(make, SPEC, EOS, None, sampling_params=dict, policy=Policy.ONE_AT_A_TIME)
    assert engine.counters() is None  # nothing built yet
    for speculative in (True, False, True):  # each switch releases the other side first
        engine.generate(request([[0], [0]], 2, GREEDY, 0, 2, speculative))
    assert len(built) == 3 and len(CountingLLM.live) == 1 and engine.llms.alive() == (True,)
    # 4 + 4 speculative requests, the first LLM's counted before it was released
    assert engine.counters() == EngineCounters(drafts=8, drafted=24, accepted=16, accepted_per_position=(8, 8, 0))
    assert engine.counters().conditional_acceptance() == (1.0, 1.0, 0.0)


def test_logprobs_are_asked_for_the_sampled_token_and_read_at_each_emitted_position():
    """vLLM's `logprobs=0` gives, per emitted token, a dict holding that token's entry; the
    adapter reads them up to each row's EOS and reports 0 after it."""

    def entries(pairs):
        return [{token: SimpleNamespace(logprob=value)} for token, value in pairs]

    rows = [Completion([5, 6], entries([(5, -0.5), (6, -1.5)])), Completion([EOS], entries([(EOS, -2.0)]))]

    class Logged(FakeLLM):
        def generate(self, prompts, sampling_params, use_tqdm=True):
            self.calls.append((prompts, sampling_params, use_tqdm))
            return [RequestOutput([rows[r]]) for r in range(len(prompts))]

    llm = Logged([])
    engine = VLLMEngine(lambda spec: llm, SPEC, EOS, "fp32", sampling_params=dict)
    tokens, logprobs = engine.generate_logprobs(request([[0, 3]], 2, SamplingParams(), 7, 2, True))
    assert tokens.tolist() == [[[5, 6], [EOS, EOS]]]
    assert logprobs.tolist() == [[[-0.5, -1.5], [-2.0, 0.0]]]
    assert all(s["logprobs"] == 0 for s in llm.calls[0][1])
    assert sampling_kwargs(SamplingParams(), 0, 2)["logprobs"] is None  # plain calls ask for none


def test_missing_logprobs_or_another_logprobs_mode_are_errors_naming_them():
    tokens = torch.tensor([[[5, 6]]])
    with pytest.raises(EngineOutputError, match="request 0 reported 1 logprobs for 2 tokens"):
        short = [RequestOutput([Completion([5, 6], [{5: SimpleNamespace(logprob=-1.0)}])])]
        to_logprobs(short, tokens, EOS, "vllm", SamplingParams(), None)
    with pytest.raises(EngineOutputError, match="reported no logprob of its token 1"):
        odd = [{5: SimpleNamespace(logprob=-1.0)}, {7: SimpleNamespace(logprob=-1.0)}]
        to_logprobs([RequestOutput([Completion([5, 6], odd)])], tokens, EOS, "vllm", SamplingParams(), None)
    with pytest.raises(OptionError, match="logprobs_mode='raw_logprobs'.*leave logprobs_mode out"):
        vllm_engine("model", SPEC, EOS, logprobs_mode="raw_logprobs")


def test_a_row_that_stops_early_on_another_id_than_eos_is_an_error_naming_the_engine():
    with pytest.raises(EngineOutputError, match=r"engine 'vllm.*stopped after 1 of 3 tokens on 7, not on EOS 1"):
        to_tensor([RequestOutput([Completion([7])])], 1, 1, 3, EOS, "vllm(draft_model, k=3)")
    with pytest.raises(EngineOutputError, match="returned 1 outputs for 2 requests"):
        to_tensor([RequestOutput([Completion([7])])], 1, 2, 3, EOS, "vllm")


def test_stop_strings_are_vllms_stop_with_detokenizing_and_end_rows_early():
    from losscheck.core.stops import StopStrings

    params = SamplingParams(stop_strings=StopStrings(("ab", "c")))
    kwargs = sampling_kwargs(params, 0, 3)
    assert kwargs["stop"] == ["ab", "c"] and kwargs["detokenize"] is True
    assert sampling_kwargs(SamplingParams(), 0, 3)["stop"] is None
    a, b, x = 2, 3, 40  # the bundled vocabulary's "a", "b" and another character
    ended = [RequestOutput([Completion([x, a, b], stop_reason="ab")]), RequestOutput([Completion([x, x, x, x])])]
    tokens = to_tensor(ended, 1, 2, 4, EOS, "vllm", (), ("ab", "c"))
    assert tokens.tolist() == [[[x, a, b, EOS], [x, x, x, x]]]
    with pytest.raises(EngineOutputError, match="stopped after 3 of 4 tokens on 3, not on EOS"):
        to_tensor(ended[:1], 1, 1, 4, EOS, "vllm")  # a stop string the request did not name
    reported = [{t: SimpleNamespace(logprob=-1.0)} for t in (x, a, b)]
    logprobs = to_logprobs([RequestOutput([Completion([x, a, b], reported)])], tokens[:, :1], EOS, "vllm", params, 64)
    assert logprobs.tolist() == [[[-1.0, -1.0, -1.0, 0.0]]]  # three tokens: the pad after "ab" is no token


def test_counters_that_cannot_be_read_for_a_call_are_never_reported_partially():
    """vLLM's process-wide metrics registry passes to the last LLM built: a speculative call whose
    counts cannot be read makes the engine report none, not what it read before."""

    class TakenOver(CountingLLM):
        def get_metrics(self):
            if len(CountingLLM.live) > 1:
                raise RuntimeError("the registry belongs to another LLM")
            return super().get_metrics()

    CountingLLM.live = set()
    make = lambda spec: TakenOver(spec is not None, exclusive=False)  # noqa: E731
    engine = VLLMEngine(make, SPEC, EOS, None, sampling_params=dict)  # KEEP_ALL: both alive
    engine.generate(request([[0]], 2, GREEDY, 0, 2, True))
    assert engine.counters().drafts == 2
    engine.generate(request([[0]], 2, GREEDY, 0, 2, False))
    engine.generate(request([[0]], 2, GREEDY, 0, 2, True))
    assert engine.counters() is None


def test_an_llm_whose_call_failed_is_never_reused():
    """vLLM's LLM keeps a failed call's requests and spins on the next call: the next request
    builds a fresh one."""

    class Failing(FakeLLM):
        def generate(self, prompts, sampling_params, use_tqdm=True):
            raise RuntimeError("CPU Generator does not use offset")

    built: list[FakeLLM] = []

    def make(spec):
        built.append(Failing([]) if not built else FakeLLM([[2, 2]]))
        return built[-1]

    engine = VLLMEngine(make, SPEC, EOS, None, sampling_params=dict)
    with pytest.raises(RuntimeError, match="does not use offset"):
        engine.generate(request([[0]], 1, SamplingParams(), 0, 2, True))
    assert engine.llms.alive() == ()
    assert engine.generate(request([[0]], 1, GREEDY, 0, 2, True)).tolist() == [[[2, 2]]] and len(built) == 2


def test_a_warm_prefix_serves_every_distinct_prompt_once_before_the_call():
    llm = FakeLLM([[2, 2], [3, 3]])
    engine = VLLMEngine(lambda spec: llm, SPEC, EOS, None, sampling_params=dict, warm_prefix=True)
    engine.generate(request([[0, 3], [0, 4]], 1, SamplingParams(), 7, 2, True))
    (warm, params, _), (asked, _, _) = llm.calls
    assert warm == [{"prompt_token_ids": [0, 3]}, {"prompt_token_ids": [0, 4]}] and len(asked) == 2
    assert all(p["max_tokens"] == 1 and p["temperature"] == 0 and p["seed"] is None for p in params)


def test_staggered_arrivals_keep_the_rows_in_flight_and_return_them_in_order():
    """The arrivals axis: each row added to the LLM's engine as an earlier one finishes, the
    engine stepped in between (steps mix new requests with running ones), the outputs in order."""
    from types import SimpleNamespace

    from losscheck.engines.vllm import staggered

    class Engine:
        def __init__(self) -> None:
            self.running: dict[str, int] = {}  # request id -> steps left
            self.most = 0
            self.added: list[str] = []

        def add_request(self, rid, prompt, params):
            self.running[rid] = 2 + len(self.added) % 3  # requests of different lengths
            self.added.append(rid)

        def step(self):
            self.most = max(self.most, len(self.running))
            out = []
            for rid in list(self.running):
                self.running[rid] -= 1
                done = self.running[rid] == 0
                out.append(SimpleNamespace(request_id=rid, finished=done, prompt=rid))
                if done:
                    del self.running[rid]
            return out

    engine = Engine()
    llm = SimpleNamespace(llm_engine=engine)
    requests = [{"prompt_token_ids": [i]} for i in range(7)]
    outputs = staggered(llm, requests, ["params"] * 7, in_flight=3)
    assert engine.most == 3 and len(engine.added) == 7
    assert [int(o.request_id.rpartition("-")[2]) for o in outputs] == list(range(7))
