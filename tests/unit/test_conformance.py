"""Conformance of a verifier to standard speculative sampling, on random rounds whose drafts are
honest samples of their q: the correct verifier passes, each planted bug fails the check it breaks."""

from __future__ import annotations

import pytest
import torch

from losscheck.cells.conformance import Recorder
from losscheck.core.sampling import SamplingParams, sample
from losscheck.core.verify import BlockOutcome, verify_block
from losscheck.selftest.verifiers import in_sampled_rounds, verify_residual_is_p, verify_shared_uniform

ROUNDS, ROWS, K, V = 60, 200, 3, 6
ALPHA, POWER = 0.01, 0.99
T1 = SamplingParams()
HONEST_FAILS = "false-failure probability <= alpha = 0.01 (Bonferroni over the four uniformity tests and the score)"


def run(verifier, dishonest_q: bool = False, seed: int = 0) -> dict:
    """ROUNDS rounds of ROWS rows: random target logits, drafts drawn from a random q (reported as
    drawn, or as the softmax of other logits when `dishonest_q`). Returns the tests by name."""
    gen = torch.Generator().manual_seed(seed)
    recorder = Recorder(verifier, torch.Generator().manual_seed(seed + 1))
    for _ in range(ROUNDS):
        logits = 2 * torch.randn(ROWS, K + 1, V, generator=gen)
        q = torch.softmax(2 * torch.randn(ROWS, K, V, generator=gen), -1)
        drafts = sample(q, gen)
        reported = torch.softmax(torch.randn(ROWS, K, V, generator=gen), -1) if dishonest_q else q
        recorder(logits, drafts, reported, T1, gen)
    return {r.name.split(".")[1]: r for r in recorder.tests(ALPHA, POWER)}


def test_the_standard_verifier_conforms():
    results = run(verify_block)
    failed = [r.message() for r in results.values() if not r.passed]
    assert not failed, HONEST_FAILS + "\n" + "\n".join(failed)
    assert results["acceptance"].n > ROUNDS * ROWS and results["residual"].n > 0 and results["bonus"].n > 0


@pytest.mark.parametrize("bug, broken", [(verify_residual_is_p, "residual"), (verify_shared_uniform, "acceptance")])
def test_a_planted_verifier_bug_fails_the_check_it_breaks(bug, broken):
    results = run(in_sampled_rounds(bug))
    assert not results[broken].passed, f"{bug.__name__} passed {broken}: {results[broken].message()}"
    assert results["draft_honesty"].passed, "the drafts are honest; " + HONEST_FAILS


def test_a_drafter_reporting_another_q_fails_draft_honesty():
    results = run(verify_block, dishonest_q=True)
    assert not results["draft_honesty"].passed, results["draft_honesty"].message()


def always_reject(logits, drafts, q, params, generator) -> BlockOutcome:
    tokens = torch.cat([drafts, drafts[:, :1]], 1)
    return BlockOutcome(torch.zeros(drafts.shape[0], dtype=torch.long), tokens)


def test_rejecting_a_draft_the_target_prefers_is_impossible():
    results = run(always_reject)
    assert not results["impossible_rejection"].passed and results["impossible_rejection"].statistic > 0


def lenient(logits, drafts, q, params, generator) -> BlockOutcome:
    """Accepts with min(1, 1.1 p / q): a lossy rule that keeps drafts a little too often at every
    prefix, then recovers from the correct residual."""
    from losscheck.core.sampling import process_logits
    from losscheck.core.verify import normalized, recovery_distribution

    p = normalized(process_logits(logits, params))  # [B, k+1, V]
    q = normalized(q)  # [B, k, V]
    k = drafts.shape[1]
    p_x = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [B, k]
    q_x = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(p_x.shape, generator=generator, dtype=torch.float64)
    keep = u < (1.1 * p_x / q_x).clamp(max=1.0)  # BUG: the ratio scaled by 1.1
    accepted = keep.long().cumprod(-1).sum(-1)  # [B]
    rows = torch.arange(len(accepted))
    stop = sample(recovery_distribution(p, q)[rows, accepted].float(), generator)  # [B]
    tokens = torch.cat([drafts, drafts[:, :1]], 1)
    tokens[rows, accepted] = stop
    return BlockOutcome(accepted, tokens)


def test_a_lenient_acceptance_rule_fails_the_acceptance_score():
    results = run(lenient)
    assert not results["acceptance_score"].passed, results["acceptance_score"].message()
    assert results["acceptance_score"].statistic > 0, "the rule keeps too many drafts"


def test_a_recording_watches_the_engine_verifier_inside_the_with_only():
    from losscheck.cells.conformance import recording
    from losscheck.core.engine import Engine
    from losscheck.core.sampling import make_generator
    from tests.support import PROMPTS, noisy_drafter, tiny_target

    target = tiny_target()
    engine = Engine(target, noisy_drafter(target, 0.6), K)
    own = engine.verifier
    with recording(engine, torch.Generator().manual_seed(1), 1e-6) as recorder:
        assert recorder is not None and engine.verifier is recorder and recorder.inner is own
        engine.generate(PROMPTS, 8, T1, make_generator(0, "recorded"))
    assert engine.verifier is own and recorder.decided > 0
    decided = recorder.decided
    engine.generate(PROMPTS, 8, T1, make_generator(0, "after"))
    assert recorder.decided == decided
    with pytest.raises(RuntimeError), recording(engine, torch.Generator(), 1e-6):
        raise RuntimeError
    assert engine.verifier is own
    with recording(None, torch.Generator(), 1e-6) as nothing:  # a split run: no engine in this process
        assert nothing is None
