"""The bundled block drafters B–E: well-formed proposals, the reported q is the distribution the
drafts were actually drawn from, truncation to width w restricts the support, greedy is a point
mass. Contexts are built from the bundled prompts and the bundled target's hidden states."""

from __future__ import annotations

import pytest
import torch

from losscheck import bundled
from losscheck.core.contract import DraftContext, validate_proposal
from losscheck.core.engine import Engine, pad_prompts
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator, process_logits
from losscheck.drafters import parallel
from losscheck.drafters.block import BlockModel
from losscheck.hashing import content_hash
from losscheck.run import drafters as registry
from tests.support import assert_follows

FAMILIES = registry.BLOCK_FAMILIES
PATH_FAMILIES = ("C", "E")
PARAMS = [GREEDY, SamplingParams(1.0), SamplingParams(0.3, top_k=8), SamplingParams(1.5, top_p=0.9)]
N_DRAWS = 20_000  # rows of one repeated context in the frequency tests
P_FLOOR = 1e-4  # chi-square p-value below which a frequency test fails: a correct drafter fails
# one such assertion with probability 1e-4 (the seeds are fixed, so the outcome is reproducible);
# the module's 16 (2 params x 4 families x 2 slots) fail one with probability <= 1.6e-3


@pytest.fixture(scope="module")
def drafters(target) -> dict[str, parallel.BlockDrafter]:
    root = bundled.fixtures_dir()
    return {f: parallel.from_path(root / f"drafter_{f.lower()}", target) for f in FAMILIES}


def context(target, prompts, k, params, width=None, seed=0, repeat=1) -> DraftContext:
    """A round's context for `prompts` (each repeated `repeat` times) with the target's hidden
    states of every scored position, as the engine builds it."""
    ids, lengths = pad_prompts(prompts, target.vocab_size)
    with torch.inference_mode():  # causal: padding after a row's end does not change its states
        hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states[-1].float()
    hidden = hidden * (torch.arange(ids.shape[1])[None, :, None] < (lengths - 1)[:, None, None])
    rep = lambda x: x.repeat_interleave(repeat, 0)  # noqa: E731
    return DraftContext(rep(ids), rep(lengths), rep(hidden), k, width, params, make_generator(seed, "t"))


def all_prompts() -> list[list[int]]:
    return [p for tier in bundled.PROMPT_TIERS for p in bundled.load_prompts(tier)]


def test_registered_with_declared_knobs(target):
    found = registry.bundled("main", target)
    assert set(found) >= {"A", *FAMILIES}
    for f in FAMILIES:
        d = found[f]
        assert d.uses_hidden and d.block_lengths == tuple(range(1, 17))
        assert d.widths == ((1, 2, 4, 16, None) if f in PATH_FAMILIES else ())


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_against_the_bundled_target(family):
    """A rebuilt target makes the drafters stale (still lossless, but acceptance collapses)."""
    import json

    root = bundled.fixtures_dir()
    build = json.loads((root / f"drafter_{family.lower()}" / "BUILD.json").read_text())
    assert build["target_sha256"] == content_hash(root / "target"), (
        f"drafter_{family.lower()} was trained against another target; run fixtures/build_families.py"
    )


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p.label())
@pytest.mark.parametrize("family", FAMILIES)
def test_proposals_are_well_formed(target, drafters, family, params):
    prompts = all_prompts()  # includes a one-token prompt: no scored position, zero feature
    widths = drafters[family].widths or (None,)
    for k in (1, 5, 16):
        for width in widths:
            proposal = drafters[family].propose(context(target, prompts, k, params, width))
            proposal = validate_proposal(proposal, family, len(prompts), k, target.vocab_size)
            assert (proposal.probs is None) == params.greedy


@pytest.mark.parametrize("family", FAMILIES)
def test_more_slots_than_trained_is_an_error(target, drafters, family):
    with pytest.raises(Exception, match="16 slots"):
        drafters[family].propose(context(target, [[0, 2]], 17, GREEDY))


@pytest.mark.parametrize("width", [1, 2, 4, 16])
@pytest.mark.parametrize("family", PATH_FAMILIES)
def test_width_restricts_support_to_the_top_w_base_candidates(target, drafters, family, width):
    drafter, prompts = drafters[family], all_prompts()
    ctx = context(target, prompts, 8, SamplingParams(1.5), width)
    proposal = drafter.propose(ctx)
    support = proposal.probs > 0  # [B, k, V]
    assert int(support.sum(-1).max()) <= width
    feature, pending = parallel.block_inputs(ctx, torch.float32)
    with torch.inference_mode():
        _, base = drafter.model(feature, pending, 8)
    allowed = torch.zeros_like(support).scatter(-1, base.topk(width, -1).indices, True)
    assert not (support & ~allowed).any()  # only the slot's own top-w candidates
    if width == 1:  # one candidate: the draft is a point mass even under sampling
        assert torch.equal(proposal.tokens, base.argmax(-1))


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(1.5, top_p=0.95)], ids=lambda p: p.label())
@pytest.mark.parametrize("family", FAMILIES)
def test_reported_q_is_the_sampling_distribution(target, drafters, family, params):
    """Slot 0 of one repeated context: every row reports the same q and the drafts' frequencies
    match it. Slot 1 (C, E: conditioned on the chosen slot-0 draft): rows sharing the most
    frequent slot-0 draft report one q and their slot-1 drafts match it."""
    drafter = drafters[family]
    prompt = bundled.load_prompts("high")[0]
    width = 4 if family in PATH_FAMILIES else None
    proposal = drafter.propose(context(target, [prompt], 2, params, width, seed=7, repeat=N_DRAWS))
    tokens, q = proposal.tokens, proposal.probs
    assert torch.allclose(q[:, 0], q[:1, 0].expand_as(q[:, 0]))
    assert_follows(tokens[:, 0], q[0, 0], P_FLOOR, f"{family} slot-0 drafts vs their reported q")

    first = tokens[:, 0].mode().values
    rows = tokens[:, 0] == first
    q1 = q[rows, 1]
    assert torch.allclose(q1, q1[:1].expand_as(q1), atol=1e-6)
    assert_follows(tokens[rows, 1], q1[0], P_FLOOR, f"{family} slot-1 drafts after {int(first)} vs their reported q")


@pytest.mark.parametrize("family", PATH_FAMILIES)
def test_path_conditions_on_the_chosen_predecessor(target, drafters, family):
    """C / E: slot-1 q differs between rows whose slot-0 drafts differ (B / D: it never does)."""
    prompt = bundled.load_prompts("high")[0]
    proposal = drafters[family].propose(context(target, [prompt], 2, SamplingParams(1.5), seed=3, repeat=2000))
    first = proposal.tokens[:, 0]
    a, b = first.unique(sorted=True)[:2]
    qa, qb = proposal.probs[first == a][0, 1], proposal.probs[first == b][0, 1]
    assert (qa - qb).abs().sum() > 1e-3


def test_q_is_processed_like_p(target, drafters):
    """B's q is process_logits of its base logits under the request's parameters."""
    params = SamplingParams(0.7, top_k=5, top_p=0.8)
    ctx = context(target, all_prompts(), 4, params)
    proposal = drafters["B"].propose(ctx)
    feature, pending = parallel.block_inputs(ctx, torch.float32)
    with torch.inference_mode():
        _, base = drafters["B"].model(feature, pending, 4)
    assert torch.allclose(proposal.probs, process_logits(base, params))
    assert int((proposal.probs > 0).sum(-1).max()) <= 5


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_loop_equals_baseline_at_every_width(target, drafters, family):
    prompts = bundled.load_prompts("mid")[:6]
    base = Engine(target).generate(prompts, 24, GREEDY, make_generator(0, "g"))
    for width in drafters[family].widths or (None,):
        spec = Engine(target, drafters[family], 16, width).generate(prompts, 24, GREEDY, make_generator(0, "g"))
        assert torch.equal(spec.tokens, base.tokens)


def test_save_load_round_trip(tmp_path, drafters):
    model = drafters["E"].model
    model.save(tmp_path / "e")
    again = BlockModel.load(tmp_path / "e")
    assert again.cfg == model.cfg
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
