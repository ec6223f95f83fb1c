"""Sampled cells of losscheck's own loop: teacher-forced PIT on the main target (with the
verifier's conformance checks) and exact enumeration on the small-vocabulary target."""

from __future__ import annotations

import math

import torch

from losscheck.cells.draw import generate_rows
from losscheck.cells.outcome import CellOutcome, Phases, sampled_outcome
from losscheck.cells.scoring import score_pit
from losscheck.core.sampling import SamplingParams, make_generator, process_logits
from losscheck.errors import LosscheckError
from losscheck.plan.cell import Cell
from losscheck.plan.profiles import min_horizon
from losscheck.run import factory
from losscheck.run.session import Session
from losscheck.serving.axis import requests
from losscheck.stats import sample_size


def run_cell(session: Session, cell: Cell) -> CellOutcome:
    """Certify a cell of losscheck's own loop the way its mode asks."""
    from losscheck.cells.greedy import run_greedy

    run = {"greedy": run_greedy, "pit": run_pit, "exact": run_exact}[cell.mode]
    return run(session, cell)


def run_pit(session: Session, cell: Cell) -> CellOutcome:
    """Teacher-forced PIT of the spec loop's sequences, plus the conformance of its verifier to
    standard speculative sampling (`losscheck.cells.conformance`), the cell's alpha split over both."""
    from losscheck.cells.conformance import CONFORMANCE_TESTS, Recorder
    from losscheck.stats.pit import PIT_TESTS

    profile = session.options.profile
    horizon = profile.pit_horizon(cell.k)
    prompts = [p for tier in session.prompt_tiers for p in session.prompts(tier)]
    alpha_pit = session.per_test_alpha * PIT_TESTS / (PIT_TESTS + CONFORMANCE_TESTS)
    n = sample_size.pit_sequences(alpha_pit, profile.power, profile.detect_tv, profile.pit_bins, horizon)
    needed = sample_size.pit_required_values(alpha_pit, profile.power, profile.detect_tv, profile.pit_bins)
    clock = Phases()
    server = factory.server(session, cell)
    engine = server.engine
    verify = engine.verifier if engine is not None else None
    with clock("requests"):  # a warm prefix cache's first turn
        prompts = requests(server, factory.serve_context(session, cell), prompts, horizon, cell.params, "pit")
    pilot: dict[str, int] = {}
    for stream in ("pit-sample", "pit-resample"):
        recorder = None
        if engine is not None and verify is not None:  # the recorder wraps the verifier in this process only
            key = ("conformance",) if stream == "pit-sample" else ("conformance", stream)
            recorder = engine.verifier = Recorder(verify, make_generator(session.options.seed, cell.id, *key))
        with clock("generate"):
            rows, gen = generate_rows(session, cell, server, prompts, n, horizon, stream)
        drawn = int(gen.mask().sum())
        if drawn >= needed:
            break
        # EOS cut the sequences short (e.g. at a high temperature): this sample was a pilot and is
        # set aside; a fresh one, sized from its tokens per sequence, is the one tested (its size
        # depends on the pilot only, so optional stopping cannot bias the tests)
        pilot = {"pilot_sequences": n, "pilot_tokens": drawn}
        n = math.ceil(needed * sample_size.SAMPLE_MARGIN * n / max(drawn, 1))
    with clock("score"):  # the teacher-forced pass and the PIT tests
        results, facts = score_pit(
            session, cell.id, session.cell_target(cell), rows, gen, cell.precision.tolerance, alpha_pit
        )
    with clock("conformance"):
        if recorder is not None:
            results += recorder.tests(session.per_test_alpha - alpha_pit, profile.power)
    outcome = sampled_outcome(
        session,
        cell,
        results,
        gen,
        sequences=n,
        horizon=horizon,
        phases=clock.seconds,
        **facts,
        **pilot,
    )
    outcome.serving_facts = server.facts()
    return outcome


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

    return session.memo(
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
    if profile.exact_horizon < min_horizon(cell.k):
        raise LosscheckError(
            f"exact cell {cell.id}: its horizon {profile.exact_horizon} must reach a bonus slot and a second "
            f"round (2k + 2 = {min_horizon(cell.k)}); run exact mode at a smaller k or a longer exact horizon"
        )
    target = session.targets[cell.target]
    prompt = exact_prompt(session)
    seqs, probs = exact_continuations(session, cell.target, cell.params)
    n = exact_cell_size(session, len(seqs))
    _, gen = generate_rows(
        session, cell, factory.server(session, cell), [prompt], n, profile.exact_horizon, "exact-sample"
    )
    samples = torch.where(gen.mask(), gen.tokens, target.eos_id if target.eos_id is not None else 0).cpu()
    results = exact_tests(samples, seqs, probs, session.per_test_alpha, profile.power, profile.detect_tv)
    return sampled_outcome(
        session, cell, results, gen, sequences=n, horizon=profile.exact_horizon, prompt=prompt, continuations=len(seqs)
    )
