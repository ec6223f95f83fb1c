"""`losscheck bench rollback`: a hybrid target's recurrent state rolled back by a checkpoint per
position (`losscheck.core.recurrent`, what the loop runs) against replay (`losscheck.core.replay`).

Greedy speculative decoding of the bundled hybrid pair at each block length, both ways, on the
same prompts: the median wall time of `repeats` runs, the target passes each ran, and the
recurrent state a row holds per layer while a round's forward is open (m + 1 states for a
forward of m = k + 1 tokens, against 2). Both must emit plain decoding's tokens; a run where
either does not is an error, not a figure.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from losscheck.errors import LosscheckError

if TYPE_CHECKING:
    from losscheck.core.contract import Drafter
    from losscheck.core.target import HFTarget

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
PROMPTS, PROMPT_TOKENS, MAX_NEW = 8, 40, 48


@dataclass(frozen=True)
class RollbackRow:
    k: int
    checkpoint_s: float  # median wall seconds of one generate call
    replay_s: float
    checkpoint_passes: int  # target forwards per call
    replay_passes: int
    state_kib_checkpoint: float  # recurrent state held per row and layer during a round's forward
    state_kib_replay: float


def _pair() -> tuple[HFTarget, Drafter, list[list[int]]]:
    from transformers import AutoTokenizer

    from losscheck.core.target import HFTarget
    from losscheck.drafters.autoregressive import from_path

    target_dir = FIXTURES / "hybrid_target"
    if not target_dir.is_dir():
        raise LosscheckError(f"the hybrid fixture is missing: {target_dir}; rebuild it with fixtures/build_hybrid.py")
    target = HFTarget.from_pretrained(target_dir)
    tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    lines = (FIXTURES / "prompts" / "text.jsonl").read_text().splitlines()[:PROMPTS]
    prompts = [tok(json.loads(line)["text"])["input_ids"][:PROMPT_TOKENS] for line in lines]
    return target, from_path(FIXTURES / "hybrid_drafter_a", target), prompts


def _state_kib(target: HFTarget) -> float:
    """One recurrent state of one layer and row, in KiB (the gated delta net's [heads, d_k, d_v])."""
    config = target.model.config
    heads, d_k, d_v = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    return heads * d_k * d_v * 4 / 1024


def measure(ks: tuple[int, ...] = (1, 4, 8, 16), repeats: int = 3) -> list[RollbackRow]:
    from losscheck.core.engine import Engine
    from losscheck.core.replay import replayed
    from losscheck.core.sampling import GREEDY

    target, drafter, prompts = _pair()
    replay = replayed(target)
    plain = Engine(target, None, k=0).generate(prompts, MAX_NEW, GREEDY, torch.Generator()).tokens
    state = _state_kib(target)
    rows = []
    for k in ks:
        timed: dict[str, list[float]] = {"checkpoint": [], "replay": []}
        passes: dict[str, int] = {}
        for _ in range(repeats):
            variants: tuple[tuple[str, HFTarget], ...] = (("checkpoint", target), ("replay", replay))
            for name, t in variants:
                before = t.lm.passes
                started = time.perf_counter()
                out = Engine(t, drafter, k=k).generate(prompts, MAX_NEW, GREEDY, torch.Generator())
                timed[name].append(time.perf_counter() - started)
                passes[name] = t.lm.passes - before
                if not torch.equal(out.tokens, plain):
                    raise LosscheckError(f"rollback by {name} at k={k} left plain decoding's output")
        rows.append(
            RollbackRow(
                k,
                round(statistics.median(timed["checkpoint"]), 3),
                round(statistics.median(timed["replay"]), 3),
                passes["checkpoint"],
                passes["replay"],
                round((k + 2) * state, 1),
                round(2 * state, 1),
            )
        )
    return rows


def write(rows: list[RollbackRow], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "rollback.json", out / "rollback.md"
    js.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    lines = [
        "| k | checkpoint s | replay s | replay / checkpoint | target passes (checkpoint / replay) "
        "| state KiB per row and layer (checkpoint / replay) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.k} | {r.checkpoint_s} | {r.replay_s} | {r.replay_s / r.checkpoint_s:.2f} | "
        f"{r.checkpoint_passes} / {r.replay_passes} | {r.state_kib_checkpoint} / {r.state_kib_replay} |"
        for r in rows
    ]
    md.write_text("\n".join(lines) + "\n")
    return [js, md]
