"""A target's own MTP layers: the drafter drafts what transformers' MTP candidate generator drafts,
ragged rows independent of each other, exact under greedy decoding in losscheck's loop; a target
without MTP layers is a clear error; `use_mtp` through transformers certified as an engine."""

from __future__ import annotations

import pytest
import torch

from losscheck import bundled
from losscheck.core.engine import Engine
from losscheck.core.sampling import GREEDY, make_generator
from losscheck.core.target import HFTarget
from losscheck.drafters import mtp
from losscheck.errors import OptionError
from tests.support import few_prompts, topk_request, verified_q

MTP_TARGET = bundled.fixtures_dir() / "mtp_target"


@pytest.fixture(scope="module")
def mtp_target():
    return HFTarget.from_pretrained(MTP_TARGET)


@pytest.fixture(scope="module")
def drafter(mtp_target):
    return mtp.from_target(mtp_target)


def _states(target, ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    target.reset(len(ids), ids.shape[1] + 1)
    _, states = target.forward(ids, torch.zeros(len(ids), dtype=torch.long), layers=layers)
    return states


def test_the_first_drafts_logits_are_those_of_transformers_mtp_candidate_generator(mtp_target, drafter, monkeypatch):
    from transformers import GenerationConfig
    from transformers.generation import candidate_generator

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = candidate_generator.MTPCandidateGenerator.get_candidates

    def record(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if logits is not None:
            seen.append((input_ids.clone(), logits.clone()))
        return ids, logits

    monkeypatch.setattr(candidate_generator.MTPCandidateGenerator, "get_candidates", record)
    prompt = torch.tensor([[0, 3, 10, 11, 12, 13]])
    config = GenerationConfig(max_new_tokens=6, do_sample=False, use_mtp=True, eos_token_id=1, pad_token_id=1)
    mtp_target.model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
    committed, reference = seen[0]  # the prompt and the target's first token
    mine = drafter.block_logits(
        committed, torch.tensor([committed.shape[1]]), _states(mtp_target, committed, drafter.uses_hidden), []
    )
    torch.testing.assert_close(mine, reference[:, 0].float(), rtol=1e-4, atol=1e-4)


def test_ragged_rows_draft_as_each_row_alone_a_lone_bos_too(mtp_target, drafter):
    rows = [[0, 2, 7, 9, 11, 13, 15, 17], [0, 4, 20], [0]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    drafts = [torch.tensor([30, 31, 32])]  # one drafted slot: the chained entry
    together = drafter.block_logits(ids, lengths, _states(mtp_target, ids, drafter.uses_hidden), drafts)
    for b, row in enumerate(rows):
        alone = torch.tensor([row])
        single = drafter.block_logits(
            alone, lengths[b : b + 1], _states(mtp_target, alone, drafter.uses_hidden), [d[b : b + 1] for d in drafts]
        )
        torch.testing.assert_close(together[b : b + 1], single, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [1, 2])
def test_the_mtp_layers_are_exact_under_greedy_in_the_loop(mtp_target, drafter, k):
    prompts = [[0, 2, 5, 6], [0, 3, 20, 21, 22], [0]]
    out = Engine(mtp_target, drafter, k).generate(prompts, 24, GREEDY, make_generator(1, "mtp", k))
    plain = Engine(mtp_target, None, 1).generate(prompts, 24, GREEDY, make_generator(1, "plain"))
    assert torch.equal(out.tokens, plain.tokens)
    assert out.stats.acceptance_length > 1.5  # BUILD.json: 1.93 at k 1, 2.66 at k 2


def test_a_target_without_mtp_layers_is_a_clear_error(target):
    with pytest.raises(OptionError, match="no MTP layers"):
        mtp.from_target(target)


def test_use_mtp_is_an_engine_arg_of_hf_without_an_assistant(mtp_target, target):
    from losscheck.engines.named import ADAPTERS
    from losscheck.engines.registry import EngineSpec

    engine = ADAPTERS["hf"].build(mtp_target, EngineSpec(str(MTP_TARGET), args={"use_mtp": True}))
    assert engine.speculation == "mtp" and engine.k == 1 and engine.assistant is None
    with pytest.raises(OptionError, match="no MTP layers"):
        ADAPTERS["hf"].build(target, EngineSpec(str(bundled.target_path()), args={"use_mtp": True}))
    with pytest.raises(OptionError, match="leave --losscheck-assistant out"):
        ADAPTERS["hf"].inputs(EngineSpec(str(MTP_TARGET), assistant="x", args={"use_mtp": True}), "hf")


@pytest.mark.usefixtures("one_thread")
def test_transformers_use_mtp_passes_its_greedy_engine_cell(tmp_path):
    """On two prompts a tier: transformers decodes one row per MTP generate call (27 s on all 48)."""
    from losscheck.cells.engine import run_engine_cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    prompts = str(few_prompts(tmp_path / "prompts.jsonl"))
    session = Session(Options(engine="losscheck.engines.hf:hf_mtp", target=str(MTP_TARGET), prompts=prompts))
    (cell,) = session.plan["engine_greedy_cell"]
    outcome = run_engine_cell(CellContext.of(session, cell))
    assert outcome.passed, outcome.message()


@pytest.mark.usefixtures("one_thread")
def test_the_planted_mtp_generator_hands_the_verifier_raw_logits_where_the_honest_one_hands_processed(mtp_target):
    """transformers #47932's shape in the MTP generator (`hf_mtp_q_raw_in_verify`) is live: at
    top-k 8 the honest generator's q is -inf off its 8 kept tokens, the planted one's nowhere.
    Its cell's FAIL is the slow test below."""
    from losscheck.engines.hf import hf_mtp
    from losscheck.selftest.engines import hf_mtp_q_raw_in_verify

    kept = torch.isfinite(verified_q(hf_mtp(mtp_target), topk_request(8))).sum(-1)  # [1, rounds * k]
    assert bool((kept == 8).all()), kept
    kept = torch.isfinite(verified_q(hf_mtp_q_raw_in_verify(mtp_target), topk_request(8))).sum(-1)
    assert bool((kept == mtp_target.vocab_size).all()), kept


@pytest.mark.slow  # the cell's two stages, one row per generate call: 268 s (2026-12-05)
@pytest.mark.usefixtures("one_thread")
def test_mtp_sampling_processed_logits_and_verifying_raw_ones_fails_blamed_on_speculation():
    from losscheck.cells.engine import run_engine_cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    engine = "losscheck.selftest.engines:hf_mtp_q_raw_in_verify"
    session = Session(Options(engine=engine, target=str(MTP_TARGET)))
    (cell,) = [c for c in session.plan["engine_cell"] if c.id.endswith("-T0.3")]
    outcome = run_engine_cell(CellContext.of(session, cell))
    assert not outcome.passed, outcome.message()
    assert outcome.facts.attribution is not None and outcome.facts.attribution.finding == "speculation"
