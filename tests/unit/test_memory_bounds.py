"""Bounded memory for a user's large-vocabulary target: the teacher-forced PIT scored in chunks of
rows, and the float64 divergence margin from the final hidden state without a copy of the model."""

from __future__ import annotations

import copy

import pytest
import torch

from losscheck.cells.scoring import pit_chunk_rows, teacher_forced_pit
from losscheck.core import divergence
from losscheck.core.engine import Engine
from losscheck.core.sampling import SamplingParams, make_generator
from tests.support import PROMPTS, noisy_drafter, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_chunk_rows_fit_the_budget():
    # 128k vocabulary, 32 scored positions: 256 MiB per row at 64 bytes per logit.
    assert pit_chunk_rows(32, 131072, 2 << 30, 4096) == 8
    assert pit_chunk_rows(32, 131072, 1, 4096) == 1  # never less than one row
    assert pit_chunk_rows(8, 64, 2 << 30, 4096) == 4096  # capped by the engine's batch


def test_chunked_pit_equals_one_pass(target):
    rows = PROMPTS * 5
    params = SamplingParams(temperature=1.0, top_p=0.9)
    gen = Engine(target, noisy_drafter(target, 0.6), 4).generate(rows, 8, params, make_generator(0, "chunks"))
    v = torch.rand(gen.tokens.shape, generator=make_generator(0, "v"), dtype=torch.float64)
    whole, _, left_out = teacher_forced_pit(target, rows, gen, v, budget_bytes=1 << 40, max_rows=4096)
    one_row_at_a_time, _, left_out_too = teacher_forced_pit(target, rows, gen, v, budget_bytes=1, max_rows=4096)
    assert torch.equal(left_out, left_out_too)
    # NaN only after EOS and where the drawn token's cut-off is uncertain (p = 0 in the law tested there)
    assert whole.shape == (len(rows), 8) and not whole[gen.mask() & ~left_out].isnan().any()
    # Padding differs between chunks, so equal up to float32 round-off, not bitwise.
    torch.testing.assert_close(one_row_at_a_time, whole, atol=1e-5, rtol=0, equal_nan=True)


def test_float64_margin_matches_a_float64_copy_of_the_model(target, monkeypatch):
    monkeypatch.setattr(divergence, "VOCAB_CHUNK", 5)  # the head in several chunks
    exact = copy.deepcopy(target.model).double()
    for prefix in PROMPTS:
        with torch.inference_mode():
            logits = exact(input_ids=torch.tensor([prefix])).logits[0, -1]
        top = logits.topk(2)
        top1, top2, margin = divergence.top2_float64(target.model, prefix)
        assert (top1, top2) == (int(top.indices[0]), int(top.indices[1]))
        # The hidden state is the fp32 model's: its round-off, scaled by the head, bounds the gap.
        assert margin == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-3)


def test_engine_batches_fit_the_budget():
    from losscheck.cells.draw import engine_batch_rows

    # k = 4 at a 128k vocabulary: 37 MB a row, so a 2 GiB budget runs 58 rows per engine call.
    assert engine_batch_rows(4, 131072, 2 << 30, 4096) == 58
    assert engine_batch_rows(16, 131072, 1 << 20, 4096) == 1
    assert engine_batch_rows(4, 64, 2 << 30, 4096) == 4096  # the bundled target: the profile's batch


def test_the_pit_quantiles_leave_out_tokens_of_probability_zero():
    """A sampled token the target gives probability 0 has no PIT value (NaN, failed by
    pit.support): the record's QQ quantiles are those of the others, never NaN (null breaks the
    certificate's schema)."""
    from losscheck.cells.scoring import _quantiles

    found = _quantiles(torch.tensor([0.1, float("nan"), 0.5, 0.9]))
    assert len(found) == 99 and all(q == q for q in found)
    assert _quantiles(torch.tensor([float("nan")])) == []
