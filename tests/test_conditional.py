"""Exact-conditional tests on closed-form toys: a random Markov table as target p, a random table
as the drafter's reported q. Calibrated under H0; each test fails on the distortion it is built for."""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest
import torch
from scipy import stats

from losscheck.errors import LosscheckError
from losscheck.stats.conditional import (
    CONDITIONAL_TESTS,
    ConditionalValues,
    conditional_tests,
    evalue_threshold,
    log_mixture_evalue,
    mixture_evalue,
    ordered_pit,
    residual_key,
    residual_order_test,
    surprisal_test,
    token_counts_test,
)
from losscheck.stats.pit import randomized_pit

V = 8
pytestmark = pytest.mark.usefixtures("one_thread")


def _tables(seed: int, vocab: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    """(target table p [V, V], drafter table q [V, V]): row s is the law after token s."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(vocab, vocab, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.log(p) + 0.8 * torch.randn(vocab, vocab, generator=g, dtype=torch.float64), -1)
    return p, q


def _walk(p_table: torch.Tensor, q_table: torch.Tensor, n: int, length: int, seed: int, law=None):
    """n rows of `length` steps of the Markov chain. At each step p = p_table[previous token], q =
    q_table[previous] (zeroed at every 4th step: a bonus slot), and the token is drawn from
    law(p, q) (None: from p, H0). Returns p [n, L, V], q [n, L, V], tokens [n, L], v [n, L]."""
    g = torch.Generator().manual_seed(seed)
    vocab = p_table.shape[0]
    state = torch.randint(vocab, (n,), generator=g)
    ps, qs, xs = [], [], []
    for t in range(length):
        p, q = p_table[state], q_table[state] * (t % 4 != 3)  # [n, V]
        draw = p if law is None else law(p, q)
        state = torch.multinomial(draw, 1, generator=g).squeeze(-1)
        ps.append(p)
        qs.append(q)
        xs.append(state)
    v = torch.rand(n, length, generator=g, dtype=torch.float64)
    return torch.stack(ps, 1), torch.stack(qs, 1), torch.stack(xs, 1), v


def _values(p, q, tokens, v) -> ConditionalValues:
    return ConditionalValues.from_chunk(p, q, tokens, v, torch.ones(tokens.shape, dtype=torch.bool))


def test_ordered_pit_by_p_is_the_randomized_pit():
    p, q, tokens, v = _walk(*_tables(0), n=5, length=30, seed=1)
    assert torch.equal(ordered_pit(p, residual_key(p, None), tokens, v), randomized_pit(p, tokens, v))


def test_ordered_pit_tiles_the_unit_interval_in_descending_key_order_ties_by_id():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0], dtype=torch.float64)
    key = torch.tensor([0.5, -0.1, 0.5, 0.2, 0.9], dtype=torch.float64)  # ids 0 and 2 tie
    tokens = torch.arange(5)[None]  # [1, 5]: each id once
    pv, kv = p.expand(1, 5, 5), key.expand(1, 5, 5)
    low = ordered_pit(pv, kv, tokens, torch.zeros(1, 5, dtype=torch.float64))[0]
    high = ordered_pit(pv, kv, tokens, torch.ones(1, 5, dtype=torch.float64))[0]
    # order: 0 (0.5, lower id), 2 (0.5), 3 (0.2), 1 (-0.1); id 4 has p = 0
    assert low[:4].tolist() == pytest.approx([0.0, 0.8, 0.1, 0.4])
    assert high[:4].tolist() == pytest.approx([0.1, 1.0, 0.4, 0.8])
    assert math.isnan(low[4])


def test_merge_of_chunks_equals_the_whole():
    p, q, tokens, v = _walk(*_tables(2), n=6, length=20, seed=3)
    tested = torch.rand(6, 20, generator=torch.Generator().manual_seed(4)) < 0.8
    whole = ConditionalValues.from_chunk(p, q, tokens, v, tested)
    parts = ConditionalValues.merge(
        [
            ConditionalValues.from_chunk(p[i : i + 2], q[i : i + 2], tokens[i : i + 2], v[i : i + 2], tested[i : i + 2])
            for i in range(0, 6, 2)
        ]
    )
    for field in ("order_u", "surprisal_y", "surprisal_var", "count_s", "count_w", "count_expected"):
        assert torch.allclose(getattr(whole, field), getattr(parts, field)), field
    assert whole.n_steps == int(tested.sum())


def test_mixture_evalue_is_stable_for_huge_sums():
    log_e = log_mixture_evalue([1e6, -1e6, 0.0], [1.0, 1.0, 0.0])
    assert np.isfinite(log_e).all() and log_e[0] == pytest.approx(log_e[1]) and log_e[0] > 1e5
    assert log_e[2] == pytest.approx(0.0)  # nothing seen: e = 1
    assert mixture_evalue(3.0, 2.0) == pytest.approx(math.exp(float(log_mixture_evalue(3.0, 2.0))))
    s = evalue_threshold(50.0, 1e-4)
    assert float(log_mixture_evalue(s, 50.0)) == pytest.approx(math.log(1e4))


@functools.cache
def _h0_p_values(replicates: int = 2000, length: int = 200) -> dict[str, np.ndarray]:
    """p-values of each test on `replicates` H0 replicates of `length` steps (a fresh Markov table
    every 100 replicates), seeded."""
    found: dict[str, list[float]] = {"residual_order": [], "token_counts": [], "surprisal": []}
    for r in range(replicates // 100):
        p, q, tokens, v = _walk(*_tables(100 + r), n=100, length=length, seed=200 + r)
        for i in range(100):
            values = _values(p[i : i + 1], q[i : i + 1], tokens[i : i + 1], v[i : i + 1])
            found["residual_order"].append(residual_order_test(values.order_u, 0.01, 0.9).p_value)
            found["token_counts"].append(token_counts_test(values, 0.01, 0.9).p_value)
            found["surprisal"].append(surprisal_test(values, 0.01, 0.9).p_value)
    return {name: np.array(ps) for name, ps in found.items()}


@pytest.mark.parametrize("alpha", [0.05, 0.01])
def test_calibrated_under_h0(alpha):
    """2000 replicates of 200 steps, every test at level alpha: the rejection count stays below
    the binomial(2000, alpha) 0.999 quantile."""
    p_values = _h0_p_values()
    replicates = len(p_values["surprisal"])
    bound = int(stats.binom.ppf(0.999, replicates, alpha))
    for name, ps in p_values.items():
        count = int((ps <= alpha).sum())
        assert count <= bound, (
            f"{name} rejected {count} of {replicates} H0 replicates at alpha = {alpha}; a valid test exceeds "
            f"{bound} (the binomial 0.999 quantile) with probability <= 0.001"
        )


def _fails(name: str, law, n: int = 20, length: int = 200) -> dict:
    p, q, tokens, v = _walk(*_tables(7), n=n, length=length, seed=8, law=law)
    results = {r.name: r for r in conditional_tests(_values(p, q, tokens, v), 0.001, 0.99)}
    assert not results[name].passed, results[name].message()
    return results


def test_surprisal_fails_at_temperature_1_3():
    results = _fails("pit.surprisal", lambda p, q: p ** (1 / 1.3) / (p ** (1 / 1.3)).sum(-1, keepdim=True))
    assert "more surprising" in results["pit.surprisal"].observed


def test_token_counts_fail_when_one_id_is_over_drawn_3x():
    def over_draw(p, q):
        tilted = p.clone()
        tilted[:, 5] *= 3
        return tilted / tilted.sum(-1, keepdim=True)

    results = _fails("pit.token_counts", over_draw)
    assert "id 5 " in results["pit.token_counts"].observed


def test_residual_order_fails_when_the_recovered_token_is_drawn_from_p():
    def residual_is_p(p, q):
        overlap = torch.minimum(p, q)
        drafted = q.sum(-1, keepdim=True) > 0
        return torch.where(drafted, overlap + (1 - overlap.sum(-1, keepdim=True)) * p, p)

    _fails("pit.residual_order", residual_is_p, n=40)


def test_conditional_tests_split_alpha_and_are_scoped():
    p, q, tokens, v = _walk(*_tables(9), n=4, length=100, seed=10)
    results = conditional_tests(_values(p, q, tokens, v), 0.03, 0.99)
    assert [r.name for r in results] == ["pit.residual_order", "pit.token_counts", "pit.surprisal", "pit.bug_classes"]
    assert all(r.alpha == pytest.approx(0.03 / CONDITIONAL_TESTS) and r.scope == "conditional" for r in results)
    assert all(r.passed for r in results), [r.message() for r in results]


def test_bad_input_names_the_argument():
    p, q, tokens, v = _walk(*_tables(11), n=2, length=5, seed=12)
    tested = torch.ones(2, 5, dtype=torch.bool)
    nan_p = p.clone()
    nan_p[0, 0, 0] = math.nan
    cases = [
        ((p[0], q, tokens, v, tested), "p [n, L, V]"),
        ((p, q[:, :3], tokens, v, tested), "q"),
        ((p, q, tokens[:, :3], v, tested), "tokens"),
        ((p, q, tokens, v[:1], tested), "v"),
        ((p, q, tokens, v, tested[:, :2]), "tested"),
        ((nan_p, q, tokens, v, tested), "p"),
        ((p, q, tokens + V, v, tested), "tokens"),
        ((p, q * 2, tokens, v, tested), "q"),
    ]
    for args, name in cases:
        with pytest.raises(LosscheckError, match=rf"from_chunk {re.escape(name)}|needs {re.escape(name)}"):
            ConditionalValues.from_chunk(*args)
    with pytest.raises(LosscheckError, match="ordered_pit tokens"):
        ordered_pit(p, p, tokens - 1, v)
    with pytest.raises(LosscheckError, match="ordered_pit key"):
        ordered_pit(p, p * math.inf, tokens, v)
