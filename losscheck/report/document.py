"""certificate.json as typed records: `Certificate` and its parts. `losscheck.report.certificate`
builds one from the manifests and the cell records, writes it, reads it back and renders it; the
published schema is generated from these classes (`losscheck.report.schema`).

A certificate of schema 2 written by an earlier losscheck lacks some fields (`scope`, `shard`,
`merged`, `tested`, `conformance`, `bug_classes`, `cost`, `bundled_option`, `verifier_option`):
they are optional here, and reading ignores fields this version does not know. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Final, Literal

from losscheck.cells.record import CellRecord
from losscheck.jsonrecord import FLAT, JsonRecord, json_field
from losscheck.plan.profiles import Profile
from losscheck.plan.scope import WHOLE
from losscheck.report.manifest import AlphaSplit, Identity, OutOfScope

SCHEMA: Final = "losscheck.certificate/2"
Verdict = Literal["PASS", "FAIL", "PARTIAL", "INTERRUPTED"]
Status = Literal["passed", "failed", "errored", "not run"]
COUNT = json_field(minimum=0)


@dataclass(frozen=True)
class Scope:
    """The part of the matrix the verdict covers (--scope) and the cells it leaves out."""

    declared: str
    whole: bool
    out: tuple[OutOfScope, ...] = ()
    cells: int | None = field(default=None, metadata=COUNT)  # cells in scope


@dataclass(frozen=True)
class ShardRecord:
    """The share of the plan a run certified with --shard I/N (`losscheck.plan.shard`) and the
    plan it is a share of: `losscheck merge` joins the shards of one plan only."""

    index: int = field(metadata=json_field(minimum=1))
    count: int = field(metadata=json_field(minimum=1))
    plan: str = field(
        metadata=json_field(
            doc="sha256 of the plan: the matrix in scope, the declared scope, the alpha split, the seed, "
            "the profile, the options that judge a cell and the models' identities (`losscheck.report.shard`)"
        )
    )
    cells: tuple[str, ...] = field(metadata=json_field(doc="the cells of the plan assigned to this shard"))


@dataclass(frozen=True)
class Counts:
    """Cells of the matrix by status."""

    SCHEMA: ClassVar[dict[str, object]] = {"additionalProperties": False}

    passed: int = field(metadata=COUNT)
    failed: int = field(metadata=COUNT)
    errored: int = field(metadata=COUNT)
    not_run: int = field(metadata=json_field(name="not run", minimum=0))


@dataclass(frozen=True)
class MatrixRow:
    """A planned cell of the full matrix and what became of it."""

    OMIT_NONE: ClassVar[bool] = True

    cell: str
    status: Status
    mode: str | None = None
    argument: str | None = None
    slow: bool | None = None
    estimated_s: float | None = None
    reason: str | None = None  # why a cell that did not run could not run here


@dataclass(frozen=True)
class Worker:
    threads: int


@dataclass(frozen=True)
class RunEnvironment:
    """Library versions, device and accelerator of the processes (empty: no certification test ran)."""

    OMIT_NONE: ClassVar[bool] = True

    losscheck: str | None = None
    git_revision: str | None = None
    python: str | None = None
    platform: str | None = None
    machine: str | None = None
    cpu_count: int | None = None
    torch: str | None = None
    transformers: str | None = None
    numpy: str | None = None
    scipy: str | None = None
    device: str | None = None
    accelerator: str | None = None
    workers: dict[str, Worker] = field(default_factory=dict)  # xdist worker id -> its torch threads
    cuda: str | None = None  # the CUDA version torch was built with
    driver: str | None = None  # the NVIDIA driver's version
    device_count: int | None = None  # CUDA devices visible


@dataclass(frozen=True)
class MergedShard:
    """A shard's certificate that `losscheck merge` joined into this one: where it was read from,
    its share of the plan and how its run went."""

    run: str  # the run directory or certificate.json, as `losscheck merge` was given it
    shard: ShardRecord = field(metadata=FLAT)
    created: str
    verdict: Verdict
    pytest_args: tuple[str, ...]
    environment: RunEnvironment


@dataclass(frozen=True)
class Tested:
    """Cells, sequences and generated tokens the sampled cells tested (pilots not counted), and how
    the sequential PIT cells stopped against their fixed-sample designs."""

    cells: int
    sampled_cells: int
    sequences: int
    tokens: int
    pilot_tokens: int
    sequential_cells: int = 0
    stopped_early: int = 0
    sequential_tokens: int = 0
    fixed_design_tokens: int = 0


@dataclass(frozen=True)
class Conformance:
    """The conformance tests' own verdict (a verifier lossless by another rule fails them)."""

    verdict: str  # "PASS", "FAIL" or "not tested"
    tests: int
    failed: tuple[str, ...] = ()  # cell:test


@dataclass(frozen=True)
class BestCell:
    cell: str
    power: float
    test: str
    tokens: float | None  # the tokens its test needs at the design's power


@dataclass(frozen=True)
class CurvePoint:
    rho: float  # the smallest mixture ρ caught
    cell: str


@dataclass(frozen=True)
class RuledOut:
    early_stops: int
    down_to: float  # every early stop ruled out the mixtures from ρ = 1 down to at least this ρ
    beta: float  # the largest chance of a wrong rule-out among them


@dataclass(frozen=True)
class BugClassClaim:
    """What the run claims of one bug class: the cells that catch its catalogue point at the
    profile's power, the best of them, its power curve, the early stops that ruled it out, and the
    cells whose tested sample fell short of their design's promise for it (no claim there)."""

    caught_by: tuple[str, ...] = ()
    best: BestCell | None = None
    curve: dict[str, CurvePoint] = field(default_factory=dict)  # power -> smallest ρ and its cell
    ruled_out: RuledOut | None = None
    withdrawn_in: tuple[str, ...] = ()


@dataclass(frozen=True)
class Slowest:
    cell: str
    seconds: float


@dataclass(frozen=True)
class Cost:
    """Seconds the cells took (summed over processes), by kind and by phase of the PIT cells."""

    cell_seconds: float
    target_passes: int
    target_tokens: int
    by_kind: dict[str, float] = field(default_factory=dict)
    pit_phases: dict[str, float] = field(default_factory=dict)
    slowest: tuple[Slowest, ...] = ()


@dataclass(frozen=True)
class RunMeta:
    """What the controller knows of a run before any model loads: its options and command line."""

    seed: int = field(metadata=json_field(doc="the run seed: --losscheck-seed replays the run"))
    pytest_args: tuple[str, ...]
    alpha_option: float = field(metadata=json_field(exclusiveMinimum=0, exclusiveMaximum=1))
    profile: Profile
    target_option: str | None
    drafter_option: str | None
    engine_option: str | None
    mutant: str | None
    device_option: str | None
    precisions: tuple[str, ...] = field(metadata=json_field(minItems=1))
    strict: bool
    bundled_option: str | None = None
    scope_option: str | None = None
    verifier_option: str | None = None
    lossy_modes: tuple[str, ...] = field(
        default=(),
        metadata=json_field(
            doc="the modes lossy by design the run was configured with (--losscheck-allow-lossy-mode), each with "
            "the setting that chose it; any fails the verdict"
        ),
    )


@dataclass(frozen=True, kw_only=True)
class Certificate(JsonRecord):
    """reports/<run>/certificate.json as `losscheck.report.certificate.build` writes it. It
    accounts for every cell of the run's full matrix; its verdict is PASS only when every cell in
    scope ran and passed. Objects are open: readers ignore fields they do not know, and a later
    losscheck may add fields without changing the schema version."""

    schema: Literal["losscheck.certificate/2"] = field(metadata=json_field(doc="the schema version this file follows"))
    created: str = field(
        metadata=json_field(
            doc="UTC time the certificate was built, ISO 8601",
            format="date-time",
            pattern="^[0-9]{4}-[0-9]{2}-[0-9]{2}T",
        )
    )
    verdict: Verdict
    scope: Scope = field(default_factory=lambda: Scope(WHOLE, True))  # absent: a certificate from before scopes
    shard: ShardRecord | None = field(
        default=None, metadata=json_field(doc="the share of the plan this run certified (--shard I/N); null: all of it")
    )
    reason: str = field(metadata=json_field(doc="the verdict's tally and why, in one sentence"))
    problems: tuple[str, ...] = field(metadata=json_field(doc="accounting problems that fail the run"))
    meta: RunMeta = field(metadata=FLAT)
    alpha: AlphaSplit | None = field(
        metadata=json_field(doc="the family-wise alpha and its Bonferroni split (null: no certification test ran)")
    )
    environment: RunEnvironment
    merged: tuple[MergedShard, ...] = field(
        default=(),
        metadata=json_field(doc="the shards' certificates `losscheck merge` joined into this one, by shard index"),
    )
    targets: dict[str, Identity] = field(
        metadata=json_field(
            doc="target name (main, small, own) -> its identity", additionalProperties={"$ref": "#/$defs/identity"}
        )
    )
    drafters: dict[str, dict[str, Identity]] = field(
        metadata=json_field(
            doc="target name -> drafter name -> the drafter's identity",
            additionalProperties={"type": "object", "additionalProperties": {"$ref": "#/$defs/identity"}},
        )
    )
    engine: Identity | None = field(default=None, metadata=json_field(doc="the black-box engine's identity"))
    counts: Counts
    tested: Tested | None = None
    conformance: Conformance | None = None
    bug_classes: dict[str, BugClassClaim] | None = None
    cost: Cost | None = None
    matrix: tuple[MatrixRow, ...] = field(
        metadata=json_field(doc="every planned cell of the full matrix, with its status")
    )
    pytest_exit_status: int
    cells: tuple[CellRecord, ...] = field(metadata=json_field(doc="one record per certification test"))
