"""Running one matrix cell: greedy equality, teacher-forced PIT or exact enumeration (black-box
engines' cells: `losscheck.cells.blackbox`).

`run_cell` returns a `CellOutcome`: the typed findings of the cell (statistical verdict,
divergences, loop statistics, oracle problems), which explain themselves in `message()` and
become JSON for the certificate in `to_record()`. The certification tests only assert on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from losscheck.core.divergence import Divergence, find_divergences
from losscheck.core.engine import Engine, pad_prompts
from losscheck.core.generation import Generation, LoopStats
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator, process_logits
from losscheck.core.target import HFTarget
from losscheck.plan.matrix import ORACLE, Cell
from losscheck.run.session import Session
from losscheck.stats import sample_size
from losscheck.stats.result import CellVerdict, combine


@dataclass
class CellOutcome:
    """What one cell found."""

    cell: Cell
    verdict: CellVerdict | None = None  # statistical cells
    divergences: list[Divergence] = field(default_factory=list)  # greedy cells
    acceptance: dict[str, LoopStats] = field(default_factory=dict)  # prompt group -> loop counters
    problems: list[str] = field(default_factory=list)  # e.g. the oracle rejected a draft
    details: dict[str, Any] = field(default_factory=dict)  # JSON-ready facts: sample sizes, horizon…
    strict: bool = False  # near-tie divergences fail too (--losscheck-strict)

    @property
    def kind(self) -> str:
        return self.cell.mode

    @property
    def failing_divergences(self) -> list[Divergence]:
        """Divergences that fail the cell: all of them under `strict`, else all but near-ties."""
        return [d for d in self.divergences if self.strict or not d.near_tie]

    @property
    def near_ties(self) -> int:
        return sum(d.near_tie for d in self.divergences)

    @property
    def passed(self) -> bool:
        statistical = self.verdict is None or self.verdict.passed
        return statistical and not self.failing_divergences and not self.problems

    def message(self) -> str:
        if self.verdict is not None:
            lines = [self.verdict.message()]
        else:
            same = (
                "equals"
                if not self.divergences
                else "DIFFERS FROM"
                if not self.passed
                else "differs at near-ties only from"
            )
            lines = [
                f"cell {self.cell.id}: greedy output {same} the baseline on {self.details['prompts']} prompts "
                f"x {self.details['max_new_tokens']} tokens ({self.cell.precision.label()}; "
                f"{self.near_ties} near-tie divergences{', failing under --losscheck-strict' if self.strict else ''})"
            ]
            lines += ["  " + d.describe() for d in self.divergences[:10]]
        lines += ["  " + p for p in self.problems]
        if self.details.get("acceptance_rule"):  # a checkpoint that brings its own rule names it
            lines.append(f"  the drafter ran its own acceptance rule: {self.details['acceptance_rule']}")
        for group, stats in self.acceptance.items():
            slots = ", ".join(f"{a:.3f}" for a in stats.slot_acceptance())
            lines.append(f"  {group}: acceptance length {stats.acceptance_length:.3f}, slot acceptance {slots}")
        return "\n".join(lines)

    def to_record(self) -> dict[str, Any]:
        """The cell's entry in the certificate (JSON-ready)."""
        c = self.cell
        return {
            "cell": c.id,
            "kind": self.kind,
            "drafter": c.drafter,
            "k": c.k,
            "width": c.width,
            "params": c.params.label(),
            "target": c.target,
            "precision": c.precision.label(),
            "passed": self.passed,
            "near_ties": self.near_ties,
            "verdict": None if self.verdict is None else self.verdict.to_dict(),
            "divergences": [d.to_dict() for d in self.divergences],
            "acceptance": {group: stats.to_dict() for group, stats in self.acceptance.items()},
            "problems": self.problems,
            **self.details,
        }


def run_cell(session: Session, cell: Cell) -> CellOutcome:
    """Certify a cell of losscheck's own loop the way its mode asks."""
    run = {"greedy": run_greedy, "pit": run_pit, "exact": run_exact}[cell.mode]
    return run(session, cell)


def oracle_problems(cell: Cell, acceptance: dict[str, LoopStats]) -> list[str]:
    """The self-draft oracle must have every draft accepted (the target drafting for itself). Only
    in fp32: in reduced precision the drafting (one token at a time) and the scoring (k+1 at once)
    round differently, so near-ties may reject; the acceptance is still reported."""
    if cell.drafter != ORACLE or cell.precision.reduced:
        return []
    return [
        f"self-draft oracle accepted {int(s.accepted.sum())}/{int(s.proposed.sum())} drafts on {group} "
        "prompts; drafting with the target itself must be accepted with probability 1"
        for group, s in acceptance.items()
        if not s.all_accepted
    ]


# --- greedy --------------------------------------------------------------------------------------
def run_greedy(session: Session, cell: Cell) -> CellOutcome:
    """Spec output == baseline output, token for token, on every prompt of every tier."""
    target = session.cell_target(cell)
    max_new = session.options.profile.greedy_max_new
    # In fp32 every divergence fails; in reduced precision, or split over ranks (another reduction
    # order), one within the target's round-off is a near-tie.
    tolerance = cell.precision.tolerance if cell.precision.reduced or cell.split > 1 else 0.0
    outcome = CellOutcome(
        cell,
        details={
            "prompts": 0,
            "max_new_tokens": max_new,
            "near_tie_margin": tolerance,
            "serving": cell.serving,
            **drafter_rule(session, cell),
        },
        strict=session.options.strict,
    )
    engine = session.engine(cell) if cell.split == 1 else None
    tiers = session.prompt_tiers
    requests = {
        tier: serving_prompts(session, cell, engine, session.prompts(tier), max_new, GREEDY, tier) for tier in tiers
    }
    streams = {tier: (cell.id, tier) for tier in tiers}
    if engine is None:
        spec_of = split_generations(session, cell, [(requests[t], max_new, GREEDY, streams[t]) for t in tiers], outcome)
    for i, tier in enumerate(tiers):
        session.progress.update(cell.id, "prompt tiers", i, len(tiers))
        prompts = requests[tier]
        gen = make_generator(session.options.seed, *streams[tier], device=target.device)
        spec = serve(session, cell, engine, prompts, max_new, GREEDY, gen) if engine is not None else spec_of[i]
        base = session.baseline(
            ("greedy", cell.target, cell.precision.target, tuple(map(tuple, prompts))),
            lambda: session.baseline_engine(cell).generate(prompts, max_new, GREEDY, gen),
        )
        outcome.divergences += find_divergences(target.model, tier, prompts, spec, base, tolerance)
        outcome.acceptance[tier] = spec.stats
        outcome.details["prompts"] += len(prompts)
    outcome.problems = oracle_problems(cell, outcome.acceptance)
    cache_facts(engine, outcome)
    return outcome


# --- serving axes: prefix cache, continuous batching, tensor-parallel split ----------------------
def serve(
    session: Session,
    cell: Cell,
    engine: Engine,
    prompts: list[list[int]],
    max_new: int,
    params: SamplingParams,
    generator: torch.Generator,
) -> Generation:
    """`engine` runs `prompts` as the cell schedules them: a batch at a time, or by continuous
    batching (a quarter as many rows as requests, arrivals staggered by a seeded draw)."""
    if cell.batching == "static":
        return engine.generate(prompts, max_new, params, generator)
    from losscheck.serving.batching import staggered_arrivals

    rows = min(max(4, len(prompts) // 4), session.options.profile.batch)
    arrivals = staggered_arrivals(
        len(prompts), rows, max_new, make_generator(session.options.seed, cell.id, "arrivals", len(prompts))
    )
    return session.batcher(engine, rows).generate(prompts, max_new, params, generator, arrivals)


def serving_prompts(
    session: Session,
    cell: Cell,
    engine: Engine | None,
    prompts: list[list[int]],
    max_new: int,
    params: SamplingParams,
    stream: object,
) -> list[list[int]]:
    """The requests a cell measures: `prompts`, or for a warm prefix cache the second turn
    (`losscheck.serving.prefix_cache.second_turn`) after a first turn of `prompts` through `engine`, which
    fills its cache."""
    if cell.prefix != "warm" or engine is None:  # a split cell has no prefix cache (matrix.SERVING_PAIRS)
        return prompts
    from losscheck.serving.prefix_cache import second_turn

    target = session.cell_target(cell)
    first = serve(
        session,
        cell,
        engine,
        prompts,
        session.options.profile.greedy_max_new,
        params,
        make_generator(session.options.seed, cell.id, "first-turn", stream, device=target.device),
    )
    assert engine.prefix_cache is not None
    return second_turn(
        prompts,
        [first.row(i) for i in range(len(prompts))],
        engine.prefix_cache.block,
        target.vocab_size,
        target.max_positions - max_new,
    )


def cache_facts(engine: Engine | None, outcome: CellOutcome) -> None:
    """The prefix cache's block size and counters (lookups, hits, hit rate, evictions) in the record."""
    if engine is not None and engine.prefix_cache is not None:
        cache = engine.prefix_cache
        outcome.details["prefix_cache"] = {"block": cache.block, "capacity": cache.capacity, **cache.stats.to_dict()}


def split_generations(
    session: Session,
    cell: Cell,
    calls: list[tuple[list[list[int]], int, SamplingParams, tuple[object, ...]]],
    outcome: CellOutcome,
) -> list[Generation]:
    """Rank 0's generations of `calls` (prompts, max_new, params, generator stream) with the
    target split over `cell.split` ranks (`losscheck.serving.split`); the split run's wall time
    and backend go into the record."""
    import pytest

    from losscheck.serving.split import Call, SplitUnavailable, split_generate

    try:
        run = split_generate(session.options, cell, [Call(p, n, params, stream) for p, n, params, stream in calls])
    except SplitUnavailable as exc:  # the certificate lists the cell as not run, with this reason
        pytest.skip(f"tensor-parallel split cannot run here: {exc}")
    outcome.details["split"] = {"ranks": run.ranks, "backend": run.backend, "wall_s": round(run.wall_s, 2)}
    return run.generations


# --- sampling: shared helpers -------------------------------------------------------------------
# Bytes held per row x scored slot x vocabulary entry by one engine round: the target's float32
# logits, the drafter's q, the processed p (top-p sorts: values and int64 indices), and the
# verifier's float64 p, q and residual.
ENGINE_BYTES_PER_LOGIT = 56


def engine_batch_rows(k: int, vocab: int, budget_bytes: int, max_rows: int) -> int:
    """Rows one engine call runs so that a round's [rows, k+1, V] tensors stay within the budget."""
    return max(1, min(max_rows, budget_bytes // ((k + 1) * vocab * ENGINE_BYTES_PER_LOGIT)))


def generate_rows(
    session: Session,
    cell: Cell,
    prompts: list[list[int]],
    n: int,
    horizon: int,
    stream: str,
    baseline: bool = False,
    engine: Engine | None = None,
    outcome: CellOutcome | None = None,
) -> tuple[list[list[int]], Generation]:
    """Draw `n` sequences of `horizon` tokens, cycling over `prompts`, in engine batches that fit
    the memory budget (with `engine`, default the cell's speculative or baseline one), served as
    the cell schedules them (`serve`; split over ranks, `split_generations`, whose facts go into
    `outcome`)."""
    target = session.cell_target(cell)
    k = engine.k if engine is not None else 0 if baseline else cell.k
    batch = engine_batch_rows(
        k, target.vocab_size, session.options.memory_budget_mib << 20, session.options.profile.batch
    )
    rows = [prompts[i % len(prompts)] for i in range(n)]
    if cell.batching == "continuous" and not baseline:  # one stream of requests, `serve` sizes the rows
        batch = n
    starts = range(0, n, batch)
    streams = [(cell.id, stream, start) for start in starts]
    if cell.split > 1 and not baseline:
        calls = [(rows[start : start + batch], horizon, cell.params, key) for start, key in zip(starts, streams)]
        return rows, Generation.concat(split_generations(session, cell, calls, outcome or CellOutcome(cell)))
    engine = engine or (session.baseline_engine(cell) if baseline else session.engine(cell))
    parts = []
    for start, key in zip(starts, streams):
        session.progress.update(cell.id, f"{stream} sequences drawn", start, n)
        gen = make_generator(session.options.seed, *key, device=target.device)
        part = rows[start : start + batch]
        parts.append(
            engine.generate(part, horizon, cell.params, gen)
            if baseline
            else serve(session, cell, engine, part, horizon, cell.params, gen)
        )
    return rows, Generation.concat(parts)


def _sampled_outcome(session: Session, cell: Cell, results: list[Any], gen: Generation, **details: Any) -> CellOutcome:
    acceptance = {"all": gen.stats}
    return CellOutcome(
        cell,
        verdict=combine(cell.id, results, session.per_test_alpha),
        acceptance=acceptance,
        problems=oracle_problems(cell, acceptance),
        details={**details, **drafter_rule(session, cell)},
    )


def drafter_rule(session: Session, cell: Cell) -> dict[str, str]:
    """`{"acceptance_rule": ...}` when the cell's drafter verifies with a rule of its own
    (`Drafter.acceptance_rule`, e.g. a speculators checkpoint's verifier_accept_k), else nothing."""
    drafter = session.drafters(cell.target, cell.precision).get(cell.drafter)
    rule = getattr(drafter, "acceptance_rule", None)
    return {"acceptance_rule": rule} if rule else {}


# --- sampling: teacher-forced PIT ---------------------------------------------------------------
# Bytes held per row x scored position x vocabulary entry while a chunk is scored: float32 logits of
# the whole row, the gathered and processed float32 distributions, and randomized_pit's float64
# copy, mask and masked sum.
BYTES_PER_LOGIT = 32


def pit_chunk_rows(width: int, vocab: int, budget_bytes: int, max_rows: int) -> int:
    """Rows scored at once so that a chunk of `width` positions over `vocab` stays within the budget."""
    return max(1, min(max_rows, budget_bytes // (width * vocab * BYTES_PER_LOGIT)))


def teacher_forced_probs(
    target: HFTarget, rows: list[list[int]], tokens: torch.Tensor, params: SamplingParams, tolerance: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fresh target pass over prompt + generated `tokens [n, L]` → (p [n, L, V] at the generated
    positions after the request's logits processing, ambiguous [n, L] bool). Independent of the
    engine's cache.

    A token is *ambiguous* when top-k / top-p cut it (p = 0 here) although its raw logit lies within
    `tolerance` of the lowest logit kept: a pass with another batch shape (the engine's cached one)
    may round it inside the cut. Under exact H0 no generated token has p = 0, so leaving these out
    of the test changes nothing but round-off; everything further out stays a support failure.
    """
    n, horizon = tokens.shape
    prompt_ids, plen = pad_prompts(rows, target.vocab_size, target.device)
    ids = torch.cat([prompt_ids, prompt_ids.new_zeros(n, horizon)], dim=1)  # [n, P+L]
    at = plen[:, None] + torch.arange(horizon, device=ids.device)  # [n, L] where generated tokens go
    ids.scatter_(1, at, tokens)
    target.reset(n, ids.shape[1])
    logits, _ = target.forward(ids, torch.zeros(n, dtype=torch.long, device=ids.device))
    index = (at - 1)[..., None].expand(-1, -1, logits.shape[-1])
    logits = logits.gather(1, index)  # [n, L, V]
    probs = process_logits(logits, params)  # [n, L, V]
    cut = probs.gather(-1, tokens[..., None]).squeeze(-1) == 0  # [n, L]
    lowest_kept = logits.masked_fill(probs == 0, float("inf")).amin(-1)  # [n, L]
    ambiguous = cut & (logits.gather(-1, tokens[..., None]).squeeze(-1) >= lowest_kept - tolerance)
    return probs, ambiguous


def teacher_forced_pit(
    target: HFTarget,
    rows: list[list[int]],
    gen: Generation,
    v: torch.Tensor,
    budget_bytes: int,
    max_rows: int,
    tolerance: float = 0.0,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Randomized PIT u [N, L] of every generated token under the target (`v [N, L]` the PIT's
    uniforms) and the cut-off ambiguity [N, L] of `teacher_forced_probs`, scored a chunk of rows at
    a time: peak memory stays within `budget_bytes` however large rows × vocabulary grow. Rows are
    independent, so chunking leaves every value unchanged. `progress(done, n)` before each chunk."""
    from losscheck.stats.pit import randomized_pit

    n, horizon = gen.tokens.shape
    chunk = pit_chunk_rows(max(len(r) for r in rows) + horizon, target.vocab_size, budget_bytes, max_rows)
    u, ambiguous = [], []
    for start in range(0, n, chunk):
        if progress is not None:
            progress(start, n)
        end = start + chunk
        probs, unsure = teacher_forced_probs(target, rows[start:end], gen.tokens[start:end], gen.params, tolerance)
        u.append(randomized_pit(probs, gen.tokens[start:end], v[start:end]))
        ambiguous.append(unsure)
    return torch.cat(u), torch.cat(ambiguous)


def score_pit(
    session: Session,
    stream: str,
    target: HFTarget,
    rows: list[list[int]],
    gen: Generation,
    tolerance: float,
    alpha: float | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """The PIT tests of `gen` (sequences continuing `rows`) under `target`, with the cut-off
    ambiguity `tolerance`, under `alpha` (default: the cell's whole share), and the facts the
    certificate keeps about them. `stream` names the PIT's uniforms (the cell id)."""
    from losscheck.stats.pit import pit_tests

    profile = session.options.profile
    # v is drawn on the CPU, so a seed gives the same PIT uniforms on every device.
    v = torch.rand(
        gen.tokens.shape, generator=make_generator(session.options.seed, stream, "pit-v"), dtype=torch.float64
    ).to(target.device)
    budget = session.options.memory_budget_mib << 20
    u, ambiguous = teacher_forced_pit(
        target,
        rows,
        gen,
        v,
        budget,
        profile.batch,
        tolerance,
        lambda done, n: session.progress.update(stream, "sequences scored", done, n),
    )
    u, mask, ambiguous = u.cpu(), gen.mask().cpu(), ambiguous.cpu() & gen.mask().cpu()
    tested = mask & ~ambiguous
    spare = torch.rand(
        gen.tokens.shape, generator=make_generator(session.options.seed, stream, "pit-pairs"), dtype=torch.float64
    )  # completes pairs that EOS cuts
    slots = None if gen.slots is None else gen.slots.cpu()
    alpha = session.per_test_alpha if alpha is None else alpha
    results = pit_tests(u, tested, alpha, profile.power, profile.detect_tv, profile.pit_bins, slots=slots, spare=spare)
    return results, {
        "cutoff_ambiguous": int(ambiguous.sum()),
        "cutoff_tolerance": tolerance,
        "pit_histogram": torch.histc(u[tested].float(), 20, 0, 1).tolist(),
        "pit_quantiles": _quantiles(u[tested]),
    }


def _quantiles(u: torch.Tensor, n: int = 99) -> list[float]:
    """The empirical quantiles of `u` at probabilities 1/(n+1) .. n/(n+1): a QQ plot in the record."""
    import numpy as np

    return np.quantile(u.double().numpy(), np.arange(1, n + 1) / (n + 1)).tolist()


def run_pit(session: Session, cell: Cell) -> CellOutcome:
    """Teacher-forced PIT of the spec loop's sequences, plus the conformance of its verifier to
    standard speculative sampling (`losscheck.cells.conformance`), the cell's alpha split over both."""
    from losscheck.cells.conformance import CONFORMANCE_TESTS, Recorder
    from losscheck.stats.pit import PIT_TESTS

    profile = session.options.profile
    horizon = profile.horizon
    prompts = [p for tier in session.prompt_tiers for p in session.prompts(tier)]
    alpha_pit = session.per_test_alpha * PIT_TESTS / (PIT_TESTS + CONFORMANCE_TESTS)
    n = sample_size.pit_sequences(alpha_pit, profile.power, profile.detect_tv, profile.pit_bins, horizon)
    needed = sample_size.pit_required_values(alpha_pit, profile.power, profile.detect_tv, profile.pit_bins)
    split = CellOutcome(cell)  # the split run's facts
    engine = session.engine(cell) if cell.split == 1 else None
    verifier = engine.verifier if engine is not None else None
    prompts = serving_prompts(session, cell, engine, prompts, horizon, cell.params, "pit")
    pilot: dict[str, int] = {}
    for stream in ("pit-sample", "pit-resample"):
        recorder = None
        if engine is not None:  # the conformance recorder wraps the verifier in this process only
            key = ("conformance",) if stream == "pit-sample" else ("conformance", stream)
            recorder = engine.verifier = Recorder(verifier, make_generator(session.options.seed, cell.id, *key))
        rows, gen = generate_rows(session, cell, prompts, n, horizon, stream, engine=engine, outcome=split)
        drawn = int(gen.mask().sum())
        if drawn >= needed:
            break
        # EOS cut the sequences short (e.g. at a high temperature): this sample was a pilot and is
        # set aside; a fresh one, sized from its tokens per sequence, is the one tested (its size
        # depends on the pilot only, so optional stopping cannot bias the tests)
        pilot = {"pilot_sequences": n, "pilot_tokens": drawn}
        n = math.ceil(needed * sample_size.SAMPLE_MARGIN * n / max(drawn, 1))
    results, facts = score_pit(
        session, cell.id, session.cell_target(cell), rows, gen, cell.precision.tolerance, alpha_pit
    )
    if recorder is not None:
        results += recorder.tests(session.per_test_alpha - alpha_pit, profile.power)
    outcome = _sampled_outcome(
        session,
        cell,
        results,
        gen,
        sequences=n,
        horizon=horizon,
        serving=cell.serving,
        **facts,
        **split.details,
        **pilot,
    )
    cache_facts(engine, outcome)
    return outcome


# --- sampling: exact enumeration ------------------------------------------------------------------
def exact_prompt(session: Session) -> list[int]:
    """The small target's longest prompt: the most context, still cheap to enumerate from."""
    return max(session.prompts("small"), key=len)


def exact_continuations(session: Session, target: str, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Every continuation of `exact_prompt` up to the profile's exact horizon and its exact target
    probability: (sequences [S, L], probabilities [S] float64), memoised per parameters."""
    from losscheck.stats.exact import enumerate_continuations

    model = session.targets[target]
    horizon = session.options.profile.exact_horizon

    @torch.inference_mode()
    def next_probs(context: torch.Tensor) -> torch.Tensor:
        logits = model.model(input_ids=context.to(model.device)).logits[:, -1]
        return process_logits(logits, params).double().cpu()

    return session.baseline(
        ("exact", target, params, horizon),
        lambda: enumerate_continuations(next_probs, exact_prompt(session), horizon, model.eos_id),
    )


def exact_cell_size(session: Session, n_continuations: int) -> int:
    """Sequences an exact cell draws."""
    profile = session.options.profile
    return sample_size.exact_sequences(
        n_continuations, profile.exact_horizon, session.per_test_alpha, profile.power, profile.detect_tv
    )


def run_exact(session: Session, cell: Cell) -> CellOutcome:
    from losscheck.stats.exact import exact_tests

    profile = session.options.profile
    target = session.targets[cell.target]
    prompt = exact_prompt(session)
    seqs, probs = exact_continuations(session, cell.target, cell.params)
    n = exact_cell_size(session, len(seqs))
    _, gen = generate_rows(session, cell, [prompt], n, profile.exact_horizon, "exact-sample")
    samples = torch.where(gen.mask(), gen.tokens, target.eos_id if target.eos_id is not None else 0).cpu()
    results = exact_tests(samples, seqs, probs, session.per_test_alpha, profile.power, profile.detect_tv)
    return _sampled_outcome(
        session, cell, results, gen, sequences=n, horizon=profile.exact_horizon, prompt=prompt, continuations=len(seqs)
    )
