"""A cell's entry in the certificate: `CellRecord`, frozen and typed. A cell builds it
(`CellOutcome.to_record`), the plugin completes it with how the test ran (`RunFacts`), and
`losscheck.report` reads it. Its JSON form, `to_json` / `from_json`, is the one place its keys
are spelled, and the certificate schema's record definitions are generated from these classes
(`record_schema`), so the published schema and the record cannot drift apart.

The JSON form (`losscheck.jsonrecord`): each field under its own name, nested records as
objects, tuples as arrays, None as null; the fields of `SampleFacts` and `RunFacts` sit in the
record's own object (the certificate's shape since schema 2), and are left out when None. Reading
ignores keys this version does not know (a certificate of the same schema from a later losscheck),
and names the path and the expected type of any value of the wrong type.

Imports nothing heavy: the xdist controller reads records without torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal, cast

from losscheck import acceptance
from losscheck.engines.counters import EngineCounters
from losscheck.jsonrecord import FLAT, JsonRecord, Scalar, decode, json_field, json_schema

if TYPE_CHECKING:
    from losscheck.core.generation import LoopStats

Outcome = Literal["passed", "failed", "skipped", "error"]


@dataclass(frozen=True)
class ResultRecord:
    """One statistical test's result (`losscheck.stats.result.TestResult`); infinities written as null."""

    name: str
    expected: str
    observed: str
    statistic: float | None
    p_value: float
    alpha: float
    n: int
    power: float
    passed: bool
    detectable: dict[str, float | None] = field(default_factory=dict)  # effect -> smallest detected
    log10_p: float | None = None
    scope: str = "pooled"


@dataclass(frozen=True)
class VerdictRecord:
    """A sampled cell's statistical verdict: its tests under its share `alpha`."""

    cell: str
    alpha: float
    passed: bool
    results: tuple[ResultRecord, ...] = ()


@dataclass(frozen=True)
class DivergenceRecord:
    """Where greedy speculative output first left the baseline on one prompt."""

    tier: str
    prompt_index: int
    prompt: tuple[int, ...]
    position: int  # index into the generated tokens
    spec_token: int | None  # None: the speculative output ended here
    base_token: int | None  # None: the baseline ended here
    top1: int
    top2: int
    margin: float  # float64 top-2 logit margin of the target at the baseline prefix
    near_tie: bool = False


@dataclass(frozen=True)
class AcceptanceRecord:
    """The loop's counters over one prompt group (`losscheck.core.generation.LoopStats`)."""

    k: int
    acceptance_length: float | None
    # [k] per slot, None where no round got there; terms as `losscheck.acceptance` defines them
    cumulative_acceptance: tuple[float | None, ...] = field(
        metadata=json_field(name="slot_acceptance", doc=f"cumulative, per slot: {acceptance.CUMULATIVE}")
    )
    proposed: tuple[int, ...]  # [k] rounds that proposed slot j
    accepted: tuple[int, ...]  # [k] rounds whose draft j was accepted
    wasted_fraction: float | None
    row_rounds: int
    draft_seconds: float
    target_seconds: float
    total_seconds: float
    draft_time_fraction: float
    # absent in certificates written before 2026-12-03 (`reached_counts()` derives it at fixed k)
    reached: tuple[int, ...] = field(
        default=(), metadata=json_field(doc="per slot: rounds that proposed slot j with drafts 1..j-1 accepted")
    )
    conditional_acceptance: tuple[float | None, ...] = field(
        default=(), metadata=json_field(doc=f"conditional, per slot: {acceptance.CONDITIONAL}")
    )

    @classmethod
    def of(cls, stats: LoopStats, where: str = "acceptance") -> AcceptanceRecord:
        """The record of `stats`; a slot no round reached (NaN acceptance) as None."""
        counters = stats.to_dict()
        for name in ("slot_acceptance", "conditional_acceptance"):
            counters[name] = [None if math.isnan(a) else a for a in cast("list[float]", counters[name])]
        return decode(cls, counters, where)

    @property
    def slot_acceptance(self) -> tuple[float | None, ...]:
        """Deprecated name of `cumulative_acceptance` (the JSON key keeps it)."""
        import warnings

        warnings.warn(
            "AcceptanceRecord.slot_acceptance is the cumulative rate: read cumulative_acceptance, or "
            "conditional() for P(draft j accepted | drafts 1..j-1 accepted)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.cumulative_acceptance

    def reached_counts(self) -> tuple[int, ...]:
        """[k] `reached` as recorded, or (older records) as at fixed k."""
        return self.reached or acceptance.reached_at_fixed_k(self.accepted, self.proposed[0] if self.proposed else 0)

    def conditional(self) -> tuple[float | None, ...]:
        """[k] `acceptance.CONDITIONAL`, from the counts."""
        return acceptance.conditional(self.accepted, self.reached_counts())


@dataclass(frozen=True)
class LooksRecord:
    """A sequential PIT cell's looks: the tested tokens at each, and where it stopped."""

    tokens: tuple[int, ...]
    allowed: int  # looks the design allowed
    stopped_at: int  # index of the look it stopped at (len(tokens): ran to the end)
    tested_tokens: int
    early: bool
    unconfirmed: tuple[int, ...] = ()  # looks where the data ruled every member out, the power not yet
    rejected: bool = False  # engine cells: stopped early because an e-value test crossed its level
    # engine cells: per covered member key, β_r (the chance its rule-out fires under it), fixed from the pilot
    rule_out_betas: dict[str, float] = field(default_factory=dict)
    # engine cells: the member keys whose rule-out the pilot predicted no look before the last
    # could pass (`sequential.may_rule_out`); where any, the cell drew its design in one look
    late: tuple[str, ...] = ()
    # engine cells with a draft model: of the rounds-scored positions the power sums read, the share
    # the verifier's rule-outs read (`hidden_rounds.bounded_positions`: none after a position with no sure token)
    rule_out_share: float | None = None


@dataclass(frozen=True)
class MemberRecord:
    """A member ρ of a bug class's family an early stop had to rule out."""

    rho: float
    beta: float  # the chance the data rule it out wrongly
    ruled_out: bool


@dataclass(frozen=True)
class FamilyRecord:
    required_down_to: float | None  # the smallest ρ an early stop had to rule out
    ruled_out_down_to: float | None  # the smallest ρ ruled out (from ρ = 1 down, without a gap)
    members: tuple[MemberRecord, ...] = ()


@dataclass(frozen=True)
class ShortRecord:
    """A member whose promised power the tested sample does not keep."""

    rho: float
    power: float
    promised: float


@dataclass(frozen=True)
class IdsRecord:
    """A misreporting drafter's ids an early stop had to rule out, by count (None: a certificate
    from before these counts)."""

    covered: int
    partial: int
    members: int | None = None
    ruled_out: int | None = None


@dataclass(frozen=True)
class BugClassRecord:
    """What a cell's tested sample says of one bug class (`losscheck.stats.design`)."""

    test: str  # the test with the most power against it
    tokens_needed: float | None  # tokens that test needs at the design's power (None: never)
    power: float
    covered: bool
    reach: str = "none"  # "covered", "partial" or "none": how the cell's design reached it
    power_checked: float | None = None
    lr_bound_tokens: float | None = None
    pilot_tokens_needed: float | None = None
    rule_out_log10_e: float | None = None
    ruled_out: bool = False
    family: FamilyRecord | None = None
    curve: dict[str, float | None] = field(default_factory=dict)  # power -> smallest ρ caught
    short: tuple[ShortRecord, ...] = ()
    ids: IdsRecord | None = None
    withdrawn: str | None = None  # why the cell claims nothing of it: its tested sample fell short
    # Wald's SPRT against it at the cell's α and power: expected tokens under it and under H0 (engine cells)
    wald_tokens: float | None = None
    wald_h0_tokens: float | None = None
    # engine cells: the second stage's power against it (`power` is then both stages' product)
    second_stage_power: float | None = None


@dataclass(frozen=True)
class BoundRecord:
    """A one-sample engine cell's tokens against the information bound: its binding class (the
    covered class that sized its sample), the tokens that class's test read, and Wald's SPRT's
    expected tokens against the class at the cell's α and power (`losscheck.stats.effects.wald_size`),
    under the class and under H0 (the certification case), each as a ratio: how many times the
    bound the cell read."""

    binding_class: str
    test: str
    tested_tokens: int
    wald_tokens: float
    wald_h0_tokens: float
    ratio: float  # tested_tokens / wald_tokens
    ratio_h0: float  # tested_tokens / wald_h0_tokens
    at_floor: bool = False  # the profile's floor sized the sample, not the class: what the floor costs
    # the early stop's promise (every member down to the design's limits ruled out): the member key
    # whose rule-out Wald's SPRT needs the most tokens for under H0 (`EngineLooks.family_bound`),
    # those tokens, and the tokens every test read over them; None with one look
    family_key: str | None = None
    family_tokens: float | None = None
    ratio_family: float | None = None


@dataclass(frozen=True)
class AttributionRecord:
    """A black-box engine cell's second stage, drawn after its first rejected
    (`losscheck.cells.engine.attribution`): fresh speculative and speculation-off rows compared on the
    row scores of the tests that rejected."""

    finding: str  # "speculation" (the sides differ: a FAIL) or "reference" (they do not: the reference differs)
    first_stage_failed: tuple[str, ...]  # the first stage's failing tests, with their p-values
    scores: tuple[str, ...]  # the row scores compared
    rows: int  # rows per side


@dataclass(frozen=True)
class SecondStageRecord:
    """A one-sample engine cell's second stage as planned from its first stage's sums, whatever
    its tests found (`losscheck.stats.second_stage`): its rows a side, the scores it compares whatever fails,
    and the level each class's second-stage power (`BugClassRecord.second_stage_power`) is
    stated at. Drawn only after a first-stage rejection (`AttributionRecord`)."""

    rows: int
    scores: tuple[str, ...]
    score_alpha: float


@dataclass(frozen=True)
class DraftLawRecord:
    """A one-sample engine cell's check of the draft law it teacher-forced the engine's draft model
    under (`losscheck.cells.engine.draft_law`): the engine's own counts of rounds and of rounds whose
    first draft was accepted, against what the round filter predicts for the rows it read."""

    OMIT_NONE: ClassVar[bool] = True

    predicted_rounds: float
    predicted_first_accepted: float
    sd_first_accepted: float
    counted_rounds: int | None = None
    counted_first_accepted: int | None = None
    verdict: str = "not checked"  # "consistent", "inconsistent" or "not checked: why"


@dataclass(frozen=True)
class SampleFacts:
    """What a cell measured of its sample; None (left out) where its kind of cell measures no such thing."""

    OMIT_NONE: ClassVar[bool] = True

    prompts: int | None = None
    max_new_tokens: int | None = None  # greedy cells
    near_tie_margin: float | None = None  # greedy cells: a smaller float64 margin is a near-tie
    # greedy cells: row-rounds that rejected a draft, each a rollback of the target's cache (and of
    # a hybrid target's recurrent state, `recurrent_state` True); 0: the cell exercised none
    rollbacks: int | None = None
    recurrent_state: bool | None = None
    zero_draft_rounds: int | None = None  # greedy cells: row-rounds whose row proposed no draft
    ends: int | None = None  # sampled loop cells: rows that ended on EOS or a stop id
    ends_in_block: int | None = None  # of them, at a slot before its round's last: drafts after it (a leak's chance)
    string_ends: int | None = None  # cells with stop strings: rows that ended on one, and of them inside a block
    string_ends_in_block: int | None = None
    sequences: int | None = None  # sampled cells: sequences tested
    horizon: int | None = None  # tokens per sequence
    prompt: tuple[int, ...] | None = None  # exact cells: the one prompt
    continuations: int | None = None  # exact cells: continuations enumerated
    pilot_sequences: int | None = None
    pilot_tokens: int | None = None
    pilot_tested_tokens: int | None = None
    design_tokens: int | None = None
    fixed_design_tokens: int | None = None  # what a fixed-sample design would have tested
    looks: LooksRecord | None = None
    bug_classes: dict[str, BugClassRecord] | None = None
    phases: dict[str, float] | None = None  # wall seconds per phase of a PIT cell
    cutoff_ambiguous: int | None = None  # positions where implementations may cut differently
    cutoff_left_out: int | None = None  # draws of tokens some implementation may cut
    cutoff_tolerance: float | None = None
    # sampled loop cells: reported log-probabilities compared with the teacher-forced target's, how
    # many left the bound (nats) and the worst deviation (`losscheck.cells.logprob_check`)
    logprobs_checked: int | None = None
    logprobs_off: int | None = None
    logprob_worst: float | None = None
    logprob_bound: float | None = None
    top_logprobs: int | None = None  # engines asked for the top N: N, the positions compared, how many off
    top_logprobs_checked: int | None = None
    top_logprobs_off: int | None = None
    top_logprob_worst: float | None = None
    pit_histogram: tuple[float, ...] | None = None  # tested PIT values in 20 equal bins of [0, 1]
    pit_quantiles: tuple[float, ...] | None = None
    pooled_tv_upper: float | None = None  # upper confidence bound on the pooled PIT binned TV
    pooled_tv_confidence: float | None = None
    engine: str | None = None  # black-box cells: the engine's name, block length and test mode
    engine_k: int | None = None
    mode: str | None = None
    engine_counters: EngineCounters | None = None  # black-box cells: the engine's own counts of the cell's calls
    acceptance_rule: str | None = None  # a drafter that verifies with a rule of its own names it
    # black-box cells: the catalogue's classes the cell has no power against, and why
    classes_not_judged: dict[str, str] | None = None
    draft_law: DraftLawRecord | None = None  # one-sample cells with a draft model: the engine's counters agree?
    bound: BoundRecord | None = None  # one-sample engine cells: the tokens read against Wald's bound
    proxy_precision: str | None = None  # two-sample cells: the precision of the proxy they were sized by
    attribution: AttributionRecord | None = None  # black-box cells whose first stage rejected
    second_stage: SecondStageRecord | None = None  # one-sample engine cells: the second stage planned


@dataclass(frozen=True)
class RunFacts:
    """How the certification test ran (the plugin's part of the record)."""

    OMIT_NONE: ClassVar[bool] = True

    nodeid: str
    outcome: Outcome
    seconds: float | None = None
    target_passes: int | None = None  # this process's target passes during the cell
    target_tokens: int | None = None
    skip_reason: str | None = None  # a cell this platform cannot run
    error: str | None = None  # the end of the traceback of a cell that errored


@dataclass(frozen=True)
class CellRecord(JsonRecord):
    """One certification test's cell: its identity in the matrix, what it found, its sample, and
    how its test ran. A record of a cell that errored or could not run carries little but its id
    and `run`."""

    cell: str
    run: RunFacts = field(metadata=FLAT)
    kind: str | None = None  # the cell's mode ("greedy", "pit", ...); "error" for an errored cell
    drafter: str | None = None
    k: int | None = None
    width: int | None = None
    params: str | None = None
    target: str | None = None
    precision: str | None = None
    passed: bool = False
    near_ties: int = 0  # greedy divergences within the precision's round-off
    verdict: VerdictRecord | None = None
    divergences: tuple[DivergenceRecord, ...] = ()
    acceptance: dict[str, AcceptanceRecord] = field(default_factory=dict)  # prompt group -> counters
    problems: tuple[str, ...] = ()
    serving: dict[str, int | str] = field(default_factory=dict)  # serving axis -> its value
    serving_facts: dict[str, dict[str, Scalar]] = field(default_factory=dict)  # axis -> what it measured
    # a black-box engine variant's axis values other than the engine's as named (`EngineAxis`)
    engine_axes: dict[str, int | str] = field(default_factory=dict)
    sample: SampleFacts = field(default_factory=SampleFacts, metadata=FLAT)

    @property
    def status(self) -> Literal["passed", "failed", "errored", "not run"]:
        """What the certificate's matrix counts the cell as: passed, failed, errored or not run."""
        if self.run.outcome == "skipped":
            return "not run"
        if self.run.outcome == "error":
            return "errored"
        return "passed" if self.passed and self.run.outcome == "passed" else "failed"

    def with_run(self, nodeid: str, outcome: Outcome) -> CellRecord:
        """The record with its test's node id and outcome as pytest reported them."""
        return dataclasses.replace(self, run=dataclasses.replace(self.run, nodeid=nodeid, outcome=outcome))


def bug_class_records(coverage: Mapping[str, Mapping[str, object]]) -> dict[str, BugClassRecord]:
    """`losscheck.stats.design`'s per-class coverage as records."""
    return decode(dict[str, BugClassRecord], coverage, "bug_classes")


def record_schema() -> dict[str, object]:
    """The JSON schema of `CellRecord` (`{"$ref": ..., "$defs": ...}`)."""
    return json_schema(CellRecord)
