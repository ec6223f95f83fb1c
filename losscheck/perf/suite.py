"""The measurements of one perf run, memoised: any subset of the perf tests measures only what it
needs, and the report (`losscheck.report.perf`) shows whatever was measured.

A *rung* is one engine ("baseline" or a drafter) at one concurrency on one workload: one warm-up
run, then `profile.repeats` timed runs of the same requests (`losscheck.perf.serving.serve`).
A drafter's runs alternate with baseline runs (its paired baseline), and its speedup is taken
over those pairs; the baseline's own rung (the latency table, the throughput curve) is measured
apart.
Workloads: "ladder" (every tier, the profile's output budgets), "short" (every tier, the short
budgets), and one per entropy tier.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from typing import TYPE_CHECKING

from losscheck.core.generation import LoopStats
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator
from losscheck.errors import OptionError
from losscheck.perf.metrics import Latencies, round_breakdown, speedup, throughput
from losscheck.perf.model import Decomposition
from losscheck.perf.serving import ServeTrace, serve
from losscheck.perf.workload import Request, distinct_prompts, make_workload
from losscheck.plan.perf_profiles import PerfProfile
from losscheck.report.perf_record import BASELINE, SCHEMA, Peer, PerfRunFile, PerRound, Rung
from losscheck.report.perf_run import Comparison

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from losscheck.run.session import Session

LADDER, SHORT = "ladder", "short"
WARMUP_MAX_NEW = 8  # output budget of the warm-up run: enough rounds to touch every code path


def drafter_names(session: Session) -> list[str]:
    """The drafters a perf run times, without loading models: the user's, else the bundled
    families (the self-draft oracle is a correctness check, not a drafter to deploy)."""
    from losscheck.run.drafters import BLOCK_FAMILIES

    if session.options.drafter:
        return ["user"]
    return ["A"] if session.options.bundled == "reference" else ["A", *BLOCK_FAMILIES]


class PerfRun:
    def __init__(self, session: Session, profile: PerfProfile) -> None:
        self.session = session
        self.profile = profile
        self.params: SamplingParams = (
            GREEDY if profile.temperature == 0 else SamplingParams(temperature=profile.temperature)
        )
        self.seed = session.options.seed
        self._traces: dict[tuple[str, int, str], list[ServeTrace]] = {}
        self._paired: dict[tuple[str, int, str], list[ServeTrace]] = {}
        self._peer: Peer | None = None
        self.comparisons: list[Comparison] | None = None  # set by the compare with a saved run
        self.started = dt.datetime.now(dt.timezone.utc)

    # -- workloads and timed runs -------------------------------------------------------------

    def workload(self, concurrency: int, kind: str = LADDER) -> list[Request]:
        p = self.profile
        n = max(p.min_requests, concurrency * p.requests_per_slot)
        sets = self.session.prompt_sets
        if kind in (LADDER, SHORT):
            return make_workload(sets, n, p.short_max_new if kind == SHORT else p.max_new, self.seed, concurrency, kind)
        if kind not in sets:
            raise OptionError(f"no prompts of entropy tier {kind!r}; the prompt sets have {sorted(sets)}")
        return make_workload({kind: sets[kind]}, n, p.max_new, self.seed, concurrency, kind)

    def traces(self, engine: str, concurrency: int, kind: str = LADDER) -> list[ServeTrace]:
        """The timed runs of a rung (measured on first use). A drafter's runs alternate with
        baseline runs of the same requests (`paired_baseline`), so that both sides of each
        speedup see the same machine: load that drifts during a run moves both."""
        key = (engine, concurrency, kind)
        if key not in self._traces:
            requests = self.workload(concurrency, kind)
            warm = [Request(r.prompt, min(r.max_new, WARMUP_MAX_NEW), r.tier) for r in requests[:concurrency]]
            sides = [engine] if engine == BASELINE else [BASELINE, engine]
            for side in sides:
                self._run(side, key, warm, "warm-up")
            runs: dict[str, list[ServeTrace]] = {side: [] for side in sides}
            for i in range(self.profile.repeats):
                for side in sides:
                    runs[side].append(self._run(side, key, requests, i))
            self._traces[key] = runs[engine]
            if engine != BASELINE:
                self._paired[key] = runs[BASELINE]
        return self._traces[key]

    def paired_baseline(self, engine: str, concurrency: int, kind: str = LADDER) -> list[ServeTrace]:
        """The baseline runs interleaved with a drafter's runs (run i right before its run i)."""
        self.traces(engine, concurrency, kind)
        return self._paired[engine, concurrency, kind]

    def _run(self, side: str, key: tuple[str, int, str], requests: list[Request], *names: object) -> ServeTrace:
        """One run of `requests` by `side` (the baseline or a drafter) at the rung `key`."""
        target = self.session.target("main")
        drafter = None if side == BASELINE else self.session.drafters("main")[side]
        gen = make_generator(self.seed, "perf", side, *key, *names, device=target.device)
        return serve(target, drafter, self.profile.k, requests, key[1], self.params, gen)

    # -- records ------------------------------------------------------------------------------

    def rung(self, engine: str, concurrency: int, kind: str = LADDER) -> Rung:
        """The figures of a rung; a drafter's with its speedup over its paired baseline runs and
        the speedup's decomposition (`losscheck.perf.model`)."""
        record = _record(engine, concurrency, kind, self.profile.k, self.traces(engine, concurrency, kind))
        if engine == BASELINE:
            return record
        base = _record(BASELINE, concurrency, kind, self.profile.k, self.paired_baseline(engine, concurrency, kind))
        return replace(
            record,
            baseline_tok_s=base.throughput_tok_s,
            speedup=speedup(record.throughput_tok_s, base.throughput_tok_s, paired=True),
            decomposition=Decomposition(
                record.tau, base.per_round.verify_s, record.per_round.draft_s, record.per_round.verify_s
            ).sources(),
        )

    def peer(self) -> Peer:
        """Hugging Face assisted generation with the family-A drafter at concurrency 1, on the
        ladder's concurrency-1 requests, against its own plain `generate`; ours beside it."""
        if self._peer is None:
            from losscheck.perf.peer import hf_generate_seconds

            model, assistant = self.session.target("main").model, self.peer_assistant()
            requests, k = self.workload(1), self.profile.k
            hf_generate_seconds(model, assistant, requests[:1], self.params, k, self.seed)  # warm-up
            runs: dict[str, list[float]] = {"plain": [], "assisted": []}
            for i in range(self.profile.repeats):
                for name, helper in (("plain", None), ("assisted", assistant)):
                    seconds, tokens = hf_generate_seconds(model, helper, requests, self.params, k, self.seed + i)
                    runs[name].append(tokens / seconds)
            ours = self.rung(self.peer_drafter(), 1)
            assert ours.speedup is not None and ours.baseline_tok_s is not None  # a drafter's rung
            self._peer = Peer(
                drafter=self.peer_drafter(),
                k=k,
                concurrency=1,
                requests=len(requests),
                hf_plain_tok_s=tuple(runs["plain"]),
                hf_assisted_tok_s=tuple(runs["assisted"]),
                hf_speedup=speedup(runs["assisted"], runs["plain"], paired=True),
                ours_speedup=ours.speedup,
                ours_spec_tok_s=ours.throughput_tok_s,
                ours_baseline_tok_s=ours.baseline_tok_s,
            )
        return self._peer

    def peer_drafter(self) -> str:
        return "user" if self.session.options.drafter else "A"

    def peer_assistant(self) -> PreTrainedModel:
        """The module HF assisted generation drafts with: the family-A drafter's causal LM."""
        from losscheck.perf.peer import assistant_model

        return assistant_model(self.session.drafters("main")[self.peer_drafter()])

    def measured(self) -> list[tuple[str, int, str]]:
        return list(self._traces)

    def document(self) -> PerfRunFile:
        """The run file (`losscheck.report.perf_run`): environment, identities, every rung measured."""
        from losscheck.report.manifest import environment

        session = self.session
        rungs = [self.rung(e, c, kind) for e, c, kind in self._traces if e != BASELINE]
        rungs += [self.rung(e, c, kind) for e, c, kind in self._traces if e == BASELINE]
        target = session.target("main")
        drafters = session.drafters("main")
        return PerfRunFile(
            schema=SCHEMA,
            created=self.started.isoformat(timespec="seconds"),
            environment=environment(session.device),
            target={"name": target.name, **target.identity},
            drafters={
                name: {"name": drafters[name].name, **getattr(drafters[name], "identity", {})}
                for name in sorted({e for e, _, _ in self._traces} - {BASELINE})
            },
            profile=self.profile,
            params=self.params.label(),
            seed=self.seed,
            rungs=tuple(rungs),
            peer=self._peer,
        )


def _record(engine: str, concurrency: int, kind: str, k: int, traces: list[ServeTrace]) -> Rung:
    """The figures of one rung's timed runs (latencies pooled over the runs)."""
    latencies = Latencies([], [], [], [])
    stats = LoopStats.empty(traces[0].stats.k)
    for trace in traces:
        latencies = latencies + Latencies.of(trace)
        stats = stats + trace.stats
    pooled = ServeTrace(
        concurrency,
        [],
        stats,
        sum(t.wall_s for t in traces),
        sum(t.rounds for t in traces),
        sum(t.round_s for t in traces),
        sum(t.draft_s for t in traces),
        sum(t.verify_s for t in traces),
        sum(t.prefill_s for t in traces),
        traces[-1].memory,
    )
    breakdown = round_breakdown(pooled)
    requests = [r.request for r in traces[0].requests]
    tokens = [sum(r.output_tokens for r in t.requests) for t in traces]
    return Rung(
        engine=engine,
        concurrency=concurrency,
        workload=kind,
        k=k if engine != BASELINE else 0,
        requests=len(requests),
        distinct_prompts=distinct_prompts(requests),
        repeats=len(traces),
        output_tokens=tuple(tokens),
        throughput_tok_s=tuple(throughput(t) for t in traces),
        latency_s=latencies.summary(),
        tau=stats.acceptance_length,
        cumulative_acceptance=tuple(stats.cumulative_acceptance()) if engine != BASELINE else (),
        conditional_acceptance=tuple(stats.conditional_acceptance()) if engine != BASELINE else (),
        wasted_fraction=stats.wasted_fraction,
        rounds=pooled.rounds,
        per_round=PerRound(breakdown["draft_s"], breakdown["verify_s"], breakdown["overhead_s"], breakdown["round_s"]),
        draft_time_fraction=breakdown["draft_fraction"],
        verify_time_fraction=breakdown["verify_fraction"],
        overhead_fraction=breakdown["overhead_fraction"],
        prefill_fraction=breakdown["prefill_fraction"],
        memory=traces[-1].memory,
    )
