"""What a certificate may claim, from its cells' records: what was tested, which bug classes each
cell would have caught, the pooled distance bounded from the data, and conformance to standard
speculative sampling as a verdict of its own.

"Lossless" is never claimed outright: a passing run says that no deviation was detected above
the effects its tests had the stated power for — per bug class (`losscheck.stats.bugclass`),
and as the pooled PIT law's binned distance, whose upper confidence bound the data give.
"""

from __future__ import annotations

from typing import Any

CONFORMANCE = "conformance"  # the scope of the conformance tests (`losscheck.cells.conformance`)


def tested(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Cells, sequences and generated tokens the sampled cells tested (the pilots not counted),
    and how the sequential PIT cells stopped: their tested tokens against what the fixed-sample
    design would have tested (`losscheck.stats.sequential`)."""
    sampled = [r for r in records if r.get("verdict")]
    tokens = 0
    for r in sampled:
        support = [t for t in r["verdict"]["results"] if t["name"].endswith(".support")]
        n = max((t["n"] for t in support), default=0)
        tokens += n * int(r.get("horizon") or 1) if r.get("kind") == "exact" else n  # exact: n counts sequences
    sequential = [r for r in sampled if r.get("looks")]
    return {
        "cells": len(records),
        "sampled_cells": len(sampled),
        "sequences": sum(int(r.get("sequences") or 0) for r in sampled),
        "tokens": tokens,
        "pilot_tokens": sum(int(r.get("pilot_tokens") or 0) for r in sampled),
        "sequential_cells": len(sequential),
        "stopped_early": sum(bool(r["looks"]["early"]) for r in sequential),
        "sequential_tokens": sum(int(r["looks"]["tested_tokens"]) for r in sequential),
        "fixed_design_tokens": sum(int(r.get("fixed_design_tokens") or 0) for r in sequential),
    }


def coverage(records: list[dict[str, Any]], level: float) -> dict[str, dict[str, Any]]:
    """Per bug class: the cells whose tested sample caught it at power >= `level` (from its own
    p and q), and the best cell's power, test and tokens."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        for name, c in (r.get("bug_classes") or {}).items():
            entry = out.setdefault(name, {"caught_by": [], "best": None})
            if c.get("power") is not None and c["power"] >= level:
                entry["caught_by"].append(r["cell"])
            best = entry["best"]
            if c.get("power") is not None and (best is None or c["power"] > best["power"]):
                entry["best"] = {
                    "cell": r["cell"],
                    "power": c["power"],
                    "test": c["test"],
                    "tokens": c["tokens_needed"],
                }
    return out


def conformance(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The conformance tests' own verdict: PASS when every one that ran passed (a verifier
    lossless by another rule fails them legitimately, so this line is kept apart)."""
    ran, failed = 0, []
    for r in records:
        for t in (r.get("verdict") or {}).get("results", []):
            if t.get("scope") == CONFORMANCE:
                ran += 1
                if not t.get("passed"):
                    failed.append(f"{r['cell']}:{t['name']}")
    verdict = "not tested" if not ran else ("PASS" if not failed else "FAIL")
    return {"verdict": verdict, "tests": ran, "failed": failed}


def pooled_bound(records: list[dict[str, Any]]) -> float | None:
    """The largest 95% upper confidence bound on a cell's pooled PIT binned TV (None: no cell has one)."""
    bounds = [r["pooled_tv_upper"] for r in records if r.get("pooled_tv_upper") is not None]
    return max(bounds) if bounds else None


def lines(cert: dict[str, Any]) -> list[str]:
    """The claims as Markdown list items."""
    t, level = cert.get("tested") or {}, cert.get("profile", {}).get("power", 0.99)
    out = []
    if t:
        out.append(
            f"- tested: {t['cells']} cells; the sampled ones drew {t['sequences']:,} sequences, "
            f"{t['tokens']:,} generated tokens tested (plus {t['pilot_tokens']:,} pilot tokens that size the "
            "samples and are never tested)"
        )
    if t.get("sequential_cells"):
        share = t["sequential_tokens"] / max(t["fixed_design_tokens"], 1)
        out.append(
            f"- sequential PIT cells: {t['stopped_early']} of {t['sequential_cells']} stopped early, every bug class "
            f"their designs cover ruled out; they tested {t['sequential_tokens']:,} tokens where fixed-sample designs "
            f"of the same α and power would test {t['fixed_design_tokens']:,} ({share:.0%})"
        )
    conf = cert.get("conformance") or {}
    if conf:
        failed = f": failed {', '.join(conf['failed'][:5])}" if conf.get("failed") else ""
        out.append(
            f"- conformance to standard speculative sampling (its own verdict; a verifier lossless by another "
            f"rule fails it legitimately): {conf['verdict']} over {conf['tests']} tests{failed}"
        )
    classes = cert.get("bug_classes") or {}
    if classes:
        out.append(f"- bug classes (each cell's power from its own p and q, at power {level:g}):")
        for name, c in classes.items():
            best = c["best"]
            where = f"caught by {len(c['caught_by'])} cells" if c["caught_by"] else "caught by no cell"
            if best is not None:
                where += f"; best {best['cell']} ({best['test']}, power {best['power']:.3f})"
            out.append(f"  - `{name}`: {where}")
    bound = pooled_bound(cert.get("cells", []))
    if bound is not None:
        out.append(
            f"- pooled PIT law: every cell's binned TV from uniform is below {bound:.3g} (95% upper confidence "
            "bound of the worst cell, tokens taken as independent)"
        )
    return out
