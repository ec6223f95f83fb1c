"""Running one matrix cell: greedy equality, teacher-forced PIT or exact enumeration.

Each `run_*` returns a `CellOutcome`: the verdict, a message that explains it and a JSON-ready
record for the certificate. The certification tests only assert on it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from losscheck import bundled
from losscheck.engine import Generation, LoopStats, pad_prompts
from losscheck.errors import TargetError
from losscheck.greedy import divergence_dict, find_divergences
from losscheck.matrix import Cell
from losscheck.sampling import GREEDY, make_generator, process_logits
from losscheck.session import Session

SAMPLE_MARGIN = 1.1  # draw 10% more than the power calculation needs (EOS shortens rows)


@dataclass
class CellOutcome:
    cell: Cell
    kind: str  # "greedy" | "pit" | "exact"
    passed: bool
    message: str
    record: dict[str, Any] = field(default_factory=dict)


def _engine(session: Session, cell: Cell) -> Any:
    target = session.targets[cell.target]
    if cell.drafter == "baseline":
        return session.engine_factory()(target)
    drafter = session.drafters(cell.target)[cell.drafter]
    return session.engine_factory()(target, drafter, cell.k, cell.width)


def _record(cell: Cell, kind: str, passed: bool, **extra: Any) -> dict[str, Any]:
    return {
        "cell": cell.id,
        "kind": kind,
        "drafter": cell.drafter,
        "k": cell.k,
        "width": cell.width,
        "params": cell.params.label(),
        "target": cell.target,
        "passed": passed,
        **extra,
    }


def merged_stats(stats: list[LoopStats]) -> LoopStats:
    """Sum the counters of several `generate` calls of one cell."""
    k = stats[0].k
    out = LoopStats(k, torch.zeros(k, dtype=torch.long), torch.zeros(k, dtype=torch.long))
    for s in stats:
        out.proposed += s.proposed
        out.accepted += s.accepted
        out.row_rounds += s.row_rounds
        out.emitted += s.emitted
        out.draft_seconds += s.draft_seconds
        out.target_seconds += s.target_seconds
        out.total_seconds += s.total_seconds
    return out


# --- greedy --------------------------------------------------------------------------------------
def run_greedy(session: Session, cell: Cell) -> CellOutcome:
    """Spec output == baseline output, token for token, on every prompt of every tier."""
    target = session.targets[cell.target]
    max_new = session.options.profile.greedy_max_new
    engine = _engine(session, cell)
    divergences, acceptance, n_prompts = [], {}, 0
    for tier in bundled.PROMPT_TIERS:
        prompts = bundled.load_prompts(tier)
        n_prompts += len(prompts)
        gen = make_generator(session.options.seed, cell.id, tier)
        spec = engine.generate(prompts, max_new, GREEDY, gen)
        base = session.baseline(
            ("greedy", cell.target, tier),
            lambda: session.engine_factory()(target).generate(prompts, max_new, GREEDY, gen),
        )
        precision = target.identity.get("precision", "fp32")
        divergences += find_divergences(target.model, tier, prompts, spec, base, precision)
        acceptance[tier] = spec.stats.to_dict()
    failing = [d for d in divergences if session.options.strict or not d.near_tie]
    problems = []
    if cell.drafter == "self":
        for tier, stats in acceptance.items():
            if stats["proposed"] != stats["accepted"]:
                problems.append(
                    f"self-draft oracle accepted {sum(stats['accepted'])}/{sum(stats['proposed'])} "
                    f"drafts on {tier}-entropy prompts; greedy self-drafts must all be accepted"
                )
    passed = not failing and not problems
    lines = [f"cell {cell.id}: greedy output {'equals' if passed else 'DIFFERS FROM'} the baseline "
             f"on {n_prompts} prompts x {max_new} tokens"]
    lines += ["  " + d.describe() for d in divergences[:10]] + ["  " + p for p in problems]
    record = _record(cell, "greedy", passed, divergences=[divergence_dict(d) for d in divergences],
                     acceptance=acceptance, max_new_tokens=max_new)
    return CellOutcome(cell, "greedy", passed, "\n".join(lines), record)


# --- sampling: shared helpers -------------------------------------------------------------------
def generate_rows(
    session: Session, cell: Cell, prompts: list[list[int]], n: int, horizon: int, stream: str
) -> tuple[list[list[int]], Generation]:
    """Draw `n` sequences of `horizon` tokens, cycling over `prompts`, in engine batches."""
    engine = _engine(session, cell)
    batch = session.options.profile.batch
    rows = [prompts[i % len(prompts)] for i in range(n)]
    gens = []
    for start in range(0, n, batch):
        gen = make_generator(session.options.seed, cell.id, stream, start)
        gens.append(engine.generate(rows[start : start + batch], horizon, cell.params, gen))
    tokens = torch.cat([g.tokens for g in gens])
    lengths = torch.cat([g.lengths for g in gens])
    return rows, Generation(tokens, lengths, merged_stats([g.stats for g in gens]), cell.params)


def oracle_problem(cell: Cell, stats: LoopStats) -> str | None:
    if cell.drafter != "self" or int(stats.proposed.sum()) == int(stats.accepted.sum()):
        return None
    return (
        f"self-draft oracle accepted {int(stats.accepted.sum())}/{int(stats.proposed.sum())} "
        "drafts; drafting with the target itself must be accepted with probability 1"
    )


def _sampling_outcome(
    session: Session, cell: Cell, kind: str, results: list[Any], stats: LoopStats, n_rows: int, **extra: Any
) -> CellOutcome:
    from losscheck.stats.result import combine

    verdict = combine(cell.id, results, session.per_test_alpha)
    problem = oracle_problem(cell, stats)
    passed = verdict.passed and problem is None
    message = verdict.message() + (f"\n  {problem}" if problem else "")
    message += f"\n  acceptance length {stats.acceptance_length:.3f}, slot acceptance " + ", ".join(
        f"{a:.3f}" for a in stats.slot_acceptance()
    )
    record = _record(cell, kind, passed, sequences=n_rows, verdict=verdict.to_dict(),
                     acceptance=stats.to_dict(), oracle_problem=problem, **extra)
    return CellOutcome(cell, kind, passed, message, record)


# --- sampling: teacher-forced PIT ---------------------------------------------------------------
def pit_sample_size(session: Session, horizon: int) -> int:
    """Sequences a PIT cell needs so its pooled tests detect the profile's TV at its power."""
    from losscheck.stats.pit import pit_required_values

    profile = session.options.profile
    values = pit_required_values(session.per_test_alpha, profile.power, profile.detect_tv, profile.pit_bins)
    return math.ceil(values * SAMPLE_MARGIN / horizon)


def teacher_forced_probs(target: Any, rows: list[list[int]], gen: Generation) -> torch.Tensor:
    """One fresh target pass over prompt + generated tokens → p [N, L, V] at generated positions,
    after the request's logits processing. Independent of the engine's cache by construction."""
    n, horizon = gen.tokens.shape
    out = []
    for start in range(0, n, 4096):
        chunk = rows[start : start + 4096]
        prompt_ids, plen = pad_prompts(chunk, target.vocab_size)
        width = prompt_ids.shape[1] + horizon
        ids = torch.cat([prompt_ids, prompt_ids.new_zeros(len(chunk), horizon)], dim=1)  # [n, P+L]
        at = plen[:, None] + torch.arange(horizon)  # [n, L] where generated tokens go
        ids.scatter_(1, at, gen.tokens[start : start + len(chunk)])
        target.reset(len(chunk), width)
        logits, _ = target.forward(ids, torch.zeros(len(chunk), dtype=torch.long))
        index = (at - 1)[..., None].expand(-1, -1, logits.shape[-1])
        out.append(process_logits(logits.gather(1, index), gen.params))  # [n, L, V]
    return torch.cat(out)


def run_pit(session: Session, cell: Cell) -> CellOutcome:
    from losscheck.stats.pit import pit_tests, randomized_pit

    profile = session.options.profile
    horizon = profile.horizon
    target = session.targets[cell.target]
    prompts = [p for tier in bundled.PROMPT_TIERS for p in bundled.load_prompts(tier)]
    n = pit_sample_size(session, horizon)
    rows, gen = generate_rows(session, cell, prompts, n, horizon, "pit-sample")
    probs = teacher_forced_probs(target, rows, gen)
    v = torch.rand(gen.tokens.shape, generator=make_generator(session.options.seed, cell.id, "pit-v"),
                   dtype=torch.float64)
    u = randomized_pit(probs, gen.tokens, v)
    results = pit_tests(u, gen.mask(), session.per_test_alpha, profile.power, profile.detect_tv, profile.pit_bins)
    return _sampling_outcome(session, cell, "pit", results, gen.stats, n, horizon=horizon,
                             pit_histogram=torch.histc(u[gen.mask()].float(), 20, 0, 1).tolist())


# --- sampling: exact enumeration ------------------------------------------------------------------
def exact_prompt() -> list[int]:
    """The small target's longest prompt: the most context, still cheap to enumerate from."""
    return max(bundled.load_prompts("small"), key=len)


def exact_sample_size(session: Session, n_sequences: int, horizon: int) -> int:
    from losscheck.stats.exact import exact_required_n

    profile = session.options.profile
    need = exact_required_n(n_sequences, horizon, session.per_test_alpha, profile.power, profile.detect_tv)
    return math.ceil(need * SAMPLE_MARGIN)


def run_exact(session: Session, cell: Cell) -> CellOutcome:
    from losscheck.stats.exact import enumerate_continuations, exact_tests

    profile = session.options.profile
    horizon = profile.exact_horizon
    target = session.targets[cell.target]
    prompt = exact_prompt()

    @torch.inference_mode()
    def next_probs(context: torch.Tensor) -> torch.Tensor:
        logits = target.model(input_ids=context).logits[:, -1]
        return process_logits(logits, cell.params).double()

    seqs, probs = session.baseline(
        ("exact", cell.target, cell.params, horizon),
        lambda: enumerate_continuations(next_probs, prompt, horizon, target.eos_id),
    )
    n = exact_sample_size(session, len(seqs), horizon)
    _, gen = generate_rows(session, cell, [prompt], n, horizon, "exact-sample")
    samples = torch.where(gen.mask(), gen.tokens, target.eos_id if target.eos_id is not None else 0)
    results = exact_tests(samples, seqs, probs, session.per_test_alpha, profile.power, profile.detect_tv)
    return _sampling_outcome(session, cell, "exact", results, gen.stats, n, horizon=horizon,
                             prompt=prompt, continuations=len(seqs))





# --- sampling: black-box engine, two-sample ------------------------------------------------------
def two_sample_size(session: Session, horizon: int) -> int:
    """Rows per sample (equal sizes) for the per-position tests to detect the profile's TV."""
    from losscheck.stats.power import chisquare_required_n

    profile = session.options.profile
    a = session.per_test_alpha / (horizon + 1)
    n_eff = chisquare_required_n(2 * profile.detect_tv, profile.two_sample_bins, a, profile.power)
    return math.ceil(2 * n_eff * SAMPLE_MARGIN)  # n_eff = n/2 for two samples of n


def run_two_sample(session: Session, cell: Cell) -> CellOutcome:
    """The black-box engine's samples against plain decoding of the same target."""
    from losscheck.stats.two_sample import two_sample_tests

    profile = session.options.profile
    horizon, target = profile.two_sample_horizon, session.targets["main"]
    prompt = max(bundled.load_prompts("mid"), key=len)
    n = two_sample_size(session, horizon)
    seed = session.options.seed
    spec = torch.as_tensor(session.blackbox.generate(prompt, n, cell.params, seed, horizon), dtype=torch.long)
    if tuple(spec.shape) != (n, horizon):
        raise TargetError(f"engine {session.blackbox.name!r} returned shape {tuple(spec.shape)}, expected ({n}, {horizon})")
    eos = target.eos_id if target.eos_id is not None else 0
    _, base = generate_rows(session, dataclasses.replace(cell, drafter="baseline"), [prompt], n, horizon, "baseline")
    base_ids = torch.where(base.mask(), base.tokens, eos)
    results = two_sample_tests(spec, base_ids, target.vocab_size, session.per_test_alpha, profile.power,
                               profile.detect_tv, max_bins=profile.two_sample_bins)
    from losscheck.stats.result import combine

    verdict = combine(cell.id, results, session.per_test_alpha)
    record = _record(cell, "two-sample", verdict.passed, sequences=n, horizon=horizon, engine=session.blackbox.name,
                     verdict=verdict.to_dict())
    return CellOutcome(cell, "two-sample", verdict.passed, verdict.message(), record)
