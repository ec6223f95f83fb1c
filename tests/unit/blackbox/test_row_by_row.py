"""`row_by_row`: the helper that turns one-continuation-at-a-time engines into `generate`'s tensor."""

from __future__ import annotations

import pytest
import torch

from losscheck.core.sampling import GREEDY
from losscheck.engines import EngineOutputError, row_by_row
from tests.support import engine_request

EOS = 0


def test_rows_land_in_place_padded_with_eos():
    prompts = [[5], [6, 7]]
    out = row_by_row(engine_request(prompts, 2, GREEDY, 0, 3, True), EOS, lambda i, j: [prompts[i][-1], j + 1][: 1 + j])
    assert out.dtype == torch.long and out.shape == (2, 2, 3)
    assert out.tolist() == [[[5, 0, 0], [5, 2, 0]], [[7, 0, 0], [7, 2, 0]]]


def test_a_zero_budget_never_asks_for_a_row():
    def row(i: int, j: int) -> list[int]:
        raise AssertionError("called")

    assert row_by_row(engine_request([[1]], 3, GREEDY, 0, 0, True), EOS, row).shape == (1, 3, 0)


def test_a_continuation_over_the_budget_is_named():
    with pytest.raises(EngineOutputError, match="continuation 1 of prompt 0 has 4 new ids, more than max_new_tokens=3"):
        row_by_row(engine_request([[1]], 2, GREEDY, 0, 3, True), EOS, lambda i, j: [1, 2, 3, 4][: 3 + j])


def test_the_old_form_still_works_with_a_warning_naming_the_new_one():
    prompts = [[5], [6, 7]]
    with pytest.warns(DeprecationWarning, match=r"pass the engine's request, row_by_row\(request, eos, row\)"):
        old = row_by_row(prompts, 2, 3, EOS, lambda i, j: [prompts[i][-1]])
    new = row_by_row(engine_request(prompts, 2, GREEDY, 0, 3, True), EOS, lambda i, j: [prompts[i][-1]])
    assert torch.equal(old, new)


def test_the_old_dtype_table_still_imports_with_a_warning():
    from losscheck.engines import hf

    with pytest.warns(DeprecationWarning, match="dtype_precision"):
        assert hf.DTYPE_PRECISION[torch.bfloat16] == "bf16"
