"""Predicted power of the exact-mode position-0 test against a mutant (docs/mutants.md).

In an exact cell the first generated token's law under the mutant is computable (`laws`): the
target's and drafter's exact logits at the cell's prompt, pushed through the mutant's first slot.
The prediction is the power of `exact.position[0]` — same bins, same sample size, same level as
`losscheck.cells.sampled.run_exact` uses — against that law (`stats.predicted_power`): a lower bound on the chance
that the cell catches the mutant, since the cell's other tests can only add to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from losscheck.cells.sampled import exact_cell_size, exact_continuations, exact_prompt
from losscheck.drafters.autoregressive import AutoregressiveDrafter
from losscheck.plan.matrix import Cell
from losscheck.run.context import CellContext
from losscheck.run.session import Session
from losscheck.selftest.laws import FirstSlot
from losscheck.selftest.registry import Mutant
from losscheck.stats import predicted_power, probability_bins, registry


@dataclass(frozen=True)
class Prediction:
    power: float | None  # None: n/a, see `note`
    tv: float | None  # total variation between the target's and the mutant's first-token laws
    note: str  # the test it is for, or why there is none


@torch.inference_mode()
def first_slot(session: Session, cell: Cell) -> FirstSlot:
    target = session.targets[cell.target]
    drafter = session.drafters(cell.target)[cell.drafter]
    prompt = torch.tensor([exact_prompt(CellContext.of(session, cell))])
    vocab = target.vocab_size
    after = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)  # [V, P+1]
    return FirstSlot(
        params=cell.params,
        target_logits=target.model(input_ids=prompt).logits[0, -1].double(),
        drafter_logits=drafter.lm.model(input_ids=prompt).logits[0, -1].double(),  # type: ignore[attr-defined]  # family A
        next_logits=target.model(input_ids=after).logits[:, -1].double(),
    )


def position0_level(session: Session, cell: Cell) -> tuple[int, float]:
    """(n, alpha) of `exact.position[0]` in `run_exact` for `cell`: the cell's sample size and its
    Bonferroni share of the cell budget among the cell's tests (support, joint χ², joint G, and
    one per position with at least two bins)."""
    target = session.targets[cell.target]
    ctx = CellContext.of(session, cell)
    seqs, probs = exact_continuations(ctx, cell.target, cell.params)
    n = exact_cell_size(ctx, len(seqs))
    testable = 0
    for pos in range(seqs.shape[1]):
        marginal = torch.zeros(target.vocab_size, dtype=torch.float64).index_add_(0, seqs[:, pos], probs)
        testable += len(probability_bins(marginal[marginal > 0], n)[1]) >= 2
    return n, registry.split(session.per_test_alpha, registry.EXACT, positions=testable).per_test


def predict(session: Session, mutant: Mutant, cell: Cell) -> Prediction:
    """Predicted power of `cell`'s position-0 test against `mutant`, or n/a with the reason."""
    if mutant.first_token is None:
        return Prediction(None, None, f"n/a: {mutant.no_law}")
    if cell.target != "small":
        return Prediction(None, None, "n/a: PIT cell on the main target (vocabulary too large to enumerate)")
    drafter = session.drafters(cell.target)[cell.drafter]
    if not isinstance(drafter, AutoregressiveDrafter):
        return Prediction(None, None, f"n/a: drafter {cell.drafter!r} does not expose its exact logits")
    slot = first_slot(session, cell)
    p0 = slot.p()
    law = mutant.first_token(slot)
    n, alpha = position0_level(session, cell)
    support = p0 > 0
    bin_of, _ = probability_bins(p0[support], n)
    n_bins = int(bin_of.max()) + 1
    # Bins of the test, then one bin of target probability 0 (caught by the support check).
    p_null = torch.zeros(n_bins + 1, dtype=torch.float64).index_add_(0, bin_of, p0[support])
    p_alt = torch.zeros(n_bins + 1, dtype=torch.float64).index_add_(0, bin_of, law[support])
    p_alt[-1] = law[~support].sum()
    power = predicted_power(p_null.numpy(), p_alt.numpy(), n, alpha)
    tv = float((law - p0).abs().sum() / 2)
    return Prediction(power, tv, f"exact.position[0]: n = {n}, alpha = {alpha:.3g}, {n_bins} bins")
