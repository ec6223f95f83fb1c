"""The verifier tier for trees: a `TreeVerifier` driven with synthetic Markov targets and drafted
trees, its output law tested exactly.

A case (`TreeCase`) is one synthetic request: a tree topology, the target's raw logits of depth
`d` given the token before it (`[D+1, V, V]`) and the drafter's law of a node at depth `d` given
its parent's token (`[D, V, V]`). Siblings are drawn independently from their parent's law
(`iid`), or are the parent law's top tokens, one point mass each (`top`: a greedy tree drafter,
EAGLE-style; the verifier is given q = None).

The exact law tested is the target's own, whatever the tree and the drafter: each row's emitted
tokens, *completed* to `D+1` tokens by drawing the rest from the target's tables, are distributed
as `Π_j p_j(y_j | y_{j−1})` — the losslessness property over every depth at once, with no model
of the verifier's internals (a lossless tree verifier that is not SpecInfer's passes it).

Checks, each a `TestResult`:

- `outcome`: every call returns a well-formed `TreeOutcome`, its path a root-to-node path of the
  tree as long as its accepted depth, its emitted ids in the vocabulary;
- `own-drafts`: the emitted tokens before the stop are the kept path's drafts;
- `greedy`: greedy rows keep the first child equal to the target's argmax and emit the argmax;
- `support`: no completed sequence has probability 0 under the target;
- `first-token[case]`, `completed[case]`: Pearson χ² of the first emitted token against `p_0` and
  of the completed sequence against the target's law; Bonferroni over all of them at `alpha`, the
  bins from the exact probabilities, and each test asserts before drawing that it detects binned
  TV `detect_tv` at `power`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from losscheck.core.sampling import SamplingParams, make_generator, process_logits, sample
from losscheck.core.tree import (
    ROOT,
    TreeOutcome,
    TreeTopology,
    TreeVerifier,
    checked_tree_outcome,
    verify_tree_greedy,
)
from losscheck.core.verify import normalized
from losscheck.stats.budget import per_test_alpha
from losscheck.stats.exact import probability_bins
from losscheck.stats.gof import goodness_of_fit
from losscheck.stats.power import chisquare_detectable_w, chisquare_required_n, require_power
from losscheck.stats.result import TestResult, scoped
from losscheck.verifiers.tier import Tally, TierConfig, raised

VOCAB = 6  # narrow, so that rejections are frequent and sibling laws overlap


@dataclass(frozen=True)
class TreeCase:
    """One synthetic request over a drafted tree."""

    name: str
    tree: TreeTopology
    params: SamplingParams
    start: int  # the token before the root's children
    target_logits: torch.Tensor  # [D+1, V, V] raw logits of depth d given the previous token
    draft: torch.Tensor  # [D, V, V] float64 law of a depth-(d+1) node given its parent's token
    siblings: str = "iid"  # "iid": drawn from the law; "top": the law's top tokens, point masses

    @property
    def vocab(self) -> int:
        return self.draft.shape[-1]

    def target(self) -> torch.Tensor:
        """[D+1, V, V] float64 processed target tables."""
        return normalized(process_logits(self.target_logits, self.params))


def _tables(gen: torch.Generator, depth: int, vocab: int, scale: float) -> torch.Tensor:
    return torch.randn(depth, vocab, vocab, generator=gen, dtype=torch.float64) * scale


def standard_cases(seed: int = 20261205) -> tuple[TreeCase, ...]:
    """Chains and branching trees, iid and top-k siblings, at T 1 and 0.7 with top-p 0.9, and a
    greedy case: drafters far enough from the target that most depths reject a sibling."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, tree, siblings, params in (
        ("chains2x3-T1", TreeTopology.chains(2, 3), "iid", SamplingParams(temperature=1.0)),
        ("branch3,2-T1", TreeTopology.parse("branching:3,2"), "iid", SamplingParams(temperature=1.0)),
        (
            "branch2,2,1-T0.7-p0.9",
            TreeTopology.parse("branching:2,2,1"),
            "iid",
            SamplingParams(temperature=0.7, top_p=0.9),
        ),
        ("top3,1-T1", TreeTopology.parse("branching:3,1"), "top", SamplingParams(temperature=1.0)),
        ("greedy-branch2,2", TreeTopology.parse("branching:2,2"), "iid", SamplingParams(temperature=0.0)),
    ):
        logits = _tables(gen, tree.depth + 1, VOCAB, 1.5)
        draft = torch.softmax(logits[: tree.depth] + _tables(gen, tree.depth, VOCAB, 1.2), -1)
        out.append(
            TreeCase(name, tree, params, int(torch.randint(VOCAB, (1,), generator=gen)), logits, draft, siblings)
        )
    return tuple(out)


def completed_law(case: TreeCase) -> torch.Tensor:
    """[V^(D+1)] float64: the target's law of D+1 tokens from the case's start, index Σ y_j·V^(D−j)."""
    p = case.target()
    law = p[0, case.start]  # [V]
    for d in range(1, case.tree.depth + 1):
        last = torch.arange(len(law)) % case.vocab  # each sequence's last token
        law = (law[:, None] * p[d][last]).reshape(-1)
    return law


def draw_tree(
    case: TreeCase, rows: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """drafts [R, N], q [R, N, V] (None for top-k siblings) and raw logits [R, N+1, V]."""
    tree, vocab = case.tree, case.vocab
    drafts = torch.empty(rows, tree.size, dtype=torch.long)
    q = torch.empty(rows, tree.size, vocab)
    logits = torch.empty(rows, tree.size + 1, vocab)
    logits[:] = case.target_logits[0, case.start].float()
    rank = [tree.children(parent).index(i) for i, parent in enumerate(tree.parents)]
    for i, parent in enumerate(tree.parents):
        prev = torch.full((rows,), case.start) if parent == ROOT else drafts[:, parent]
        law = case.draft[tree.depths[i] - 1, prev].float()  # [R, V]
        q[:, i] = law
        if case.siblings == "top":
            drafts[:, i] = law.argsort(dim=-1, descending=True, stable=True)[:, rank[i]]
        else:
            drafts[:, i] = sample(law, gen)
        logits[:, i + 1] = case.target_logits[tree.depths[i], drafts[:, i]].float()
    return drafts, (None if case.siblings == "top" else q), logits


def complete(case: TreeCase, outcome: TreeOutcome, gen: torch.Generator) -> torch.Tensor:
    """[R] long: each row's emitted tokens completed to D+1 from the target's tables, as an index
    into `completed_law`."""
    p, depth = case.target(), case.tree.depth
    emitted = torch.arange(depth + 1)[None, :] <= outcome.accepted[:, None]  # [R, D+1]
    code = torch.zeros(len(outcome.accepted), dtype=torch.long)
    prev = torch.full_like(code, case.start)
    for j in range(depth + 1):
        drawn = sample(p[j, prev].float(), gen)
        token = torch.where(emitted[:, j], outcome.tokens[:, j].long(), drawn)
        code = code * case.vocab + token
        prev = token
    return code


@dataclass(frozen=True)
class TreeTierReport:
    verifier: str
    results: tuple[TestResult, ...]
    draws: int
    seconds: float
    replicates: int
    alpha_per_test: float

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def failed(self) -> list[str]:
        return [r.name for r in self.results if not r.passed]

    def lines(self, name: str | None = None) -> list[str]:
        """Per-check verdicts, then the draws and their rate."""
        out = [f"tree tier: {name or self.verifier}"]
        for r in self.results:
            verdict = "PASS" if r.passed else "FAIL"
            detail = r.observed if r.alpha == 0 else f"p {r.p_value:.3g} at alpha {r.alpha:.2g}, {r.observed}"
            out.append(f"  {r.name:<34} {verdict}  {detail[:160]}")
        rate = self.draws / self.seconds if self.seconds > 0 else float("inf")
        out.append(
            f"  {self.draws} trees ({self.replicates} per sampled case) in {self.seconds:.1f} s: {rate:,.0f} trees/s"
        )
        out.append(f"verdict: {'PASS' if self.passed else 'FAIL: ' + ', '.join(self.failed())}")
        return out


def _well_formed(case: TreeCase, outcome: TreeOutcome, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([R] bool malformed rows, [R] bool rows whose emitted tokens before the stop are not the
    kept path's drafts)."""
    tree, depth = case.tree, case.tree.depth
    a, path, tokens = outcome.accepted.long(), outcome.path.long(), outcome.tokens.long()
    on_path = torch.arange(depth)[None, :] < a[:, None]  # [R, D]
    parents = torch.tensor(tree.parents + (ROOT,))  # index −1 (past the path) reads ROOT
    node_depth = torch.tensor(tree.depths + (0,))
    prev = torch.cat([torch.full((len(a), 1), ROOT), path[:, :-1]], 1)
    linked = (parents[path] == prev) & (node_depth[path] == torch.arange(1, depth + 1)) & (path >= 0)
    bad = (a < 0) | (a > depth) | ((on_path & ~linked) | (~on_path & (path != ROOT))).any(-1)
    emitted = torch.arange(depth + 1)[None, :] <= a.clamp(0, depth)[:, None]
    bad |= (((tokens < 0) | (tokens >= case.vocab)) & emitted).any(-1)
    kept = drafts.gather(1, path.clamp_min(0))
    foreign = ((tokens[:, :depth] != kept) & on_path).any(-1) & ~bad
    return bad, foreign


def run_tree_tier(
    verifier: TreeVerifier, cases: tuple[TreeCase, ...] | None = None, config: TierConfig | None = None
) -> TreeTierReport:
    """Drive `verifier` with every case and test its output law (module docstring)."""
    config = config or TierConfig()
    cases = cases if cases is not None else standard_cases(config.seed)
    sampled = [c for c in cases if not c.params.greedy]
    level = per_test_alpha(config.alpha, max(2 * len(sampled), 1))
    replicates = config.replicates or chisquare_required_n(2 * config.detect_tv, config.max_bins, level, config.power)
    name = getattr(verifier, "__qualname__", None) or type(verifier).__qualname__
    started, draws = time.perf_counter(), 0
    tallies = {key: Tally(key, expected) for key, expected in _EXPECTED.items()}
    chi2: list[TestResult] = []

    def tally(key: str, bad: torch.Tensor, example: str) -> None:
        tallies[key].add(bad, lambda i: example)

    bins = {case.name: _bins(case, replicates, level, config) for case in sampled}
    for case in cases:
        rows = config.greedy_rows if case.params.greedy else replicates
        gen = make_generator(config.seed, "tree-tier", case.name, "draft")
        verify_gen = make_generator(config.seed, "tree-tier", case.name, "verify")
        drafts, q, logits = draw_tree(case, rows, gen)
        draws += rows
        try:
            outcome = checked_tree_outcome(
                verifier(logits, drafts, q, case.tree, case.params, verify_gen), verifier, rows, case.tree
            )
        except Exception as exc:  # a verifier that raises fails `outcome`; the other cases go on
            tallies["outcome"].event(f"{case.name}: {raised(exc)}")
            continue
        bad, foreign = _well_formed(case, outcome, drafts)
        tally("outcome", bad, f"{case.name}: a row returned path {outcome.path[bad][:1].tolist()}")
        tally("own-drafts", foreign, f"{case.name}: a row emitted tokens that are not its kept path's drafts")
        good = ~bad & ~foreign
        if case.params.greedy:
            want = verify_tree_greedy(logits, drafts, case.tree)
            differs = (want.accepted != outcome.accepted) | (
                (want.tokens != outcome.tokens) & (torch.arange(case.tree.depth + 1) <= want.accepted[:, None])
            ).any(-1)
            tally("greedy", differs & good, f"{case.name}: a greedy row differs from the argmax rule")
            continue
        picked = TreeOutcome(outcome.accepted[good], outcome.path[good], outcome.tokens[good])
        codes = complete(case, picked, make_generator(config.seed, "tree-tier", case.name, "complete"))
        law = completed_law(case)
        outside = law[codes] == 0
        tally("support", outside, f"{case.name}: a completed sequence of target probability 0")
        first = picked.tokens[:, 0].long()[~outside]
        chi2 += _chisquare(case, bins[case.name], {"first-token": first, "completed": codes[~outside]}, level, config)
    results = [t.result(config.power) for t in tallies.values()]
    return TreeTierReport(name, (*results, *chi2), draws, time.perf_counter() - started, replicates, level)


_EXPECTED = {
    "outcome": "a well-formed TreeOutcome (a root-to-node path as deep as the accepted count) from every call",
    "own-drafts": "the emitted tokens before the stop to be the kept path's drafts",
    "greedy": "greedy rows to keep the first child equal to the target's argmax and emit its argmax",
    "support": "every completed sequence to have positive probability under the target",
}


Bins = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # test -> (exact law, bin_of, expected)


def _bins(case: TreeCase, n: int, level: float, config: TierConfig) -> Bins:
    """The first-token and completed laws of a sampled case and their bins for `n` rows, each
    test's power asserted before any draw."""
    found = {}
    for test, law in (("first-token", case.target()[0, case.start]), ("completed", completed_law(case))):
        max_bins = config.max_bins if test == "completed" else max(config.max_bins, case.vocab)
        bin_of, expected = probability_bins(law, n, max_bins=max_bins)
        if len(expected) < 2:
            continue
        require_power(
            chisquare_detectable_w(n, len(expected), level, config.power) / 2,
            config.detect_tv,
            f"{test}[{case.name}] (Pearson χ² on {len(expected)} bins at alpha = {level:.3g}, power {config.power:g})",
            n=n,
            required_n=chisquare_required_n(2 * config.detect_tv, len(expected), level, config.power),
            unit="rows",
        )
        found[test] = (law, bin_of, expected)
    return found


def _chisquare(
    case: TreeCase,
    bins: Bins,
    values: dict[str, torch.Tensor],
    level: float,
    config: TierConfig,
) -> list[TestResult]:
    """The χ² tests of one sampled case: `values[test]` [R] outcome indices of the well-formed rows
    inside the law's support (those outside counted by `support`)."""
    out = []
    for test, (_, bin_of, expected) in bins.items():
        n = len(values[test])
        if n == 0:
            continue
        observed = torch.bincount(bin_of[values[test]], minlength=len(expected)).double()
        what = "first emitted token" if test == "first-token" else f"emitted tokens completed to {case.tree.depth + 1}"
        result = goodness_of_fit(
            f"{test}[{case.name}]",
            f"{what} of {case.params.label()} rows over tree {case.tree.label()} ({case.siblings} siblings), "
            f"{len(expected)} bins of exact probability",
            observed,
            expected * (n / expected.sum()),
            level,
            config.power,
        )
        out += scoped([result], "pooled")
    return out
