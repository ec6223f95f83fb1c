"""The drafter an engine runs, as losscheck teacher-forces it (`losscheck.engines.draft_model`):
what each adapter gives, how its q is formed, and the errors for a drafter that does not fit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from losscheck import bundled
from losscheck.cells.engine.rounds import draft_params, not_judged
from losscheck.core.sampling import SamplingParams
from losscheck.engines import DraftModel, draft_model
from losscheck.engines.vllm import VLLMEngine
from losscheck.errors import OptionError

VOCAB = 64  # the bundled target's


def vllm(**config: object) -> VLLMEngine:
    spec = {"num_speculative_tokens": 4, **config}
    return VLLMEngine(lambda spec: pytest.fail("no LLM is built to read the draft model"), spec, 0, "fp32", vocab=VOCAB)


def test_vllm_gives_its_draft_model_with_the_law_of_its_draft_sample_method(monkeypatch):
    loaded = []
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB), forward=lambda *a: None)
    monkeypatch.setattr("losscheck.core.target.load_causal_lm", lambda path: loaded.append(path) or model)
    where = str(bundled.fixtures_dir() / "drafter_a32")
    greedy = draft_model(vllm(method="draft_model", model=where), VOCAB)
    assert greedy == DraftModel(model, "greedy") and loaded == [where]
    sampled = draft_model(vllm(method="draft_model", model=where, draft_sample_method="probabilistic"), VOCAB)
    assert sampled is not None and sampled.law == "temperature"


@pytest.mark.parametrize(
    "config",
    [
        {"method": "ngram", "prompt_lookup_max": 3},
        {"method": "eagle3", "model": str(bundled.fixtures_dir() / "speculators_eagle3")},
        {"method": "draft_model", "model": "org/a-hub-name"},
    ],
)
def test_vllm_gives_none_where_its_drafter_lives_inside_it(config):
    assert draft_model(vllm(**config), VOCAB) is None


def test_a_bare_model_is_read_as_drafting_from_its_processed_logits():
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB), forward=lambda *a: None)
    engine = SimpleNamespace(name="e", draft_model=lambda: model)
    assert draft_model(engine, VOCAB) == DraftModel(model, "processed")
    assert draft_model(SimpleNamespace(name="none", draft_model=lambda: None), VOCAB) is None
    assert draft_model(SimpleNamespace(name="gives nothing"), VOCAB) is None


def test_a_drafter_that_does_not_fit_is_a_usage_error_naming_both_sides():
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=100), forward=lambda *a: None)
    with pytest.raises(OptionError, match="engine 'e': its draft model has a vocabulary of 100 tokens, the target 64"):
        draft_model(SimpleNamespace(name="e", draft_model=lambda: model), VOCAB)
    with pytest.raises(OptionError, match="engine 'e': draft_model\\(\\) returned str; return a Hugging Face causal"):
        draft_model(SimpleNamespace(name="e", draft_model=lambda: "drafter"), VOCAB)
    fits = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB), forward=lambda *a: None)
    with pytest.raises(OptionError, match="draft law 'top_k'; use 'processed', 'temperature' or 'greedy'"):
        draft_model(SimpleNamespace(name="e", draft_model=lambda: DraftModel(fits, "top_k")), VOCAB)  # type: ignore[arg-type]


def test_each_law_processes_the_draft_logits_with_what_the_engine_reads():
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.9, repetition_penalty=1.5)
    assert draft_params(params, "processed") == params
    assert draft_params(params, "temperature") == SamplingParams(temperature=0.7)
    assert draft_params(params, "greedy") == SamplingParams(temperature=1.0)  # the argmax is taken after


def test_a_cell_names_the_verifier_classes_its_draft_law_leaves_without_power():
    assert (
        set(not_judged("processed"))
        == set(not_judged("temperature"))
        == {
            "stale_q",
            "drafter_misreports_one_id",
            "draft_noise_reused",
        }
    )
    assert "point mass" in not_judged("greedy")["top_p_one_side"] and "residual_is_p" not in not_judged("greedy")
    assert "teacher-force" in not_judged(None)["residual_is_p"]


@pytest.mark.parametrize("law", ["processed", "temperature", "greedy", None])
def test_every_catalogue_class_is_judged_in_an_engine_cell_or_named_with_why_not(law):
    """One account per class: judged from the target's p alone, judged through the draft model's
    rounds, or in `classes_not_judged` with a reason — never silently missing, never both."""
    from losscheck.stats import buglaws, hidden_rounds

    not_said = not_judged(law)
    judged = {bug.name for bug in buglaws.TARGET_SIDE}
    if law is not None:
        judged |= {c.name for c in hidden_rounds.CLASSES} - set(not_said)
    catalogue = {bug.name for bug in buglaws.CATALOGUE}
    assert catalogue <= judged | set(not_said), catalogue - judged - set(not_said)
    assert not judged & set(not_said), judged & set(not_said)
    assert all(why.strip() for why in not_said.values())
