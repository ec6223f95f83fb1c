"""The black-box engine contract: declared attributes, validated output, planned cells, and
losscheck's own loop and Hugging Face assisted generation behind it."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from losscheck import bundled
from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.engines import EngineOutputError, check_engine, checked_samples, lengths
from losscheck.errors import OptionError
from losscheck.plan.matrix import OWN_TARGET, SAMPLING_VARIANTS, engine_cells
from tests.support import engine_request as request

EOS, V = 1, 64


def shaped(n_prompts, n, max_new_tokens):
    """A request whose answer has the shape [n_prompts, n, max_new_tokens]."""
    return request([[0]] * n_prompts, n, GREEDY, 0, max_new_tokens, True)


def engine(**attrs):
    base = {"name": "fake", "k": 4, "precision": "fp32", "generate": lambda request: None}
    return SimpleNamespace(**{**base, **attrs})


@pytest.mark.parametrize(
    "attrs, message",
    [
        ({"generate": None}, "without a generate"),
        ({"k": 0}, "k = 0; declare the block length"),
        ({"k": True}, "k = True"),
        ({"precision": "int8"}, "precision = 'int8'"),
        ({"name": None}, "without a name"),
    ],
)
def test_an_engine_missing_a_declaration_is_an_option_error_naming_its_source(attrs, message):
    with pytest.raises(OptionError, match=message) as info:
        check_engine(engine(**attrs), "--losscheck-engine='m:f'")
    assert "--losscheck-engine='m:f' returned SimpleNamespace" in str(info.value)


def test_a_valid_engine_passes_with_precision_none_meaning_two_sample():
    e = engine(precision=None)
    assert check_engine(e, "x") is e


@pytest.mark.parametrize(
    "out, message",
    [
        ([[1]], "returned list"),
        (torch.zeros(2, 3, 5), "dtype torch.float32"),
        (
            torch.zeros(2, 3, 4, dtype=torch.long),
            r"shape \(2, 3, 4\), expected \[prompts, n, max_new_tokens\] = \(2, 3, 5\)",
        ),
        (torch.full((2, 3, 5), V, dtype=torch.long), r"ids in \[64, 64\], outside the target's vocabulary \[0, 64\)"),
        (torch.tensor([5, EOS, 7, EOS, EOS]).expand(2, 3, 5), "ids other than EOS"),
    ],
)
def test_malformed_engine_output_is_an_error_naming_the_engine(out, message):
    with pytest.raises(EngineOutputError, match=message) as info:
        checked_samples(engine(), out, shaped(2, 3, 5), V, EOS)
    assert "engine 'fake'" in str(info.value)


def test_eos_padded_rows_pass_and_their_lengths_count_the_eos():
    out = torch.tensor([[[5, 6, 7], [8, EOS, EOS]], [[EOS, EOS, EOS], [9, 9, EOS]]], dtype=torch.int32)
    ok = checked_samples(engine(), out, shaped(2, 2, 3), V, EOS)
    assert ok.dtype == torch.long
    assert lengths(ok, EOS).tolist() == [[3, 2], [1, 3]]


def test_engine_cells_run_at_the_engines_k_in_its_precision_or_two_sample():
    sampled, greedy = engine_cells(engine(k=3, precision="bf16"))
    assert [c.params for c in sampled] == list(SAMPLING_VARIANTS) and greedy[0].params == GREEDY
    assert {c.mode for c in sampled} == {"one-sample"} and greedy[0].mode == "engine-greedy"
    assert sampled[0].id == "engine-k3-T1-bf16" and {c.precision.target for c in sampled + greedy} == {"bf16"}
    sampled, greedy = engine_cells(engine(precision=None))
    assert {c.mode for c in sampled} == {"two-sample"} and {c.target for c in sampled + greedy} == {OWN_TARGET}
    assert sampled[0].id == "engine-k4-T1-two-sample" and greedy[0].id == "engine-k4-greedy-two-sample"


PROMPTS = [[0, 3, 53, 39], [0, 3]]


@pytest.mark.parametrize("factory", ["losscheck.engines.spec_loop:spec_loop", "losscheck.engines.hf:hf_assisted"])
def test_adapters_return_the_contracts_shape_and_greedy_on_equals_off(target, factory):
    from losscheck.run.loading import load_object

    e = check_engine(load_object(factory, "test")(target), factory)
    assert e.k == 4 and e.precision == "fp32"
    sampled = e.generate(request(PROMPTS, 3, SamplingParams(), 7, 10, True))
    checked_samples(e, sampled, request(PROMPTS, 3, SamplingParams(), 7, 10, True), V, EOS)
    assert torch.equal(sampled, e.generate(request(PROMPTS, 3, SamplingParams(), 7, 10, True)))  # the seed decides
    assert not torch.equal(sampled, e.generate(request(PROMPTS, 3, SamplingParams(), 8, 10, True)))
    on, off = (e.generate(request(PROMPTS, 1, GREEDY, 0, 12, s)) for s in (True, False))
    assert torch.equal(on, off)


def test_hf_generation_config_is_exactly_the_request(target):
    from losscheck.engines.hf import hf_assisted

    config = hf_assisted(target).generation_config(SamplingParams(temperature=0.3, top_p=0.9), 10)
    assert (config.do_sample, config.temperature, config.top_k, config.top_p) == (True, 0.3, 0, 0.9)
    assert (config.num_assistant_tokens, config.num_assistant_tokens_schedule) == (4, "constant")
    assert config.assistant_confidence_threshold == 0.0 and config.eos_token_id == EOS
    assert hf_assisted(target).generation_config(GREEDY, 10).do_sample is False


@pytest.mark.parametrize("params", [GREEDY, SamplingParams()], ids=["greedy", "T1"])
def test_hf_stream_drafts_the_declared_block_and_emits_what_generate_returns(target, params):
    """The perf tier's HF stream: each chunk is one round of at most k drafts + 1 (transformers
    reads the block from the assistant's own generation config, whose defaults are 20 candidates
    and a confidence cut-off), its counters add up, and its tokens are `generate`'s for the seed."""
    from losscheck.engines.hf import hf_assisted

    engine = hf_assisted(target)
    stream = engine.stream(speculative=True)
    prompts = ((0, 5, 9, 2), (0, 7, 3))
    for i, prompt in enumerate(prompts):
        stream.add(i, prompt, 20, params, seed=11 + i)
    emitted = [e for _ in prompts for e in stream.step()]
    assert not stream.busy() and [e.finished for e in emitted].count(True) == 2
    assert max(len(e.tokens) for e in emitted) <= engine.k + 1
    counted = stream.counters()
    assert counted is not None and counted.problems() == [] and len(counted.accepted_per_position) == engine.k
    assert counted.drafts == len(emitted) and counted.emitted == counted.drafts + counted.accepted
    for i, prompt in enumerate(prompts):
        tokens = [t for e in emitted if e.request == i for t in e.tokens]
        row = engine.generate(request([list(prompt)], 1, params, 11 + i, 20, True))[0, 0].tolist()
        assert tokens == row[: len(tokens)] and set(row[len(tokens) :]) <= {EOS}


def test_hf_engine_with_another_block_length(target):
    """A perf run's k sweep: the same models, the assistant's block set to the new k on each call."""
    from losscheck.engines.hf import hf_assisted

    engine = hf_assisted(target)
    two = engine.with_k(2)
    assert (two.k, two.name, two.assistant) == (2, "hf-assisted(k=2)", engine.assistant)
    two.generation_config(GREEDY, 10)
    assert two.assistant.generation_config.num_assistant_tokens == 2
    engine.generation_config(GREEDY, 10)
    assert engine.assistant.generation_config.num_assistant_tokens == 4


@pytest.mark.parametrize(
    "bug",
    [
        "residual-from-p",
        "residual-from-p-half",
        "bonus-off-by-one",
        "temperature-draft-only",
        "stale-q",
        "q-raw-in-verify",
    ],
)
def test_each_planted_hf_bug_changes_only_speculative_rows_and_is_removed_afterwards(target, bug):
    import transformers.generation.utils as hf_utils

    from losscheck.engines.hf import hf_assisted
    from losscheck.selftest.hf import HFPlanted

    correct = hf_assisted(target)
    buggy = HFPlanted(correct, bug, name=f"hf-{bug}")
    before = hf_utils._speculative_sampling
    args = (PROMPTS, 4, SamplingParams(temperature=0.7), 3, 12)  # T != 1: the temperature bug acts
    on, off = request(*args, True), request(*args, False)
    assert not torch.equal(correct.generate(on), buggy.generate(on))
    assert torch.equal(correct.generate(off), buggy.generate(off))
    assert hf_utils._speculative_sampling is before


def test_a_tempered_assistant_drafts_from_logits_divided_by_its_factor():
    from losscheck.core.target import load_causal_lm
    from losscheck.engines.hf import tempered

    assistant = load_causal_lm(bundled.fixtures_dir() / "drafter_a")
    ids = torch.tensor([[1, 5, 9, 3]])
    plain = assistant(ids).logits
    stressed = tempered(assistant, 2.0)(ids).logits
    assert torch.allclose(stressed, plain / 2, atol=1e-6)


@pytest.mark.parametrize(
    "request_args, message",
    [
        ({}, "--losscheck-engine=openvino needs --losscheck-assistant=DIR"),
        ({"assistant": "d", "args": {"num_assistant_tokens": 0}}, "num_assistant_tokens=0: need an int >= 1"),
        ({"assistant": "d", "args": {"enable_prefix_caching": "no"}}, "enable_prefix_caching='no': need true or false"),
        ({"assistant": "d", "speculative_config": {}}, "--losscheck-speculative-config is vLLM's"),
    ],
)
def test_the_openvino_adapter_checks_its_options_before_loading_anything(request_args, message):
    from losscheck.engines.named import ADAPTERS, EngineSpec
    from losscheck.errors import OptionError

    with pytest.raises(OptionError, match=re.escape(message)):
        ADAPTERS["openvino"].check(EngineSpec(target="t", **request_args))


def test_an_old_signature_engine_is_wrapped_with_a_warning_naming_the_new_form():
    from losscheck.engines import LegacyEngine

    seen = []

    class Old:
        name, k, precision = "old", 4, "fp32"

        def generate(self, prompts, n, params, seed, max_new_tokens, speculative):
            seen.append((prompts, n, params, seed, max_new_tokens, speculative))
            return torch.full((len(prompts), n, max_new_tokens), EOS)

    with pytest.warns(DeprecationWarning, match=r"old engine contract: write generate\(self, request: "):
        wrapped = check_engine(Old(), "--losscheck-engine='m:old'")
    assert isinstance(wrapped, LegacyEngine) and (wrapped.name, wrapped.k, wrapped.precision) == ("old", 4, "fp32")
    out = wrapped.generate(request([[0, 3]], 2, GREEDY, 11, 5, True))
    assert out.shape == (1, 2, 5) and seen == [([[0, 3]], 2, GREEDY, 11, 5, True)]  # seed and budget in place
    assert wrapped.counters() is None


def test_a_new_signature_engine_is_not_wrapped():
    import warnings

    e = engine(generate=lambda request, *, extra=None: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_engine(e, "x") is e


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"n": 0}, r"GenerationRequest.n = 0: need an int >= 1"),
        ({"seed": -1}, r"GenerationRequest.seed = -1"),
        ({"max_new_tokens": 2.5}, r"GenerationRequest.max_new_tokens = 2.5"),
        ({"prompts": [[0], []]}, r"GenerationRequest.prompts\[1\] = \[\]: need a non-empty list of ids"),
        ({"prompts": [[0, -3]]}, r"GenerationRequest.prompts\[0\] = \[0, -3\]"),
        ({"params": 1.0}, r"GenerationRequest.params is a float; pass a SamplingParams"),
        ({"speculative": 1}, r"GenerationRequest.speculative = 1: need True or False"),
    ],
)
def test_a_malformed_request_is_named_field_by_field(fields, message):
    from losscheck.engines import GenerationRequest

    good = {"prompts": [[0]], "n": 1, "params": GREEDY, "seed": 0, "max_new_tokens": 4, "speculative": True}
    with pytest.raises(OptionError, match=message):
        GenerationRequest(**{**good, **fields})


def test_a_request_is_frozen_keyword_only_and_seeds_each_row():
    from dataclasses import FrozenInstanceError

    from losscheck.core.sampling import derive_seed
    from losscheck.engines import GenerationRequest

    r = request([[0, 3], [0]], 2, GREEDY, 9, 4, False)
    assert r.prompts == ((0, 3), (0,)) and r.shape == (2, 2, 4)
    assert r.rows() == [(0, 3), (0, 3), (0,), (0,)] and r.row_seed(1, 0) == derive_seed(9, 1, 0)
    with pytest.raises(FrozenInstanceError):
        r.seed = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        GenerationRequest([[0]], 1, GREEDY, 0, 4, True)  # type: ignore[misc]  # positional: seed and budget could swap


def test_counters_give_both_acceptance_curves_and_a_cells_share():
    from losscheck.engines.counters import EngineCounters

    before = EngineCounters(drafts=10, drafted=40, accepted=20, accepted_per_position=(8, 6, 4, 2))
    after = EngineCounters(drafts=30, drafted=120, accepted=60, accepted_per_position=(24, 18, 12, 6))
    cell = after.since(before)
    assert cell == EngineCounters(drafts=20, drafted=80, accepted=40, accepted_per_position=(16, 12, 8, 4))
    assert cell.tau == 3.0 and before.plus(cell) == after
    assert cell.cumulative_acceptance() == (0.8, 0.6, 0.4, 0.2)  # at least j + 1 accepted
    assert cell.conditional_acceptance() == (0.8, 0.75, 8 / 12, 0.5)
    assert EngineCounters(drafts=4, emitted=10).tau == 2.5 and EngineCounters(drafts=0).tau is None
    assert cell.problems() == []


@pytest.mark.parametrize(
    "counters, problem",
    [
        ({"drafts": 2, "drafted": 8, "accepted": 9}, "accepted 9 > drafted 8"),
        ({"drafts": 2, "accepted": 3, "accepted_per_position": (1, 2)}, "grows with the position"),
        ({"drafts": 2, "accepted": 3, "accepted_per_position": (2, 0)}, "sums to 2, accepted is 3"),
        ({"drafts": -1}, "drafts = -1 < 0"),
    ],
)
def test_inconsistent_counters_are_an_engine_error(counters, problem):
    from losscheck.engines import engine_counters
    from losscheck.engines.counters import EngineCounters

    class Counting:
        name = "counting"

        def counters(self):
            return EngineCounters(**counters)

    with pytest.raises(EngineOutputError, match=f"engine 'counting': inconsistent counters: .*{problem}"):
        engine_counters(Counting())


def test_counters_of_the_wrong_type_are_named():
    from losscheck.engines import engine_counters

    class Counting:
        name = "counting"

        def counters(self):
            return {"drafts": 3}

    with pytest.raises(
        EngineOutputError, match="counters\\(\\) returned dict; return losscheck.engines.EngineCounters"
    ):
        engine_counters(Counting())


def test_the_spec_loop_engine_counts_what_its_loop_did(target):
    from losscheck.engines.spec_loop import spec_loop

    e = spec_loop(target)
    e.generate(request(PROMPTS, 2, SamplingParams(), 1, 10, False))
    assert e.counters().drafts == 0  # speculation off drafts nothing
    e.generate(request(PROMPTS, 2, SamplingParams(), 1, 10, True))
    c = e.counters()
    assert c.drafts > 0 and c.drafted == 4 * c.drafts and c.problems() == []
    assert 1 <= c.tau <= 5 and len(c.cumulative_acceptance()) == 4


def test_one_at_a_time_releases_the_other_instance_before_building():
    from losscheck.engines.pool import Instances, Policy

    log = []
    pool = Instances(
        lambda key: log.append(("build", key)) or key, Policy.ONE_AT_A_TIME, lambda k, v: log.append(("release", k))
    )
    pool.get(True), pool.get(True), pool.get(False)
    assert log == [("build", True), ("release", True), ("build", False)] and pool.alive() == (False,)
    keep = Instances(lambda key: key, Policy.KEEP_ALL)
    keep.get(True), keep.get(False)
    assert keep.alive() == (True, False)
    keep.discard(True)
    assert keep.alive() == (False,)


def test_an_engine_certificate_pins_the_engines_version_and_the_draft_models_hash():
    """Hugging Face assisted generation named as a user names it (`--engine hf --assistant DIR`):
    the manifest every certificate is written from names transformers' installed version, the
    assistant's content hash and the options, and the run's torch and CUDA."""
    import importlib.metadata

    from losscheck.hashing import content_hash
    from losscheck.report import manifest
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    assistant = bundled.fixtures_dir() / "drafter_a"
    found = manifest.build(Session(Options(engine="hf", assistant=str(assistant))))
    assert found.engine is not None and found.engine["name"].startswith("hf")
    assert found.engine["package"] == {"transformers": importlib.metadata.version("transformers")}
    assert found.engine["draft_model"] == {"path": "bundled:drafter_a", "sha256": content_hash(assistant)}
    assert isinstance(found.engine["options"], dict)
    assert found.environment.torch == torch.__version__ and found.environment.cuda == torch.version.cuda
