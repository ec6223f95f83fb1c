"""DFlash through Hugging Face assisted generation (`speculation_type="dflash"`) certified as a
black-box engine: the bundled checkpoint passes its engine cells, and transformers #47932's bug
planted in its candidate generator (candidates drawn from the processed logits, the raw ones
returned as q) fails, blamed on speculation. transformers' DFlash q depends on where its round
began, so no causal LM can be teacher-forced for it: the cells judge the target-side classes and
name the drafter-side ones not judged."""

from __future__ import annotations

import pytest

from losscheck import bundled
from losscheck.errors import OptionError
from tests.support import few_prompts, topk_request, verified_q

DFLASH = bundled.fixtures_dir() / "dflash"


def _cell(engine: str, cell_id: str, kind: str = "engine_cell", prompts: str | None = None):
    from losscheck.cells.engine import run_engine_cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    session = Session(Options(engine=engine, prompts=prompts))
    (cell,) = [c for c in session.plan[kind] if c.id == cell_id]
    return run_engine_cell(CellContext.of(session, cell))


@pytest.mark.slow  # one row per generate call: ~60 s
@pytest.mark.usefixtures("one_thread")
def test_the_bundled_dflash_checkpoint_in_transformers_passes_its_sampled_engine_cell():
    outcome = _cell("losscheck.engines.hf:hf_dflash", "engine-k8-T0.3")
    assert outcome.passed, outcome.message()


@pytest.mark.slow  # the cell's two stages, one row per generate call: ~170 s (2026-12-05)
@pytest.mark.usefixtures("one_thread")
def test_dflash_sampling_processed_logits_and_verifying_raw_ones_fails_blamed_on_speculation():
    outcome = _cell("losscheck.selftest.engines:hf_dflash_q_raw_in_verify", "engine-k8-T0.3")
    assert not outcome.passed, outcome.message()
    assert outcome.facts.attribution is not None and outcome.facts.attribution.finding == "speculation"


@pytest.mark.usefixtures("one_thread")
def test_the_bundled_dflash_checkpoint_in_transformers_is_exact_under_greedy(tmp_path):
    """On two prompts a tier: one row per generate call (16 s on all 48)."""
    prompts = str(few_prompts(tmp_path / "prompts.jsonl"))
    outcome = _cell("losscheck.engines.hf:hf_dflash", "engine-k8-greedy", "engine_greedy_cell", prompts)
    assert outcome.passed, outcome.message()


@pytest.mark.usefixtures("one_thread")
def test_the_planted_generator_hands_the_verifier_raw_logits_where_the_honest_one_hands_processed(target):
    """The quick tier's check that the plant is live (its cell's FAIL is the slow test above; the
    class itself, `q_raw_in_verify`, FAILs quickly in tests/cells/blackbox/test_q_contract.py): at
    top-k 8 the honest generator's q is -inf off its 8 kept tokens, the planted one's nowhere."""
    import torch

    from losscheck.engines.hf import hf_dflash
    from losscheck.selftest.engines import hf_dflash_q_raw_in_verify

    kept = torch.isfinite(verified_q(hf_dflash(target), topk_request(8))).sum(-1)  # [1, rounds * k]
    assert bool((kept == 8).all()), kept
    kept = torch.isfinite(verified_q(hf_dflash_q_raw_in_verify(target), topk_request(8))).sum(-1)
    assert bool((kept == target.vocab_size).all()), kept


def test_engine_hf_with_a_dflash_assistant_runs_transformers_dflash_generator(target):
    from losscheck.engines.named import ADAPTERS
    from losscheck.engines.registry import EngineSpec

    given = EngineSpec(str(bundled.target_path()), assistant=str(DFLASH))
    engine = ADAPTERS["hf"].build(target, given)
    assert engine.speculation == "dflash" and engine.k == 8 and engine.draft_model() is None
    assert engine.name.startswith("hf-dflash[dflash]")
    with pytest.raises(OptionError, match="block_size - 1 = 8"):
        ADAPTERS["hf"].build(target, EngineSpec(given.target, str(DFLASH), args={"num_assistant_tokens": 4}))
