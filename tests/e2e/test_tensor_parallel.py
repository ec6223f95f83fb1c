"""The split axis: the speculative loop with the bundled target split over 2 real
`torch.distributed` ranks (gloo, CPU processes) against the unsplit engine in this process.

The ranks come from one fork server per test process, which imports torch and transformers once
(~15 s on a loaded 2-core machine); each split run after it costs a few seconds.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import tempfile
from collections.abc import Callable

import pytest
import torch

from losscheck.core.divergence import find_divergences
from losscheck.core.generation import Generation, LoopStats
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator
from losscheck.errors import LosscheckError
from losscheck.plan.matrix import ORACLE, Cell
from losscheck.run import factory
from losscheck.run.options import Options
from losscheck.run.session import Session
from losscheck.serving.axis import Call
from losscheck.serving.split import (
    SplitError,
    SplitRun,
    SplitUnavailable,
    rank_disagreement,
    split_generate,
)

OPTIONS = dataclasses.replace(Options(), device="cpu")  # gloo ranks, also on a machine with one GPU
TIERS = ("low", "mid", "high")
PROMPTS_PER_TIER = 3
NEW_TOKENS = 32
# An fp32 all-reduce sums the two shards' partial products in another order than one matmul does:
# logits move by ~1e-6. Only a float64 top-2 margin below this can flip a greedy token that way.
REDUCTION_MARGIN = 1e-4
T1 = SamplingParams(temperature=1.0)
# one worker's fork server and module fixture for all of them under `pytest -n N --dist loadgroup`
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.xdist_group("tensor_parallel"),
    pytest.mark.usefixtures("one_thread"),
]  # tests/conftest.py


def greedy_calls(session: Session) -> list[Call]:
    return [Call(session.prompts(tier)[:PROMPTS_PER_TIER], NEW_TOKENS, GREEDY, ("split-test", tier)) for tier in TIERS]


def run_split(cell: Cell, calls: list[Call], options: Options = OPTIONS, timeout_s: float = 300.0) -> SplitRun:
    """`calls` with `cell` (unsplit) served in 2 ranks, the target split over them."""
    try:
        return split_generate(factory.rank_recipe(options, cell), cell.serving, cell.id, 2, calls, timeout_s)
    except SplitUnavailable as exc:
        pytest.skip(f"no tensor-parallel split on this platform: {exc}")


@pytest.fixture(scope="module")
def session() -> Session:
    return Session(OPTIONS)


@pytest.fixture(scope="module")
def split_a(session: Session) -> tuple[list[Call], SplitRun]:
    """Drafter A, k=4, split=2: the greedy calls of every tier, then one sampled call (T=1)."""
    calls = [*greedy_calls(session), Call(session.prompts("mid")[:4], NEW_TOKENS, T1, ("split-test", "T1"))]
    return calls, run_split(Cell("A", 4, GREEDY), calls)


def unsplit(session: Session, cell: Cell, call: Call) -> Generation:
    engine = factory.engine(session, cell)
    generator = make_generator(OPTIONS.seed, *call.stream, device=engine.target.device)
    return engine.generate(call.prompts, call.max_new_tokens, call.params, generator)


def greedy_differences(session: Session, cell: Cell, calls: list[Call], run: SplitRun) -> list[str]:
    """Each row where the split output leaves the unsplit engine's, with the target's float64 top-2
    margin there and what it means."""
    found = []
    for tier, call, split in zip(TIERS, calls, run.generations):
        base = unsplit(session, cell, call)
        for div in find_divergences(session.target().model, tier, call.prompts, split, base):
            why = (
                f"margin below {REDUCTION_MARGIN:g}: a near-tie the split's reduction order can flip"
                if div.margin < REDUCTION_MARGIN
                else "not a near-tie: the split changed the algorithm"
            )
            found.append(f"{div.describe()} — {why}")
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_greedy_split_matches_unsplit_drafter_a(session, split_a):
    calls, run = split_a
    assert (run.ranks, run.backend, len(run.generations)) == (2, "gloo", len(calls))
    assert run.identity["split"] == "2", f"rank 0's target was not loaded split: {run.identity}"
    differences = greedy_differences(session, Cell("A", 4, GREEDY), calls[: len(TIERS)], run)
    assert not differences, "split=2 greedy output differs from the unsplit engine:\n" + "\n".join(differences)


def test_greedy_split_matches_unsplit_self_draft_oracle(session):
    cell = Cell(ORACLE, 4, GREEDY)
    calls = greedy_calls(session)
    run = run_split(cell, calls)
    differences = greedy_differences(session, cell, calls, run)
    assert not differences, "split=2 greedy output differs from the unsplit engine:\n" + "\n".join(differences)
    for gen in run.generations:  # the target drafting for itself, split on both sides: all accepted
        assert gen.stats.all_accepted, f"self-draft oracle rejected drafts under split=2: {gen.stats.to_dict()}"


def test_sampled_split_runs_identically_on_both_ranks(session, split_a):
    calls, run = split_a
    # split_generate raises SplitError unless rank 1's tokens equal rank 0's
    sampled, call = run.generations[-1], calls[-1]
    target = session.target()
    assert sampled.params == T1 and sampled.tokens.shape == (len(call.prompts), NEW_TOKENS)
    for b in range(len(call.prompts)):
        row = sampled.row(b)
        assert len(row) == NEW_TOKENS or row[-1] == target.eos_id, f"row {b} stopped early without EOS: {row}"
        assert all(0 <= t < target.vocab_size for t in row), row
    assert sampled.stats.row_rounds > 0


def self_draft_after_fault_on_rank_1(target, fault: Callable[[], None]):
    """The self-draft oracle, built after `fault()` on rank 1: a planted failure of that rank."""
    import torch.distributed as dist

    from losscheck.run import drafters as registry

    if dist.get_rank() == 1:
        fault()
    return registry.self_draft(target)


def drafter_failing_on_rank_1(target):
    """A drafter factory that raises on rank 1 only: rank 0 goes on into the loop and blocks in
    the target's first all-reduce, so the parent must stop it."""

    def fail() -> None:
        raise RuntimeError("planted drafter failure on rank 1")

    return self_draft_after_fault_on_rank_1(target, fail)


def drafter_crashing_rank_1(target):
    """A drafter factory whose rank 1 dies of SIGABRT, as a heap corruption in native code ends
    it: no Python error, no result, and rank 0 then fails on the closed connection."""
    return self_draft_after_fault_on_rank_1(target, os.abort)


def crash_once_marker() -> str:
    """The file that tells `drafter_crashing_rank_1_once` its first crash happened: one per fork
    server (the ranks' parent), so parallel test processes do not share it."""
    return os.path.join(tempfile.gettempdir(), f"losscheck-test-crash-once-{os.getppid()}")


def drafter_crashing_rank_1_once(target):
    """`drafter_crashing_rank_1` in the first run only: the next run's ranks find the marker."""

    def abort_once() -> None:
        try:
            os.close(os.open(crash_once_marker(), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        os.abort()

    return self_draft_after_fault_on_rank_1(target, abort_once)


@pytest.mark.parametrize(
    ("drafter", "said", "crashed"),
    [
        ("drafter_failing_on_rank_1", "RuntimeError: planted drafter failure on rank 1", False),
        ("drafter_crashing_rank_1", "died of SIGABRT", True),  # again in the rerun: it fails
    ],
)
def test_a_rank_that_fails_or_crashes_is_named_with_its_cause_and_every_rank_ends(session, drafter, said, crashed):
    options = dataclasses.replace(OPTIONS, drafter=f"{__name__}:{drafter}")
    with pytest.raises(SplitError) as info:
        run_split(Cell("user", 4, GREEDY), greedy_calls(session)[:1], options)
    message = str(info.value)
    assert "rank 1 of 2" in message and said in message, message
    # a crash is named first, before the closed connection its peer then failed on
    assert (info.value.crash is not None) == crashed and (message.startswith("rank 1 of 2") or not crashed), message
    assert len(info.value.pids) == 2 and not [p for p in info.value.pids if alive(p)]


def test_a_single_rank_crash_runs_the_split_again_and_is_recorded(session):
    options = dataclasses.replace(OPTIONS, drafter=f"{__name__}:drafter_crashing_rank_1_once")
    cell = Cell("user", 4, GREEDY)
    markers = glob.glob(os.path.join(tempfile.gettempdir(), "losscheck-test-crash-once-*"))
    try:
        run = run_split(cell, greedy_calls(session)[:1], options)
    finally:
        for path in set(glob.glob(os.path.join(tempfile.gettempdir(), "losscheck-test-crash-once-*"))) - set(markers):
            os.remove(path)
    assert run.crashed is not None and "rank 1 of 2" in run.crashed and "SIGABRT" in run.crashed, run.crashed
    assert len(run.generations) == 1 and run.generations[0].stats.all_accepted
    summary = run.facts()["split"]
    assert summary["crashed"] == run.crashed and "run twice" in str(summary["summary"]), summary


def test_a_timeout_kills_every_rank(session):
    """10 ms: no rank can join the group and load its shard by then, however warm the forkserver
    (at 0.5 s a warm one finished a call in time, and nothing timed out)."""
    with pytest.raises(SplitError, match=r"timed out after 0\.01 s") as info:
        run_split(Cell("A", 4, GREEDY), greedy_calls(session)[:1], timeout_s=0.01)
    assert len(info.value.pids) == 2 and not [p for p in info.value.pids if alive(p)]


def test_a_split_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(LosscheckError, match=r"split=3 .*num_attention_heads=4, num_key_value_heads=2"):
        cell = Cell("A", 4, GREEDY)
        split_generate(factory.rank_recipe(OPTIONS, cell), cell.serving, cell.id, 3, [])


def test_rank_disagreement_names_the_call_and_row():
    def gen(rows: list[list[int]]) -> Generation:
        return Generation(torch.tensor(rows), torch.tensor([len(r) for r in rows]), LoopStats.empty(4))

    rank0 = [gen([[5, 6, 7], [8, 9, 10]])]
    assert rank_disagreement(1, [gen([[5, 6, 7], [8, 9, 10]])], rank0) is None
    differs = rank_disagreement(1, [gen([[5, 6, 7], [8, 9, 11]])], rank0)
    assert differs is not None and "call 0" in differs and "rows [1]" in differs, differs
