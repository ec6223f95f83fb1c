"""The bundled fixtures load offline, say what fixtures/README.md says, and behave like the
languages they were trained on; the generator they come from is reproducible."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from tests.support import ROOT

FIXTURES = ROOT / "fixtures"

# name -> (vocab, hidden, layers, heads, kv heads, intermediate, max positions)
MODELS = {
    "target": (64, 128, 4, 4, 2, 256, 256),
    "drafter_a": (64, 48, 1, 4, 2, 96, 256),
    "small_target": (8, 32, 2, 2, 1, 64, 64),
    "small_drafter_a": (8, 16, 1, 2, 1, 32, 64),
}


def _module(filename: str) -> ModuleType:
    """Load fixtures/<filename> under a private name (``build`` is also a PyPI package);
    build.py imports its sibling ``synthetic``, so fixtures/ is on sys.path meanwhile."""
    spec = importlib.util.spec_from_file_location(f"_fixtures_{filename[:-3]}", FIXTURES / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    sys.path.insert(0, str(FIXTURES))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(FIXTURES))
    return module


@pytest.fixture(scope="module")
def syn() -> ModuleType:
    return _module("synthetic.py")


@functools.cache  # the tests only read the models
def load(name: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, local_files_only=True)
    return model.eval()


def prompts(name: str) -> dict:
    return json.loads((FIXTURES / "prompts" / f"{name}.json").read_text())


@pytest.mark.parametrize("name", MODELS)
def test_model_loads_offline_with_documented_shape(name: str) -> None:
    vocab, hidden, layers, heads, kv, inter, max_pos = MODELS[name]
    model = load(name)
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (vocab, hidden, layers)
    assert (c.num_attention_heads, c.num_key_value_heads) == (heads, kv)
    assert (c.intermediate_size, c.max_position_embeddings) == (inter, max_pos)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (0, 1, 0)
    assert not c.tie_word_embeddings
    files = {p.name for p in (FIXTURES / name).iterdir()}
    assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt")) for f in files)
    build = json.loads((FIXTURES / name / "BUILD.json").read_text())
    assert build["parameters"] == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[0]])).logits
    assert logits.shape == (1, 1, vocab) and torch.isfinite(logits).all()


def steady_entropy(model, prompt_set: list[list[int]], start: int) -> float:
    """Mean next-token entropy (nats), teacher-forced on the prompts, at predictions whose context
    holds at least ``start + 1`` tokens (BOS, tier token, two content tokens for start=3)."""
    ents = []
    with torch.no_grad():
        for p in prompt_set:
            if len(p) <= start:
                continue
            logp = torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0], -1)
            ents.append(-(logp.exp() * logp).sum(-1)[start:])
    return torch.cat(ents).mean().item()


def test_target_entropy_follows_the_tiers() -> None:
    target = load("target")
    h = {t: steady_entropy(target, prompts(t)["prompts"], 3) for t in ("low", "mid", "high")}
    # the language's own floors are 0.11 / 0.96 / 2.35 nats (fixtures/README.md)
    assert h["low"] < 0.4 < h["mid"] - 0.3 and h["mid"] + 0.8 < h["high"], h


def test_small_target_is_moderately_spread() -> None:
    h = steady_entropy(load("small_target"), prompts("small")["prompts"], 1)
    assert 0.5 < h < 1.5, h


def test_drafter_agrees_more_where_the_target_is_sure() -> None:
    target, drafter = load("target"), load("drafter_a")
    agree = {}
    with torch.no_grad():
        for tier in ("low", "high"):
            hits = []
            for p in prompts(tier)["prompts"]:
                if len(p) > 3:
                    x = torch.tensor([p])
                    t, d = target(input_ids=x).logits, drafter(input_ids=x).logits
                    same = t.argmax(-1) == d.argmax(-1)
                    hits.append(same[0, 3:].float())
            agree[tier] = torch.cat(hits).mean().item()
    assert agree["high"] + 0.1 < agree["low"] and agree["high"] > 2 / 64, agree


@pytest.mark.parametrize("tier", ["low", "mid", "high"])
def test_tier_prompts_are_well_formed(tier: str, syn) -> None:
    data = prompts(tier)
    assert data["tier"] == tier and len(data["prompts"]) == 16
    lengths = [len(p) for p in data["prompts"]]
    assert min(lengths) == 1 and max(lengths) <= 24 and len(set(lengths)) > 8
    for p in data["prompts"]:
        assert p[0] == syn.BOS and p[1:2] in ([], [syn.TIER_TOKENS[tier]])
        assert all(syn.FIRST_CONTENT <= t < syn.VOCAB_SIZE for t in p[2:])


def test_small_prompts_are_well_formed(syn) -> None:
    data = prompts("small")
    lengths = [len(p) for p in data["prompts"]]
    assert len(lengths) == 8 and min(lengths) == 1 and max(lengths) <= 6
    for p in data["prompts"]:
        assert p[0] == syn.BOS and all(syn.SMALL_FIRST_CONTENT <= t < 8 for t in p[1:])


def test_committed_prompts_rebuild_identically(tmp_path: Path) -> None:
    _module("build.py").build_prompts(tmp_path)
    for name in ("low", "mid", "high", "small"):
        rebuilt = (tmp_path / f"{name}.json").read_text()
        assert rebuilt == (FIXTURES / "prompts" / f"{name}.json").read_text(), name


def test_generator_is_reproducible(syn) -> None:
    lang = syn.TieredLanguage()
    assert np.array_equal(lang.high_table, syn.TieredLanguage().high_table)
    tiers = ["low", "mid", "high", "mid"]
    a = lang.documents(tiers, np.random.default_rng(7))
    b = lang.documents(tiers, np.random.default_rng(7))
    c = lang.documents(tiers, np.random.default_rng(8))
    assert all(np.array_equal(x, y) for x, y in zip(a.tokens, b.tokens))
    assert not all(np.array_equal(x[:20], y[:20]) for x, y in zip(a.tokens, c.tokens))
    small = syn.SmallLanguage()
    s1 = small.documents(5, np.random.default_rng(7))
    s2 = small.documents(5, np.random.default_rng(7))
    assert all(np.array_equal(x, y) for x, y in zip(s1.tokens, s2.tokens))


def test_documents_have_the_documented_shape(syn) -> None:
    lang = syn.TieredLanguage()
    docs = lang.documents(["low", "mid", "high"] * 4, np.random.default_rng(0))
    for tier, doc in zip(["low", "mid", "high"] * 4, docs.tokens):
        assert doc[0] == syn.BOS and doc[1] == syn.TIER_TOKENS[tier] and doc[-1] == syn.EOS
        assert 100 <= len(doc) - 3 <= 200
        assert ((doc[2:-1] >= syn.FIRST_CONTENT) & (doc[2:-1] < syn.VOCAB_SIZE)).all()
    # a low document is a progression with rare off-by-one slips
    low = docs.tokens[0][2:-1] - syn.FIRST_CONTENT
    steps = np.diff(low) % syn.N_CONTENT
    assert np.mean(steps == np.bincount(steps).argmax()) > 0.9
