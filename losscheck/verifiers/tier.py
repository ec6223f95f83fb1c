"""The verifier tier: a `Verifier` driven with synthetic target logits and drafts, its output law
tested exactly.

Each synthetic case (`losscheck.verifiers.cases`) is replicated over many rows of vectorised
verifier calls; every row draws its own drafts. Checks, each a `TestResult`:

- `outcome`: every call returns a well-formed `BlockOutcome` with emitted ids in the vocabulary
  (a verifier that raises fails it too);
- `greedy`: greedy rows equal the argmax rule token for token (accepted count and emitted ids);
- `drafted-length`: the accepted count never exceeds the row's real drafts (ragged rows);
- `own-drafts`: the emitted tokens before the stop slot are the row's own drafts;
- `never-reject-p>=q`: no draft with p(x) >= q(x) is rejected;
- `reproducible`: the same generator state gives the same outcome;
- `support`: no emitted outcome has probability 0 under the exact law;
- `first-token[call/case]`: Pearson χ² of the first emitted token against p_0 (losslessness);
- `joint[call/case]`: Pearson χ² of (accepted count, emitted tokens) against the closed-form law
  of standard speculative sampling (conformance: a lossless verifier that is not the standard
  algorithm may fail it while passing `first-token`).

The deterministic checks count events of probability 0 (level 0: they spend no false-alarm
budget). The χ² tests split `alpha` by Bonferroni over all of them, fixed before any draw; bins
come from the exact probabilities (`losscheck.stats.exact.probability_bins`), and every test
first asserts that it detects binned TV `detect_tv` at `power`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from losscheck.core.sampling import make_generator, sample
from losscheck.core.verify import BlockOutcome, Verifier, checked_outcome
from losscheck.errors import LosscheckError
from losscheck.stats.budget import per_test_alpha
from losscheck.stats.exact import probability_bins
from losscheck.stats.gof import goodness_of_fit, impossible_event
from losscheck.stats.power import chisquare_detectable_w, chisquare_required_n, require_power
from losscheck.stats.result import TestResult, scoped
from losscheck.verifiers import cases as synthetic
from losscheck.verifiers.cases import Call, Case

# A draft with p(x) >= q(x)·(1 + this) must never be rejected; below it, a verifier computing
# p / q from two float32 softmaxes may see a ratio a few ulps under 1.
RATIO_TOLERANCE = 1e-5
REPRODUCIBLE_ROWS = 4096  # rows of the first sampled call verified twice from one generator state


@dataclass(frozen=True)
class TierConfig:
    """Sizes and error rates of one tier run."""

    seed: int = 20261129  # every synthetic table, draft and verifier generator derives from it
    alpha: float = 0.01  # family-wise false-alarm rate of the χ² tests
    power: float = 0.99  # power at which each test's detectable TV is stated and asserted
    detect_tv: float = 0.01  # binned TV every χ² test must detect
    max_bins: int = 50  # χ² bins per test at most (merged in probability order, >= 5 expected)
    replicates: int | None = None  # rows per sampled case; None: the fewest that reach `detect_tv`
    greedy_rows: int = 20_000  # rows per greedy case (deterministic checks only)
    chunk_rows: int = 1 << 16  # rows per verifier call
    calls: tuple[Call, ...] | None = None  # the synthetic calls; None: `cases.standard_calls(seed)`


@dataclass
class Tally:
    """Events of probability 0 under H0 for one deterministic check."""

    name: str
    expected: str
    count: int = 0
    n: int = 0
    example: str = ""

    def add(self, bad: torch.Tensor, describe: Callable[[int], str]) -> None:
        """`bad` [N] bool over N checked rows; `describe(i)` words the first bad row i."""
        self.n += int(bad.numel())
        found = int(bad.sum())
        if found and not self.count:
            self.example = describe(int(bad.nonzero()[0, 0]))
        self.count += found

    def event(self, example: str) -> None:
        """One violation that stopped a call (its rows are not counted)."""
        self.example = self.example or example
        self.count += 1
        self.n += 1

    def result(self, power: float) -> TestResult:
        observed = f"{self.count} of {self.n} rows violate it" + (f"; first: {self.example}" if self.count else "")
        return scoped([impossible_event(self.name, self.expected, observed, self.count, self.n, power)], "conformance")[
            0
        ]


@dataclass(frozen=True)
class TierReport:
    """What a tier run found: its checks' results and how fast it drew."""

    verifier: str
    results: tuple[TestResult, ...]
    draws: int  # verifier rows (one drafted block each) drawn
    seconds: float  # the whole run's wall time
    verifier_seconds: float  # time inside the verifier
    alpha_per_test: float  # each χ² test's level
    replicates: int  # rows per sampled case
    detect_tv: float  # binned TV every χ² test was asserted to detect at its power
    not_run: tuple[str, ...] = ()  # mixed calls left out: the verifier takes one SamplingParams per call

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def by_check(self) -> dict[str, list[TestResult]]:
        """Check name (a χ² test's name without its `[call/case]`) -> its results."""
        found: dict[str, list[TestResult]] = {}
        for r in self.results:
            found.setdefault(r.name.partition("[")[0], []).append(r)
        return found

    def failed_checks(self) -> list[str]:
        return [name for name, results in self.by_check().items() if not all(r.passed for r in results)]

    def lines(self) -> list[str]:
        """Per-check verdicts, then the draws and their rate."""
        out = [f"verifier tier: {self.verifier}"]
        for name, results in self.by_check().items():
            failed = [r for r in results if not r.passed]
            verdict = "PASS" if not failed else "FAIL"
            if len(results) == 1 and results[0].alpha == 0:
                out.append(f"  {name:<20} {verdict}  {results[0].observed}")
                continue
            worst = min(results, key=lambda r: r.p_value)
            out.append(
                f"  {name:<20} {verdict}  {len(results) - len(failed)}/{len(results)} passed, "
                f"min p {worst.p_value:.3g}, alpha {self.alpha_per_test:.2g} each, "
                f"each detects TV >= {self.detect_tv:g} at power {results[0].power:g}"
            )
            out += [f"    {r.message()}" for r in failed[:3]]
        rate = self.draws / self.seconds if self.seconds > 0 else float("inf")
        out.append(
            f"  {self.draws} draws ({self.replicates} per sampled case) in {self.seconds:.1f} s: {rate:,.0f} draws/s, "
            f"{rate * 60 / 1e6:.1f} M/min ({self.verifier_seconds:.1f} s in the verifier)"
        )
        if self.not_run:
            out.append(
                f"  not run: {', '.join(self.not_run)} (mixed batches: the verifier takes one SamplingParams "
                "per call and has no per-row `decide`)"
            )
        out.append(f"verdict: {'PASS' if self.passed else 'FAIL: ' + ', '.join(self.failed_checks())}")
        return out


def replicates_needed(config: TierConfig, n_tests: int) -> int:
    """Rows per sampled case at which a χ² test with `max_bins` bins at the tier's per-test level
    detects binned TV `detect_tv` (w = 2·TV) at `power`."""
    level = per_test_alpha(config.alpha, max(n_tests, 1))
    return chisquare_required_n(2 * config.detect_tv, config.max_bins, level, config.power)


@dataclass
class _CallState:
    """Tables of one call's cases stacked over a leading case axis C, and its counts."""

    call: Call
    logits: torch.Tensor  # [C, k+1, V, V] raw target logits
    draft: torch.Tensor  # [C, k, V, V] float64 q tables
    target: torch.Tensor  # [C, k+1, V, V] float64 processed p tables (greedy: one-hot)
    best: torch.Tensor  # [C, k+1, V] argmax tables
    real: torch.Tensor  # [C] real drafts
    start: torch.Tensor  # [C] start tokens
    greedy: torch.Tensor  # [C] bool: greedy request
    joint: torch.Tensor = field(init=False)  # [C, n_outcomes] counts
    first: torch.Tensor = field(init=False)  # [C, V] counts

    def __post_init__(self) -> None:
        c, k, v = len(self.call.cases), self.call.k, self.logits.shape[-1]
        self.joint = torch.zeros(c, synthetic.n_outcomes(v, k), dtype=torch.long)
        self.first = torch.zeros(c, v, dtype=torch.long)


def _state(call: Call) -> _CallState:
    cs = call.cases
    return _CallState(
        call=call,
        logits=torch.stack([c.target_logits for c in cs]),
        draft=torch.stack([c.draft for c in cs]),
        target=torch.stack([synthetic.target_table(c) for c in cs]),
        best=torch.stack([synthetic.best_tokens(c) for c in cs]),
        real=torch.tensor([c.real for c in cs]),
        start=torch.tensor([c.start for c in cs]),
        greedy=torch.tensor([c.params.greedy for c in cs]),
    )


def _draw(
    st: _CallState, case_of: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafts [N, k], their previous tokens [N, k+1], raw logits [N, k+1, V] and q [N, k, V]
    (float32) for rows of cases `case_of` [N]."""
    n, k, v = len(case_of), st.call.k, st.logits.shape[-1]
    prev = torch.empty(n, k + 1, dtype=torch.long)
    prev[:, 0] = st.start[case_of]
    drafts = torch.empty(n, k, dtype=torch.long)
    q = torch.empty(n, k, v)
    for j in range(k):
        q[:, j] = st.draft[case_of, j, prev[:, j]].float()
        drafts[:, j] = sample(q[:, j], gen)
        prev[:, j + 1] = drafts[:, j]
    slots = torch.arange(k + 1)
    logits = st.logits[case_of[:, None], slots[None, :], prev]  # [N, k+1, V]
    return drafts, prev, logits, q


def _emitted(accepted: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k+1] bool: slots a row emits (0..accepted)."""
    return torch.arange(k + 1)[None, :] <= accepted[:, None]


def takes_rows(verifier: Verifier) -> bool:
    """Whether `verifier` also decides a batch of one request per row: a method
    `decide(logits, drafts, q, params: list[SamplingParams], generator) -> BlockOutcome` (vLLM's
    adapter, `losscheck.engines.vllm_verifier`, has one). Only such a verifier runs mixed calls."""
    return callable(getattr(verifier, "decide", None))


def _verify(
    verifier: Verifier,
    st: _CallState,
    case_of: torch.Tensor,
    drafts: torch.Tensor,
    logits: torch.Tensor,
    q: torch.Tensor,
    gen: torch.Generator,
) -> BlockOutcome:
    reported = None if st.call.point_mass else q
    params = st.call.params
    if params is None:  # a mixed call: one request per row
        rows = [st.call.cases[int(c)].params for c in case_of]
        outcome = cast(Any, verifier).decide(logits, drafts, reported, rows, gen)
    else:
        outcome = verifier(logits, drafts, reported, params, gen)
    return checked_outcome(outcome, verifier, *drafts.shape)


class _Run:
    def __init__(self, verifier: Verifier, config: TierConfig) -> None:
        self.verifier, self.config = verifier, config
        calls = config.calls if config.calls is not None else synthetic.standard_calls(config.seed)
        self.calls = [c for c in calls if c.params is not None or takes_rows(verifier)]
        self.not_run = [c.name for c in calls if c not in self.calls]  # mixed calls, per-call params only
        self.sampled = [(call, case) for call in self.calls for case in call.cases if not case.params.greedy]
        self.n_tests = 2 * len(self.sampled)  # first-token and joint per sampled case, fixed before drawing
        self.level = per_test_alpha(config.alpha, max(self.n_tests, 1))
        self.replicates = config.replicates or replicates_needed(config, self.n_tests)
        self.tallies = {
            name: Tally(name, expected)
            for name, expected in (
                ("outcome", "a well-formed BlockOutcome with emitted ids in the vocabulary from every call"),
                ("greedy", "greedy rows to accept the drafts matching the target's argmax and emit its argmax"),
                ("drafted-length", "accepted counts within each row's real drafts (pad drafts have p = 0)"),
                ("own-drafts", "the emitted tokens before the stop slot to be the row's own drafts"),
                ("never-reject-p>=q", f"no rejection of a draft with p(x) >= q(x)·(1 + {RATIO_TOLERANCE:g})"),
                ("support", "every emitted (accepted count, tokens) outcome to have positive exact probability"),
                ("reproducible", "the same generator state to give the same outcome"),
            )
        }
        self.draws = 0
        self.verifier_seconds = 0.0

    def bins(self) -> dict[tuple[str, str, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per sampled case: the exact laws and their bins, power asserted before any draw."""
        found = {}
        n = self.replicates
        for call, case in self.sampled:
            laws = {"first-token": synthetic.first_token_law(case), "joint": synthetic.joint_law(case)}
            for test, law in laws.items():
                # the first token has at most V outcomes: each of >= 5 expected gets its own bin
                max_bins = self.config.max_bins if test == "joint" else max(self.config.max_bins, n)
                bin_of, expected = probability_bins(law, n, max_bins=max_bins)
                if len(expected) >= 2:
                    w = chisquare_detectable_w(n, len(expected), self.level, self.config.power)
                    require_power(
                        w / 2,
                        self.config.detect_tv,
                        f"{test}[{call.name}/{case.name}] (Pearson χ² on {len(expected)} bins at alpha = "
                        f"{self.level:.3g}, power {self.config.power:g})",
                        n=n,
                        required_n=chisquare_required_n(
                            2 * self.config.detect_tv, len(expected), self.level, self.config.power
                        ),
                        unit="rows",
                    )
                found[call.name, case.name, test] = (law, bin_of, expected)
        return found

    def run(self) -> list[TestResult]:
        laws = self.bins()
        states = [_state(call) for call in self.calls]
        for st in states:
            self.run_call(st)
        if states:
            self.check_reproducible(next((s for s in states if not bool(s.greedy.all())), states[0]))
        results = [t.result(self.config.power) for name, t in self.tallies.items() if name != "support"]
        chi2 = []
        support = self.tallies["support"]
        for st in states:
            for c, case in enumerate(st.call.cases):
                if case.params.greedy:
                    continue
                for test, counts in (("first-token", st.first[c]), ("joint", st.joint[c])):
                    law, bin_of, expected = laws[st.call.name, case.name, test]
                    chi2 += self.chisquare(test, st.call, case, counts, law, bin_of, expected, support)
        return [*results, support.result(self.config.power), *chi2]

    def chisquare(
        self,
        test: str,
        call: Call,
        case: Case,
        counts: torch.Tensor,
        law: torch.Tensor,
        bin_of: torch.Tensor,
        expected: torch.Tensor,
        support: Tally,
    ) -> list[TestResult]:
        outside = counts[law == 0]
        if test == "joint":  # a first token outside p_0's support is outside the joint law's too
            if int(outside.sum()):
                code = int((law == 0).nonzero()[int(outside.nonzero()[0, 0]), 0])
                accepted, tokens = synthetic.decode(code, case.vocab, case.k)
                support.example = support.example or (
                    f"{call.name}/{case.name}: accepted {accepted}, emitted {tokens} (exact probability 0)"
                )
            support.count += int(outside.sum())
            support.n += int(counts.sum())
        inside = int(counts.sum()) - int(outside.sum())
        if len(expected) < 2 or inside == 0:
            return []
        observed = torch.bincount(bin_of, weights=counts.where(law > 0, 0).double(), minlength=len(expected))
        what = "first emitted token" if test == "first-token" else "(accepted count, emitted tokens)"
        desc = (
            f"{what} of {case.params.label()} rows ({case.name}, {case.real} of {call.k} drafts real) "
            f"over {len(expected)} bins of exact probability"
        )
        result = goodness_of_fit(
            f"{test}[{call.name}/{case.name}]",
            desc,
            observed,
            expected * (inside / expected.sum()),
            self.level,
            self.config.power,
        )
        return scoped([result], "pooled" if test == "first-token" else "conformance")

    def run_call(self, st: _CallState) -> None:
        call, cfg = st.call, self.config
        rows = torch.tensor([cfg.greedy_rows if c.params.greedy else self.replicates for c in call.cases])
        draft_gen = make_generator(cfg.seed, "verifier-tier", call.name, "draft")
        verify_gen = make_generator(cfg.seed, "verifier-tier", call.name, "verify")
        cases = torch.arange(len(call.cases)).repeat_interleave(rows)
        case_of = cases[torch.randperm(len(cases), generator=draft_gen)]
        for chunk in case_of.split(cfg.chunk_rows):
            drafts, prev, logits, q = _draw(st, chunk, draft_gen)
            started = time.perf_counter()
            try:
                outcome = _verify(self.verifier, st, chunk, drafts, logits, q, verify_gen)
            except Exception as exc:  # a verifier that raises fails `outcome`; the run goes on
                self.tallies["outcome"].event(f"{call.name}: {raised(exc)}")
                return
            finally:
                self.verifier_seconds += time.perf_counter() - started
                self.draws += len(chunk)
            self.check(st, chunk, drafts, prev, outcome)

    def check(
        self,
        st: _CallState,
        case_of: torch.Tensor,
        drafts: torch.Tensor,
        prev: torch.Tensor,
        outcome: BlockOutcome,
    ) -> None:
        call, k, vocab = st.call, st.call.k, st.logits.shape[-1]
        accepted, tokens = outcome.accepted.long().cpu(), outcome.tokens.long().cpu()
        emitted = _emitted(accepted, k)
        bad_ids = ((tokens < 0) | (tokens >= vocab)) & emitted
        self.tallies["outcome"].add(
            bad_ids.any(-1), lambda i: f"{call.name}: row emitted {tokens[i, : accepted[i] + 1].tolist()}"
        )
        keep = ~bad_ids.any(-1)
        rows = _Rows(call, case_of[keep], drafts[keep], prev[keep], accepted[keep], tokens[keep])
        self.tallies["drafted-length"].add(rows.accepted > st.real[rows.case_of], rows.describe)
        greedy = st.greedy[rows.case_of]
        self.check_greedy(st, rows.select(greedy))
        self.check_sampled(st, rows.select(~greedy))

    def check_greedy(self, st: _CallState, rows: _Rows) -> None:
        k, n = st.call.k, len(rows.case_of)
        index = torch.arange(n)
        best = st.best[rows.case_of[:, None], torch.arange(k + 1)[None, :], rows.prev]  # [N, k+1]
        want = (rows.drafts == best[:, :k]).long().cumprod(-1).sum(-1)  # [N]
        expected = torch.cat([rows.drafts, best[:, k:]], 1)  # [N, k+1]
        expected[index, want] = best[index, want]
        same = (rows.accepted == want) & ((rows.tokens == expected) | ~_emitted(want, k)).all(-1)

        def describe(i: int) -> str:
            return rows.describe(i) + (
                f"; the argmax rule accepts {int(want[i])} and emits {expected[i, : want[i] + 1].tolist()}"
            )

        self.tallies["greedy"].add(~same, describe)

    def check_sampled(self, st: _CallState, rows: _Rows) -> None:
        k, vocab, n = st.call.k, st.logits.shape[-1], len(rows.case_of)
        index = torch.arange(n)
        a = rows.accepted
        before_stop = torch.arange(k)[None, :] < a[:, None]  # [N, k]
        self.tallies["own-drafts"].add((before_stop & (rows.tokens[:, :k] != rows.drafts)).any(-1), rows.describe)
        rejected = a < st.real[rows.case_of]
        slot = a.clamp(max=k - 1)
        x, before = rows.drafts[index, slot], rows.prev[index, slot]
        p = st.target[rows.case_of, slot, before, x]
        q = st.draft[rows.case_of, slot, before, x]
        self.tallies["never-reject-p>=q"].add(
            rejected & (p >= q * (1 + RATIO_TOLERANCE)),
            lambda i: (
                rows.describe(i) + f"; rejected at slot {int(slot[i])} with p = {float(p[i]):.4g} >= "
                f"q = {float(q[i]):.4g}"
            ),
        )
        codes = synthetic.encode(a, rows.tokens, vocab)
        n_codes = st.joint.shape[1]
        st.joint += torch.bincount(rows.case_of * n_codes + codes, minlength=st.joint.numel()).view_as(st.joint)
        first = rows.case_of * vocab + rows.tokens[:, 0]
        st.first += torch.bincount(first, minlength=st.first.numel()).view_as(st.first)

    def check_reproducible(self, st: _CallState) -> None:
        gen = make_generator(self.config.seed, "verifier-tier", "reproducible", "draft")
        case_of = torch.randint(0, len(st.call.cases), (REPRODUCIBLE_ROWS,), generator=gen)
        drafts, _, logits, q = _draw(st, case_of, gen)
        outcomes = []
        for _ in range(2):
            again = make_generator(self.config.seed, "verifier-tier", "reproducible", "verify")
            try:
                outcomes.append(_verify(self.verifier, st, case_of, drafts, logits, q, again))
            except Exception:  # `outcome` has failed on it already
                return
        first, second = outcomes
        a1, a2 = first.accepted.cpu(), second.accepted.cpu()
        t1, t2 = first.tokens.cpu(), second.tokens.cpu()
        same_tokens = ((t1 == t2) | ~_emitted(a1, st.call.k)).all(-1)
        self.tallies["reproducible"].add(
            (a1 != a2) | ~same_tokens,
            lambda i: (
                f"{st.call.name} row {i}: emitted {t1[i, : a1[i] + 1].tolist()}, then {t2[i, : a2[i] + 1].tolist()}"
            ),
        )


@dataclass(frozen=True)
class _Rows:
    """Checked rows of one call: their cases [N], drafts [N, k], previous tokens [N, k+1] and
    outcome (accepted [N], tokens [N, k+1])."""

    call: Call
    case_of: torch.Tensor
    drafts: torch.Tensor
    prev: torch.Tensor
    accepted: torch.Tensor
    tokens: torch.Tensor

    def select(self, mask: torch.Tensor) -> _Rows:
        return _Rows(
            self.call, self.case_of[mask], self.drafts[mask], self.prev[mask], self.accepted[mask], self.tokens[mask]
        )

    def describe(self, i: int) -> str:
        case = self.call.cases[int(self.case_of[i])]
        return (
            f"{self.call.name}/{case.name}: drafts {self.drafts[i].tolist()}, accepted {int(self.accepted[i])}, "
            f"emitted {self.tokens[i, : self.accepted[i] + 1].tolist()}"
        )


def raised(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, LosscheckError) else f"{type(exc).__name__}: {exc}"
    return text.splitlines()[0][:300] if text else type(exc).__name__


def run_tier(verifier: Verifier, config: TierConfig | None = None, name: str | None = None) -> TierReport:
    """Drive `verifier` through the tier (module docstring); raise `UnderpoweredError` before any
    draw when `config` cannot reach its detectable TV."""
    config = config or TierConfig()
    started = time.perf_counter()
    run = _Run(verifier, config)
    results = run.run()
    return TierReport(
        verifier=name or str(getattr(verifier, "__qualname__", repr(verifier))),
        results=tuple(results),
        draws=run.draws,
        seconds=time.perf_counter() - started,
        verifier_seconds=run.verifier_seconds,
        alpha_per_test=run.level,
        replicates=run.replicates,
        detect_tv=config.detect_tv,
        not_run=tuple(run.not_run),
    )
