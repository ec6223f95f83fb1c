"""What a certificate may claim, from its cells' records: what was tested, which bug classes each
cell would have caught, the pooled distance bounded from the data, and conformance to standard
speculative sampling as a verdict of its own.

"Lossless" is never claimed outright: a passing run says that no deviation was detected above
the effects its tests had the stated power for — per bug class (`losscheck.stats.bugclass`),
and as the pooled PIT law's binned distance, whose upper confidence bound the data give.

A bug class is a family: the mixtures (1 - ρ)·p + ρ·p' of the target's law p and the class's
catalogue law p' — the bug at magnitude ρ, or acting on a share ρ of the tokens
(`losscheck.stats.sequential`). Each cell's record gives, per class, its power curve (the
smallest ρ its tests catch at power 0.99 and 0.8 at the tokens it tested) and, for a sequential
cell, the members its early stop ruled out (down to which ρ, at which β).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from losscheck.cells.record import BoundRecord, CellRecord
from losscheck.report.document import BestCell, BugClassClaim, Conformance, CurvePoint, RuledOut, Tested

if TYPE_CHECKING:
    from losscheck.report.document import Certificate

CONFORMANCE = "conformance"  # the scope of the conformance tests (`losscheck.cells.conformance`)


def tested(records: Sequence[CellRecord]) -> Tested:
    """Cells, sequences and generated tokens the sampled cells tested (the pilots not counted),
    and how the sequential PIT cells stopped: their tested tokens against what the fixed-sample
    design would have tested (`losscheck.stats.sequential`)."""
    sampled = [r for r in records if r.verdict is not None]
    tokens = 0
    for r in sampled:
        assert r.verdict is not None
        n = max((t.n for t in r.verdict.results if t.name.endswith(".support")), default=0)
        tokens += n * (r.sample.horizon or 1) if r.kind == "exact" else n  # exact: n counts sequences
    # the PIT cells' looks: an engine cell has looks but no fixed-sample design to set them against
    # (its tokens are set against Wald's bound instead, `_bounds`)
    pit = [r for r in sampled if r.sample.looks is not None and r.sample.fixed_design_tokens is not None]
    looks = [r.sample.looks for r in pit if r.sample.looks is not None]
    return Tested(
        cells=len(records),
        sampled_cells=len(sampled),
        sequences=sum(r.sample.sequences or 0 for r in sampled),
        tokens=tokens,
        pilot_tokens=sum(r.sample.pilot_tokens or 0 for r in sampled),
        sequential_cells=len(looks),
        stopped_early=sum(look.early for look in looks),
        sequential_tokens=sum(look.tested_tokens for look in looks),
        fixed_design_tokens=sum(r.sample.fixed_design_tokens or 0 for r in pit),
    )


def coverage(records: Sequence[CellRecord], level: float) -> dict[str, BugClassClaim]:
    """Per bug class: the cells whose tested sample caught its catalogue point at power >=
    `level` (from its own p and q), the best cell's power, test and tokens; per power of the
    curve, the smallest member ρ a cell's tested sample catches and that cell; and of the early
    stops that had to rule the class's family out, how many, and the largest ρ one of them ruled
    it out down to (every early stop ruled out every member from 1 down to at least that ρ)."""
    out: dict[str, BugClassClaim] = {}
    for r in records:
        early = r.sample.looks is not None and r.sample.looks.early
        for name, c in (r.sample.bug_classes or {}).items():
            claim = out.get(name, BugClassClaim())
            curve = dict(claim.curve)
            for power, rho in c.curve.items():
                known = curve.get(power)
                if rho is not None and (known is None or rho < known.rho):
                    curve[power] = CurvePoint(rho, r.cell)
            ruled = claim.ruled_out
            if early and c.family is not None and c.family.members:
                stops = ruled or RuledOut(0, 0.0, 0.0)
                ruled = RuledOut(
                    stops.early_stops + 1,
                    max(stops.down_to, c.family.ruled_out_down_to or 1.0),
                    max([stops.beta, *(m.beta for m in c.family.members)]),
                )
            best = claim.best
            if best is None or c.power > best.power:
                best = BestCell(r.cell, c.power, c.test, c.tokens_needed)
            caught = (*claim.caught_by, r.cell) if c.power >= level and c.withdrawn is None else claim.caught_by
            withdrawn = (*claim.withdrawn_in, r.cell) if c.withdrawn is not None else claim.withdrawn_in
            out[name] = dataclasses.replace(
                claim, caught_by=caught, best=best, curve=curve, ruled_out=ruled, withdrawn_in=withdrawn
            )
    return out


def conformance(records: Sequence[CellRecord]) -> Conformance:
    """The conformance tests' own verdict: PASS when every one that ran passed (a verifier
    lossless by another rule fails them legitimately, so this line is kept apart)."""
    ran, failed = 0, []
    for r in records:
        for t in r.verdict.results if r.verdict is not None else ():
            if t.scope == CONFORMANCE:
                ran += 1
                if not t.passed:
                    failed.append(f"{r.cell}:{t.name}")
    verdict = "not tested" if not ran else ("PASS" if not failed else "FAIL")
    return Conformance(verdict, ran, tuple(failed))


def pooled_bound(records: Sequence[CellRecord]) -> tuple[float, str, float] | None:
    """The largest of the cells' upper confidence bounds on their pooled PIT binned TV, its cell
    and its confidence (each cell's own, look-corrected; None: no cell has one)."""
    bounds = [(r.sample.pooled_tv_upper, r) for r in records if r.sample.pooled_tv_upper is not None]
    if not bounds:
        return None
    bound, worst = max(bounds, key=lambda br: br[0])
    confidence = worst.sample.pooled_tv_confidence
    return bound, worst.cell, 0.95 if confidence is None else confidence


def lines(cert: Certificate) -> list[str]:
    """The claims of `cert` as Markdown list items."""
    from losscheck.stats import sequential  # the package imports torch: only when claims are written

    t, level = cert.tested, cert.meta.profile.power
    out = []
    if t is not None:
        out.append(
            f"- tested: {t.cells} cells; the sampled ones drew {t.sequences:,} sequences, "
            f"{t.tokens:,} generated tokens tested (plus {t.pilot_tokens:,} pilot tokens that size the "
            "samples and are never tested)"
        )
    if t is not None and t.sequential_cells:
        share = t.sequential_tokens / max(t.fixed_design_tokens, 1)
        beta_r = (1 - level) * sequential.RULE_OUT_SHARE
        out.append(
            f"- sequential PIT cells: {t.stopped_early} of {t.sequential_cells} stopped early; a cell stops "
            "only once, for every bug class its design reaches, it has ruled out each mixture (1 - ρ)·p + ρ·p' from "
            f"the catalogue point ρ = 1 down to the ρ at which its tests at the last look have power "
            f"{sequential.PARTIAL_POWER:g} (at β {beta_r:.3g} where they have the design's power, "
            f"{sequential.PARTIAL_BETA:g} elsewhere), so against those it keeps the fixed design's power less that β. "
            f"They tested {t.sequential_tokens:,} tokens where fixed-sample designs at the same α would test "
            f"{t.fixed_design_tokens:,} ({share:.0%}). Not claimed after an early stop: smaller mixtures, and "
            "laws outside these families, which a fixed design of the full size might still have caught"
        )
    conf = cert.conformance
    if conf is not None:
        failed = f": failed {', '.join(conf.failed[:5])}" if conf.failed else ""
        out.append(
            f"- conformance to standard speculative sampling (its own verdict; a verifier lossless by another "
            f"rule fails it legitimately): {conf.verdict} over {conf.tests} tests{failed}"
        )
    classes = cert.bug_classes or {}
    if classes:
        out.append(
            f"- bug classes (each cell's power from its own p and q: a PIT cell's tested sample's, an engine cell's "
            f"pilot and tested rows together; ρ: the mixture "
            f"(1 - ρ)·p + ρ·p', the bug at magnitude ρ or on a share ρ of the tokens; caught: at power {level:g}):"
        )
        for name, c in classes.items():
            best = c.best
            where = (
                f"power ≥ {level:g} at ρ = 1 in {_cells(len(c.caught_by))}"
                if c.caught_by
                else f"power ≥ {level:g} at ρ = 1 in no cell"
            )
            if best is not None:
                where += f" (best {best.cell}, {best.test}, power {best.power:.3f})"
            if c.curve:
                where += "; its tests at their stopping n catch down to " + ", ".join(
                    f"ρ = {point.rho:.3g} at power {power} ({point.cell})" for power, point in c.curve.items()
                )
            stops = c.ruled_out
            if stops:
                where += (
                    f"; {stops.early_stops} early stops ruled out its mixtures from ρ = 1 down to "
                    f"ρ ≤ {stops.down_to:.3g} (each at β ≤ {stops.beta:.3g})"
                )
            if c.withdrawn_in:
                where += (
                    f"; NOT COVERED in {', '.join(c.withdrawn_in)} (the tested sample fell short of the power "
                    "its design promised: no claim there, no failure either)"
                )
            out.append(f"  - `{name}`: {where}")
        engine_cells = [r for r in cert.cells if r.sample.mode == "one-sample"]
        if engine_cells:
            reasons: dict[str, str] = {}
            for r in engine_cells:
                reasons.update(r.sample.classes_not_judged or {})
            unjudged = "; ".join(f"`{name}` ({why})" for name, why in reasons.items())
            out.append(
                "  - a black-box engine's one-sample cells judge the classes whose law reads the target's p alone "
                "and, when the engine gives its draft model, the verifier's classes through a filter over the "
                f"slots it does not report; not claimed for them: {unjudged or 'none'}"
            )
    laws = [(r.cell, r.sample.draft_law) for r in cert.cells if r.sample.draft_law is not None]
    if laws:
        verdicts: dict[str, list[str]] = {}
        for cell, law in laws:
            verdicts.setdefault(law.verdict.split(":")[0], []).append(cell)
        out.append(
            "- the draft law each one-sample engine cell teacher-forced, against the engine's own counts of "
            "first drafts accepted (`losscheck.cells.engine.draft_law`): "
            + "; ".join(f"{verdict} in {len(cells)} ({', '.join(cells[:4])})" for verdict, cells in verdicts.items())
            + (
                " — where inconsistent, the drafter-side classes are withdrawn there"
                if "inconsistent" in verdicts
                else ""
            )
        )
    out += _bounds(cert) + _second_stages(cert) + _references(cert) + _ends(cert)
    found = {
        "speculation": "speculation blamed",
        "reference": "the reference differs from the engine, judged two-sample",
    }
    attributed = [(r.cell, r.sample.attribution) for r in cert.cells if r.sample.attribution is not None]
    if attributed:
        said = "; ".join(
            f"{cell}: {found.get(a.finding, a.finding)}"
            + (
                f" (a PASS of the row scores {', '.join(a.scores)} alone; its bug-class claims are that "
                "stage's own power)"
                if a.finding == "reference"
                else ""
            )
            for cell, a in attributed
        )
        out.append(
            "- black-box cells whose first stage rejected against losscheck's copy of the target, then compared "
            "speculative with speculation-off rows on the planned and the failing tests' row scores: "
            f"{said}. At reduced precision a first-stage rejection may be the verify pass's kernel numerics "
            "against the decode pass's as much as speculation's algorithm; the second stage tells the engine's "
            "two sides apart, not which of the two"
        )
    greedy = [r for r in cert.cells if r.sample.rollbacks is not None]
    if greedy:
        idle = [r.cell for r in greedy if r.sample.rollbacks == 0]
        state = " (the target's recurrent state included)" if any(r.sample.recurrent_state for r in greedy) else ""
        out.append(
            f"- greedy cells: {sum(r.sample.rollbacks or 0 for r in greedy):,} rejected drafts, each a rollback "
            f"of the target's cache{state}, in {len(greedy) - len(idle)} of {_cells(len(greedy))}"
            + (f"; no rollback exercised, so their PASS says nothing of rollback: {', '.join(idle)}" if idle else "")
        )
        gapped = [r for r in greedy if r.sample.zero_draft_rounds]
        out.append(
            f"- zero-draft rounds (a row proposing nothing, as an n-gram drafter without a match): "
            f"{sum(r.sample.zero_draft_rounds or 0 for r in gapped):,} row-rounds in {len(gapped)} of {len(greedy)} "
            "greedy cells" + ("" if gapped else "; none ran, so the PASS says nothing of that path")
        )
        cached = [r for r in greedy if "prefix" in r.serving_facts]
        if cached:
            hits = {r.cell: int(r.serving_facts["prefix"].get("hits") or 0) for r in cached}
            resumed = sum(int(r.serving_facts["prefix"].get("state_resumed") or 0) for r in cached)
            cold = [cell for cell, n in hits.items() if n == 0]
            out.append(
                f"- prefix-cache hits: {sum(hits.values()):,} blocks reused in {len(cached) - len(cold)} of "
                f"{len(cached)} greedy prefix-cache cells"
                + (f", {resumed:,} of them resuming a recurrent state" if resumed else "")
                + (f"; no hit, so their PASS says nothing of a resumed prefix: {', '.join(cold)}" if cold else "")
            )
    bound = pooled_bound(cert.cells)
    if bound is not None:
        worst, cell, confidence = bound
        out.append(
            f"- pooled PIT law: each cell's binned TV from uniform lies below its own upper confidence bound "
            "(95% per cell at whichever look it stopped: each look's bound at 1 - 0.05 / looks; not simultaneous "
            f"over cells; tokens taken as independent); the largest is {worst:.3g} ({cell}, "
            f"at confidence {confidence:.3g} per look)"
        )
    return out


def _cells(n: int, kind: str = "") -> str:
    """ "1 cell", "3 sampled cells": a count of cells with its noun in number."""
    return f"{n} {kind + ' ' if kind else ''}cell{'' if n == 1 else 's'}"


def _bounds(cert: Certificate) -> list[str]:
    """The one-sample engine cells' tokens against Wald's bound at their binding classes."""
    bounds = [(r.cell, r.sample.bound) for r in cert.cells if r.sample.bound is not None]
    if not bounds:
        return []
    early = [r.sample.looks.early for r in cert.cells if r.sample.bound is not None and r.sample.looks is not None]
    worst_cell, worst = max(bounds, key=lambda cb: cb[1].ratio_h0)
    h0 = sorted(b.ratio_h0 for _, b in bounds)
    bug = sorted(b.ratio for _, b in bounds)
    return [
        f"- tokens read against the information bound in {_cells(len(bounds), 'one-sample engine')} "
        f"({sum(early)} stopped before their last look): "
        "each binding class's test read, against Wald's approximation (overshoot neglected) of the tokens "
        "the sequential probability ratio test needs on average at the cell's α and power "
        "(`losscheck.stats.effects.wald_size`), "
        f"{h0[0]:.1f}-{h0[-1]:.1f} times the bound under H0 (median {statistics.median(h0):.1f}) and "
        f"{bug[0]:.1f}-{bug[-1]:.1f} times it under the class (median {statistics.median(bug):.1f}); "
        f"the most, {worst_cell} (`{worst.binding_class}`, {worst.tested_tokens} tokens against "
        f"{worst.wald_h0_tokens:.0f}"
        + (", sized by the profile's floor, not the class)" if worst.at_floor else ")")
        + (f"; {_cells(floored)} sized by the floor" if (floored := sum(b.at_floor for _, b in bounds)) else "")
        + _family(bounds)
    ]


def _family(bounds: list[tuple[str, BoundRecord]]) -> str:
    """The tokens every test read against the early stop's promise, where cells had looks."""
    family = sorted(b.ratio_family for _, b in bounds if b.ratio_family is not None)
    if not family:
        return ""
    return (
        f"; against the early stop's promise (every family member down to the design's limits ruled out: "
        f"Wald's bound under H0 for the slowest member's rule-out, `EngineLooks.family_bound`) "
        f"{family[0]:.1f}-{family[-1]:.1f} times (median {statistics.median(family):.1f}) in "
        f"{_cells(len(family))}"
    )


def _second_stages(cert: Certificate) -> list[str]:
    """The one-sample engine cells' second stages as planned: a claim is both stages' power."""
    planned = [r.sample.second_stage for r in cert.cells if r.sample.second_stage is not None]
    if not planned:
        return []
    rows = sorted(p.rows for p in planned)
    return [
        f"- the bug-class claims of {_cells(len(planned), 'one-sample engine')} are each cell's chance to FAIL, "
        "both stages: the first stage's power times the second's (`losscheck.stats.second_stage`), the second "
        f"planned from the first's sums, whatever its tests found, at {rows[0]:,}-{rows[-1]:,} rows a side "
        "and drawn only after a first-stage rejection"
    ]


def _references(cert: Certificate) -> list[str]:
    """What a black-box engine's cells were scored against, where it is not an fp32 copy of the
    engine's target: a reduced-precision reference (one-sample) or the proxy (two-sample)."""
    from losscheck.core.precision import LOGIT_TOLERANCE

    out = []
    reduced: dict[str, list[str]] = {}
    proxies: dict[str, list[str]] = {}
    for r in cert.cells:
        if r.sample.mode == "one-sample" and r.precision is not None and r.precision.split("/")[0] != "fp32":
            reduced.setdefault(r.precision.split("/")[0], []).append(r.cell)
        if r.sample.proxy_precision is not None:
            proxies.setdefault(r.sample.proxy_precision, []).append(r.cell)
    for precision, names in reduced.items():
        out.append(
            f"- {_cells(len(names), 'one-sample engine')} scored by losscheck's copy of the target in {precision} "
            f"({', '.join(names[:4])}): their power figures are computed on that reference's p, from which the "
            f"engine's kernels may differ at the scale of the precision's logit tolerance "
            f"({LOGIT_TOLERANCE[precision]:g} nats; not measured per kernel); a first-stage rejection is put to "
            "the engine's own plain side before any blame"
        )
    for precision, names in proxies.items():
        out.append(
            f"- {_cells(len(names), 'two-sample engine')} sized through a proxy, losscheck's copy of the target in "
            f"{precision} ({', '.join(names[:4])}): their tests keep their level whatever the proxy is; their power "
            "figures are the proxy's, kept only where the tested plain rows' surprisal agrees with it"
        )
    return out


def _ends(cert: Certificate) -> list[str]:
    """How often the sampled loop cells put a stop inside a block to the test, and where the
    stopping-time test (`pit.stop_hazard`) has its power against a stop dropped wherever it lands
    inside a block: a loss of that share of the cell's ends, `ends_in_block / ends`."""
    counted = [r for r in cert.cells if r.sample.ends is not None]
    if not counted:
        return []
    ends = sum(r.sample.ends or 0 for r in counted)
    inside = sum(r.sample.ends_in_block or 0 for r in counted)
    most = max(counted, key=lambda r: r.sample.ends_in_block or 0)
    out = [
        f"- rows ending on EOS or a stop id in {_cells(len(counted), 'sampled')}: {ends:,}, {inside:,} of them with "
        "drafted positions after the end in its round (where an engine that commits past a stop leaks; "
        f"most in {most.cell}: {most.sample.ends_in_block or 0:,} of {most.sample.ends or 0:,})"
    ]
    covered: list[str] = []
    short: list[str] = []
    for r in counted:
        hazard = next((t for t in (r.verdict.results if r.verdict else ()) if t.name == "pit.stop_hazard"), None)
        if hazard is None or not r.sample.ends:
            continue
        share = (r.sample.ends_in_block or 0) / r.sample.ends
        detects = hazard.detectable.get("stop_loss_share")
        detected = "none" if detects is None else f"{detects:.2f}"
        said = f"{r.cell} ({share:.2f} of its ends in a block, detectable {detected})"
        (covered if detects is not None and detects <= share else short).append(said)
    strings = [r for r in counted if r.sample.string_ends is not None]
    if strings:
        out.append(
            f"  - rows ending on a stop string in {_cells(len(strings))}: "
            f"{sum(r.sample.string_ends or 0 for r in strings):,}, "
            f"{sum(r.sample.string_ends_in_block or 0 for r in strings):,} of them inside a block; where such a "
            "row ends is a function of its tokens, which the end check reads exactly (`losscheck.cells.ends`)"
        )
    if covered or short:
        out.append(
            "  - a stop dropped wherever it lands inside a block (the end lost, the row running on) loses about "
            "that share of a cell's ends, which `pit.stop_hazard` detects at the cell's stated power (read as the "
            "same share of every end's probability) in "
            + (", ".join(covered) if covered else "no cell")
            + ("; not covered in " + ", ".join(short) if short else "")
        )
    return out
