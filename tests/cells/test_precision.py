"""Precision as a matrix axis: parsing, the planned cells, near-tie triage of greedy divergences
and top-k / top-p cut-off ambiguity in the teacher-forced pass."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from losscheck.cells.outcome import CellOutcome
from losscheck.cells.record import SampleFacts
from losscheck.cells.scoring import teacher_forced_probs
from losscheck.core.divergence import Divergence
from losscheck.core.precision import Precision, parse_precisions
from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.errors import OptionError
from losscheck.plan.matrix import GREEDY_CELL, PIT_CELL, Cell, plan
from tests.support import noisy_drafter, tiny_target


def test_parsing_and_labels():
    assert parse_precisions("fp32, bf16/fp32") == (Precision(), Precision("bf16", "fp32"))
    assert Precision.parse("fp16") == Precision("fp16", "fp16")
    assert Precision("bf16", "fp32").label() == "bf16/fp32"
    assert Precision("bf16", "fp32").id() == "tbf16-dfp32"
    assert not Precision("fp32", "bf16").reduced  # greedy verification reads the target only
    for bad in ("fp8", "bf16/int4", "", "fp32,fp32"):
        with pytest.raises(OptionError):
            parse_precisions(bad)


def test_each_extra_precision_is_one_greedy_and_one_pit_cell_of_the_named_drafters():
    target = tiny_target()
    drafters = {"main": {"A": noisy_drafter(target, 0.1), "self": noisy_drafter(target, 0.0)}}
    precisions = parse_precisions("bf16,fp32,fp16/fp32")
    cells = plan(drafters, None, None, precisions, frozenset({"A"}))
    extra = [c for c in cells[GREEDY_CELL] + cells[PIT_CELL] if c.precision != precisions[0] and c.axis("split") == 1]
    assert sorted((c.params.greedy, c.precision.label()) for c in extra) == [
        (False, "fp16/fp32"),
        (False, "fp32"),
        (True, "fp16/fp32"),
        (True, "fp32"),
    ]
    # and the slow tier's pair of the split with the first extra precision
    split = [c for c in cells[GREEDY_CELL] + cells[PIT_CELL] if c.precision != precisions[0] and c.axis("split") != 1]
    assert [(c.id, c.slow) for c in split] == [("A-k4-greedy-tp2", True)]  # fp32 is the id default
    assert {c.drafter for c in extra} == {"A"} and {c.k for c in extra} == {4}
    base = [c for c in cells[GREEDY_CELL] if c.precision == precisions[0]]
    assert base and all("-bf16" in c.id for c in base)  # the base cells say their precision


def divergence(margin: float, near_tie: bool) -> Divergence:
    return Divergence("low", 0, [0], 3, 5, 6, 6, 5, margin, near_tie)


@pytest.mark.parametrize("strict", [False, True])
def test_near_ties_fail_only_under_strict(strict):
    cell = Cell("A", 4, GREEDY, precision=Precision("bf16", "bf16"))
    facts = SampleFacts(prompts=1, max_new_tokens=8)
    tie = CellOutcome(cell, divergences=[divergence(0.01, True)], facts=facts, strict=strict)
    assert tie.passed is not strict and tie.near_ties == 1
    real = CellOutcome(cell, divergences=[divergence(2.0, False)], facts=facts, strict=strict)
    assert not real.passed


def test_a_top_k_edge_within_tolerance_makes_the_position_ambiguous_whatever_was_drawn():
    """Ambiguity is the position's, decided from its logits: the first token out within tolerance
    of the last kept makes every draw there ambiguous (kept, just out or far out alike); outside
    the tolerance none is."""
    target = tiny_target()
    prompt = [0, 3, 4]
    with torch.no_grad():
        logits = target.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    order = logits.argsort(descending=True)
    params = SamplingParams(top_k=3)
    gap = float(logits[order[2]] - logits[order[3]])
    for tolerance, expected in ((gap * 1.01, True), (gap * 0.99, False)):
        for token in (order[0], order[2], order[3], order[-1]):
            forced = teacher_forced_probs(target, [prompt], torch.tensor([[int(token)]]), params, tolerance)
            assert bool(forced.ambiguous[0, 0]) is expected, (int(token), tolerance)


def test_tied_logits_at_a_cut_off_edge_are_ambiguous_at_tolerance_zero():
    """All logits equal (a position that saw only BOS, say): which of them a top-k or top-p cut
    keeps is the implementation's choice, so the position is ambiguous even at tolerance 0 (for
    top-p 0.9 no mass before lies near 0.9: 57/64 and 58/64 straddle it); no cut, no ambiguity."""
    from losscheck.cells.scoring import cutoff_ambiguous

    logits = torch.zeros(2, 3, 64)
    logits[1] = torch.linspace(0, 1, 64)  # row 1: no tie anywhere
    for params in (SamplingParams(top_k=8), SamplingParams(top_p=0.9)):
        ambiguous = cutoff_ambiguous(logits, params, tolerance=0.0)
        assert ambiguous[0].all() and not ambiguous[1].any(), params
    assert not cutoff_ambiguous(logits, SamplingParams(), tolerance=0.0).any()


def _next_token_law() -> tuple[Any, list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tiny target, a prompt, and its next token's logits [V], softmax [V] (float64) and ids
    by descending probability [V]."""
    target = tiny_target()
    prompt = [0, 3, 4]
    with torch.no_grad():
        logits = target.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    probs = logits.softmax(-1).double()
    return target, prompt, logits, probs, probs.argsort(descending=True)


def test_a_token_just_past_the_top_p_mass_is_ambiguous_and_one_further_is_not():
    """The mass before a token within `top_p_band(tolerance, V)` above top_p: ambiguous; further: a
    support failure. V = 64: the band is 64 unit round-offs (3.8e-6) plus e^(2 tolerance) - 1."""
    target, prompt, logits, probs, order = _next_token_law()
    first_out = order[3]
    before = float(probs[order[:3]].sum())  # the mass before the fourth token
    for top_p, tolerance, expected in (
        (before - 1e-6, 0.0, True),
        (before - 1e-3, 0.0, False),
        (before - 1e-3, 1e-3, True),
        (before - 1e-2, 1e-3, False),
    ):
        params = SamplingParams(top_p=top_p)
        token = torch.tensor([[int(first_out)]])
        forced = teacher_forced_probs(target, [prompt], token, params, tolerance)
        assert forced.probs[0, 0, first_out] == 0  # the cut keeps three tokens
        assert bool(forced.ambiguous[0, 0]) is expected, (top_p, tolerance)
        assert bool(forced.left_out[0, 0]) is expected  # drawn where one cut keeps it: left out


def test_at_an_ambiguous_cut_off_the_wide_law_is_the_law_before_it_on_every_token_it_may_keep():
    """`ForcedProbs.wide` (`widest_law`): where the fourth token's keep is ambiguous, the softmax
    on the three sure tokens and that one, renormalized; the law of either kept set lies between
    the round filter's bounds (`hidden_rounds.kept_bounds`). Where no position is ambiguous
    there is no wide law, and a greedy cell's is its own point mass."""
    from losscheck.cells.scoring import widest_law
    from losscheck.stats.hidden_rounds import kept_bounds

    target, prompt, logits, probs, order = _next_token_law()
    top_p = float(probs[order[:3]].sum()) - 1e-6  # the fourth token: kept by one cut, not another
    token = torch.tensor([[int(order[3])]])
    forced = teacher_forced_probs(target, [prompt], token, SamplingParams(top_p=top_p), 0.0)
    assert forced.wide is not None and forced.no_sure is not None and not bool(forced.no_sure.any())
    wide = forced.wide[0, 0].double()
    expected = torch.zeros_like(probs)
    expected[order[:4]] = probs[order[:4]] / probs[order[:4]].sum()
    assert torch.allclose(wide, expected, atol=1e-6)
    lo, hi = kept_bounds(forced.probs.double(), forced.wide.double())
    for kept in (order[:3], order[:4]):
        law = torch.zeros_like(probs)
        law[kept] = probs[kept] / probs[kept].sum()
        assert bool((lo[0, 0] <= law + 1e-6).all() and (law <= hi[0, 0] + 1e-6).all())
    sure = teacher_forced_probs(target, [prompt], token, SamplingParams(top_p=top_p - 1e-2), 0.0)
    assert sure.wide is None and sure.no_sure is None
    point = torch.zeros(1, 1, probs.shape[-1])
    point[..., 0] = 1.0
    assert widest_law(logits[None, None], GREEDY, point, torch.ones_like(point, dtype=torch.bool)) is point


def test_every_token_hugging_faces_top_p_keeps_and_losscheck_cuts_is_in_the_band():
    """The finding behind the band: Hugging Face's `TopPLogitsWarper` (ascending cumulative sum,
    `<= 1 - top_p`) and `process_logits` (descending, mass before `>= top_p`) are one rule, yet on
    the text target's 8,192 tokens they keep a different last token at a few positions in a
    thousand. Each such token HF keeps and losscheck cuts must be ambiguous, even at tolerance 0."""
    import math

    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import TopPLogitsWarper

    from losscheck import bundled
    from losscheck.cells.scoring import cutoff_ambiguous
    from losscheck.core.sampling import process_logits

    model = AutoModelForCausalLM.from_pretrained(bundled.fixtures_dir() / "text_target").eval()
    # 2,048 positions: 5 where the two keep a different last token (7 in 4,096; 2 in 1,024)
    ids = torch.randint(0, model.config.vocab_size, (32, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [32, 64, V]
    params = SamplingParams(top_p=0.9)
    probs = process_logits(logits, params)
    hf_kept = TopPLogitsWarper(0.9)(None, logits.flatten(0, 1).clone()).view_as(logits) > -math.inf
    rows, positions, tokens = (hf_kept & (probs == 0)).nonzero(as_tuple=True)
    assert len(tokens) > 0  # the two disagree here; else this test shows nothing
    ambiguous = cutoff_ambiguous(logits, params, tolerance=0.0)  # [32, 64], computed once
    missed = [(int(r), int(p)) for r, p in zip(rows, positions) if not ambiguous[r, p]]
    assert not missed, f"positions where HF keeps a token losscheck cuts, not flagged ambiguous: {missed[:5]}"


def test_the_summary_counts_near_ties():
    from losscheck.report.summary import summary_rows
    from tests.support import cell_record

    record = cell_record("A-k4-greedy-bf16", kind="greedy", passed=True, near_ties=3, max_new_tokens=64)
    assert summary_rows([record])[0][2] == "PASS (3 near-ties)"
    assert summary_rows([dataclasses.replace(record, near_ties=0)])[0][2] == "PASS"


def test_at_an_ambiguous_position_the_law_is_conditioned_on_the_surely_kept_tokens():
    """Top-p 0.6 over logits 3, 2, 2 - ε, 1, 0 (p ≈ 0.52, 0.19, 0.19, 0.07, 0.03; ε within the
    tolerance): the cut falls inside the tied pair, and which of the two a sort ranks first is the
    implementation's, so both are uncertain. The law tested there is p restricted to the surely
    kept first token; the tokens every implementation cuts keep p = 0 (a support failure). At
    top-p 0.95 the cut (after the fourth token, 0.90 before it) is certain and nothing changes."""
    from losscheck.cells.scoring import cutoff_law
    from losscheck.core.sampling import process_logits

    logits = torch.tensor([[[3.0, 2.0, 2.0 - 1e-4, 1.0, 0.0]]])
    params = SamplingParams(top_p=0.6)
    probs, uncertain = cutoff_law(logits, params, tolerance=1e-3)
    assert uncertain[0, 0].tolist() == [False, True, True, False, False]  # the tied pair straddles the cut
    p = logits.softmax(-1)[0, 0]
    torch.testing.assert_close(probs[0, 0], torch.tensor([1.0, 0, 0, 0, 0]))
    assert process_logits(logits, params)[0, 0, 1] > 0  # losscheck's own cut keeps the second token
    probs, uncertain = cutoff_law(logits, SamplingParams(top_p=0.95), tolerance=1e-3)
    assert uncertain[0, 0].tolist() == [False, False, False, False, False]
    torch.testing.assert_close(probs[0, 0], torch.cat([p[:4] / p[:4].sum(), torch.zeros(1)]))


def test_conditioning_on_the_surely_kept_tokens_keeps_the_pit_uniform_under_another_cut():
    """The claim the conditioning rests on, checked by sampling: an engine whose cut keeps every
    uncertain token (T ⊋ S) draws from p restricted to T. Its PITs under the law conditioned on S,
    left-out draws removed, are uniform: KS at α = 1e-3 on 20,000 draws passes; the same draws'
    PITs under losscheck's own cut (the law without conditioning) fail it, p < 1e-6, which shows
    the test can see the difference (seven uncertain tokens carry 19% of the mass here: a tolerance
    of 0.05 widens the top-p band to e^0.1 - 1)."""
    from scipy import stats

    from losscheck.cells.scoring import cutoff_law
    from losscheck.core.sampling import process_logits
    from losscheck.stats.pit import randomized_pit

    gen = torch.Generator().manual_seed(20261202)
    logits = torch.randn(1, 1, 32, generator=gen) * 2  # [1, 1, V]
    params, tolerance = SamplingParams(top_p=0.8), 0.05
    probs, uncertain = cutoff_law(logits, params, tolerance)
    assert float(logits.softmax(-1)[uncertain].sum()) > 0.1 and int((probs > 0).sum()) > 1
    wide = logits.softmax(-1) * (process_logits(logits, params) > 0 | uncertain)  # the engine keeps T = S ∪ A
    n = 20_000
    tokens = torch.multinomial(wide[0, 0] / wide.sum(), n, replacement=True, generator=gen)[None]  # [1, n]
    v = torch.rand(1, n, generator=gen, dtype=torch.float64)
    kept = ~uncertain[0, 0, tokens[0]]
    conditioned = randomized_pit(probs.expand(1, n, -1), tokens, v)[0, kept]
    assert stats.kstest(conditioned.numpy(), "uniform").pvalue > 1e-3
    own = randomized_pit(process_logits(logits, params).expand(1, n, -1), tokens, v)[0]
    own = own[~own.isnan()]  # a draw losscheck's cut removes has no PIT (a support failure besides)
    assert stats.kstest(own.numpy(), "uniform").pvalue < 1e-6


def test_on_the_text_target_top_p_leaves_out_a_few_drawn_tokens_not_the_ambiguous_positions():
    """The 8,192-token text target at top-p 0.9, sampling by Hugging Face's own `generate`: most
    positions are ambiguous (about 15 uncertain tokens of ~1e-3 mass each), yet the draws that land
    on an uncertain token, the only ones the PIT tests leave out, are under 1% — where leaving out
    whole ambiguous positions left 85% untested and the engine's top-p cell underpowered."""
    from transformers import AutoModelForCausalLM

    from losscheck import bundled
    from losscheck.cells.scoring import cutoff_law

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(bundled.fixtures_dir() / "text_target").eval()
    with torch.no_grad():
        rows = model.generate(
            torch.zeros(32, 1, dtype=torch.long),
            do_sample=True,
            top_p=0.9,
            top_k=0,
            max_new_tokens=28,
            min_new_tokens=28,
        )  # [32, 29]
        logits = model(rows).logits[:, :-1]  # [32, 28, V] the predictions of the drawn tokens
    probs, uncertain = cutoff_law(logits, SamplingParams(top_p=0.9), tolerance=Precision().tolerance)
    drawn = rows[:, 1:, None]  # [32, 28, 1]
    left_out = uncertain.gather(-1, drawn).squeeze(-1)  # [32, 28]
    assert float(uncertain.any(-1).float().mean()) > 0.5  # the ambiguity is real on this vocabulary
    assert float(left_out.float().mean()) < 0.01
    assert not (probs.gather(-1, drawn).squeeze(-1)[~left_out] == 0).any()  # HF's draws: no support failure


def test_with_top_k_and_top_p_only_a_top_k_ambiguity_makes_every_token_uncertain():
    """Top-k then top-p over logits 3, 2, 2 - ε, 1, 0, -5: with top-k 4 (a clear edge) only the tied
    pair straddling the top-p 0.6 cut is uncertain; with top-k 2 the top-k edge falls in the tie,
    which tokens reach the top-p stage is the implementation's, and so is every token's mass."""
    from losscheck.cells.scoring import cutoff_uncertain

    logits = torch.tensor([[[3.0, 2.0, 2.0 - 1e-4, 1.0, 0.0, -5.0]]])
    clear_edge = cutoff_uncertain(logits, SamplingParams(top_k=4, top_p=0.6), tolerance=1e-3)
    assert clear_edge[0, 0].tolist() == [False, True, True, False, False, False]
    tied_edge = cutoff_uncertain(logits, SamplingParams(top_k=2, top_p=0.6), tolerance=1e-3)
    assert tied_edge[0, 0].all()


@pytest.mark.parametrize("top_k", [0, 1, 3, 15, 16])
@pytest.mark.parametrize("min_p", [0.0, 0.2])
@pytest.mark.parametrize("tolerance", [1e-3, 0.6])
def test_the_top_k_edge_read_from_a_partial_sort_is_the_order_free_definition(top_k, min_p, tolerance):
    """Without top-p, `cutoff_uncertain` ranks only the first k + 1 logits (`torch.topk`, which
    orders ties as it likes). With a the k-th largest logit and b the (k+1)-th, a token is
    uncertain iff a <= v <= b + tol (kept, within tol of the first out) or a - tol <= v <= b (out,
    within tol of the last kept): a definition that needs no order among ties; with no cut-off at
    all (top-k 0, min-p 0) nothing is. Logits on a 0.5 grid over 16 tokens tie at most edges."""
    from losscheck.cells.scoring import cutoff_uncertain

    gen = torch.Generator().manual_seed(20261207 + top_k)
    logits = torch.randint(-4, 5, (3, 40, 16), generator=gen).float() * 0.5  # [n, L, V]
    params = SamplingParams(top_k=top_k, min_p=min_p)
    got = cutoff_uncertain(logits, params, tolerance)
    expected = torch.zeros_like(got)
    if min_p:
        edge = logits.amax(-1, keepdim=True) + math.log(min_p)
        expected |= (logits - edge).abs() <= 2 * tolerance
        if top_k:
            expected |= expected.any(-1, keepdim=True)
    if 0 < top_k < logits.shape[-1]:
        ranked = logits.sort(-1, descending=True).values
        a, b = ranked[..., top_k - 1 : top_k], ranked[..., top_k : top_k + 1]  # [n, L, 1] each
        expected |= ((logits >= a) & (logits <= b + tolerance)) | ((logits <= b) & (logits >= a - tolerance))
    assert torch.equal(got, expected)
    if not min_p and 0 < top_k < logits.shape[-1]:
        assert 0 < got.sum() < got.numel()  # the grid puts some tokens at the edge, not all


@pytest.mark.parametrize("offset", [0.0, 5000.0])
@pytest.mark.parametrize("grid", [True, False])
@pytest.mark.parametrize("top_p", [0.5, 0.9])
@pytest.mark.parametrize("tolerance", [0.0, 3e-4, 1e-3, 0.3])
def test_the_top_p_window_is_the_order_free_definition(grid, top_p, tolerance, offset):
    """`cutoff_uncertain`'s top-p rule counts the tokens above each rank in a window of ranks
    only. Against the definition over sets (no order, no window): token v is uncertain iff
    p(v) > 0, the mass of the other tokens whose logit is at least v's - tol exceeds top_p - band
    and the mass of those above v's + tol falls short of top_p + band. Logits on a 0.5 grid over
    16 tokens (ties at most edges), Gaussian ones over 512, and a flat row (every token tied: the
    window is the whole vocabulary, every token uncertain); each again shifted by 5,000 (the
    softmax is the same, float32's rounding of the logits 500 times coarser). Positions with a
    mass within 1e-6 of a threshold (where float sums in another order may land either side) are
    left out; they are rare."""
    from losscheck.cells.scoring import cutoff_uncertain
    from losscheck.core.sampling import process_logits, top_p_band

    gen = torch.Generator().manual_seed(20261207)
    if grid:
        logits = torch.randint(-4, 5, (4, 40, 16), generator=gen).float() * 0.5  # [n, L, V]
    else:
        logits = torch.randn(4, 10, 512, generator=gen) * 2.0
    logits[0, 0] = 0.0  # a flat row
    logits += offset
    params = SamplingParams(top_p=top_p)
    got = cutoff_uncertain(logits, params, tolerance)
    p = process_logits(logits, dataclasses.replace(params, top_p=1.0)).double()  # [n, L, V]
    band = top_p_band(tolerance, logits.shape[-1])
    v, u = logits[..., :, None], logits[..., None, :]  # [n, L, V, 1], [n, L, 1, V]
    others = ~torch.eye(logits.shape[-1], dtype=torch.bool)
    most = ((u >= v - tolerance) & others).double() @ p[..., None]  # [n, L, V, 1]
    least = (u > v + tolerance).double() @ p[..., None]
    most, least = most.squeeze(-1), least.squeeze(-1)
    expected = (p > 0) & (most > top_p - band) & (least < top_p + band)
    near = ((most - (top_p - band)).abs() < 1e-6) | ((least - (top_p + band)).abs() < 1e-6)  # [n, L, V]
    clear = ~near.any(-1)  # [n, L]
    assert clear.float().mean() > 0.9 and clear[0, 0]
    assert torch.equal(got[clear], expected[clear])
    assert got[0, 0].all()  # the flat row: every token may fall either side of the cut
    assert got.any() and (band > 0.5 or not got.all())  # bf16's band, expm1(0.6) = 0.82, may leave nothing sure


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.5, temperature=0.3),
        SamplingParams(top_p=0.9, top_k=5),
        SamplingParams(top_p=0.8, min_p=0.05, temperature=1.5),
    ],
    ids=["top-p", "cold", "with-top-k", "with-min-p"],
)
def test_the_top_p_law_from_the_logits_sort_is_process_logits_to_the_bit(params):
    """`cutoff_law` sorts the vocabulary once (`Ranking`): its top-p law is `process_logits`',
    which sorts the probabilities, bit for bit, or it is left to `process_logits`. Gaussian logits
    over 512 tokens (no ties: the logits' order serves), logits on a 0.5 grid over 16 (ties of
    positive probability across some cut: `process_logits` decides), and two logits 1e-9 apart,
    distinct as logits and one probability after the softmax, straddling the cut (the logits'
    order would keep the other id)."""
    from losscheck.cells.scoring import Ranking, cutoff_law
    from losscheck.core.sampling import process_logits

    gen = torch.Generator().manual_seed(20261208)
    gaussian = torch.randn(4, 10, 512, generator=gen) * 2.0  # [n, L, V]
    grid = torch.randint(-4, 5, (4, 40, 16), generator=gen).float() * 0.5
    law = Ranking.of(gaussian, params).top_p_law(params.top_p)
    assert law is not None and torch.equal(law, process_logits(gaussian, params))
    assert Ranking.of(grid, params).top_p_law(params.top_p) is None
    for logits in (gaussian, grid):  # cutoff_law: process_logits' law on the surely kept tokens
        probs, _ = cutoff_law(logits, params, 0.0)
        sure = torch.where(probs > 0, process_logits(logits, params), 0.0)
        assert torch.allclose(probs, sure / sure.sum(-1, keepdim=True))
    straddle = torch.tensor([[[0.0, 1e-9, -20.0, -20.0]]])  # one probability, 1/2, at ranks 0 and 1
    cut = SamplingParams(top_p=0.4)
    assert Ranking.of(straddle, cut).top_p_law(0.4) is None
    assert process_logits(straddle, cut)[0, 0, :2].tolist() == [1.0, 0.0]  # the stable sort keeps id 0
