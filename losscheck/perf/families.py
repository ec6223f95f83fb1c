"""Acceptance analytics across drafter families (`losscheck families`): the experiment.

Every bundled family (A–E, plus the self-draft oracle for reference; C and E also at a truncated
width) drafts for the same bundled target on the low / mid / high entropy prompt sets at each
block length, greedy and at T=1, through the ordinary engine. Per run the engine's `LoopStats`
give τ (tokens per round), per-slot acceptance, the wasted fraction and the draft-time fraction.

The one-token prompt `[BOS]` is in all three sets and carries no tier; it is run as its own group
(`bos`) so that its very long decodes (a target that, greedy, continues `[BOS]` with BOS after BOS
makes 64 one-token rounds for any drafter that does not copy that habit) do not swamp the
per-slot curves of the tiers.

The JSON document (every run) is rendered by `losscheck.report.families`. Timings are of this
process on this machine; run it alone (not under xdist, not beside other heavy jobs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from losscheck import bundled
from losscheck.cells.record import AcceptanceRecord
from losscheck.core.engine import Engine
from losscheck.core.generation import Generation
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator
from losscheck.core.target import HFTarget
from losscheck.core.tree_engine import TreeEngine
from losscheck.plan.matrix import ORACLE
from losscheck.report.families import SCHEMA, FamiliesSetup, FamiliesTable, FamilyRun, write_report
from losscheck.report.manifest import environment
from losscheck.run import drafters as registry

KS = (4, 8, 16)
MODES = ("greedy", "T1")
TRUNCATED_WIDTH = 4  # C and E are also run at this transition width
SAMPLED_REPEATS = 16  # T=1: each prompt is decoded this many times (independent draws)
MAX_NEW = 64


@dataclass(frozen=True)
class Variant:
    drafter: str  # registry name
    width: int | None = None

    @property
    def label(self) -> str:
        return self.drafter if self.width is None else f"{self.drafter} w{self.width}"


def _params(mode: str) -> SamplingParams:
    return GREEDY if mode == "greedy" else SamplingParams(temperature=1.0)


def compare_families(
    out: Path, seed: int, ks: tuple[int, ...] = KS, max_new: int = MAX_NEW, repeats: int = SAMPLED_REPEATS
) -> FamiliesTable:
    """Run the comparison and write the report files under `out`; return the document."""
    target = HFTarget.from_pretrained(bundled.target_path())
    drafters = {**registry.bundled("main", target), ORACLE: registry.self_draft(target)}
    variants = [Variant(name) for name in drafters]
    variants += [Variant(name, TRUNCATED_WIDTH) for name, d in drafters.items() if TRUNCATED_WIDTH in d.widths]
    prompts = prompt_groups({tier: bundled.load_prompts(tier) for tier in bundled.PROMPT_TIERS})

    def run(variant: Variant, k: int, mode: str, tier: str) -> Generation:
        rows = prompts[tier] * (1 if mode == "greedy" else repeats)
        drafter = drafters[variant.drafter]
        engine = (  # a tree drafter's rounds run the tree loop (its k is the tree's depth)
            TreeEngine(target, drafter) if hasattr(drafter, "tree") else Engine(target, drafter, k, variant.width)
        )
        gen = make_generator(seed, "families", variant.label, k, mode, tier)
        return engine.generate(rows, max_new, _params(mode), gen)

    def declared(variant: Variant) -> list[int]:
        """The ks a drafter declares (a speculators checkpoint drafts at most speculative_tokens)."""
        return [k for k in ks if k in drafters[variant.drafter].block_lengths]

    variants = [v for v in variants if declared(v)]  # a drafter declaring none of `ks` sits this out
    for variant in variants:  # warm-up: first-call costs (allocation, lazy init) stay out of timings
        run(variant, max(declared(variant)), "T1", "high")

    records = []
    for variant in variants:
        for k in declared(variant):
            for mode in MODES:
                for tier in prompts:
                    stats = AcceptanceRecord.of(run(variant, k, mode, tier).stats)
                    records.append(FamilyRun(variant.label, variant.drafter, variant.width, mode, tier, stats))
    doc = FamiliesTable(
        schema=SCHEMA,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        seed=seed,
        target=dict[str, object](target.identity),
        drafters={v.label: drafters[v.drafter].name for v in variants},
        setup=FamiliesSetup(ks, MODES, max_new, {t: len(p) for t, p in prompts.items()}, repeats),
        environment=environment(target.device),
        runs=tuple(records),
    )
    write_report(doc, out)
    return doc


def prompt_groups(sets: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
    """Each tier's prompts of two or more tokens, then the distinct one-token prompts as `bos`."""
    groups = {tier: [p for p in prompts if len(p) > 1] for tier, prompts in sets.items()}
    single = sorted({tuple(p) for prompts in sets.values() for p in prompts if len(p) == 1})
    if single:
        groups["bos"] = [list(p) for p in single]
    return groups
