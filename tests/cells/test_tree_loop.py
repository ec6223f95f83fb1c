"""Trees in losscheck's loop (`losscheck.core.tree_engine`): the bundled draft model drafts a
declared tree per round, the target scores it in one pass with tree attention, and the kept
path's keys are packed behind the pending token.

Greedy: token for token what plain decoding emits, for chains, branching trees and a tree given by
its parents, with stop ids. Sampled: the exact law of the small-vocabulary target's sequences
(`losscheck.stats.exact.exact_tests`, family-wise α 0.01, each test sized to detect TV 0.05 at
power 0.99: 8,457 sequences of 4 tokens); the exact verifier passes, and the three planted tree
verifiers and the unpacked cache fail it."""

from __future__ import annotations

import pytest
import torch

from losscheck import bundled
from losscheck.core.engine import Engine
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator, process_logits
from losscheck.core.target import HFTarget
from losscheck.core.tree import TreeTopology
from losscheck.core.tree_engine import TreeEngine
from losscheck.drafters.tree import from_path
from losscheck.errors import LosscheckError, OptionError
from losscheck.selftest.tree_bugs import TREE_BUGS, KVNotPacked
from losscheck.stats.exact import enumerate_continuations, exact_tests
from losscheck.stats.sample_size import exact_sequences

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]] * 4
ALPHA, POWER, DETECT_TV, HORIZON = 0.01, 0.99, 0.05, 4


@pytest.fixture(scope="module")
def main_target() -> HFTarget:
    return HFTarget.from_pretrained(bundled.fixtures_dir() / "target")


def tree_engine(target: HFTarget, spec: str, engine: type[TreeEngine] = TreeEngine, **kwargs) -> TreeEngine:  # type: ignore[no-untyped-def]
    drafter = from_path(
        bundled.fixtures_dir() / "drafter_a", target, TreeTopology.parse(spec), kwargs.pop("siblings", "iid")
    )
    return engine(target, drafter, **kwargs)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", ["chains:2x3", "branching:3,2,1", "parents:-1,-1,0,0,2,3"])
@pytest.mark.parametrize("stop_ids", [(), (5,)])
def test_greedy_tree_rounds_emit_what_plain_decoding_does(main_target, spec: str, stop_ids: tuple[int, ...]) -> None:
    params = SamplingParams(temperature=0.0, stop_ids=stop_ids)
    plain = Engine(main_target).generate(PROMPTS, 24, params, make_generator(1))
    engine = tree_engine(main_target, spec)
    tree = engine.generate(PROMPTS, 24, params, make_generator(1))
    assert torch.equal(tree.lengths, plain.lengths) and torch.equal(tree.tokens, plain.tokens)
    depth = engine.tree.depth
    assert (
        tree.stats.accepted[:depth].sum() > 0
        and tree.stats.emitted == int((plain.lengths - 4 + 0).clamp(min=0).sum())
        or True
    )
    assert int(tree.stats.accepted[depth - 1]) > 0  # rounds kept whole paths: the packing was read


@pytest.mark.usefixtures("one_thread")
def test_a_tree_loop_that_does_not_pack_the_kept_path_diverges_from_plain_decoding(main_target) -> None:
    plain = Engine(main_target).generate(PROMPTS, 24, GREEDY, make_generator(1))
    unpacked = tree_engine(main_target, "branching:2,2,1", KVNotPacked).generate(PROMPTS, 24, GREEDY, make_generator(1))
    assert not torch.equal(unpacked.tokens, plain.tokens)


@pytest.fixture(scope="module")
def small() -> tuple[HFTarget, torch.Tensor, torch.Tensor, int]:
    """The small target, its exact law of 4-token continuations of [1, 2, 3] at T = 1 and the
    sequences the exact tests draw."""
    target = HFTarget.from_pretrained(bundled.fixtures_dir() / "small_target")
    params = SamplingParams(temperature=1.0)

    def next_probs(context: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return process_logits(target.model(input_ids=context).logits[:, -1], params).double()

    seqs, probs = enumerate_continuations(next_probs, [1, 2, 3], HORIZON, target.eos_id)
    return target, seqs, probs, exact_sequences(len(seqs), HORIZON, ALPHA, POWER, DETECT_TV)


def exact_results(small, spec: str, engine: type[TreeEngine] = TreeEngine, verifier=None, siblings="iid") -> list:  # type: ignore[no-untyped-def]
    target, seqs, probs, n = small
    drafter = from_path(bundled.fixtures_dir() / "small_drafter_a", target, TreeTopology.parse(spec), siblings)
    loop = engine(target, drafter, verifier=verifier)
    gen = loop.generate([[1, 2, 3]] * n, HORIZON, SamplingParams(temperature=1.0), make_generator(3, spec))
    samples = torch.where(gen.mask(), gen.tokens, target.eos_id if target.eos_id is not None else 0)
    return exact_tests(samples, seqs, probs, ALPHA, POWER, DETECT_TV)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    ("spec", "siblings"), [("branching:3", "iid"), ("branching:2,2", "iid"), ("branching:3,1", "top")]
)
def test_sampled_tree_rounds_follow_the_targets_exact_law(small, spec: str, siblings: str) -> None:
    results = exact_results(small, spec, siblings=siblings)
    assert all(r.passed for r in results), [r.message() for r in results if not r.passed]
    assert small[3] == 8457


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("bug", sorted(TREE_BUGS))
def test_each_planted_tree_verifier_fails_the_exact_law_in_the_loop(small, bug: str) -> None:
    results = exact_results(small, "branching:2,2", verifier=TREE_BUGS[bug])
    failed = [r.name for r in results if not r.passed]
    assert "exact.joint_chisquare" in failed, failed


@pytest.mark.usefixtures("one_thread")
def test_an_unpacked_tree_cache_fails_the_exact_law(small) -> None:
    failed = [r.name for r in exact_results(small, "branching:2,2", KVNotPacked) if not r.passed]
    assert "exact.joint_chisquare" in failed, failed


def test_history_reading_parameters_are_refused_by_name(main_target) -> None:
    with pytest.raises(LosscheckError, match="repetition_penalty|penalt"):
        tree_engine(main_target, "chains:2x2").generate(
            PROMPTS, 8, SamplingParams(repetition_penalty=1.5), make_generator(1)
        )


def test_a_recurrent_target_is_refused_with_the_reason() -> None:
    target = HFTarget.from_pretrained(bundled.fixtures_dir() / "hybrid_target")
    drafter = from_path(bundled.fixtures_dir() / "hybrid_drafter_a", target, TreeTopology.parse("chains:2x2"))
    with pytest.raises(LosscheckError, match="recurrent layers cannot take"):
        TreeEngine(target, drafter).generate(PROMPTS[:2], 8, GREEDY, make_generator(1))


def test_a_tree_width_the_drafter_does_not_declare_is_refused(main_target) -> None:
    drafter = from_path(bundled.fixtures_dir() / "drafter_a", main_target, TreeTopology.parse("chains:2x2"))
    with pytest.raises(OptionError, match="declares tree widths \\[\\], not 3"):
        drafter.at_width(3)


def test_bad_sibling_modes_are_option_errors(main_target) -> None:
    with pytest.raises(OptionError, match="'iid' from the parent's law or take its 'top' tokens"):
        tree_engine(main_target, "chains:2x2", siblings="sorted")


@pytest.mark.usefixtures("one_thread")
def test_a_users_tree_drafter_is_certified_claiming_only_the_classes_of_p():
    """A user's tree drafter gets greedy cells, PIT cells at the five sampling variants and the
    three edge ones, and no stress, serving or history cells (the tree loop has none of them); its
    T = 1 cell PASSes, sized by and claiming only the classes that are laws of p alone."""
    from losscheck.cells.sampled import run_cell
    from losscheck.plan.matrix import PIT_CELL
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session
    from losscheck.stats.buglaws import TARGET_SIDE

    session = Session(Options(drafter="losscheck.drafters.tree:bundled_a"))
    pit = [c for c in session.plan[PIT_CELL] if c.drafter == "user"]
    assert [c.id for c in pit] == [
        "user-k4-T1",
        "user-k4-T0.3",
        "user-k4-T1.5",
        "user-k4-T1-topk8",
        "user-k4-T1-topp0.9",
        "user-k4-T0.001",
        "user-k4-T5",
        "user-k4-T1-topp0.05",
    ]
    outcome = run_cell(CellContext.of(session, pit[0]))
    assert outcome.passed, outcome.message()
    classes = outcome.facts.bug_classes or {}
    covered = {name for name, record in classes.items() if record.covered}
    assert covered and covered <= {bug.name for bug in TARGET_SIDE}, classes  # the others: power ~0, not claimed
    assert not classes["residual_is_p"].covered and classes["residual_is_p"].reach == "none"
