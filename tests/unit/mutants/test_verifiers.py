"""Planted verifier bugs on a closed-form toy: a Markov-table target and drafter.

For each mutant the exact law of the first emitted token (`losscheck.selftest.laws`) is computed
from the tables, checked to be far from the target's p (the bug is really lossy), and checked
against 100k seeded rounds of the mutant's actual code (the law describes the code). The
correct verifier goes through the same harness and must give p exactly.
"""

from __future__ import annotations

import pytest
import torch

from losscheck.core.contract import DraftContext
from losscheck.core.sampling import GREEDY, SamplingParams, process_logits, sample
from losscheck.core.verify import BlockOutcome, Verifier, verify_block
from losscheck.selftest import drafters as planted
from losscheck.selftest import get_mutant, laws
from losscheck.selftest.verifiers import inverse_cdf, verify_bonus_counted_not_written, verify_rows_mixed_up
from tests.support import assert_follows, markov_table

V, START, ROWS, K = 6, 0, 100_000, 2
# The χ² level of every assert_follows call: a correct sampler fails one call with probability
# 1e-6; the module's 17 calls (4 + 11 parametrized, 2 more) fail one with probability <= 1.7e-5.
ALPHA = 1e-6
_gen = torch.Generator().manual_seed(7)
TARGET = markov_table(V, _gen)  # [V, V] logits, row = previous token
DRAFTER = 0.6 * TARGET + markov_table(V, _gen, sharpness=1.0)  # a plausible, imperfect drafter


def honest_draw(logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    q = process_logits(logits, ctx.params)
    return sample(q, ctx.generator), q


def one_round(verify: Verifier, draw, params: SamplingParams, k: int = K, seed: int = 0) -> BlockOutcome:
    """ROWS independent rounds from START: k drafts by `draw` on the drafter table, verified by
    `verify` on the target table's logits."""
    gen = torch.Generator().manual_seed(seed)
    ctx = DraftContext(
        torch.zeros(ROWS, 1, dtype=torch.long), torch.ones(ROWS, dtype=torch.long), None, k, None, params, gen
    )
    prev = torch.full((ROWS,), START)
    drafts, reports = [], []
    for _ in range(k):
        token, q = draw(DRAFTER[prev].float(), ctx)
        drafts.append(token)
        reports.append(q)
        prev = token
    tokens = torch.stack(drafts, 1)  # [ROWS, k]
    scored = torch.cat([torch.full((ROWS, 1), START), tokens], 1)  # [ROWS, k+1]
    return verify(TARGET[scored].float(), tokens, torch.stack(reports, 1), params, gen)


def planted_verifier(name: str) -> Verifier:
    return get_mutant(name).verifier


def first_slot(params: SamplingParams) -> laws.FirstSlot:
    return laws.FirstSlot(params, TARGET[START], DRAFTER[START], TARGET)


T1, COLD, TOPK = SamplingParams(), SamplingParams(temperature=0.5), SamplingParams(top_k=3)
CASES = {  # name: (verify, draw, exact law, params)
    "unnormalised_residual": (planted_verifier("unnormalised_residual"), honest_draw, laws.unnormalised_residual, T1),
    "residual_is_p": (planted_verifier("residual_is_p"), honest_draw, laws.residual_is_p, T1),
    "inverted_ratio": (planted_verifier("inverted_ratio"), honest_draw, laws.inverted_ratio, T1),
    "residual_is_p_on_30pct_of_rounds": (
        planted_verifier("residual_is_p_on_30pct_of_rounds"),
        honest_draw,
        laws.on_share(laws.residual_is_p, 0.3),
        T1,
    ),
    "shared_uniform": (planted_verifier("shared_uniform"), honest_draw, laws.shared_uniform, T1),
    "typical_acceptance": (planted_verifier("typical_acceptance"), honest_draw, laws.typical, T1),
    "recovered_after_rejected": (
        planted_verifier("recovered_after_rejected"),
        honest_draw,
        laws.recovered_after_rejected,
        T1,
    ),
    "temperature_q_only": (planted_verifier("temperature_q_only"), honest_draw, laws.temperature_q_only, COLD),
    "truncation_draft_only": (planted_verifier("truncation_draft_only"), honest_draw, laws.truncation_draft_only, TOPK),
    "temperature_p_only": (verify_block, planted.untempered_report, laws.temperature_p_only, COLD),
    "greedy_draft_softmax_q": (verify_block, planted.argmax_with_softmax_report, laws.greedy_draft_softmax_q, T1),
    "truncated_candidates_full_q": (verify_block, planted.top_w_with_full_report, laws.truncated_candidates_full_q, T1),
}


@pytest.mark.parametrize("params", [T1, COLD, TOPK, SamplingParams(top_p=0.8)], ids=lambda p: p.label())
def test_the_correct_verifier_gives_p_exactly_and_the_harness_agrees(params):
    slot = first_slot(params)
    law = laws.correct(slot)
    assert torch.allclose(law, slot.p(), atol=1e-9)
    assert_follows(
        one_round(verify_block, honest_draw, params).tokens[:, 0],
        slot.p(),
        ALPHA,
        f"correct verifier, {params.label()}: first token vs p",
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_mutant_first_token_law_is_lossy_and_describes_the_code(name):
    verify, draw, law_of, params = CASES[name]
    slot = first_slot(params)
    law = law_of(slot)
    assert law.sum() == pytest.approx(1.0, abs=1e-9) and (law >= 0).all()
    tv = float((law - slot.p()).abs().sum() / 2)
    assert tv > 0.01, f"{name}: first-token TV {tv:.4f} from p; the planted bug would not be lossy here"
    assert_follows(one_round(verify, draw, params).tokens[:, 0], law, ALPHA, f"{name}: first token vs its law")


def test_bonus_from_wrong_slot_draws_the_bonus_without_the_last_draft():
    verdict = one_round(planted_verifier("bonus_from_wrong_slot"), honest_draw, T1, k=1)
    kept = verdict.accepted == 1
    p_start = process_logits(TARGET[START], T1).double()
    assert_follows(
        verdict.tokens[kept, 1], p_start, ALPHA, "bonus vs p at START"
    )  # the bonus ignores the accepted draft
    honest = one_round(verify_block, honest_draw, T1, k=1)
    honest_kept = honest.accepted == 1
    bonus_law = process_logits(TARGET[honest.tokens[honest_kept, 0]], T1).double().mean(0)
    assert float((bonus_law - p_start).abs().sum() / 2) > 0.05  # ...which is far from its right law


def test_inverse_cdf_runs_off_an_unnormalised_residual_onto_the_last_id():
    residual = torch.tensor([[0.0, 0.02, 0.01, 0.0]])
    assert inverse_cdf(residual, torch.tensor([0.015], dtype=torch.float64), clamp_to_support=False).item() == 1
    assert inverse_cdf(residual, torch.tensor([0.5], dtype=torch.float64), clamp_to_support=False).item() == 3
    normalised = residual / residual.sum()
    assert inverse_cdf(normalised, torch.tensor([0.9999999999], dtype=torch.float64)).item() == 2


def greedy_logits(best: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """Logits [B, k+1, V] whose argmax at slot j of row b is best[b][j]."""
    return torch.nn.functional.one_hot(torch.tensor(best), vocab).float()


def test_bonus_left_unwritten_only_when_every_draft_is_kept():
    drafts = torch.tensor([[5, 6], [5, 4]])
    logits = greedy_logits([[5, 6, 7], [5, 3, 9]])  # row 0 keeps both drafts (bonus 7), row 1 one
    assert verify_block(logits, drafts, None, GREEDY, None).tokens.tolist() == [[5, 6, 7], [5, 3, 9]]
    planted_outcome = verify_bonus_counted_not_written(logits, drafts, None, GREEDY, None)
    assert planted_outcome.tokens.tolist() == [[5, 6, 0], [5, 3, 9]]


def test_rows_are_permuted_only_when_they_accept_different_counts():
    drafts = torch.tensor([[1], [2], [3]])
    same = greedy_logits([[1, 4], [2, 5], [3, 6]])
    assert torch.equal(
        verify_rows_mixed_up(same, drafts, None, GREEDY, None).tokens,
        verify_block(same, drafts, None, GREEDY, None).tokens,
    )
    ragged = greedy_logits([[1, 4], [7, 5], [3, 6]])  # row 1 rejects its draft
    assert verify_rows_mixed_up(ragged, drafts, None, GREEDY, None).tokens.tolist() == [[7, 5], [1, 4], [3, 6]]


def test_a_batch_position_bug_touches_only_its_rows():
    """residual_is_p_one_row_in_4: rows 0, 4, 8, … of the call follow residual_is_p's first-token
    law, every other row the target's p."""
    tokens = one_round(planted_verifier("residual_is_p_one_row_in_4"), honest_draw, T1).tokens[:, 0]
    slot = first_slot(T1)
    hit = torch.arange(ROWS) % 4 == 0
    assert_follows(tokens[hit], laws.residual_is_p(slot), ALPHA, "rows at positions 0 mod 4 vs residual_is_p")
    assert_follows(tokens[~hit], slot.p(), ALPHA, "the other rows vs p")


def test_a_slot_bug_changes_only_the_rounds_that_stop_at_its_slot():
    """residual_is_p_at_slot_1, from one seed: rounds whose first rejection is at slot 1 emit what
    residual_is_p emits from that seed, every other round what the correct verifier emits."""
    from losscheck.selftest.verifiers import in_sampled_rounds, verify_residual_is_p

    planted_at_slot = one_round(planted_verifier("residual_is_p_at_slot_1"), honest_draw, T1, seed=3)
    correct = one_round(verify_block, honest_draw, T1, seed=3)
    everywhere = one_round(in_sampled_rounds(verify_residual_is_p), honest_draw, T1, seed=3)
    at_slot = correct.accepted == 1
    assert bool(at_slot.any()) and bool((~at_slot).any())
    assert torch.equal(planted_at_slot.accepted, correct.accepted)
    assert torch.equal(planted_at_slot.tokens[at_slot], everywhere.tokens[at_slot])
    assert torch.equal(planted_at_slot.tokens[~at_slot], correct.tokens[~at_slot])
    assert not torch.equal(planted_at_slot.tokens[at_slot], correct.tokens[at_slot])


def test_reused_draft_noise_is_what_the_mutant_draws_and_is_lossy():
    """recovery_reuses_draft_noise against the bug written literally (k = 1): the draft drawn by the
    exponential race x = argmax q / E, the recovered token by argmax r / E with the same E. The two
    agree (a two-sample χ² at ALPHA), and both are far from p: on these tables about half the rounds
    reject and the first token's TV from p is about 0.011, which 100k rounds show at p < 1e-20."""
    from scipy.stats import chi2_contingency

    from losscheck.core.verify import residual_distribution
    from tests.support import chi_square_p

    gen = torch.Generator().manual_seed(11)
    p, q = (process_logits(table[START].float(), T1).double() for table in (TARGET, DRAFTER))
    noise = torch.empty(ROWS, V, dtype=torch.float64).exponential_(generator=gen)
    drafts = (q / noise).argmax(-1)
    kept = torch.rand(ROWS, generator=gen, dtype=torch.float64) < (p[drafts] / q[drafts]).clamp(max=1)
    literal = torch.where(kept, drafts, (residual_distribution(p, q) / noise).argmax(-1))
    planted = one_round(planted_verifier("recovery_reuses_draft_noise"), honest_draw, T1, k=1).tokens[:, 0]
    counts = torch.stack([torch.bincount(t, minlength=V) for t in (literal, planted)])
    assert chi2_contingency(counts.numpy())[1] > ALPHA, "the mutant does not draw what the literal bug draws"
    assert chi_square_p(planted, p) < 1e-12, "the reused noise left the first token's law at p"
