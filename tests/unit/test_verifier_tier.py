"""The verifier tier (docs/verifier-tier.md): losscheck's verifier and transformers' speculative
sampling pass it, every planted verifier is caught, and `--losscheck-verifier` puts a verifier
into the white-box cells.

The tier's runs are seeded: each statistical verdict here is reproducible. Their false-failure
probability is the tier's alpha (0.01, Bonferroni over its χ² tests); a planted bug is missed
with probability <= 1 - 0.99 when it moves a law by at least the detectable TV.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from losscheck.core.sampling import SamplingParams
from losscheck.core.verify import BlockOutcome, verify_block
from losscheck.errors import OptionError, UnderpoweredError
from losscheck.selftest.registry import CATALOGUE
from losscheck.verifiers import cases
from losscheck.verifiers.tier import TierConfig, run_tier

pytestmark = pytest.mark.verifier
pytest_plugins = ["pytester"]

DETERMINISTIC = ("outcome", "greedy", "drafted-length", "own-drafts", "never-reject-p>=q", "reproducible", "support")

# Planted verifier -> the checks that must catch it in the seeded run below (docs/verifier-tier.md
# has the full table); each list names the check the bug's mechanism violates, not only χ².
CAUGHT_BY = {
    "unnormalised_residual": ("support", "first-token", "joint"),  # emits the last id after a rejection
    "residual_is_p": ("support", "first-token", "joint"),  # re-emits the rejected draft
    "inverted_ratio": ("drafted-length", "never-reject-p>=q", "first-token", "joint"),  # keeps p = 0 pads
    "temperature_q_only": ("never-reject-p>=q", "first-token", "joint"),
    "truncation_draft_only": ("support", "joint"),  # emits tokens top-k / top-p removed
    "bonus_from_wrong_slot": ("joint",),  # the first token is untouched: only the joint law sees it
    "recovered_after_rejected": ("greedy", "first-token", "joint"),
    "shared_uniform": ("first-token", "joint"),
    "typical_acceptance": ("never-reject-p>=q", "first-token", "joint"),
    "bonus_counted_not_written": ("greedy", "support", "joint"),
    "rows_mixed_up": ("greedy", "drafted-length", "own-drafts", "first-token", "joint"),
    # the intermittent mutants: the same mechanisms on a share of rounds, rows or slots
    "residual_is_p_on_30pct_of_rounds": ("support", "first-token", "joint"),
    "residual_is_p_one_row_in_4": ("support", "first-token", "joint"),
    "residual_is_p_at_slot_1": ("support", "joint"),  # slot 0's rejections untouched: the first token too
    "bonus_from_wrong_slot_on_25pct_of_rounds": ("joint",),
    "min_p_at_first_position_only": ("support", "joint"),  # emits tokens min-p removed after slot 0
    "greedy_at_any_temperature": ("never-reject-p>=q", "first-token", "joint"),  # rejects every non-argmax draft
    "recovery_reuses_draft_noise": ("first-token", "joint"),  # the recovered law under-weights q's favourites
}
PLANTED = {m.name: m.verifier for m in CATALOGUE if m.verifier is not None}
PLANTED_TV = 0.05  # planted bugs move the laws by far more: a coarse tier catches each in ~1 s


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The tier's tensors are small; see tests/conftest.py."""


def test_every_planted_verifier_has_its_expected_catch():
    assert set(CAUGHT_BY) == set(PLANTED), "a planted verifier was added or removed: list the checks that catch it"


def test_losscheck_verifier_passes_the_tier():
    report = run_tier(verify_block, TierConfig(detect_tv=0.03))
    assert report.passed, "\n".join(report.lines())
    checks = report.by_check()
    assert set(DETERMINISTIC) | {"first-token", "joint"} == set(checks)
    assert len(checks["joint"]) == 34 and all(r.detectable["tv"] <= 0.03 for r in checks["joint"])
    assert all(r.n > 0 for name in DETERMINISTIC for r in checks[name]), "a deterministic check saw no rows"
    assert report.draws > 500_000


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_verifier_is_caught(name):
    report = run_tier(PLANTED[name], TierConfig(detect_tv=PLANTED_TV, greedy_rows=5000), name)
    failed = set(report.failed_checks())
    missing = set(CAUGHT_BY[name]) - failed
    assert not missing, f"{name}: expected {missing} to fail too; failed {sorted(failed)}\n" + "\n".join(report.lines())


def test_hf_speculative_sampling_passes_the_tier():
    """transformers' `_speculative_sampling`, one call per row (its batch size is 1)."""
    pytest.importorskip("transformers")
    from losscheck.verifiers.hf import speculative_sampling

    report = run_tier(speculative_sampling(), TierConfig(detect_tv=0.12, greedy_rows=2000), "hf")
    assert report.passed, "\n".join(report.lines())


def test_the_hf_adapter_leaves_the_global_rng_alone_and_replays_from_its_generator():
    from losscheck.verifiers.hf import speculative_sampling

    verifier = speculative_sampling()
    gen = torch.Generator().manual_seed(0)
    logits, q = torch.randn(64, 4, 5, generator=gen), torch.softmax(torch.randn(64, 3, 5, generator=gen), -1)
    drafts = torch.multinomial(q.view(-1, 5), 1, generator=gen).view(64, 3)
    before = torch.random.get_rng_state()
    runs = [verifier(logits, drafts, q, SamplingParams(), torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(runs[0].accepted, runs[1].accepted)


class PerRow:
    """`verify_block` deciding one request per row (`decide`), by parameter group; with
    `first_params_only` it applies the first row's parameters to every row (a batch-expansion bug)."""

    def __init__(self, first_params_only: bool = False) -> None:
        self.first_params_only = first_params_only

    def __call__(self, logits, drafts, q, params, generator):
        return verify_block(logits, drafts, q, params, generator)

    def decide(self, logits, drafts, q, params, generator):
        accepted = torch.zeros(len(drafts), dtype=torch.long)
        tokens = torch.zeros(len(drafts), drafts.shape[1] + 1, dtype=torch.long)
        groups = {params[0]: list(range(len(params)))} if self.first_params_only else {}
        for row, p in enumerate(params):
            if not self.first_params_only:
                groups.setdefault(p, []).append(row)
        for p, rows in groups.items():
            idx = torch.tensor(rows)
            out = verify_block(logits[idx], drafts[idx], None if q is None else q[idx], p, generator)
            accepted[idx], tokens[idx] = out.accepted, out.tokens
        return BlockOutcome(accepted, tokens)


def test_mixed_batches_run_for_a_verifier_that_decides_one_request_per_row():
    honest = run_tier(PerRow(), TierConfig(detect_tv=PLANTED_TV, greedy_rows=5000), "per-row")
    assert honest.passed and not honest.not_run, "\n".join(honest.lines())
    assert any(r.name.startswith("joint[mixed-k4-q/") for r in honest.results)
    broken = run_tier(PerRow(first_params_only=True), TierConfig(detect_tv=PLANTED_TV, greedy_rows=5000), "first")
    assert not broken.passed
    assert {r.name.split("/")[0] for r in broken.results if not r.passed} >= {"joint[mixed-k4-q"}
    assert not any(r.name.startswith("joint[T1-k4-q/") for r in broken.results if not r.passed)


def test_an_underpowered_tier_errors_before_drawing():
    with pytest.raises(UnderpoweredError, match="underpowered"):
        run_tier(verify_block, TierConfig(replicates=200))


@pytest.mark.parametrize("call", cases.standard_calls(0)[:2], ids=lambda c: c.name)
def test_the_closed_form_joint_law_is_lossless(call):
    """Summing the (accepted, tokens) law over everything but the first token gives p_0: the
    closed form is standard speculative sampling's, whose output is the target's."""
    for case in call.cases:
        law = cases.joint_law(case)
        vocab, k = case.vocab, case.k
        first = torch.zeros(vocab, dtype=torch.float64)
        offsets = cases.outcome_offsets(vocab, k)
        for a in range(k + 1):
            block = law[offsets[a] : offsets[a] + vocab ** (a + 1)].view(vocab, -1)  # y_0 is the leading digit
            first += block.sum(-1)
        assert torch.allclose(first, cases.first_token_law(case), atol=1e-12), case.name


def test_outcome_codes_match_the_law_index():
    accepted = torch.tensor([0, 1, 2])
    tokens = torch.tensor([[3, 9, 9], [1, 2, 9], [0, 0, 1]])  # junk (9) after the stop slot
    assert cases.encode(accepted, tokens, 4).tolist() == [3, 4 + 1 * 4 + 2, 4 + 16 + 1]


# --losscheck-verifier


MODULE = """
from losscheck.core.verify import BlockOutcome, verify_block

def good():
    return verify_block

def returns_none():
    return None

def needs_target(target):
    return verify_block

def raises():
    raise RuntimeError("no GPU here")

NOT_CALLABLE = 3
"""


@pytest.fixture
def verifier_module(tmp_path, monkeypatch):
    (tmp_path / "tier_verifiers.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "tier_verifiers", raising=False)
    return "tier_verifiers"


@pytest.mark.parametrize(
    "attr, message",
    [
        ("missing", "module 'tier_verifiers' has no attribute 'missing'"),
        ("NOT_CALLABLE", "is a int, not a factory() -> Verifier"),
        ("returns_none", "the factory returned a NoneType, not a Verifier: a callable (logits"),
        ("needs_target", "takes arguments; a verifier factory takes none"),
        ("raises", "calling the factory raised RuntimeError: no GPU here"),
    ],
)
def test_a_bad_verifier_factory_is_one_option_error(verifier_module, attr, message):
    from losscheck.run.factory import load_verifier

    with pytest.raises(OptionError) as error:
        load_verifier(f"{verifier_module}:{attr}")
    assert message in str(error.value) and f"--losscheck-verifier='{verifier_module}:{attr}'" in str(error.value)


def test_a_verifier_named_instead_of_its_factory_gets_a_hint():
    from losscheck.run.factory import load_verifier

    with pytest.raises(OptionError, match="looks like a Verifier itself.*losscheck.verifiers:reference"):
        load_verifier("losscheck.core.verify:verify_block")
    with pytest.raises(OptionError, match="cannot import module .no_such_pkg.mod."):
        load_verifier("no_such_pkg.mod:factory")


def test_the_run_verifier_decides_every_white_box_cell_and_a_plant_verifier_wins(verifier_module):
    from losscheck.run import factory

    mine = factory.load_verifier(f"{verifier_module}:good")
    assert mine is factory.load_verifier(f"{verifier_module}:good"), "the factory runs once per process"

    def own(*args):
        raise AssertionError("never called")

    def planted(*args):
        raise AssertionError("never called")

    target, drafter = SimpleNamespace(), SimpleNamespace(uses_hidden=False, verifier=own)
    assert factory.planted_engine(None, target, drafter, 4, verifier=mine).verifier is mine  # over the drafter's
    assert factory.planted_engine(None, target, drafter, 4).verifier is own
    plant = SimpleNamespace(verifier=planted, wrap_drafter=None, wrap_target=None)
    assert factory.planted_engine(plant, target, drafter, 4, verifier=mine).verifier is planted
    plant = SimpleNamespace(verifier=None, wrap_drafter=None, wrap_target=None)  # plants something else
    assert factory.planted_engine(plant, target, drafter, 4, verifier=mine).verifier is mine

    from losscheck.run.options import Options

    cell: Any = SimpleNamespace(target="main", precision=None, drafter="A", stress=None, k=4, width=None, serving=())
    session: Any = SimpleNamespace(
        options=Options(verifier=f"{verifier_module}:good"),
        plant=None,
        cell_target=lambda c: target,
        drafters=lambda t, p: {"A": drafter},
    )
    assert factory.engine(session, cell).verifier is mine


def test_the_cli_runs_the_tier_on_a_planted_verifier(capsys):
    from losscheck.cli import main

    assert main(["verifier-tier", "--mutant", "residual_is_p", "--detect-tv", str(PLANTED_TV)]) == 1
    out = capsys.readouterr().out
    assert "verdict: FAIL: support, first-token, joint" in out and "draws/s" in out
    assert main(["verifier-tier", "--mutant", "stale_target_cache"]) == 2  # plants no verifier
