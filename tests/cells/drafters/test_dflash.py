"""DFlash checkpoints in the transformers format: the drafter drafts what transformers' own
DFlash candidate generator drafts, one block per forward, ragged rows independent of each other;
a checkpoint that cannot draft for the target is a clear error; the bundled checkpoint's loop is
exact under greedy decoding."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from losscheck import bundled
from losscheck.core.contract import DraftContext
from losscheck.core.engine import Engine
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator
from losscheck.drafters import dflash, dflash_config
from losscheck.errors import OptionError

DFLASH = bundled.fixtures_dir() / "dflash"


@pytest.fixture(scope="module")
def drafter(target):
    return dflash.from_path(DFLASH, target)


def _states(target, ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    target.reset(len(ids), ids.shape[1] + 1)
    _, states = target.forward(ids, torch.zeros(len(ids), dtype=torch.long), layers=layers)
    return states


def test_the_bundled_checkpoint_declares_its_block_and_reads_the_layers_transformers_numbers_one_up(drafter):
    config = json.loads((DFLASH / "config.json").read_text())
    assert config["model_type"] == "muse_glimmer_assistant" and dflash_config.is_dflash_dir(DFLASH)
    assert drafter.block_lengths == tuple(range(1, config["block_size"]))
    assert drafter.uses_hidden == tuple(i + 1 for i in config["target_layer_ids"])


def test_block_logits_are_those_of_transformers_dflash_candidate_generator(target, drafter, monkeypatch):
    """transformers' generator (its `DFlashCache`, its masks) and losscheck's recomputed context draft
    the same logits for the first round after a prompt."""
    from transformers import AutoModel, GenerationConfig
    from transformers.generation import candidate_generator

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = candidate_generator.DFlashTokenCandidateGenerator.get_candidates

    def record(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if logits is not None:
            seen.append((input_ids.clone(), logits.clone()))
        return ids, logits

    monkeypatch.setattr(candidate_generator.DFlashTokenCandidateGenerator, "get_candidates", record)
    assistant = AutoModel.from_pretrained(DFLASH).eval()
    prompt = torch.tensor([[0, 3, 10, 11, 12, 13]])
    config = GenerationConfig(
        max_new_tokens=12, do_sample=False, speculation_type="dflash", eos_token_id=1, pad_token_id=1
    )
    target.model.generate(
        prompt, attention_mask=torch.ones_like(prompt), generation_config=config, assistant_model=assistant
    )
    committed, reference = seen[0]  # the prompt and the target's first token
    k = drafter.block_size - 1
    mine = drafter.block_logits(
        committed, torch.tensor([committed.shape[1]]), _states(target, committed, drafter.uses_hidden), k
    )
    torch.testing.assert_close(mine, reference.float(), rtol=1e-4, atol=1e-4)


def test_ragged_rows_draft_as_each_row_alone(target, drafter):
    rows = [[0, 2, 7, 9, 11, 13, 15, 17], [0, 4, 20], [0]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    together = drafter.block_logits(ids, lengths, _states(target, ids, drafter.uses_hidden), 4)
    for b, row in enumerate(rows):
        alone = torch.tensor([row])
        single = drafter.block_logits(alone, lengths[b : b + 1], _states(target, alone, drafter.uses_hidden), 4)
        torch.testing.assert_close(together[b : b + 1], single, rtol=1e-4, atol=1e-4)


def test_slots_are_drawn_from_their_own_q_and_q_is_processed_by_the_request(target, drafter):
    ids = torch.tensor([[0, 3, 10, 11, 12]])
    hidden = _states(target, ids, drafter.uses_hidden)
    params = SamplingParams(temperature=0.7, top_k=5)
    ctx = DraftContext(ids, torch.tensor([5]), hidden, 4, None, params, torch.Generator().manual_seed(0))
    proposal = drafter.propose(ctx)
    assert proposal.probs is not None and proposal.tokens.shape == (1, 4)
    assert ((proposal.probs > 0).sum(-1) <= 5).all()  # top-k 5 of each slot
    drafted = proposal.probs[0].gather(-1, proposal.tokens[0][:, None])
    assert (drafted > 0).all()


def test_the_bundled_checkpoint_is_exact_under_greedy_and_accepts_drafts(target, drafter):
    prompts = [[0, 2, 5, 6], [0, 3, 20, 21, 22], [0, 4, 9]]
    out = Engine(target, drafter, 8).generate(prompts, 32, GREEDY, make_generator(1, "dflash"))
    plain = Engine(target, None, 1).generate(prompts, 32, GREEDY, make_generator(1, "plain"))
    assert torch.equal(out.tokens, plain.tokens)
    assert out.stats.acceptance_length > 2.0  # BUILD.json: 3.97 at k 8 over the bundled prompts


@pytest.mark.parametrize(
    "edit, problem",
    [
        (
            {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
            "hidden_size 64",
        ),
        ({"target_layer_ids": [0, 4]}, "target_layer_ids"),
        ({"block_size": 1}, "block_size 1"),
        ({"mask_token_id": 64}, "mask_token_id 64"),
    ],
)
def test_a_checkpoint_that_cannot_draft_for_the_target_is_a_clear_error(tmp_path, target, edit, problem):
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(DFLASH)
    for key, value in edit.items():
        setattr(config, key, value)
    AutoModel.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(OptionError, match=problem):
        dflash.from_path(tmp_path, target)


def test_a_directory_without_a_dflash_config_or_weights_is_named(tmp_path, target):
    with pytest.raises(OptionError, match="model_type"):
        dflash.from_path(tmp_path, target)
    shutil.copy(DFLASH / "config.json", tmp_path / "config.json")
    with pytest.raises(OptionError, match="safetensors"):
        dflash.from_path(tmp_path, target)


def test_the_command_line_takes_a_dflash_checkpoint_as_drafter_and_as_hf_assistant_checked_before_loading(tmp_path):
    from losscheck.run.loading import check_options
    from losscheck.run.options import Options

    check_options(Options(drafter=str(DFLASH)))
    check_options(Options(engine="hf", assistant=str(DFLASH)))
    config = json.loads((DFLASH / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"target_layer_ids": [0, 7]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(OptionError, match=r"--losscheck-drafter=.*target_layer_ids \[0, 7\]"):
        check_options(Options(drafter=str(tmp_path)))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(OptionError, match=r"--losscheck-assistant=.*no \*\.safetensors"):
        check_options(Options(engine="hf", assistant=str(tmp_path)))
