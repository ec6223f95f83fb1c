"""Benchmarks of the loop on the bundled models (`losscheck bench`), written out by
`losscheck.report.bench`; figures go to docs/perf.md.

Timings, not tests: nothing here asserts a speed. Each figure is the best of `repeats` runs after
one warm-up, on whatever threads torch uses (the command prints them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from losscheck import bundled
from losscheck.core.contract import Drafter
from losscheck.core.engine import Engine
from losscheck.core.generation import Generation, LoopStats
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator
from losscheck.core.target import HFTarget
from losscheck.drafters.autoregressive import from_path
from losscheck.jsonrecord import JsonRecord
from losscheck.perf.peer import assistant_model, hf_generate_seconds
from losscheck.perf.workload import Request
from losscheck.report.bench import BenchResults, LoopRow, SamplesPerSecond, write_report


def best_seconds(run: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    run()  # warm-up
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - t0)
    return best, out


def prompts_for(batch: int) -> list[list[int]]:
    pool = [p for tier in bundled.PROMPT_TIERS for p in bundled.load_prompts(tier)]
    return [pool[i % len(pool)] for i in range(batch)]


def loop_throughput(
    target: HFTarget, drafter: Drafter, batch: int, new: int, params: SamplingParams, k: int, repeats: int
) -> LoopRow:
    """Generated tokens per second of the spec loop and of the baseline, same prompts."""
    prompts = prompts_for(batch)
    tokens_per_s, gens = {}, {}
    for name, engine in (("baseline", Engine(target)), ("spec", Engine(target, drafter, k))):

        def run(engine: Engine = engine) -> Generation:  # this engine, a fresh generator each repeat
            return engine.generate(prompts, new, params, make_generator(0, "bench"))

        seconds, gens[name] = best_seconds(run, repeats)
        tokens_per_s[name] = float(gens[name].lengths.sum()) / seconds
    stats = gens["spec"].stats
    return LoopRow(
        batch=batch,
        new_tokens=new,
        k=k,
        baseline_tokens_per_s=tokens_per_s["baseline"],
        spec_tokens_per_s=tokens_per_s["spec"],
        acceptance_length=stats.acceptance_length,
        draft_time_fraction=stats.draft_seconds / max(stats.total_seconds, 1e-12),
        speedup=tokens_per_s["spec"] / tokens_per_s["baseline"],
        params=params.label(),
    )


def hf_assisted_samples_per_s(target: HFTarget, drafter: Drafter, new: int, n: int, k: int) -> float:
    """Sequences per second of Hugging Face assisted generation (`losscheck.perf.peer`) over `n`
    prompts, up to `new` tokens each (a row ends sooner at EOS, as in the loop), batch 1 (its only
    supported batch), sampling at T=1, `drafter` as assistant drafting `k` tokens per round; timed
    after a one-request warm-up."""
    requests = [Request(prompt, new, "bench") for prompt in prompts_for(n)]
    model, assistant, params = target.model, assistant_model(drafter), SamplingParams(temperature=1.0)
    hf_generate_seconds(model, assistant, requests[:1], params, k, 0)  # warm-up
    seconds, _ = hf_generate_seconds(model, assistant, requests, params, k, 0)
    return n / seconds


def run_benchmarks(out: Path, repeats: int = 2) -> BenchResults:
    target = HFTarget.from_pretrained(bundled.target_path())
    drafter = from_path(bundled.fixtures_dir() / "drafter_a", target)
    horizon = 16
    rows = []
    for batch in (1, 64, 1024):
        for params in (GREEDY, SamplingParams(temperature=1.0)):
            row = loop_throughput(target, drafter, batch, 64 if batch == 1 else horizon, params, 4, repeats)
            rows.append(row)
            print(json.dumps(row.to_json()), flush=True)
    # Samples per second: our loop at batch 1024 vs HF assisted generation at batch 1.
    seconds, _ = best_seconds(
        lambda: Engine(target, drafter, 4).generate(
            prompts_for(1024), horizon, SamplingParams(), make_generator(1, "b")
        ),
        repeats,
    )
    ours = 1024 / seconds
    theirs = hf_assisted_samples_per_s(target, drafter, horizon, 32, 4)
    samples = SamplesPerSecond(ours, theirs, ours / theirs, horizon, 4)
    print(json.dumps(samples.to_json()), flush=True)
    results = BenchResults(torch.get_num_threads(), torch.__version__, tuple(rows), samples)
    write_report(results, out)
    return results


@dataclass(frozen=True)
class PitMemory(JsonRecord):
    """Peak memory of one PIT cell's teacher-forced scoring (`pit_peak_memory`)."""

    vocab: int
    rows: int
    positions: int  # prompt + horizon
    budget_mib: int
    chunk_rows: int  # rows scored per chunk under the budget
    unchunked_logits_mib: float  # what scoring every row at once would hold in logits
    rss_before_mib: int
    rss_peak_mib: int
    scoring_peak_mib: int
    seconds: float
    pit_values: int


def pit_peak_memory(vocab: int, budget_mib: int, rows: int = 2541, horizon: int = 16, prompt: int = 16) -> PitMemory:
    """Peak memory of one PIT cell's teacher-forced scoring — the gate's sample, `rows` sequences
    of `horizon` tokens after `prompt`-token prompts — on a random 2-layer Llama of `vocab` tokens,
    under a budget of `budget_mib`. Reads this process's resident high-water mark before and after:
    run it in a fresh process (`losscheck bench pit-memory VOCAB`)."""
    import resource

    from transformers import LlamaConfig, LlamaForCausalLM

    from losscheck.cells.scoring import pit_chunk_rows, teacher_forced_pit

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=prompt + horizon,
    )
    target = HFTarget(LlamaForCausalLM(config).eval(), f"random-llama-{vocab}", {})
    prompts = torch.randint(vocab, (rows, prompt)).tolist()
    gen = Generation(
        torch.randint(vocab, (rows, horizon)), torch.full((rows,), horizon), LoopStats.empty(0), SamplingParams()
    )
    v = torch.rand(rows, horizon, dtype=torch.float64)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux reports KiB)
    started = time.perf_counter()
    u, _, _ = teacher_forced_pit(target, prompts, gen, v, budget_mib << 20, 4096)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return PitMemory(
        vocab=vocab,
        rows=rows,
        positions=prompt + horizon,
        budget_mib=budget_mib,
        chunk_rows=pit_chunk_rows(prompt + horizon, vocab, budget_mib << 20, 4096),
        unchunked_logits_mib=rows * (prompt + horizon) * vocab * 4 / 2**20,
        rss_before_mib=round(before),
        rss_peak_mib=round(peak),
        scoring_peak_mib=round(peak - before),
        seconds=round(time.perf_counter() - started, 1),
        pit_values=int(u.numel()),
    )


@dataclass(frozen=True)
class MarginNoise(JsonRecord):
    """How far a precision's top-2 logit margins move with the batch shape (`margin_noise`)."""

    dtype: str
    prompts: int
    positions: int
    tolerance: float  # `LOGIT_TOLERANCE[dtype]`, the one in use
    max_deviation: dict[str, float]  # by shape: "one-token", "block-{k+1}", "whole-row"
    p999_deviation: dict[str, float]
    argmax_disagreements: int  # positions where the shapes' argmaxes differ
    float64_margin_under_tolerance: int


@torch.inference_mode()
def margin_noise(dtype: str, max_new: int = 64, k: int = 4) -> MarginNoise:
    """How far a reduced-precision target's top-2 logit margins move with the batch shape: the
    measurement behind `losscheck.core.precision.LOGIT_TOLERANCE` (`losscheck bench near-ties`).

    On the bundled target in `dtype`, along the fp32 greedy continuation of every bundled prompt,
    each position's top-2 margin is computed three ways — one token at a time through the cache
    (the baseline's shape), `k + 1` tokens at a time (the speculative loop's scoring) and one
    teacher-forced pass over the whole row — and compared with the float64 margin of the same two
    tokens from `top2_float64` (final hidden state, LM head in float64). Reports the largest and the
    99.9th-percentile deviation, how often the shapes' argmaxes disagree, and how many positions
    have a float64 margin under the tolerance in use.
    """
    from losscheck.core.divergence import top2_float64
    from losscheck.core.precision import LOGIT_TOLERANCE

    prompts = prompts_for(len(bundled.PROMPT_TIERS) * 16)
    reference = HFTarget.from_pretrained(bundled.target_path())
    rows = Engine(reference).generate(prompts, max_new, GREEDY, make_generator(0, "noise"))
    target = HFTarget.from_pretrained(bundled.target_path(), dtype)
    deviations: dict[str, list[float]] = {"one-token": [], f"block-{k + 1}": [], "whole-row": []}
    flips, under, positions = 0, 0, 0
    for b, prompt in enumerate(prompts):
        seq = torch.tensor([prompt + rows.row(b)])  # [1, P+L]
        n_scored = seq.shape[1] - 1  # logits at positions 0..T-2 predict tokens 1..T-1
        shapes = {}
        for name, step in (("one-token", 1), (f"block-{k + 1}", k + 1), ("whole-row", n_scored)):
            target.reset(1, seq.shape[1])
            parts = [
                target.forward(seq[:, s : min(s + step, n_scored)], torch.tensor([s]))[0]
                for s in range(0, n_scored, step)
            ]
            shapes[name] = torch.cat(parts, 1)[0]  # [T-1, V]
        for pos in range(len(prompt) - 1, n_scored):  # the generated positions
            top1, top2, margin = top2_float64(target.model, seq[0, : pos + 1].tolist())
            positions += 1
            under += margin < LOGIT_TOLERANCE[dtype]
            argmaxes = {int(logits[pos].argmax()) for logits in shapes.values()}
            flips += len(argmaxes) > 1
            for name, logits in shapes.items():
                deviations[name].append(abs(float(logits[pos, top1] - logits[pos, top2]) - margin))
    found = {name: torch.tensor(d, dtype=torch.float64) for name, d in deviations.items()}
    return MarginNoise(
        dtype=dtype,
        prompts=len(prompts),
        positions=positions,
        tolerance=LOGIT_TOLERANCE[dtype],
        max_deviation={name: float(d.max()) for name, d in found.items()},
        p999_deviation={name: float(d.quantile(0.999)) for name, d in found.items()},
        argmax_disagreements=flips,
        float64_margin_under_tolerance=int(under),
    )
