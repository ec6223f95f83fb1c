"""Acceptance analytics across drafter families (`losscheck families`).

Every bundled family (A–E, plus the self-draft oracle for reference; C and E also at a truncated
width) drafts for the same bundled target on the low / mid / high entropy prompt sets at each
block length, greedy and at T=1, through the ordinary engine. Per run the engine's `LoopStats`
give τ (tokens per round), per-slot acceptance, the wasted fraction and the draft-time fraction.

The one-token prompt `[BOS]` is in all three sets and carries no tier; it is run as its own group
(`bos`) so that its very long decodes (a target that, greedy, continues `[BOS]` with BOS after BOS
makes 64 one-token rounds for any drafter that does not copy that habit) do not swamp the
per-slot curves of the tiers.

Writes `table.json` (every run), `table.md` and `slot_acceptance.png` (one panel per drafter,
per-slot acceptance at the largest k, one curve per tier and mode). Timings are of this process
on this machine; run it alone (not under xdist, not beside other heavy jobs).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KS = (4, 8, 16)
MODES = ("greedy", "T1")
TRUNCATED_WIDTH = 4  # C and E are also run at this transition width
SAMPLED_REPEATS = 16  # T=1: each prompt is decoded this many times (independent draws)
MAX_NEW = 64
ORACLE = "self"


@dataclass(frozen=True)
class Variant:
    drafter: str  # registry name
    width: int | None = None

    @property
    def label(self) -> str:
        return self.drafter if self.width is None else f"{self.drafter} w{self.width}"


def _params(mode: str) -> Any:
    from losscheck.sampling import GREEDY, SamplingParams

    return GREEDY if mode == "greedy" else SamplingParams(temperature=1.0)


def compare_families(
    out: Path, seed: int, ks: tuple[int, ...] = KS, max_new: int = MAX_NEW, repeats: int = SAMPLED_REPEATS
) -> dict[str, Any]:
    """Run the comparison and write the report files under `out`; return the JSON document."""
    from losscheck import bundled
    from losscheck.drafters import registry
    from losscheck.engine import Engine
    from losscheck.report.certificate import environment
    from losscheck.sampling import make_generator
    from losscheck.target import HFTarget

    target = HFTarget.from_pretrained(bundled.target_path())
    drafters = {**registry.bundled("main", target), ORACLE: registry.self_draft(target)}
    variants = [Variant(name) for name in drafters]
    variants += [Variant(name, TRUNCATED_WIDTH) for name, d in drafters.items() if TRUNCATED_WIDTH in d.widths]
    prompts = prompt_groups({tier: bundled.load_prompts(tier) for tier in bundled.PROMPT_TIERS})

    def run(variant: Variant, k: int, mode: str, tier: str) -> Any:
        rows = prompts[tier] * (1 if mode == "greedy" else repeats)
        engine = Engine(target, drafters[variant.drafter], k, variant.width)
        gen = make_generator(seed, "families", variant.label, k, mode, tier)
        return engine.generate(rows, max_new, _params(mode), gen)

    for variant in variants:  # warm-up: first-call costs (allocation, lazy init) stay out of timings
        run(variant, max(ks), "T1", "high")

    records = []
    for variant in variants:
        for k in ks:
            for mode in MODES:
                for tier in prompts:
                    stats = run(variant, k, mode, tier).stats
                    records.append({
                        "drafter": variant.label, "family": variant.drafter, "width": variant.width,
                        "k": k, "mode": mode, "tier": tier, **stats.to_dict(),
                    })
                    # a slot no round reached has no acceptance (NaN): null in JSON
                    records[-1]["slot_acceptance"] = [a if a == a else None for a in stats.slot_acceptance()]
    doc = {
        "schema": "losscheck.families/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seed": seed,
        "target": target.identity,
        "drafters": {v.label: drafters[v.drafter].name for v in variants},
        "setup": {"ks": list(ks), "modes": list(MODES), "max_new_tokens": max_new,
                  "prompts_per_tier": {t: len(p) for t, p in prompts.items()}, "sampled_repeats": repeats},
        "environment": environment(),
        "runs": records,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "table.md").write_text(markdown(doc))
    plot_slot_acceptance(doc, out / "slot_acceptance.png")
    return doc


def prompt_groups(sets: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
    """Each tier's prompts of two or more tokens, then the distinct one-token prompts as `bos`."""
    groups = {tier: [p for p in prompts if len(p) > 1] for tier, prompts in sets.items()}
    single = sorted({tuple(p) for prompts in sets.values() for p in prompts if len(p) == 1})
    if single:
        groups["bos"] = [list(p) for p in single]
    return groups


def _by(runs: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {(r["drafter"], r["k"], r["mode"], r["tier"]): r for r in runs}


def markdown(doc: dict[str, Any]) -> str:
    """τ, wasted fraction and draft-time fraction per prompt group; per-slot acceptance."""
    runs, setup = doc["runs"], doc["setup"]
    index = _by(runs)
    labels = list(dict.fromkeys(r["drafter"] for r in runs))
    tiers = list(setup["prompts_per_tier"])
    env = doc["environment"]
    lines = [
        "# Drafter families on the bundled target",
        "",
        f"Seed {doc['seed']}; {setup['max_new_tokens']} new tokens per prompt, "
        f"{'/'.join(str(n) for n in setup['prompts_per_tier'].values())} prompts per tier "
        f"({'/'.join(tiers)}; `bos` = the one-token prompt [BOS] shared by all three sets, run apart); "
        f"T=1 rows decode each prompt {setup['sampled_repeats']} times. "
        f"torch {env['torch']}, {env['threads']} thread(s). "
        "τ = tokens per round (1 + accepted); wasted = drafts discarded after the first rejection; "
        "draft = share of the loop's wall time spent drafting (CPU, batched, tiny models: the "
        "target is cheap, so the draft cost weighs heavily).",
        "",
        f"Drafters: {', '.join(f'{k} = `{v}`' for k, v in doc['drafters'].items())}.",
    ]
    for mode in setup["modes"]:
        lines += ["", f"## {mode}", "",
                  "| drafter | k | " + " | ".join(f"τ {t}" for t in tiers) + " | "
                  + " | ".join(f"wasted {t}" for t in tiers) + " | "
                  + " | ".join(f"draft {t}" for t in tiers) + " |",
                  "|" + "---|" * (2 + 3 * len(tiers))]
        for label in labels:
            for k in setup["ks"]:
                cells = [index[label, k, mode, t] for t in tiers]
                lines.append(
                    f"| {label} | {k} | " + " | ".join(f"{c['acceptance_length']:.2f}" for c in cells) + " | "
                    + " | ".join(f"{c['wasted_fraction']:.2f}" for c in cells) + " | "
                    + " | ".join(f"{c['draft_time_fraction']:.2f}" for c in cells) + " |"
                )
    k_max = max(setup["ks"])
    lines += ["", f"## Per-slot acceptance at k={k_max}", "",
              "P(draft j accepted | drafts before it accepted), slots 1..k; `-` = never reached.", ""]
    for mode in setup["modes"]:
        for tier in tiers:
            group = "the [BOS] prompt" if tier == "bos" else f"{tier} entropy"
            lines += [f"**{mode}, {group}**", "", "| drafter | " + " | ".join(str(j + 1) for j in range(k_max)) + " |",
                      "|---|" + "---|" * k_max]
            for label in labels:
                curve = index[label, k_max, mode, tier]["slot_acceptance"]
                lines.append(f"| {label} | " + " | ".join("-" if a is None else f"{a:.2f}" for a in curve) + " |")
            lines.append("")
    return "\n".join(lines)


def plot_slot_acceptance(doc: dict[str, Any], path: Path) -> None:
    """One panel per drafter: per-slot acceptance at the largest k, a curve per tier and mode
    (the `bos` group is left out: it is one degenerate prompt, see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, setup = doc["runs"], doc["setup"]
    index = _by(runs)
    labels = list(dict.fromkeys(r["drafter"] for r in runs))
    k = max(setup["ks"])
    cols = 4
    rows = -(-len(labels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), sharex=True, sharey=True, squeeze=False)
    colors = {"low": "tab:blue", "mid": "tab:orange", "high": "tab:red"}
    styles = {"greedy": "-", "T1": "--"}
    for ax, label in zip(axes.flat, labels):
        for mode in setup["modes"]:
            for tier in [t for t in setup["prompts_per_tier"] if t != "bos"]:
                run = index[label, k, mode, tier]
                curve = [math.nan if a is None else a for a in run["slot_acceptance"]]
                ax.plot(range(1, k + 1), curve, styles.get(mode, ":"), marker=".",
                        color=colors.get(tier), label=f"{tier} {mode} (τ {run['acceptance_length']:.2f})")
        ax.set_title(f"{label}: {doc['drafters'][label]}", fontsize=9)
        ax.set_ylim(0, 1.02)
        ax.set_xticks(range(1, k + 1, max(1, k // 8)))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower left")
    for ax in axes.flat[len(labels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("slot j")
    for ax in axes[:, 0]:
        ax.set_ylabel("P(accept j | accepted < j)")
    fig.suptitle(f"Per-slot acceptance at k={k} (solid greedy, dashed T=1; the [BOS] prompt is in table.md only)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
