"""Exactness of one verification round, by enumeration over Markov-table toy models.

For a target chain P and a drafter chain Q (both after the same logits processing), a round
drafts x_1..x_k ~ Q, keeps each with `acceptance_probability`, and emits the stopping slot's
token from `recovery_distribution`. Completing the round's output with the target chain up to
k+1 tokens must give exactly the target chain's law of k+1 tokens — for every p, q, k,
temperature and top-k/top-p. The enumeration uses the verifier's own pure functions.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from losscheck.core.sampling import SamplingParams, process_logits
from losscheck.core.verify import acceptance_probability, recovery_distribution, verify_greedy, verify_rejection
from losscheck.selftest.verifiers import widening_everything
from tests.support import assert_follows, markov_table


def chain_prob(table: torch.Tensor, start: int, seq: tuple[int, ...]) -> float:
    prob, prev = 1.0, start
    for tok in seq:
        prob *= float(table[prev, tok])
        prev = tok
    return prob


def round_law(
    P: torch.Tensor, Q: torch.Tensor, start: int, k: int, point_mass: bool, recovery=recovery_distribution
) -> dict[tuple[int, ...], float]:
    """Exact law of the round's output completed to k+1 tokens with the target chain."""
    vocab = P.shape[0]
    law: dict[tuple[int, ...], float] = {}
    for drafts in itertools.product(range(vocab), repeat=k):
        draft_prob = 1.0 if point_mass else chain_prob(Q, start, drafts)
        if point_mass and drafts != _argmax_path(Q, start, k):
            continue
        prevs = (start, *drafts)
        p = torch.stack([P[t] for t in prevs])[None]  # [1, k+1, V]
        q = torch.stack([Q[t] for t in prevs[:k]])[None] if k else torch.zeros(1, 0, vocab, dtype=P.dtype)
        if point_mass:
            q = torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.long), vocab).to(P.dtype)[None]
        d = torch.tensor(drafts, dtype=torch.long)[None]
        acc = acceptance_probability(
            p[:, :k].gather(-1, d[..., None]).squeeze(-1), q.gather(-1, d[..., None]).squeeze(-1)
        )[0]  # [k]
        stop = recovery(p, q)[0]  # [k+1, V]
        reach = 1.0
        for m in range(k + 1):  # m drafts accepted
            stop_prob = reach * (1.0 - float(acc[m])) if m < k else reach
            if stop_prob > 0:
                for y in range(vocab):
                    head = (*drafts[:m], y)
                    if stop[m, y] == 0:
                        continue
                    for tail in itertools.product(range(vocab), repeat=k - m):
                        seq = head + tail
                        w = draft_prob * stop_prob * float(stop[m, y]) * chain_prob(P, y, tail)
                        law[seq] = law.get(seq, 0.0) + w
            if m < k:
                reach *= float(acc[m])
    return law


def _argmax_path(Q: torch.Tensor, start: int, k: int) -> tuple[int, ...]:
    path, prev = [], start
    for _ in range(k):
        prev = int(Q[prev].argmax())
        path.append(prev)
    return tuple(path)


def normalised(table: torch.Tensor) -> torch.Tensor:
    """float64 rows summing to 1 (process_logits works in float32)."""
    table = table.double()
    return table / table.sum(-1, keepdim=True)


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.5]),
    top_k=st.sampled_from([0, 2, 3]),
    top_p=st.sampled_from([1.0, 0.9, 0.6]),
)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 4),
    k=st.integers(0, 3),
    params=params_strategy,
    point_mass=st.booleans(),
)
def test_round_output_follows_the_target_exactly(seed, vocab, k, params, point_mass):
    gen = torch.Generator().manual_seed(seed)
    P = normalised(process_logits(markov_table(vocab, gen), params))
    Q = normalised(process_logits(markov_table(vocab, gen, sharpness=1.0), params))
    law = round_law(P, Q, start=0, k=k, point_mass=point_mass)
    for seq in itertools.product(range(vocab), repeat=k + 1):
        assert law.get(seq, 0.0) == pytest.approx(chain_prob(P, 0, seq), abs=1e-9), seq
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-9)


def test_a_wrong_residual_is_detected_by_the_enumeration():
    """The enumeration can fail: with the residual replaced by p, the law is off."""
    gen = torch.Generator().manual_seed(3)
    P = normalised(process_logits(markov_table(3, gen), SamplingParams()))
    Q = normalised(process_logits(markov_table(3, gen, sharpness=1.0), SamplingParams()))
    honest = round_law(P, Q, 0, 2, False)
    broken = round_law(P, Q, 0, 2, False, recovery=lambda p, q: p)  # the "residual is p" bug
    worst = max(abs(broken.get(s, 0) - honest[s]) for s in honest)
    assert worst > 1e-3


def test_sampled_verifier_matches_its_exact_parts():
    """verify_rejection's accepted-count frequencies agree with the exact acceptance law.

    200k rows; a chi-square test at alpha = 1e-6 (false-failure probability 1e-6, seeded)."""
    gen = torch.Generator().manual_seed(11)
    vocab, k, rows = 5, 3, 200_000
    p = torch.softmax(torch.randn(1, k + 1, vocab, generator=gen), -1).expand(rows, -1, -1)
    q = torch.softmax(torch.randn(1, k, vocab, generator=gen), -1).expand(rows, -1, -1)
    drafts = torch.tensor([[0, 1, 2]]).expand(rows, -1)
    verdict = verify_rejection(p, drafts, q, gen)
    acc = acceptance_probability(
        p[:1, :k].gather(-1, drafts[:1, :, None]).squeeze(-1), q[:1].gather(-1, drafts[:1, :, None]).squeeze(-1)
    )[0]
    reach = torch.cat([torch.ones(1, dtype=torch.float64), acc.cumprod(0)])  # P(accepted >= m)
    law = reach - torch.cat([reach[1:], torch.zeros(1, dtype=torch.float64)])  # P(accepted == m)
    assert_follows(verdict.accepted, law, 1e-6, "accepted counts vs the exact acceptance law")


def test_q_off_by_its_tolerance_in_mass_is_verified_as_the_law_it_samples():
    """A drafter's q may sum to 1 ± 1e-3; its sampler drew in proportion to q, so the verifier
    must decide exactly as for the normalised q (same uniforms, same decisions, same tokens)."""
    gen = torch.Generator().manual_seed(12)
    vocab, k, rows = 6, 3, 50_000
    p = torch.softmax(torch.randn(rows, k + 1, vocab, generator=gen), -1)
    q = torch.softmax(torch.randn(rows, k, vocab, generator=gen), -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(rows, k)
    exact = verify_rejection(p, drafts, q, torch.Generator().manual_seed(1))
    off = verify_rejection(p, drafts, q * 1.001, torch.Generator().manual_seed(1))
    assert torch.equal(off.accepted, exact.accepted)
    emitted = torch.arange(k + 1)[None, :] <= exact.accepted[:, None]
    assert torch.equal(off.tokens[emitted], exact.tokens[emitted])


def test_greedy_verification_accepts_the_matching_prefix_and_emits_the_argmax():
    logits = torch.tensor([[[0.0, 5, 1], [3, 0, 1], [0, 0, 9], [1, 2, 0]]])  # argmax 1, 0, 2, 1
    verdict = verify_greedy(logits, torch.tensor([[1, 0, 0]]))
    assert int(verdict.accepted[0]) == 2
    assert verdict.tokens[0, :3].tolist() == [1, 0, 2]


def test_point_mass_drafts_are_verified_against_the_point_mass():
    """A deterministic draft the target gives probability 0.3 is kept with probability 0.3."""
    gen = torch.Generator().manual_seed(5)
    rows = 100_000
    p = torch.tensor([[0.3, 0.7], [0.5, 0.5]]).expand(rows, -1, -1)
    verdict = verify_rejection(p, torch.zeros(rows, 1, dtype=torch.long), None, gen)
    rate = verdict.accepted.double().mean().item()
    # sd = sqrt(.3*.7/1e5) = 0.00145; 6 sd bounds a false failure at ~2e-9.
    assert abs(rate - 0.3) < 6 * 0.00145, (
        f"acceptance rate {rate:.5f} over {rows} rows is more than 6 sd (0.00145) from 0.3; "
        "false-failure probability ~2e-9 (two-sided normal tail)"
    )
    rejected = verdict.accepted == 0
    assert (verdict.tokens[rejected, 0] == 1).all()  # residual of p - δ_0 is all on token 1


@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("vocab", [7, 1000])
def test_gathering_the_stop_slot_first_changes_no_draw(k, point_mass, vocab):
    """verify_rejection widens only the drafted entries and each row's stopping slot to float64;
    on 2,000 rows with q off its unit mass by up to 1e-3 (what validation allows), its accepted
    counts and every emitted token equal the widen-everything form's, from the same generator."""
    gen = torch.Generator().manual_seed(100 * k + vocab + point_mass)
    rows = 2000
    p = torch.softmax(2 * torch.randn(rows, k + 1, vocab, generator=gen), -1)
    q = torch.softmax(2 * torch.randn(rows, k, vocab, generator=gen), -1)
    q = q * (1 + 1e-3 * (2 * torch.rand(rows, k, 1, generator=gen) - 1))
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(rows, k)
    q = None if point_mass else q
    got = verify_rejection(p, drafts, q, torch.Generator().manual_seed(3))
    ref = widening_everything(p, drafts, q, torch.Generator().manual_seed(3))
    accepted = ref.accepted
    assert torch.equal(got.accepted, accepted)
    emitted = torch.arange(k + 1)[None, :] <= accepted[:, None]
    assert torch.equal(got.tokens[emitted], ref.tokens[emitted])
    assert 0 < int(accepted.sum()) < rows * k or k == 0  # rows stopped at drafts and at the bonus
