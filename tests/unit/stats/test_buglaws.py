"""`losscheck.stats.buglaws.top_p`: its shortcut through a row's largest entries keeps exactly the
set a stable descending sort of the whole row keeps."""

from __future__ import annotations

import pytest
import torch

from losscheck.stats.buglaws import top_p


def _sorted_whole(q: torch.Tensor, top: float) -> torch.Tensor:
    """The definition: rank the whole row (ties by id), keep while the mass before is short of `top`."""
    ranked, order = q.sort(dim=-1, descending=True, stable=True)
    keep = torch.zeros_like(ranked, dtype=torch.bool).scatter(-1, order, (ranked.cumsum(-1) - ranked) < top)
    kept = torch.where(keep, q, 0.0)
    total = kept.sum(-1, keepdim=True)
    return torch.where(total > 0, kept / total.clamp_min(1e-300), q)


@pytest.mark.parametrize("top", [0.5, 0.9, 0.999])
def test_top_p_keeps_what_a_stable_sort_of_the_whole_row_keeps(top):
    """2,048 rows over a vocabulary of 2,000: peaked rows (the kept set among the 256 largest),
    flat ones (it is not: sorted whole), rows rounded to a coarse grid (ties across the cut, and
    at the 256th entry), all-zero rows and uniform rows (every entry tied)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 256, 2000, generator=g, dtype=torch.float64)
    logits *= torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 8.0, 4.0, 1.0], dtype=torch.float64)[:, None, None]
    q = logits.softmax(-1)  # [8, 256, V]
    q[5:] = (q[5:] * 300).round() / 300  # coarse: many equal entries
    q[5:] /= q[5:].sum(-1, keepdim=True).clamp_min(1e-300)
    q[7, :8] = 0.0
    q[7, 8:16] = 1 / 2000
    assert torch.equal(top_p(q, top), _sorted_whole(q, top))
