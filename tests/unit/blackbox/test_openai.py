"""`--engine openai` against the self-test's fake OpenAI-compatible server (in process, on an
ephemeral localhost port): the rows a server emits, what it lacks probed once and named, and the
usage errors of a URL nobody answers on or a server that answers text."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch

from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.engines.named import ADAPTERS
from losscheck.engines.openai_api import OpenAIEngine, ServerLacks, Side
from losscheck.engines.registry import EngineSpec
from losscheck.engines.request import GenerationRequest
from losscheck.errors import CellUnavailable, OptionError
from losscheck.selftest.fake_openai import Behaviour, FakeOpenAI, ToyChain

EOS, VOCAB = 1, 64
TARGET = SimpleNamespace(eos_id=EOS, vocab_size=VOCAB)  # what the adapter reads of the loaded target
SAMPLED = SamplingParams(temperature=1.0)


def request(spec: str, plain: str, **args: object) -> EngineSpec:
    return EngineSpec(target="unused", args={"base_url": spec, "plain_base_url": plain, "k": 4, **args})


def build(spec: FakeOpenAI, plain: FakeOpenAI) -> OpenAIEngine:
    return ADAPTERS["openai"].build(TARGET, request(spec.url, plain.url))  # type: ignore[return-value]


def ask(engine: OpenAIEngine, params: SamplingParams, seed: int = 3, speculative: bool = True, n: int = 2):
    prompts = ((2, 3), (5,), (7, 8, 9))
    call = GenerationRequest(prompts=prompts, n=n, params=params, seed=seed, max_new_tokens=6, speculative=speculative)
    return engine.generate(call)


def fake(**behaviour: object) -> FakeOpenAI:
    return FakeOpenAI(Behaviour(vocab=VOCAB, eos=EOS, **behaviour), max_requests=400, lifetime_s=60)  # type: ignore[arg-type]


def greedy_rows(prompt: tuple[int, ...], budget: int) -> list[int]:
    return ToyChain(VOCAB, Behaviour().table_seed).generate(prompt, {"temperature": 0, "max_tokens": budget}, None, EOS)  # type: ignore[arg-type]


def test_greedy_rows_are_the_servers_on_either_side():
    with fake() as spec, fake() as plain:
        engine = build(spec, plain)
        assert engine.name == "openai(toy-markov, k=4)" and engine.k == 4 and engine.precision is None
        for speculative in (True, False):
            out = ask(engine, GREEDY, speculative=speculative)  # [P, n, L]
            for i, prompt in enumerate(((2, 3), (5,), (7, 8, 9))):
                expected = greedy_rows(prompt, 6)
                expected += [EOS] * (6 - len(expected))
                assert out[i].tolist() == [expected, expected]
        served = [r for r in spec.requests if r.get("max_tokens") == 6]
        assert served and all(r["prompt"] in ([2, 3], [5], [7, 8, 9]) and r["n"] == 1 for r in served)


def test_a_seeded_server_reproduces_a_call_and_draws_each_row_apart():
    with fake() as spec, fake() as plain:
        engine = build(spec, plain)
        assert engine.capabilities() == [
            f"{s.url}: token-id prompts yes; ids from token_ids; per-request seed yes" for s in (spec, plain)
        ]
        first, again, other = ask(engine, SAMPLED, n=4), ask(engine, SAMPLED, n=4), ask(engine, SAMPLED, seed=4, n=4)
        assert first.equal(again) and not first.equal(other)
        assert len({tuple(row) for row in first.reshape(-1, 6).tolist()}) > 6  # 12 rows, each its own seed


def test_a_server_without_seeds_serves_greedy_cells_and_refuses_sampled_ones_by_name():
    with fake(seeds=False) as spec, fake() as plain:
        engine = build(spec, plain)
        assert "per-request seed no: it ignores the per-request seed" in engine.capabilities()[0]
        assert ask(engine, GREEDY).shape == (3, 2, 6)
        ask(engine, SAMPLED, speculative=False)  # the plain side keeps its seeds
        with pytest.raises(CellUnavailable, match=f"from {spec.url}: it ignores the per-request seed"):
            ask(engine, SAMPLED)


def test_a_parameter_the_server_refuses_makes_the_cell_unavailable_with_its_words():
    with fake() as spec, fake() as plain:
        with pytest.raises(CellUnavailable, match="refuses the request: .*unsupported parameter min_p"):
            ask(build(spec, plain), SamplingParams(temperature=1.0, min_p=0.1))


def test_an_unreachable_base_url_is_a_usage_error_naming_it():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with fake() as plain:
        message = f"--losscheck-engine-arg base_url='{url}': no server answers there"
        with pytest.raises(OptionError, match=message) as caught:
            ADAPTERS["openai"].check(request(url, plain.url))
        assert "start the OpenAI-compatible server or fix the URL" in str(caught.value)


def test_a_server_answering_text_where_ids_were_asked_is_a_usage_error():
    with fake(ids=False) as spec, fake() as plain:
        with pytest.raises(OptionError, match="base_url='.*': the server answers text where token ids were asked"):
            build(spec, plain)


@pytest.mark.parametrize(
    "args, message",
    [
        ({"plain_base_url": None}, "--losscheck-engine=openai needs --losscheck-engine-arg plain_base_url=URL"),
        ({"k": None}, "--losscheck-engine=openai needs --losscheck-engine-arg k=N"),
        ({"k": 0}, "--losscheck-engine-arg k=0: need an int >= 1"),
        ({"dtype": "int8"}, "dtype='int8': need one of ['fp32', 'bf16', 'fp16']"),
    ],
)
def test_missing_or_bad_options_are_named(args, message):
    with fake() as spec, fake() as plain:
        args = {"base_url": spec.url, "plain_base_url": plain.url, "k": 4, **args}
        given = {k: v for k, v in args.items() if v is not None}
        with pytest.raises(OptionError, match=message.replace("[", r"\[").replace("]", r"\]")):
            ADAPTERS["openai"].check(EngineSpec(target="unused", args=given))


class LetterTokenizer:
    """Ids 2-27 are the letters a-z, and id 30 the pair "ab" (a merge): [2, 3] decodes to "ab",
    which encodes to [30], so that prompt does not survive the round trip."""

    def decode(self, ids):
        return "".join("ab" if i == 30 else chr(ord("a") + i - 2) for i in ids)

    def encode(self, text, add_special_tokens=True):
        out, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                out, i = [*out, 30], i + 2
            else:
                out, i = [*out, ord(text[i]) - ord("a") + 2], i + 1
        return out


def test_a_server_without_token_id_prompts_gets_text_where_the_round_trip_is_exact():
    tokenizer = LetterTokenizer()
    with fake(token_prompts=False, encode=tokenizer.encode) as spec, fake() as plain:
        sides = [Side(s.url, "opt", EOS, VOCAB, lambda: tokenizer) for s in (spec, plain)]
        engine = OpenAIEngine(sides[0], sides[1], k=4, precision=None, max_in_flight=4)
        assert engine.capabilities()[0].startswith(f"{spec.url}: token-id prompts no (text through the target")
        call = GenerationRequest(prompts=((5, 3),), n=1, params=GREEDY, seed=0, max_new_tokens=4, speculative=True)
        assert engine.generate(call)[0, 0].tolist()[: len(greedy_rows((5, 3), 4))] == greedy_rows((5, 3), 4)
        assert spec.requests[-1]["prompt"] == "db"
        merged = GenerationRequest(prompts=((2, 3),), n=1, params=GREEDY, seed=0, max_new_tokens=4, speculative=True)
        with pytest.raises(ServerLacks, match="does not survive the target tokenizer's round trip"):
            engine.generate(merged)


def test_stop_ids_reach_the_server_and_rows_end_on_them_keeping_them():
    """`stop_token_ids` beside EOS in every request; a row ends at its first stop id, keeps it and
    is EOS-padded after it (what vLLM's server answers: its `token_ids` end on the stop id)."""
    from losscheck.engines import lengths

    stops = (3, 5, 7, 9, 11)
    params = SamplingParams(temperature=1.0, stop_ids=stops)
    with fake() as spec, fake() as plain:
        out = ask(build(spec, plain), params, n=8)  # [P, n, L]
        asked = [r for r in spec.requests if r.get("max_tokens") == 6]
        assert asked and all(set(stops) <= set(r["stop_token_ids"]) for r in asked)
    rows = out.flatten(0, 1)
    ended = lengths(rows, EOS, stops)  # [P*n]
    last = rows[torch.arange(len(rows)), ended - 1]
    on_stop = (ended < 6) & torch.isin(last, torch.tensor(stops))
    assert on_stop.any(), rows  # some row stopped on a stop id, and it is the row's last id
    assert all((row[int(e) :] == EOS).all() for row, e in zip(rows, ended))
