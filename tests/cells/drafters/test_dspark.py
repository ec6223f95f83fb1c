"""Speculators-format DSpark and DFlash checkpoints: the config's block fields read and checked,
the drafter's forward as the library trains it (every anchor of a sequence in one pass), ragged
rows independent, the Markov head making each slot's q depend on the draft before it, vLLM's
top-k truncation, the DFlash layout, the bundled checkpoint exact under greedy decoding — and a
drafter that samples with the Markov bias but reports q without it (the shape of transformers
#47932) failing its sampled cell."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from losscheck import bundled
from losscheck.core.contract import DraftContext
from losscheck.core.engine import Engine
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator, process_logits
from losscheck.drafters import speculators
from losscheck.drafters.dspark import BlockSpeculatorsDrafter
from losscheck.drafters.speculators_config import read_config
from losscheck.drafters.speculators_parts import draw
from losscheck.errors import OptionError
from tests.cells.drafters.test_speculators import _edited as edited_copy

DSPARK, DFLASH = (bundled.fixtures_dir() / d for d in ("speculators_dspark", "speculators_dflash"))
ROWS = [[0, 2, 7, 9, 11, 13, 15, 17], [0, 4, 20], [0, 3, 10, 11, 12]]


@pytest.fixture(scope="module")
def drafter(target) -> BlockSpeculatorsDrafter:
    found = speculators.from_path(DSPARK, target)
    assert isinstance(found, BlockSpeculatorsDrafter)
    return found


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows]), torch.tensor([len(r) for r in rows])


def _context(target, drafter, rows, k: int, params=GREEDY, seed: int = 0, width=None) -> DraftContext:
    tokens, lengths = _padded(rows)
    target.reset(len(rows), tokens.shape[1] + 1)
    _, hidden = target.forward(tokens, torch.zeros_like(lengths), layers=drafter.uses_hidden)
    return DraftContext(tokens, lengths, hidden.float(), k, width, params, torch.Generator().manual_seed(seed))


# ---- the format ------------------------------------------------------------------------------------


def test_the_bundled_checkpoint_reads_as_dspark_with_its_heads(drafter):
    cfg = read_config(DSPARK)
    assert cfg.model_type == "dspark" and cfg.block is not None
    assert (cfg.block.block_size, cfg.block.sample_from_anchor, cfg.block.markov_rank) == (8, True, 16)
    assert (cfg.draft_vocab_size, cfg.target_vocab_size, cfg.aux_layers) == (48, 64, (1, 2, 3))
    assert drafter.block_lengths == tuple(range(1, 9))  # sampling from the anchor: block_size drafts
    assert drafter.widths == (None, 8) and drafter.identity["block"]["markov_head_type"] == "vanilla"


def _edited(tmp_path: Path, edit) -> Path:
    return edited_copy(tmp_path, edit, DSPARK)


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda c: c.update(markov_head_type="lstm"), "markov_head_type 'lstm'"),
        (lambda c: c.update(sample_from_anchor=False, block_size=1), "block_size 1 leaves no draft slot"),
        (lambda c: c.update(dspark_draft_topk=0), "dspark_draft_topk 0"),
        (lambda c: c.update(dspark_draft_topk=49), "1..48"),
        (lambda c: c.update(markov_rank=0), "confidence_head_with_markov needs a Markov head"),
        (lambda c: c.update(block_size="8"), "block_size is '8'"),
        (lambda c: c.update(sample_from_anchor="false"), "sample_from_anchor is 'false'; it must be true or false"),
        (lambda c: c.pop("mask_token_id"), "needs an integer mask_token_id"),
        (lambda c: c.update(mask_token_id=64), "mask_token_id 64 is not an id"),
        (lambda c: c.pop("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids is None"),
        (lambda c: c.update(markov_rank=8), "markov_head.markov_w1.weight has shape"),
        (lambda c: c.update(speculators_model_type="mtp"), "speculators_model_type 'mtp', which losscheck recognises"),
    ],
)
def test_a_checkpoint_that_cannot_draft_for_the_target_is_a_clear_error(tmp_path, target, edit, problem):
    with pytest.raises(OptionError, match=problem):
        speculators.from_path(_edited(tmp_path, edit), target)


# ---- the forward -----------------------------------------------------------------------------------


def test_one_round_drafts_what_the_training_layout_computes_for_that_anchor(target, drafter):
    """The library trains every anchor of a sequence in one pass (each block reads the states
    before its anchor); the drafter's round at each prefix must give that anchor's block states."""
    net = drafter.net
    row = ROWS[0]
    ids = torch.tensor([row])
    target.reset(1, len(row) + 1)
    _, feats = target.forward(ids, torch.zeros(1, dtype=torch.long), layers=drafter.uses_hidden)
    block = 4
    anchors = torch.arange(1, len(row))
    owner, depth = anchors.repeat_interleave(block), torch.arange(block).repeat(len(anchors))
    allowed = torch.cat([torch.arange(len(row))[None] < owner[:, None], owner[:, None] == owner[None]], 1)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    with torch.inference_mode():
        x = net.embed_tokens(torch.where(depth == 0, ids[:, owner], drafter.mask_token_id))
        ctx = net.hidden_norm(net.fc(feats))
        cos, sin = net.rotary_emb(x, torch.cat([torch.arange(len(row)), owner + depth])[None])
        for layer in net.layers:
            x = layer(x, ctx, cos, sin, mask)
        trained = net.norm(x).view(len(anchors), block, -1)
    for i, a in enumerate(anchors.tolist()):  # the round whose anchor is token a: a + 1 committed tokens
        round_ = drafter.backbone(ids[:, : a + 1], torch.tensor([a + 1]), feats[:, : a + 1], block)
        torch.testing.assert_close(round_[0], trained[i], rtol=1e-4, atol=1e-4)


def test_ragged_rows_draft_as_each_row_alone(target, drafter):
    together = _context(target, drafter, ROWS, 4, SamplingParams(temperature=1.0))
    proposal = drafter.propose(together)
    for b, row in enumerate(ROWS):
        single = drafter.backbone(*_padded([row]), _context(target, drafter, [row], 4).hidden, 4)
        batched = drafter.backbone(together.tokens, together.lengths, together.hidden, 4)[b : b + 1]
        torch.testing.assert_close(batched, single, rtol=1e-4, atol=1e-4)
    assert proposal.probs is not None and proposal.probs.shape == (3, 4, 48) and proposal.vocab_map is not None


def test_each_slots_q_carries_the_markov_bias_of_the_draft_before_it(target, drafter):
    """Two seeds that draw different first drafts get different second-slot q's (P-EAGLE and DFlash
    would not), and each q is softmax(base + markov_w2(markov_w1[previous token])) as drawn."""
    params = SamplingParams(temperature=1.0)
    proposals = [drafter.propose(_context(target, drafter, ROWS[:1] * 64, 3, params, seed)) for seed in (1, 2)]
    first = torch.cat([p.tokens[:, 0] for p in proposals])
    q1 = torch.cat([p.probs[:, 1] for p in proposals])  # [128, V_d]
    differ = first != first[0]
    assert differ.any() and not torch.allclose(q1[differ], q1[~differ][:1].expand(int(differ.sum()), -1))
    ctx = _context(target, drafter, ROWS[:1], 3, params)
    states = drafter.backbone(ctx.tokens, ctx.lengths, ctx.hidden, 3)
    head = drafter.net.markov_head
    with torch.inference_mode():
        base = drafter.net.lm_head(states[0, 1]).float()
        for b in range(len(first)):
            expected = torch.softmax(base + head.markov_w2(head.markov_w1(first[b])), -1)
            torch.testing.assert_close(q1[b], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_the_gated_and_rnn_heads_draw_what_the_librarys_block_formula_gives_their_drafts(tmp_path, target, kind):
    """A checkpoint with the `gated` or `rnn` head (the bundled weights, the new head's own at
    random): each slot's q is softmax(base + bias) with the bias computed over the whole block as
    the library trains it, from the drafts as the previous tokens."""
    from safetensors.torch import load_file, save_file

    out = _edited(tmp_path, lambda c: c.update(markov_head_type=kind))
    state = load_file(str(out / "model.safetensors"))
    torch.manual_seed(0)
    extra = {
        "gated": {"markov_head.gate_proj.weight": (16, 128 + 16), "markov_head.gate_proj.bias": (16,)},
        "rnn": {"markov_head.joint_proj.weight": (48, 32 + 128), "markov_head.joint_proj.bias": (48,)},
    }[kind]
    save_file({**state, **{k: torch.randn(shape) for k, shape in extra.items()}}, str(out / "model.safetensors"))
    drafter = speculators.from_path(out, target)
    ctx = _context(target, drafter, ROWS, 4, SamplingParams(temperature=1.0), seed=3)
    proposal = drafter.propose(ctx)
    head = drafter.net.markov_head
    with torch.inference_mode():
        states = drafter.backbone(ctx.tokens, ctx.lengths, ctx.hidden, 4)  # [B, k, H]
        anchor = ctx.tokens[torch.arange(3), ctx.lengths - 1]
        prev = torch.cat([anchor[:, None], proposal.tokens[:, :-1]], 1)  # [B, k] the token before each draft
        e = head.markov_w1(prev)  # [B, k, r]
        if kind == "gated":
            bias = head.markov_w2(torch.sigmoid(head.gate_proj(torch.cat([states, e], -1))) * e)
        else:
            state, outs = e.new_zeros(3, 16), []
            for j in range(4):
                gate, cand, o = head.joint_proj(torch.cat([state, e[:, j], states[:, j]], -1)).chunk(3, -1)
                state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
                outs.append(head.markov_w2(torch.tanh(o)))
            bias = torch.stack(outs, 1)
        expected = torch.softmax(drafter.net.lm_head(states).float() + bias.float(), -1)
    torch.testing.assert_close(proposal.probs, expected, rtol=1e-4, atol=1e-6)


def test_a_truncation_width_keeps_the_backbones_top_w_and_biases_only_those(target, drafter):
    params = SamplingParams(temperature=1.0)
    full = drafter.propose(_context(target, drafter, ROWS, 4, params))
    cut = drafter.propose(_context(target, drafter, ROWS, 4, params, width=8))
    assert cut.probs is not None and full.probs is not None
    assert ((cut.probs > 0).sum(-1) <= 8).all() and ((full.probs > 0).sum(-1) > 8).all()
    ctx = _context(target, drafter, ROWS, 4)
    with torch.inference_mode():
        base = drafter.net.lm_head(drafter.backbone(ctx.tokens, ctx.lengths, ctx.hidden, 4)).float()
    top = base.topk(8, -1).indices  # [B, k, 8]
    assert bool((cut.probs.gather(-1, top).sum(-1) - 1).abs().max() < 1e-5)  # all of q on the top 8


def test_the_speculators_dflash_checkpoint_has_no_heads_and_drafts_block_size_minus_one(target):
    """The bundled speculators DFlash checkpoint (the same backbone, DFlash's layout): the anchor is
    not a prediction slot, its slots are drawn independently, and its greedy loop is exact."""
    dflash = speculators.from_path(DFLASH, target)
    assert isinstance(dflash, BlockSpeculatorsDrafter) and dflash.net.markov_head is None
    assert dflash.block_lengths == tuple(range(1, 9)) and dflash.widths == ()  # block 9
    params = SamplingParams(temperature=1.0)
    first, second = (dflash.propose(_context(target, dflash, ROWS[:1] * 32, 3, params, seed)) for seed in (1, 2))
    assert not torch.equal(first.tokens, second.tokens)
    torch.testing.assert_close(first.probs, second.probs)  # q does not read the drafts before it
    prompts = [[0, 2, 5, 6], [0, 3, 20, 21, 22]]
    out = Engine(target, dflash, 8).generate(prompts, 24, GREEDY, make_generator(1, "dflash"))
    assert torch.equal(out.tokens, Engine(target, None, 1).generate(prompts, 24, GREEDY, make_generator(1, "p")).tokens)
    assert out.stats.acceptance_length > 2.0


def test_the_bundled_checkpoint_is_exact_under_greedy_and_accepts_drafts(target, drafter):
    prompts = [[0, 2, 5, 6], [0, 3, 20, 21, 22], [0, 4, 9]]
    out = Engine(target, drafter, 8).generate(prompts, 32, GREEDY, make_generator(1, "dspark"))
    plain = Engine(target, None, 1).generate(prompts, 32, GREEDY, make_generator(1, "plain"))
    assert torch.equal(out.tokens, plain.tokens)
    assert out.stats.acceptance_length > 2.0  # BUILD.json's τ over the bundled prompts is higher


# ---- a shipped bug's shape -------------------------------------------------------------------------


class QWithoutMarkov(BlockSpeculatorsDrafter):
    """Samples each slot with the Markov bias, reports q without it (processed sampling, raw q:
    transformers #47932's shape, on DSpark's head)."""

    def draw(self, logits, base, ctx, drafted):
        token, _ = draw(logits, ctx, drafted, self.map, self.target_vocab)
        return token, process_logits(base, ctx.params)


def q_without_markov(target):
    honest = speculators.from_path(DSPARK, target)
    return QWithoutMarkov(honest.net, honest.cfg, honest.identity)


def test_a_drafter_reporting_q_without_its_markov_bias_fails_its_sampled_cell(one_thread):
    from losscheck.cells.sampled import run_pit
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    session = Session(Options(drafter=f"{__name__}:q_without_markov"))
    (planned,) = [c for cells in session.plan.values() for c in cells if c.id == "user-k4-T1"]
    outcome = run_pit(CellContext.of(session, planned))
    assert not outcome.passed, f"user-k4-T1 passed (probability <= 0.01 for this bug)\n{outcome.message()}"
