"""Speculators-format checkpoints: the config read natively, checked against the target, the
EAGLE-3 / P-EAGLE forward consistent across its cache and rollback, the sub-vocabulary, the
format's lossy acceptance switch — and the contract pieces they brought (named layers, vocab_map)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from losscheck import bundled
from losscheck.core.contract import DraftContext, Proposal, hidden_layers, validate_proposal
from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.core.target import HFTarget
from losscheck.drafters import speculators
from losscheck.drafters.speculators_config import read_config
from losscheck.errors import DrafterOutputError, LosscheckError, OptionError

FIXTURES = bundled.fixtures_dir()
EAGLE3, PEAGLE, ACCEPT_K2 = (
    FIXTURES / d for d in ("speculators_eagle3", "speculators_peagle", "speculators_eagle3_accept_k2")
)


# ---- contract: a draft vocabulary mapped into the target's ----------------------------------------


def test_vocab_map_spreads_q_onto_the_target_vocabulary_with_zeros_elsewhere():
    vocab_map = torch.tensor([2, 5, 7])
    probs = torch.tensor([[[0.2, 0.5, 0.3]]])  # [1, 1, 3]
    out = validate_proposal(Proposal(torch.tensor([[5]]), probs, vocab_map), "d", 1, 1, 8)
    assert out.probs is not None and out.vocab_map is None
    assert out.probs[0, 0].tolist() == pytest.approx([0, 0, 0.2, 0, 0, 0.5, 0, 0.3])


@pytest.mark.parametrize(
    "vocab_map, tokens, problem",
    [
        (torch.tensor([2, 2, 7]), [[2]], "same target id"),
        (torch.tensor([2, 5, 8]), [[2]], "target's vocabulary"),
        (torch.tensor([2, 5]), [[2]], "draft vocabulary"),
        (torch.tensor([2.0, 5.0, 7.0]), [[2]], "integer tensor"),
        (torch.tensor([2, 5, 7]), [[3]], "zero probability"),  # a drafted id the map does not reach
    ],
)
def test_bad_vocab_maps_are_named(vocab_map, tokens, problem):
    probs = torch.full((1, 1, 3), 1 / 3)
    with pytest.raises(DrafterOutputError, match=problem):
        validate_proposal(Proposal(torch.tensor(tokens), probs, vocab_map), "d", 1, 1, 8)


# ---- contract: named target layers ----------------------------------------------------------------


def test_named_layers_are_huggingface_hidden_states_concatenated(target):
    ids = torch.tensor([[0, 2, 9, 10, 11]])
    target.reset(1, 8)
    _, states = target.forward(ids, torch.zeros(1, dtype=torch.long), layers=(1, 4))
    with torch.no_grad():
        reference = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert states.shape == (1, 5, 2 * target.hidden_size)
    torch.testing.assert_close(states, torch.cat([reference[1], reference[4]], -1), rtol=1e-5, atol=1e-5)


def test_uses_hidden_true_is_the_last_layer_and_bad_ids_are_refused(target):
    class Asks:
        name = "asks"
        uses_hidden: object = True

    drafter = Asks()
    assert hidden_layers(drafter, target) == (target.num_layers,)
    drafter.uses_hidden = (0, 2)
    assert hidden_layers(drafter, target) == (0, 2)
    for bad in ((5,), (1, 1), ()):
        drafter.uses_hidden = bad
        with pytest.raises(LosscheckError, match="layer ids 0..4"):
            hidden_layers(drafter, target)


# ---- the checkpoint format --------------------------------------------------------------------------


def test_fixture_configs_read_as_published():
    eagle3, peagle = read_config(EAGLE3), read_config(PEAGLE)
    assert (eagle3.model_type, eagle3.draft_vocab_size, eagle3.target_vocab_size) == ("eagle3", 48, 64)
    assert eagle3.aux_layers == (1, 2, 3) and eagle3.proposal.speculative_tokens == 8
    assert not eagle3.proposal.relaxed and peagle.mask_token_id is not None
    relaxed = read_config(ACCEPT_K2).proposal
    assert relaxed.relaxed and relaxed.verifier_accept_k == 2


def _edited(tmp_path: Path, edit, source: Path = EAGLE3) -> Path:
    """A copy of the checkpoint `source` with `edit(config)` applied to its config.json."""
    out = tmp_path / "ckpt"
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda c: c.pop("speculators_config"), "no speculators_config"),
        (lambda c: c.update(speculators_model_type="medusa"), "not supported"),
        (lambda c: c.update(speculators_model_type="mtp"), "'mtp', which losscheck recognises but"),
        (lambda c: c["transformer_layer_config"].update(vocab_size=128), "vocabulary 128 tokens, the target has 64"),
        (lambda c: c["transformer_layer_config"].update(hidden_size=64), "hidden size 64"),
        (lambda c: c["speculators_config"]["verifier"].update(architectures=["Qwen3ForCausalLM"]), "Qwen3ForCausalLM"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 9]), "layer ids are 0..4"),
        (lambda c: c["speculators_config"].update(default_proposal_method="tree"), "not among proposal_methods"),
    ],
)
def test_a_mismatched_or_foreign_checkpoint_is_a_clear_error(tmp_path, target, edit, problem):
    with pytest.raises(OptionError, match=problem):
        speculators.from_path(_edited(tmp_path, edit), target)


def test_missing_embedding_comes_from_the_target_and_a_missing_weight_is_named(tmp_path, target):
    from safetensors.torch import load_file, save_file

    out = _edited(tmp_path, lambda c: None)
    state = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k != "embed_tokens.weight"}, str(out / "model.safetensors"))
    drafter = speculators.from_path(out, target)
    torch.testing.assert_close(drafter.net.embed_tokens.weight, target.model.get_input_embeddings().weight)
    save_file({k: v for k, v in state.items() if k != "fc.weight"}, str(out / "model.safetensors"))
    with pytest.raises(OptionError, match="missing weights \\['fc.weight'\\]"):
        speculators.from_path(out, target)


# ---- the forward: incremental == from scratch; parallel slots independent -------------------------

PROMPTS = [[0, 2, 9, 10, 11, 12], [0], [0, 4, 30, 17]]


def _context(
    target: HFTarget, drafter, tokens: torch.Tensor, lengths: torch.Tensor, k: int, params=GREEDY
) -> DraftContext:
    """What the engine hands the drafter: committed tokens and the target's named-layer states."""
    target.reset(tokens.shape[0], tokens.shape[1] + k + 1)
    _, hidden = target.forward(tokens, torch.zeros_like(lengths), layers=drafter.uses_hidden)
    return DraftContext(tokens, lengths, hidden.float(), k, None, params, torch.Generator().manual_seed(0))


def _padded(rows: list[list[int]], capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(len(rows), capacity, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    return tokens, torch.tensor([len(r) for r in rows])


@pytest.mark.parametrize("fixture", [EAGLE3, PEAGLE])
def test_drafts_after_a_rollback_equal_a_fresh_drafters(target, fixture):
    """Round 1 drafts, keeps one draft per row (plus a correction token); round 2 must draft
    exactly what a drafter that never saw round 1 drafts from the same committed tokens: the
    entries built on rejected drafts were rebuilt, not reused."""
    drafter, fresh = speculators.from_path(fixture, target), speculators.from_path(fixture, target)
    k, capacity, params = 4, 24, SamplingParams(temperature=1.0)
    tokens, lengths = _padded(PROMPTS, capacity)
    drafter.reset(len(PROMPTS), capacity + k + 1)
    first = drafter.propose(_context(target, drafter, tokens, lengths, k, params))
    grown = [row + [int(first.tokens[i, 0]), 7] for i, row in enumerate(PROMPTS)]  # 1 kept + a correction
    drafter.commit(torch.ones(len(PROMPTS), dtype=torch.long))
    tokens, lengths = _padded(grown, capacity)
    again = drafter.propose(_context(target, drafter, tokens, lengths, k, params))
    fresh.reset(len(PROMPTS), capacity + k + 1)
    scratch = fresh.propose(_context(target, fresh, tokens, lengths, k, params))
    assert torch.equal(again.tokens, scratch.tokens)  # the same seed draws the same tokens from the same q
    torch.testing.assert_close(again.probs, scratch.probs, rtol=1e-5, atol=1e-6)


def test_peagle_slots_do_not_see_each_others_drafts(target):
    """P-EAGLE's placeholders read no drafted token: sampled and greedy blocks share the slots'
    distributions, so each slot's q does not depend on the tokens drawn before it."""
    drafter = speculators.from_path(PEAGLE, target)
    tokens, lengths = _padded(PROMPTS, 24)
    qs = []
    for seed in (1, 2):
        drafter.reset(len(PROMPTS), 30)
        ctx = _context(target, drafter, tokens, lengths, 4, SamplingParams(temperature=1.0))
        ctx = DraftContext(
            ctx.tokens, ctx.lengths, ctx.hidden, 4, None, ctx.params, torch.Generator().manual_seed(seed)
        )
        qs.append(drafter.propose(ctx))
    assert not torch.equal(qs[0].tokens, qs[1].tokens)
    torch.testing.assert_close(qs[0].probs, qs[1].probs)


def test_eagle3_drafts_only_draft_vocabulary_tokens_and_reports_q_over_it(target):
    drafter = speculators.from_path(EAGLE3, target)
    tokens, lengths = _padded(PROMPTS, 24)
    drafter.reset(len(PROMPTS), 30)
    proposal = drafter.propose(_context(target, drafter, tokens, lengths, 4, SamplingParams(temperature=1.0)))
    assert proposal.probs is not None and proposal.probs.shape == (3, 4, 48) and proposal.vocab_map is not None
    assert bool(torch.isin(proposal.tokens, proposal.vocab_map).all())
    spread = validate_proposal(proposal, drafter.name, 3, 4, 64)
    outside = torch.ones(64, dtype=torch.bool)
    outside[proposal.vocab_map] = False
    assert spread.probs is not None and float(spread.probs[..., outside].abs().max()) == 0.0


# ---- the format's lossy switch ----------------------------------------------------------------------


def test_top_k_acceptance_keeps_a_second_best_draft_within_the_tolerance():
    from losscheck.drafters.speculators_config import GreedyProposal

    logits = torch.tensor([[[3.0, 2.0, -5.0], [0.0, 0.0, 0.0]]])  # [1, k+1=2, V=3]
    lenient = speculators.top_k_acceptance(GreedyProposal(4, verifier_accept_k=2, accept_tolerance=5.0))
    strict = speculators.top_k_acceptance(GreedyProposal(4, verifier_accept_k=2, accept_tolerance=0.5))
    assert int(lenient(logits, torch.tensor([[1]]), None, GREEDY, torch.Generator()).accepted) == 1
    assert int(strict(logits, torch.tensor([[1]]), None, GREEDY, torch.Generator()).accepted) == 0
    assert int(lenient(logits, torch.tensor([[2]]), None, GREEDY, torch.Generator()).accepted) == 0  # not top-2


def test_verifier_accept_k_2_fails_the_greedy_gate_naming_the_setting():
    from losscheck.cells.greedy import run_greedy
    from losscheck.plan.matrix import Cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    session = Session(Options(drafter=f"speculators:{ACCEPT_K2}"))
    outcome = run_greedy(CellContext.of(session, Cell("user", 4, GREEDY)))
    assert not outcome.passed
    assert "verifier_accept_k=2" in outcome.message() and outcome.divergences
