"""The bug-class power table: tokens each test needs to catch each bug class (docs/bug-classes.md).

    python -m losscheck.selftest.bugtable [--rows N] [--seed S]

A synthetic Markov target (V = 64: a seeded random transition table; the law of the next token
depends on the last one), a drafter whose q is a perturbed copy of the table tuned to a per-slot
acceptance Σ min(p, q) of about 0.88 and 0.97 (averaged over the chain's stationary law), and the
standard speculative loop (k = 4 drafts per round, rejection sampling, recovered and bonus tokens)
run for L = 16 tokens per row. Every emitted token is a step with its p, the q of its slot (none
at a bonus slot), its slot and the previous round's q for that slot (exact here: the simulation
keeps every round's drafts, wasted ones included). The steps go through `PowerAccumulator`, and
the table prints tokens needed per bug class and test at power 0.99. As in a cell, a pilot (a
tenth of the rows, its own seed) picks the id `pit.bug_classes` aims drafter_misreports_one_id
at, and the table is computed at that id. The per-test levels are those a cell uses: the run's
per-test α of a cell (1.98e-5) split over the cell's PIT tests (`losscheck.stats.registry`) for the
pooled and slot χ², over the conditional tests for those and for the LR
bound. The previous round's q is exact in the bugs' laws; `pit.bug_classes` scores stale_q with
the approximation a cell has (the q of the row's last step at the same slot).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch

from losscheck.stats import registry
from losscheck.stats.bugclass import LR_BOUND, PowerAccumulator, design_tests
from losscheck.stats.registry import CONDITIONAL, PIT

VOCAB, K, LENGTH = 64, 4, 16
CELL_ALPHA = 1.98e-5  # the gate's per-test α: one cell's share of --losscheck-alpha 0.01
POWER = 0.99
ACCEPTANCES = (0.88, 0.97)
ROWS = 4000  # rows of LENGTH tokens per drafter: 64k steps
PILOT_SHARE = 10  # the pilot draws ROWS / PILOT_SHARE rows


@dataclass(frozen=True)
class Chain:
    """Target table p [V, V] and drafter table q [V, V]: row s is the law after token s."""

    p: torch.Tensor
    q: torch.Tensor

    def acceptance(self) -> float:
        """Per-slot acceptance Σ_x min(p, q) averaged over the stationary law of p."""
        stationary = _stationary(self.p)
        return float((stationary * torch.minimum(self.p, self.q).sum(-1)).sum())


def _stationary(p: torch.Tensor) -> torch.Tensor:
    """Stationary law [V] of the transition table p [V, V]."""
    law = torch.full((len(p),), 1.0 / len(p), dtype=torch.float64)
    for _ in range(500):
        law = law @ p
    return law


def make_chain(acceptance: float, seed: int, vocab: int = VOCAB) -> Chain:
    """A target table (softmax of 2·N(0, 1) logits) and a drafter q = softmax(log p + σ·N(0, 1)),
    σ solved by bisection so that the per-slot acceptance is `acceptance` (to 1e-4)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2.0 * torch.randn(vocab, vocab, generator=g, dtype=torch.float64), -1)
    noise = torch.randn(vocab, vocab, generator=g, dtype=torch.float64)

    def chain(sigma: float) -> Chain:
        return Chain(p, torch.softmax(p.log() + sigma * noise, -1))

    low, high = 0.0, 8.0
    while high - low > 1e-6:
        mid = (low + high) / 2
        low, high = (mid, high) if chain(mid).acceptance() > acceptance else (low, mid)
    return chain((low + high) / 2)


@dataclass(frozen=True)
class Steps:
    """What the loop emitted, as steps: every tensor [N, L] (ids index the chain's tables)."""

    tokens: torch.Tensor  # emitted ids
    before: torch.Tensor  # the token before each step: p = chain.p[before], q = chain.q[before]
    slots: torch.Tensor  # slot of each token in its round (K = bonus)
    stale: torch.Tensor  # the previous round's state for the same slot (its q = chain.q[stale]); -1: none
    accepted: int  # drafts accepted
    decided: int  # drafts decided (up to the first rejection)


def simulate(chain: Chain, rows: int, seed: int, k: int = K, length: int = LENGTH) -> Steps:
    """The standard speculative loop on `rows` independent rows until each has `length` tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = chain.p.shape[0]
    out = {name: torch.full((rows, length), -1, dtype=torch.long) for name in ("tokens", "before", "slots", "stale")}
    last = torch.randint(vocab, (rows,), generator=g)  # the prompt's last token
    prev_states = torch.full((rows, k), -1, dtype=torch.long)  # previous round's state per slot
    filled = torch.zeros(rows, dtype=torch.long)
    all_rows = torch.arange(rows)
    accepted_total = decided_total = 0
    while bool((filled < length).any()):
        states = torch.empty(rows, k + 1, dtype=torch.long)  # token before each slot (k: bonus)
        drafts = torch.empty(rows, k, dtype=torch.long)
        states[:, 0] = last
        for j in range(k):
            drafts[:, j] = torch.multinomial(chain.q[states[:, j]], 1, generator=g).squeeze(-1)
            states[:, j + 1] = drafts[:, j]
        p_draft = chain.p[states[:, :k], drafts]  # [rows, k]
        q_draft = chain.q[states[:, :k], drafts]
        keep = torch.rand(rows, k, generator=g, dtype=torch.float64) < (p_draft / q_draft).clamp(max=1.0)
        accepted = keep.long().cumprod(-1).sum(-1)  # [rows]
        stop_state = states[all_rows, accepted]  # [rows]
        residual = (chain.p[stop_state] - chain.q[stop_state]).clamp_min(0.0)
        law = torch.where((accepted < k)[:, None], residual, chain.p[stop_state])
        stop = torch.multinomial(law, 1, generator=g).squeeze(-1)
        emitted = torch.cat([drafts, torch.zeros(rows, 1, dtype=torch.long)], 1)
        emitted[all_rows, accepted] = stop
        active = filled < length
        accepted_total += int(accepted[active].sum())
        decided_total += int(torch.minimum(accepted + 1, torch.tensor(k))[active].sum())
        stale = torch.cat([prev_states, torch.full((rows, 1), -1, dtype=torch.long)], 1)  # bonus: no q
        for j in range(k + 1):
            at = filled + j
            write = active & (j <= accepted) & (at < length)
            r, t = all_rows[write], at[write]
            out["tokens"][r, t] = emitted[write, j]
            out["before"][r, t] = states[write, j]
            out["slots"][r, t] = j
            out["stale"][r, t] = stale[write, j]
        filled = torch.where(active, filled + accepted + 1, filled)
        last = torch.where(active, stop, last)
        prev_states = torch.where(active[:, None], states[:, :k], prev_states)
    return Steps(**out, accepted=accepted_total, decided=decided_total)


def accumulate(chain: Chain, steps: Steps, chunk: int = 500, misreported: int | None = None) -> PowerAccumulator:
    """The steps fed to a `PowerAccumulator` (aimed at `misreported`) a chunk of rows at a time,
    as a cell would."""
    acc = PowerAccumulator(misreported=misreported)
    for start in range(0, len(steps.tokens), chunk):
        part = slice(start, start + chunk)
        before, slots, stale = steps.before[part], steps.slots[part], steps.stale[part]
        drafted = (slots < K)[..., None]
        p = chain.p[before]  # [n, L, V]
        q = torch.where(drafted, chain.q[before], 0.0)
        q_prev = torch.where(drafted & (stale >= 0)[..., None], chain.q[stale.clamp_min(0)], 0.0)
        acc.update(p, q, steps.tokens[part], slots, K, torch.ones(before.shape, dtype=torch.bool), q_prev=q_prev)
    return acc


def level(test: str) -> float:
    """The per-test α the table judges `test` at: the cell's α over its family's tests (the LR
    bound's: over the conditional tests')."""
    family = CONDITIONAL if test == LR_BOUND else registry.get(test).family
    return CELL_ALPHA / registry.budget_count(family)


@dataclass(frozen=True)
class Column:
    """One drafter's results: achieved acceptance, TV per class and tokens needed per class and test."""

    target_acceptance: float
    acceptance: float  # observed in the loop: accepted / decided drafts
    misreported_id: int | None
    tv: dict[str, float]
    needed: dict[str, dict[str, float]]


def column(acceptance: float, rows: int, seed: int) -> Column:
    chain = make_chain(acceptance, seed)
    pilot = accumulate(chain, simulate(chain, max(1, rows // PILOT_SHARE), seed + 2))
    steps = simulate(chain, rows, seed + 1)
    acc = accumulate(chain, steps, misreported=pilot.misreported_id)
    tests = (*design_tests(), LR_BOUND)
    by_level = {a: acc.tokens_needed(a, POWER) for a in {level(t) for t in tests}}
    needed = {
        bug: {t: by_level[level(t)][bug][t] for t in tests if t in by_level[level(t)][bug]}
        for bug in by_level[level(LR_BOUND)]
    }
    return Column(acceptance, steps.accepted / steps.decided, acc.misreported_id, acc.tv(), needed)


def _tokens(n: float) -> str:
    if not math.isfinite(n):
        return "—"
    for scale, unit in ((1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def table(columns: list[Column]) -> str:
    """Markdown: one row per bug class and drafter; pooled χ² (what cells test today), the best of
    the four exact-conditional tests (after), every test and the LR bound."""
    short = {t: t.removeprefix("pit.") for t in design_tests()}
    head = ["bug class", "acc", "TV/step", "before: pooled χ²", "after: best conditional", *short.values(), "LR bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    conditional = [t.name for t in registry.designed() if t.family == CONDITIONAL]
    for bug in columns[0].needed:
        for col in columns:
            needed = col.needed[bug]
            best = min((t for t in conditional if t in needed), key=lambda t: needed[t])
            cells = [
                bug,
                f"{col.acceptance:.3f}",
                f"{col.tv[bug]:.2e}",
                _tokens(needed["pit.pooled_chisquare"]),
                f"{_tokens(needed[best])} ({short[best]})" if math.isfinite(needed[best]) else "—",
                *(_tokens(needed[t]) if t in needed else "n/a" for t in short),
                _tokens(needed[LR_BOUND]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m losscheck.selftest.bugtable", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=ROWS, help=f"rows of {LENGTH} tokens per drafter")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # [.., 64]-sized tensors: more threads only spin on a shared machine
    began = time.perf_counter()
    columns = [column(a, args.rows, args.seed) for a in ACCEPTANCES]
    print(
        f"V = {VOCAB}, k = {K}, L = {LENGTH}, {args.rows} rows per drafter, seed {args.seed}; power {POWER}; "
        f"per-test α: pooled and slot χ² {level('pit.pooled_chisquare'):.3g} (cell α {CELL_ALPHA:g} / "
        f"{registry.budget_count(PIT)}), conditional tests and LR bound {level(LR_BOUND):.3g} "
        f"(/ {registry.budget_count(CONDITIONAL)})"
    )
    for col in columns:
        print(
            f"drafter tuned to acceptance {col.target_acceptance}: observed {col.acceptance:.4f}; "
            f"misreported id {col.misreported_id} (the pilot's)"
        )
    print(table(columns))
    print(f"({time.perf_counter() - began:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
