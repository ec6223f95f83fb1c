"""Draft trees: the topology, multi-candidate verification, and the tree tier against the three
planted tree bugs.

The tier tests run at family-wise alpha 0.01 with every χ² test sized to detect binned TV 0.03 at
power 0.99 (about 22k rows per sampled case); the planted bugs move the law by TV 0.1 or more."""

from __future__ import annotations

import pytest
import torch

from losscheck.core.sampling import SamplingParams, make_generator
from losscheck.core.tree import ROOT, TreeOutcome, TreeTopology, verify_tree
from losscheck.core.verify import verify_block
from losscheck.errors import OptionError
from losscheck.selftest.tree_bugs import TREE_BUGS
from losscheck.verifiers.tier import TierConfig
from losscheck.verifiers.tree_tier import completed_law, run_tree_tier, standard_cases

QUICK = TierConfig(detect_tv=0.03, greedy_rows=2000)


def test_topologies_parse_and_label() -> None:
    chains = TreeTopology.parse("chains:2x3")
    assert chains.parents == (ROOT, 0, 1, ROOT, 3, 4)
    assert chains.widths() == (2, 2, 2) and chains.depth == 3 and chains.label() == "chains:2x3"
    tree = TreeTopology.parse("branching:3,2")
    assert tree.parents == (ROOT, ROOT, ROOT, 0, 0, 1, 1, 2, 2)
    assert tree.children(1) == (5, 6) and tree.path(6) == (1, 6) and tree.label() == "branching:3,2"
    odd = TreeTopology.parse("parents:-1,0,0,1")
    assert odd.depths == (1, 2, 2, 3) and odd.label() == "parents:-1,0,0,1"
    assert TreeTopology.parse(odd.label()) == odd


def test_ancestry_is_the_tree_attention_mask() -> None:
    mask = TreeTopology.parse("parents:-1,-1,0").ancestry()  # positions: root, node 0, node 1, node 2
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("chains:0x3", "width >= 1"),
        ("branching:", "is not a topology"),
        ("parents:-1,2", "node 1 has parent 2"),
        ("star:3", "chains:WxK"),
    ],
)
def test_bad_topologies_are_usage_errors(spec: str, says: str) -> None:
    with pytest.raises(OptionError, match=says):
        TreeTopology.parse(spec)


def test_a_tree_deeper_than_k_does_not_fit() -> None:
    with pytest.raises(OptionError, match="depth 3, more than the block length k = 2"):
        TreeTopology.parse("chains:2x3").fits(2)


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_one_chain_tree_is_the_chain_verifier_draw_for_draw(point_mass: bool, temperature: float) -> None:
    gen = torch.Generator().manual_seed(3)
    batch, k, vocab = 4096, 3, 5
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    reported = None if point_mass else q
    params = SamplingParams(temperature=temperature)
    chain = verify_block(logits, drafts, reported, params, make_generator(7, "chain"))
    tree = verify_tree(logits, drafts, reported, TreeTopology.chains(1, k), params, make_generator(7, "chain"))
    assert torch.equal(tree.accepted, chain.accepted)
    emitted = torch.arange(k + 1)[None, :] <= chain.accepted[:, None]
    assert torch.equal(tree.tokens[emitted], chain.tokens[emitted])
    assert bool((chain.accepted > 0).any() and (chain.accepted < k).any())  # both kinds of rows were seen


def test_the_completed_law_is_the_target_chain() -> None:
    case = standard_cases()[0]
    law, p = completed_law(case), case.target()
    v = case.vocab
    assert law.shape == (v ** (case.tree.depth + 1),) and abs(float(law.sum()) - 1) < 1e-12
    y = (2, 0, 5, 1)
    code = ((y[0] * v + y[1]) * v + y[2]) * v + y[3]
    want = p[0, case.start, y[0]] * p[1, y[0], y[1]] * p[2, y[1], y[2]] * p[3, y[2], y[3]]
    assert float(law[code]) == pytest.approx(float(want), rel=1e-12)


def test_the_exact_tree_verifier_passes_the_tier() -> None:
    report = run_tree_tier(verify_tree, config=QUICK)
    assert report.passed, [r.message() for r in report.results if not r.passed]
    chi2 = [r for r in report.results if r.alpha > 0]
    assert len(chi2) == 8 and {r.name.partition("[")[0] for r in chi2} == {"first-token", "completed"}
    assert report.alpha_per_test == pytest.approx(0.01 / 8)


@pytest.mark.parametrize("bug", sorted(TREE_BUGS))
def test_each_planted_tree_bug_fails_the_tier(bug: str) -> None:
    report = run_tree_tier(TREE_BUGS[bug], config=QUICK)
    failed = set(report.failed())
    assert any(name.startswith("completed[") for name in failed), failed
    if bug != "wrong_logits_slice":  # a branch read with another's logits keeps the first token's law
        assert any(name.startswith("first-token[") for name in failed), failed


def test_a_malformed_tree_outcome_fails_outcome() -> None:
    def off_the_tree(logits, drafts, q, tree, params, generator) -> TreeOutcome:  # type: ignore[no-untyped-def]
        out = verify_tree(logits, drafts, q, tree, params, generator)
        path = out.path.clone()
        path[:, 0] = torch.where(out.accepted > 0, tree.size - 1, ROOT)  # a deepest node at depth 1
        return TreeOutcome(out.accepted, path, out.tokens)

    report = run_tree_tier(off_the_tree, cases=standard_cases()[:1], config=QUICK)
    assert "outcome" in report.failed()


def test_a_verifier_returning_the_wrong_type_fails_outcome_with_its_name() -> None:
    def chain_shaped(logits, drafts, q, tree, params, generator):  # type: ignore[no-untyped-def]
        return verify_block(logits[:, : tree.depth + 1], drafts[:, : tree.depth], None, params, generator)

    report = run_tree_tier(chain_shaped, cases=standard_cases()[:1], config=QUICK)
    outcome = next(r for r in report.results if r.name == "outcome")
    assert not outcome.passed and "not a losscheck TreeOutcome" in outcome.observed


@pytest.mark.parametrize(
    ("argv", "status", "says"),
    [
        ([], 0, "verdict: PASS"),
        (["--mutant", "siblings_as_chains"], 1, "verdict: FAIL: first-token[chains2x3-T1]"),
        (["--mutant", "bonus_from_previous_slot"], 2, "not a planted tree bug; with --tree: wrong_logits_slice"),
    ],
)
def test_the_command_line_runs_the_tree_tier(argv: list[str], status: int, says: str, capsys) -> None:  # type: ignore[no-untyped-def]
    from losscheck import cli

    assert cli.main(["verifier-tier", "--tree", "--detect-tv", "0.05", *argv]) == status
    out = capsys.readouterr()
    assert says in out.out + out.err
