"""The round filter (`losscheck.stats.hidden_rounds`) against the speculative loop's exact law,
enumerated branch by branch over a Markov-table target and drafter (p and q read the last token)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import norm

from losscheck.errors import LosscheckError
from losscheck.stats.buglaws import TOP_P, top_p
from losscheck.stats.hidden_rounds import (
    CLASSES,
    MEMBERS,
    RoundsPower,
    RoundsSample,
    bounded_positions,
    class_laws,
    filter_rounds,
    kept_bounds,
    round_bounds,
    round_parts,
    rounds_test,
)

V, K, L = 3, 2, 5


def tables(seed: int, vocab: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    """P, Q [vocab + 1, vocab]: the law of the next token after token a (row vocab: after the prompt)."""
    g = torch.Generator().manual_seed(seed)
    P = torch.rand(vocab + 1, vocab, generator=g, dtype=torch.float64) ** 3
    Q = torch.rand(vocab + 1, vocab, generator=g, dtype=torch.float64) ** 3
    return P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)


def loop_law(
    P: torch.Tensor, Q: torch.Tensor, bug: str | None, first: str = "round", R: torch.Tensor | None = None
) -> dict[tuple[int, ...], float]:
    """The probability of every first-L output of the speculative loop with `bug` (None: correct),
    by enumerating drafts, accept / reject outcomes and recovered and bonus tokens; `first`
    "prefill": the first token is the prefill's sample of p, and the rounds start after it. `R`:
    the draft model's other (raw) law, which the q-contract bugs draw from or verify with."""
    R = Q if R is None else R
    law: dict[tuple[int, ...], float] = {}

    def emit(out: tuple[int, ...], x: int) -> tuple[int, ...]:
        return (*out, x)

    def last(out: tuple[int, ...]) -> int:
        return out[-1] if out else V

    def round_(out: tuple[int, ...], prob: float) -> None:
        if len(out) >= L:
            law[out[:L]] = law.get(out[:L], 0.0) + prob
            return
        slot(out, 0, prob)

    def slot(out: tuple[int, ...], j: int, prob: float) -> None:
        if len(out) >= L:
            round_(out, prob)
            return
        p, q = P[last(out)], Q[last(out)]
        if j == K:  # bonus slot
            law_x = P[out[-2] if len(out) >= 2 else V] if bug == "bonus_from_previous_slot" else p
            for x in range(V):
                round_(emit(out, x), prob * float(law_x[x]))
            return
        o = R[last(out)]
        drawn = {"top_p_one_side": top_p(q, TOP_P), "q_raw_in_draft": o}.get(bug or "", q)
        verified = o if bug == "q_raw_in_verify" else q
        residual = (p - verified).clamp_min(0)
        recovered = p if bug == "residual_is_p" or residual.sum() <= 0 else residual / residual.sum()
        rejected = 0.0
        for d in range(V):
            accept = min(1.0, float(p[d] / verified[d])) if verified[d] > 0 else 1.0
            if drawn[d] > 0:
                slot(emit(out, d), j + 1, prob * float(drawn[d]) * accept)
                rejected += float(drawn[d]) * (1 - accept)
        for x in range(V):
            if rejected > 0 and recovered[x] > 0:
                round_(emit(out, x), prob * rejected * float(recovered[x]))

    if first == "prefill":
        for x in range(V):
            round_((x,), float(P[V, x]))
    else:
        round_((), 1.0)
    return law


def forced(seqs: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """[n, L, V] the table's law at every position of `seqs` [n, L] (position 0 after the prompt)."""
    before = torch.cat([torch.full((len(seqs), 1), V), seqs[:, :-1]], 1)
    return T[before]


def filtered_law(
    P: torch.Tensor, Q: torch.Tensor, first: str | None = "round", R: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = torch.tensor(list(itertools.product(range(V), repeat=L)))  # [V^L, L]
    p, q = forced(seqs, P), forced(seqs, Q)
    other = None if R is None else forced(seqs, R)
    everywhere = torch.ones(seqs.shape, dtype=torch.bool)
    out = filter_rounds(round_parts(p, q, seqs, other=other), K, everywhere, everywhere, first)
    p_seq = p.gather(-1, seqs[..., None]).squeeze(-1).prod(-1)  # [V^L]
    return seqs, p_seq[:, None, None] * out.log_lr.exp()  # [V^L, C, G]


@pytest.mark.parametrize(("seed", "greedy"), [(0, False), (1, False), (2, False), (0, True), (3, True)])
def test_the_correct_loop_emits_p_and_every_member_s_law_is_the_loop_s_with_the_bug(seed, greedy):
    """`greedy`: the drafts are the drafter's argmax, q a point mass (vLLM's default draft law),
    under which drafting from top-p(q) changes nothing. The draft model's other law R is another
    table (its raw law where q is processed) or, for argmax drafts, the law before the argmax."""
    P, Q = tables(seed)
    R = tables(seed + 100)[1]
    if greedy:
        Q, R = torch.nn.functional.one_hot(Q.argmax(-1), V).double(), Q
    seqs, law = filtered_law(P, Q, R=R)
    correct = loop_law(P, Q, None)
    p_seq = torch.tensor([correct.get(tuple(s.tolist()), 0.0) for s in seqs], dtype=torch.float64)
    assert torch.allclose(p_seq, forced(seqs, P).gather(-1, seqs[..., None]).squeeze(-1).prod(-1), atol=1e-12)
    one = MEMBERS.index(1.0)
    for c, cls in enumerate(CLASSES):
        buggy = loop_law(P, Q, cls.name, R=R)
        exact = torch.tensor([buggy.get(tuple(s.tolist()), 0.0) for s in seqs], dtype=torch.float64)
        assert abs(float(exact.sum()) - 1) < 1e-12
        assert torch.allclose(law[:, c, one], exact, atol=1e-12), cls.name
        if greedy and cls.name == "top_p_one_side":
            assert torch.allclose(exact, p_seq, atol=1e-12)
            continue
        assert not torch.allclose(exact, p_seq, atol=1e-3), f"{cls.name} changes nothing on these tables"
        for g in range(len(MEMBERS)):  # every member's law is a probability law over the outputs
            assert abs(float(law[:, c, g].sum()) - 1) < 1e-12


@pytest.mark.parametrize("seed", [0, 2])
def test_a_first_token_from_the_prefill_is_filtered_exactly_and_an_undeclared_one_as_the_mixture(seed):
    """vLLM, llama.cpp and OpenVINO GenAI emit a row's first token from the prefill, then draft.
    With `first="prefill"` every member's law is the loop's with that start, exactly; the rows
    started at slot 0 (the default) are not that law; with `first=None` the filter's law is the
    half-and-half mixture of the two starts."""
    P, Q = tables(seed)
    R = tables(seed + 100)[1]
    seqs, prefill = filtered_law(P, Q, "prefill", R)
    _, at_slot_0 = filtered_law(P, Q, "round", R)
    _, mixed = filtered_law(P, Q, None, R)
    one = MEMBERS.index(1.0)
    for c, cls in enumerate(CLASSES):
        buggy = loop_law(P, Q, cls.name, first="prefill", R=R)
        exact = torch.tensor([buggy.get(tuple(s.tolist()), 0.0) for s in seqs], dtype=torch.float64)
        assert torch.allclose(prefill[:, c, one], exact, atol=1e-12), cls.name
        assert not torch.allclose(at_slot_0[:, c, one], exact, atol=1e-4), cls.name
    assert torch.allclose(mixed, (prefill + at_slot_0) / 2, atol=1e-12)
    with pytest.raises(LosscheckError, match="first token comes from one of"):
        filtered_law(P, Q, "slot1")


def test_under_h0_the_likelihood_ratio_has_mean_one_and_rejects_within_alpha():
    """Rows drawn from p itself (q arbitrary): E[LR] = 1 exactly, and the test's false alarms over
    400 cells at alpha 0.05 stay within the binomial bound (P(X > 34) < 1e-4 at 20 expected)."""
    P, Q = tables(3)
    seqs, law = filtered_law(P, Q)
    p_seq = forced(seqs, P).gather(-1, seqs[..., None]).squeeze(-1).prod(-1)
    ratio = law / p_seq[:, None, None]
    assert torch.allclose((p_seq[:, None, None] * ratio).sum(0), torch.ones(1, dtype=torch.float64), atol=1e-12)
    g = torch.Generator().manual_seed(11)
    alarms = 0
    for _ in range(400):
        rows = _draw(P, 30, g)
        alarms += not rounds_test(_score(P, Q, rows), "residual_is_p", 0.05, 0.9).passed
    assert alarms <= 34, alarms


def _draw(P: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    rows = torch.zeros(n, L, dtype=torch.long)
    last = torch.full((n,), V)
    for t in range(L):
        rows[:, t] = torch.multinomial(P[last], 1, generator=g)[:, 0]
        last = rows[:, t]
    return rows


def _score(P: torch.Tensor, Q: torch.Tensor, rows: torch.Tensor) -> RoundsSample:
    everywhere = torch.ones(rows.shape, dtype=torch.bool)
    sample = RoundsSample(K)
    sample.update(forced(rows, P), forced(rows, Q), rows, everywhere, everywhere)
    return sample


def test_two_samples_power_sums_are_the_sums_of_both_rows():
    """A pilot's and a tested sample's power sums pooled (`RoundsPower.plus`) are those of one
    sample of both's rows, the drift's clustered bound and the power included."""
    P, Q = tables(6)
    rows = _draw(P, 120, torch.Generator().manual_seed(8))
    whole, first, second = _score(P, Q, rows), _score(P, Q, rows[:50]), _score(P, Q, rows[50:])
    pooled = first.power.plus(second.power)
    assert pooled.tokens == whole.power.tokens and pooled.rows == whole.power.rows == 120
    for name in ("residual_is_p", "bonus_from_previous_slot"):
        assert pooled.drift(name, MEMBERS[2]) == pytest.approx(whole.power.drift(name, MEMBERS[2]), rel=1e-9)
        assert pooled.second_moment(name) == pytest.approx(whole.power.second_moment(name), rel=1e-9)
        assert pooled.power(name, 1.0, 300, 1e-3) == pytest.approx(whole.power.power(name, 1.0, 300, 1e-3), rel=1e-9)
    # the pooled drift's standard error is smaller than either part's: more rows
    errors = [s.drift("residual_is_p")[1] for s in (pooled, first.power, second.power)]
    assert errors[0] < min(errors[1:])
    with pytest.raises(LosscheckError, match="different classes"):
        first.power.plus(RoundsPower(classes=("residual_is_p",)))


@pytest.mark.parametrize("greedy", [False, True])
def test_a_loop_with_the_residual_bug_is_caught_where_its_power_says(greedy):
    """Rows drawn from the buggy loop's exact law; the power model's tokens are enough to catch it
    in at least 16 of 20 cells at alpha 1e-3 (its stated power 0.9; P(<16 | 0.9) = 0.043, fixed
    seeds). `greedy`: point-mass drafts (q the drafter's argmax)."""
    P, Q = tables(4)
    if greedy:
        Q = torch.nn.functional.one_hot(Q.argmax(-1), V).double()
    law = loop_law(P, Q, "residual_is_p")
    outputs = list(law)
    weights = torch.tensor([law[o] for o in outputs], dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    pilot = torch.tensor([outputs[i] for i in torch.multinomial(weights, 200, True, generator=g)])
    needed = _score(P, Q, pilot).power.tokens_needed("residual_is_p", 1e-3, 0.9)
    assert math.isfinite(needed)
    rows_needed = math.ceil(needed / L)
    caught = 0
    for _ in range(20):
        rows = torch.tensor([outputs[i] for i in torch.multinomial(weights, rows_needed, True, generator=g)])
        caught += not rounds_test(_score(P, Q, rows), "residual_is_p", 1e-3, 0.9).passed
    assert caught >= 16, (caught, rows_needed)


def test_under_greedy_drafts_the_top_p_class_spends_no_alpha_and_is_not_run():
    """top-p of a point mass is itself: against argmax drafts `rounds.top_p_one_side` cannot reject,
    so a cell that lacks sampled drafts gives the other rounds tests its share and runs them alone."""
    from losscheck.stats import registry

    sampled, greedy = frozenset(), frozenset({registry.SAMPLED_DRAFTS})
    assert registry.budget_count(registry.ROUNDS, missing=greedy) == registry.budget_count(registry.ROUNDS) - 1
    alpha = 0.01
    assert registry.split(alpha, registry.ROUNDS, missing=greedy).per_test == alpha / (len(CLASSES) - 1)
    assert registry.split(alpha, registry.ROUNDS, missing=sampled).per_test == alpha / len(CLASSES)
    names = {t.name for t in registry.registered(registry.ROUNDS) if not t.needs & greedy}
    assert "rounds.top_p_one_side" not in names and len(names) == len(CLASSES) - 1


def test_the_null_drift_wald_reads_is_the_mean_of_the_log_lr_under_h0():
    """Rows drawn from p: the realised log-LR of `residual_is_p` at ρ = 1 summed over 400 rows
    (10 scored tokens each) is a martingale whose compensator is `RoundsPower.null`; the two agree
    within 4 standard deviations of the realised sum (its variance from the per-row sums), and
    Wald's expected tokens under H0 follow from that drift."""
    from losscheck.stats.effects import wald_size

    P, Q = tables(6)
    rows = _draw(P, 400, torch.Generator().manual_seed(2))
    sample = _score(P, Q, rows)
    ci, gi = [c.name for c in CLASSES].index("residual_is_p"), MEMBERS.index(1.0)
    per_row = torch.cat(sample.rows)[:, ci].double()  # [400] each row's log-LR at ρ = 1
    drift = float(sample.power.null[ci, gi])
    assert drift < 0
    assert abs(float(per_row.sum()) - drift) <= 4 * float(per_row.std()) * math.sqrt(len(per_row))
    wald = sample.power.wald("residual_is_p", 1e-3, 0.99)
    expected = wald_size(
        float(sample.power.mean[ci, gi]) / sample.tokens,
        drift / sample.tokens,
        1e-3,
        0.99,
        float(sample.power.outside[ci, gi]) / sample.tokens,
    )
    assert wald == expected and math.isfinite(wald.under_h0) and math.isfinite(wald.under_bug)
    # the same compensator, per scored token, is how fast the member's rule-out grows under H0
    # (`rule_out_rate`, which fixes its β_r from a pilot): the realised log rule-out e-value agrees
    rate = sample.power.rule_out_rate("residual_is_p", 1.0)
    assert rate is not None and rate * sample.power.tokens == pytest.approx(-drift)
    realised = sample.rule_out_log_e()["residual_is_p"]
    assert abs(realised + drift) <= 4 * float(per_row.std()) * math.sqrt(len(per_row))
    assert RoundsPower().rule_out_rate("residual_is_p", 1.0) is None  # before any token
    # rule-outs that read each row's first two positions only (`bounded_positions` before a
    # position with no sure token) grow at 2 / L the rate per scored token
    first_two = RoundsSample(K)
    everywhere = torch.ones(rows.shape, dtype=torch.bool)
    no_sure = everywhere & (torch.arange(L) == 2)
    wide = forced(rows, P)
    first_two.update(forced(rows, P), forced(rows, Q), rows, everywhere, everywhere, wide=wide, no_sure=no_sure)
    assert first_two.power.rule_out_rate("residual_is_p", 1.0) == pytest.approx(rate * 2 / L)
    assert first_two.power.rule_out_share() == pytest.approx(2 / L) and RoundsPower().rule_out_share() is None


@pytest.mark.parametrize("seed", [4, 6])
@pytest.mark.parametrize("bug", ["residual_is_p", "bonus_from_previous_slot"])
def test_the_second_stage_s_row_law_is_the_exact_one_over_every_output(seed, bug):
    """A second stage compares rows' summed log-LR at ρ = 1 (`RoundsSample.row_scores`). Exact,
    over every output of the correct and the buggy loop: the shift of its mean and its variance
    under each law. `RoundsPower.row_shift` from 4,000 rows of p gives the shift within
    [0.8, 1.1] of the exact one (the drift at its 95% lower bound) and each variance within
    [0.85, 1.3] of it (an upper bound on the spread of the rows' conditional means, evaluated
    along H0's rows). Measured: shifts 0.89-1.02 of the exact ones, variances 0.93-1.12."""
    P, Q = tables(seed)
    correct, buggy = loop_law(P, Q, None), loop_law(P, Q, bug)
    outputs = torch.tensor(list(correct))
    scores = torch.cat(_score(P, Q, outputs).rows)[:, [c.name for c in CLASSES].index(bug)].double()
    assert bool(torch.isfinite(scores).all())

    def moments(law: dict[tuple[int, ...], float]) -> tuple[float, float]:
        w = torch.tensor([law.get(tuple(o), 0.0) for o in outputs.tolist()], dtype=torch.float64)
        mean = float((w * scores).sum())
        return mean, float((w * scores**2).sum()) - mean**2

    (m0, v0), (m1, v1) = moments(correct), moments(buggy)
    model = _score(P, Q, _draw(P, 4000, torch.Generator().manual_seed(1))).power.row_shift(bug)
    assert 0.8 <= model.shift / (m1 - m0) <= 1.1, (model.shift, m1 - m0)
    assert 0.85 <= model.var_h0 / v0 <= 1.3, (model.var_h0, v0)
    assert 0.85 <= model.var_bug / v1 <= 1.3, (model.var_bug, v1)


@pytest.mark.parametrize(("engine_first", "declared"), [("round", "round"), ("prefill", "prefill"), ("prefill", None)])
def test_a_rule_out_e_value_has_mean_at_most_one_under_the_member_it_rules_out(engine_first, declared):
    """Exact, over every output of a loop with the residual bug (ρ = 1): E[Π p / P'] <= 1 under the
    bug, where the filter's first token is declared as the engine draws it, and where it is not
    declared (the filter mixes both; `rule_out_log_e` takes log 2 off, without which the mean is
    1.0014 here). Positions the rule-outs do not read add nothing: a row with no sure token at its
    first position leaves log e at 0 (less the slack)."""
    P, Q = tables(7)
    law = loop_law(P, Q, "residual_is_p", first=engine_first)
    key = "residual_is_p"
    mean = 0.0
    for out, prob in law.items():
        seq = torch.tensor([out])
        everywhere = torch.ones(seq.shape, dtype=torch.bool)
        sample = RoundsSample(K, declared)
        sample.update(forced(seq, P), forced(seq, Q), seq, everywhere, everywhere)
        mean += prob * math.exp(sample.rule_out_log_e()[key])
    assert abs(sum(law.values()) - 1) < 1e-12
    assert mean <= 1 + 1e-9, mean
    if declared is None:  # the mixture's e-value without the slack: above 1 here, so the slack is needed
        assert 2 * mean > 1 + 1e-4, mean
    seq = torch.tensor([next(iter(law))])
    everywhere = torch.ones(seq.shape, dtype=torch.bool)
    sample = RoundsSample(K, declared)
    sample.update(forced(seq, P), forced(seq, Q), seq, everywhere, everywhere, wide=forced(seq, P), no_sure=everywhere)
    assert sample.rule_out_log_e()[key] == (-math.log(2) if declared is None else 0.0)
    assert float(sample.log_lr.abs().sum()) > 0  # the test's own log-LR still reads every scored position


def test_the_drift_s_and_second_moment_s_standard_errors_are_the_spread_of_a_pilot_s_estimates():
    """The bonus bug, whose drift sits in the rows that reach a bonus slot. Exact: each of the
    V^L rows scored alone gives its drift S_r and second moment M_r; with p's law over rows those
    are the per-token means and the standard errors of a 100-row pilot's estimates. 200 pilots of
    100 rows drawn from p, for each of the two: their mean is within 4 standard errors of the
    exact one, and the root mean square of the standard errors they state, and the spread of their
    estimates, are within 12% and 15% of the exact one (the spread's own relative error at 200
    pilots is 5%). The power a pilot states is at the drift's lower bound and the variance's upper
    bound, below that at the point estimates."""
    P, Q = tables(4)
    bug = "bonus_from_previous_slot"
    ci, gi = [c.name for c in CLASSES].index(bug), MEMBERS.index(1.0)
    seqs = torch.tensor(list(itertools.product(range(V), repeat=L)))  # [V^L, L]
    weight = forced(seqs, P).gather(-1, seqs[..., None]).squeeze(-1).prod(-1)  # [V^L]
    alone = [_score(P, Q, row[None]).power for row in seqs]
    g = torch.Generator().manual_seed(5)
    pilots = [_score(P, Q, _draw(P, 100, g)).power for _ in range(200)]
    for per_row, estimate in (
        ([float(a.mean[ci, gi]) for a in alone], RoundsPower.drift),
        ([float(a.second[ci, gi]) for a in alone], RoundsPower.second_moment),
    ):
        rows = torch.tensor(per_row, dtype=torch.float64)
        exact = float((weight * rows).sum()) / L
        exact_se = math.sqrt(float((weight * (rows / L - exact) ** 2).sum()) / 100)
        stated = torch.tensor([estimate(pilot, bug) for pilot in pilots], dtype=torch.float64)  # [200, 2]
        assert abs(float(stated[:, 0].mean()) - exact) <= 4 * exact_se / math.sqrt(200), estimate
        assert abs(float(stated[:, 1].pow(2).mean().sqrt()) / exact_se - 1) <= 0.12, estimate
        assert abs(float(stated[:, 0].std()) / exact_se - 1) <= 0.15, estimate
    pilot, alpha, z = pilots[0], 1e-3, float(norm.ppf(0.95))
    n = pilot.tokens_needed(bug, alpha, 0.9)  # where the stated power is above one half
    (mu, se), (moment, moment_se) = pilot.drift(bug), pilot.second_moment(bug)

    def gauss(drift: float, var: float) -> float:  # P(Σ >= log(G / α)), the sum over n tokens taken as Gaussian
        return float(norm.cdf((n * drift - math.log(len(MEMBERS) / alpha)) / math.sqrt(var * n)))

    lower = mu - z * se
    stated_power = pilot.power(bug, 1.0, n, alpha)
    assert se > 0 and moment_se > 0 and 0.9 <= stated_power < 0.91
    assert stated_power == pytest.approx(gauss(lower, moment + z * moment_se - lower * lower))
    assert stated_power < gauss(lower, moment - mu * mu) < gauss(mu, moment - mu * mu)


def test_the_mass_outside_p_s_support_is_taken_at_its_lower_bound_too():
    """P with zeros (no token twice in a row): the bonus bug's previous-slot law puts mass where p
    has none, which catches the bug outright. 400 rows from p: the rate is the outside sum per
    token, its standard error is finite and positive, and the power at a token count the Gaussian
    part cannot reach is 1 - (1 - (rate - z·SE))^n, below the point estimate's."""
    P, Q = tables(8)
    P[torch.arange(V), torch.arange(V)] = 0.0  # no token twice in a row; the previous slot's law allows it
    P /= P.sum(-1, keepdim=True)
    sample = _score(P, Q, _draw(P, 400, torch.Generator().manual_seed(4)))
    power, bug = sample.power, "bonus_from_previous_slot"
    ci, gi = [c.name for c in CLASSES].index(bug), MEMBERS.index(1.0)
    rate, error = power.outside_rate(bug)
    assert rate == pytest.approx(float(power.outside[ci, gi]) / power.tokens) and 0 < error < rate
    lower = rate - float(norm.ppf(0.95)) * error
    assert power.power(bug, 1.0, 5, 0.5) == pytest.approx(max(1 - (1 - lower) ** 5, 0.0), rel=1e-9)
    assert power.power(bug, 1.0, 5, 0.5) < 1 - (1 - rate) ** 5


@pytest.mark.parametrize("cut", [False, True], ids=["whole-support", "cut-off"])
def test_the_power_sums_are_the_plain_formulas_per_class_and_member(cut):
    """`RoundsPower.update` fuses its per-member work (float32, no mask where p keeps every id);
    from the same float32 class laws, its sums equal the plain formulas in float64 within 1e-3 —
    member ρ's law P' = p + ρ·(draft + π·(bonus - draft) - p), Σ E_P'[log(P'/p)], Σ E_P'[log²],
    Σ E_p[log(P'/p)] over ids both give mass, Σ P' outside p's support — with p whole, and with a
    cut-off that leaves ids out of it. (Two float32 logs subtracted, as before 2026-12-07, put a
    drift near zero 13% off here: a q-contract class at its null, where it is the correct round.)"""
    P, Q = tables(6)
    if cut:
        P[torch.arange(V), torch.arange(V)] = 0.0  # no id twice in a row; the previous slot's law allows it
        P /= P.sum(-1, keepdim=True)
    rows = _draw(P, 40, torch.Generator().manual_seed(8))
    p, q = forced(rows, P), forced(rows, Q)
    everywhere = torch.ones(rows.shape, dtype=torch.bool)
    sample = RoundsSample(K)
    sample.update(p, q, rows, everywhere, everywhere)
    filtered = filter_rounds(round_parts(p, q, rows), K, everywhere, everywhere, "round")
    p_prev = torch.cat([torch.zeros_like(p[:, :1]), p[:, :-1]], dim=1)
    for ci, cls in enumerate(CLASSES):
        # the class's laws as the update forms them, in float32; everything after, in float64
        laws = class_laws(cls, *(x.float() for x in (p, q, p_prev)))
        laws = type(laws)(*(x.double() for x in laws))
        p = p.float().double()
        for gi, rho in enumerate(MEMBERS):
            last = filtered.bonus_belief[..., ci, gi][..., None]  # [n, L, 1]
            law = p + rho * (laws.draft + last * (laws.bonus - laws.draft) - p)
            both = (p > 0) & (law > 0)
            ratio = torch.where(both, law.clamp_min(1e-300).log() - p.clamp_min(1e-300).log(), 0.0)
            expected = [(law * ratio).sum(), (law * ratio * ratio).sum(), (p * ratio).sum(), law[p == 0].sum()]
            got = [sample.power.mean, sample.power.second, sample.power.null, sample.power.outside]
            for want, have in zip(expected, got, strict=True):
                assert float(have[ci, gi]) == pytest.approx(float(want), rel=1e-3, abs=1e-9), (cls.name, rho)
    assert (float(sample.power.outside.abs().sum()) > 0) == cut  # mass outside p's support only with a cut-off


def test_a_subnormal_float32_p_leaves_the_power_sums_finite():
    """An id whose p is 1e-41 (subnormal in float32) where a class's law gives it mass (the
    previous slot's law, for the bonus class): the member's factor is read against p's floor
    (1e-38), never divided by the subnormal itself, so every sum stays finite."""
    P, Q = tables(6)
    P[torch.arange(V), torch.arange(V)] = 1e-41  # an id after itself: subnormal in float32, likely before
    P /= P.sum(-1, keepdim=True)
    rows = _draw(P, 40, torch.Generator().manual_seed(8))
    sample = _score(P, Q, rows)
    for sums in (sample.power.mean, sample.power.second, sample.power.null, sample.power.outside):
        assert bool(torch.isfinite(sums).all()), sums


def _rule_out_mean(
    P: torch.Tensor, P_sure: torch.Tensor, Q: torch.Tensor, law: dict, name: str, bounded: bool
) -> torch.Tensor:
    """E[e] [G] over every output of `law` of the rule-out e-values of class `name`'s members,
    the filter fed the sure tokens' law `P_sure` where `P` (the law before the cut-off on every
    token it may keep) differs from it. `bounded`: `round_bounds` at every position (as
    `RoundsSample.update` reads them); else `round_parts` of `P_sure`, read at every position whose
    cut-off is not ambiguous."""
    seqs = torch.tensor(list(law))  # [N, L]
    prob = torch.tensor(list(law.values()), dtype=torch.float64)  # [N]
    p, wide, q = forced(seqs, P_sure), forced(seqs, P), forced(seqs, Q)
    everywhere = torch.ones(seqs.shape, dtype=torch.bool)
    if bounded:
        parts, read = round_bounds(p, wide, q, seqs), bounded_positions(everywhere, None)
    else:
        parts, read = round_parts(p, q, seqs), (wide == p).all(-1)
    log_lr = filter_rounds(parts, K, everywhere, read, "round").log_lr
    e = (-log_lr[:, [c.name for c in CLASSES].index(name)]).exp()  # [N, G]
    return (prob[:, None] * e).sum(0)


def _sure_only(P: torch.Tensor) -> torch.Tensor:
    """P with token 0 cut after token 0 (the law on the sure tokens {1, 2} there), renormalized."""
    P_sure = P.clone()
    P_sure[0, 0] = 0.0
    P_sure[0] /= P_sure[0].sum()
    return P_sure


def test_a_rule_out_e_value_bounds_the_member_s_law_over_the_kept_sets_of_an_ambiguous_cut_off():
    """Exact, over every output of a loop with each class (every member): after token 0,
    losscheck's cut-off is unsure of token 0, sure of {1, 2}; the engine keeps {1, 2} or all three
    (its target `P_sure` or `P`). Fed the law on the sure tokens there and read at every other
    position, the belief and a bonus's p after the ambiguous one are not the member's and E[e]
    exceeds 1 (infinite for the bonus bug, whose law there can give no mass to a token the engine
    draws). Fed `round_bounds` — each part at its largest over the kept sets, the law on all three
    as numerator — and read at every position, E[e] <= 1 under the member whichever set the engine
    keeps. The price is about the unsure token's mass at each ambiguous position: where it is
    0.005 (a top-p cut's unsure tokens on the text target hold about 1e-3), the bounded e-value
    grows under H0 within 5% of the rate of a filter that knows the engine's set."""
    worst = 0.0
    for seed in (0, 2):
        P, Q = tables(seed)
        P_sure = _sure_only(P)
        for name in ("residual_is_p", "bonus_from_previous_slot", "top_p_one_side"):
            for engine in (P, P_sure):
                mean = _rule_out_mean(P, P_sure, Q, loop_law(engine, Q, name), name, bounded=True)
                assert bool((mean <= 1 + 1e-9).all()), (seed, name, mean)
            worst = max(worst, float(_rule_out_mean(P, P_sure, Q, loop_law(P, Q, name), name, bounded=False).max()))
    assert worst > 1.05, worst
    # the price of not knowing the set, under H0 (the engine keeps all three): E[log e] per row
    P, Q = tables(0)
    P[0, 0] = 0.005 * P[0, 1:].sum() / 0.995  # the unsure token's mass: 0.005
    P[0] /= P[0].sum()
    law = loop_law(P, Q, None)
    seqs, prob = torch.tensor(list(law)), torch.tensor(list(law.values()), dtype=torch.float64)
    everywhere = torch.ones(seqs.shape, dtype=torch.bool)
    p, wide, q = forced(seqs, _sure_only(P)), forced(seqs, P), forced(seqs, Q)
    bounded = -filter_rounds(round_bounds(p, wide, q, seqs), K, everywhere, everywhere).log_lr
    known = -filter_rounds(round_parts(wide, q, seqs), K, everywhere, everywhere).log_lr
    at_one = MEMBERS.index(1.0)
    for name in ("residual_is_p", "bonus_from_previous_slot"):
        ci = [c.name for c in CLASSES].index(name)
        grown, ideal = (float((prob * x[:, ci, at_one]).sum()) for x in (bounded, known))
        assert 0.95 * ideal <= grown <= ideal, (name, grown, ideal)


def test_kept_bounds_hold_every_kept_set_s_law_and_each_class_s_parts():
    """Random laws w on 6 ids, sure set S of 3, uncertain U of the other 3: for every K with
    S ⊆ K ⊆ S ∪ U, lo <= w on K renormalized <= hi (`kept_bounds`), and every class's accepted,
    recovered and bonus laws at that p (the previous position's at its own K) are at most
    `RoundClass.bounds`. Where nothing is ambiguous (the law before the cut-off is p itself)
    lo = hi = p."""
    g = torch.Generator().manual_seed(3)
    w = torch.rand(50, 1, 6, generator=g, dtype=torch.float64) ** 2
    q, o = (x / x.sum(-1, keepdim=True) for x in torch.rand(2, 50, 1, 6, generator=g, dtype=torch.float64) ** 2)
    sure = torch.tensor([True, True, True, False, False, False])
    wide = w / w.sum(-1, keepdim=True)
    p_sure = wide * sure / (wide * sure).sum(-1, keepdim=True)
    lo, hi = kept_bounds(p_sure, wide)
    checked = 0
    for extra in itertools.product((False, True), repeat=3):
        kept = sure | torch.tensor((False, False, False, *extra))
        p_k = wide * kept / (wide * kept).sum(-1, keepdim=True)
        assert bool((lo <= p_k + 1e-15).all() and (p_k <= hi + 1e-15).all())
        for cls in CLASSES:
            laws = class_laws(cls, p_k, q, torch.roll(p_k, 1, 0), o)
            bound = cls.bounds(lo, hi, q, torch.roll(hi, 1, 0), o)
            for part, top in zip((laws.accept, laws.draft - laws.accept, laws.bonus), bound, strict=True):
                assert bool((part <= top + 1e-12).all()), cls.name
                checked += 1
    assert checked == 8 * len(CLASSES) * 3
    lo, hi = kept_bounds(wide, wide)
    assert torch.equal(lo, wide) and torch.equal(hi, wide)


def test_the_rule_outs_read_no_position_after_one_with_no_sure_token():
    """`bounded_positions`: a row's positions before its first with no sure token."""
    no_sure = torch.tensor([[False, True, False], [False, False, False]])
    generated = torch.tensor([[True, True, True], [True, True, False]])
    assert bounded_positions(generated, no_sure).tolist() == [[True, False, False], [True, True, False]]
    assert bounded_positions(generated, None).tolist() == generated.tolist()


def test_round_bounds_computes_only_the_positions_a_bound_changes():
    """Random laws where about a third of the positions are ambiguous: `round_bounds` (the bounds
    at those positions and the ones after them, `round_parts` elsewhere) equals every class's
    bounds computed at every position (where nothing is ambiguous they are the exact parts)."""
    from losscheck.stats.hidden_rounds import _gather, _mixed

    g = torch.Generator().manual_seed(0)
    n, length, vocab = 6, 7, 9
    w = torch.rand(n, length, vocab, generator=g, dtype=torch.float64) ** 2
    w[..., -1] = 0.0  # an id no implementation keeps
    wide = w / w.sum(-1, keepdim=True)
    ambiguous = torch.rand(n, length, generator=g) < 0.3
    sure = torch.ones(n, length, vocab, dtype=torch.bool)
    sure[ambiguous] = torch.arange(vocab) < 6
    p = wide * sure / (wide * sure).sum(-1, keepdim=True)
    wide = torch.where(ambiguous[..., None], wide, p)
    q, o = (x / x.sum(-1, keepdim=True) for x in torch.rand(2, n, length, vocab, generator=g, dtype=torch.float64))
    tokens = torch.randint(0, vocab - 1, (n, length), generator=g)
    lo, hi = kept_bounds(p, wide)
    hi_prev = torch.cat([torch.zeros_like(hi[:, :1]), hi[:, :-1]], dim=1)
    at = tokens[..., None]
    h0 = (_gather(torch.minimum(hi, q), at), _gather((hi - q).clamp_min(0.0), at), _gather(hi, at))
    whole = _mixed([c.bounds(lo, hi, q, hi_prev, o) for c in CLASSES], h0, _gather(wide, at), at)
    assert 0 < int(ambiguous.sum()) < n * length
    for want, have in zip(whole, round_bounds(p, wide, q, tokens, other=o), strict=True):
        assert torch.allclose(want, have, rtol=0.0, atol=1e-15)
