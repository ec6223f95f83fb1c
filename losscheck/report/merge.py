"""`losscheck merge`: the certificates of one plan's shards (`--shard I/N` on N runners,
`losscheck.plan.shard`) joined into one certificate of the whole scope.

Shards join only when they are shares of one plan: the same seed, alpha and plan fingerprint
(`losscheck.report.shard`), the same count N, each index once, disjoint cells that together hold
every cell in scope. Anything else is a `LosscheckError` naming what differs and the fix. A shard
that holds no cell (more shards than cells) writes no certificate and is not needed. The joined
certificate is then accounted as one run's (`certificate.account`): PASS only when every cell in
scope ran and passed; a failed cell fails it and a shard's problems are its problems.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from losscheck.errors import LosscheckError
from losscheck.plan.entry import MatrixEntry
from losscheck.report import certificate
from losscheck.report.document import Certificate, MergedShard, RunEnvironment, ShardRecord

FIX = "pass every shard's run directory once (reports/<run>, as `losscheck certify --shard I/N` writes it)"


@dataclasses.dataclass(frozen=True)
class ShardRun:
    """A shard's certificate as `losscheck merge` was given it."""

    name: str  # the run directory or certificate.json, as the user named it
    cert: Certificate
    run: Path  # the directory it lies in: its model paths are relative to it


def merge(runs: Sequence[ShardRun]) -> Certificate:
    """One certificate of the scope the shards `runs` (any order) are shares of, its model paths
    relative to the current directory, as a run's are until `certificate.write_run` writes it."""
    shards = sorted(_checked(runs), key=lambda r: _share(r).index)
    first = shards[0].cert
    worst = next((c for c in (r.cert.pytest_exit_status for r in shards) if c not in (0, 5)), 0)
    found = certificate.account(
        first.meta,
        [_planned(first)],
        [record for r in shards for record in r.cert.cells],
        worst,
        any(r.cert.verdict == "INTERRUPTED" for r in shards),
        problems=[f"shard {_label(r)}: {p}" for r in shards for p in r.cert.problems],
    )
    joined = dataclasses.replace(
        first,
        created=certificate.now(),
        shard=None,
        merged=tuple(
            MergedShard(r.name, _share(r), r.cert.created, r.cert.verdict, r.cert.meta.pytest_args, r.cert.environment)
            for r in shards
        ),
        meta=dataclasses.replace(first.meta, pytest_args=()),  # each shard's command is in `merged`
        environment=_environment(shards),
        pytest_exit_status=worst,
        **found.fields(),
    )
    return certificate.relative_to_run(joined, Path.cwd(), start=shards[0].run)


def _checked(runs: Sequence[ShardRun]) -> list[ShardRun]:
    """`runs`, when they are the shards of one plan; else the error naming what differs."""
    if not runs:
        raise LosscheckError(f"no certificate to merge: {FIX}")
    for r in runs:
        if r.cert.shard is None:
            what = "a merged certificate" if r.cert.merged else "not a shard's certificate (run without --shard)"
            raise LosscheckError(f"{r.name} is {what}: {FIX}")
    first = runs[0]
    for r in runs[1:]:
        differs = _difference(first, r)
        if differs:
            raise LosscheckError(f"{first.name} and {r.name} {differs}, then merge")
    seen: dict[int, ShardRun] = {}
    holder: dict[str, ShardRun] = {}
    for r in runs:
        share = _share(r)
        if share.index in seen:
            raise LosscheckError(f"{seen[share.index].name} and {r.name} are both shard {_label(r)}: {FIX}")
        seen[share.index] = r
        for cell in share.cells:
            if cell in holder:
                raise LosscheckError(
                    f"{holder[cell].name} and {r.name} both hold cell {cell}: the shards of one plan are disjoint; "
                    "rerun them with one losscheck version"
                )
            holder[cell] = r
    missing = [e.cell for e in _planned(first.cert) if e.cell not in holder]
    if missing:
        count = _share(first).count
        absent = [f"{i}/{count}" for i in range(1, count + 1) if i not in seen]
        cells = f"{len(missing)} cells of the plan are in none of the certificates given (e.g. {missing[0]})"
        if not absent:
            raise LosscheckError(f"{cells}, though every shard of {count} is: rerun the shards with one losscheck")
        which = f"shard {absent[0]} is" if len(absent) == 1 else f"shards {', '.join(absent)} are"
        raise LosscheckError(f"{which} missing: {cells}; {FIX}")
    return list(runs)


def _difference(a: ShardRun, b: ShardRun) -> str | None:
    """How shards `a` and `b` are not shares of one plan, with the fix; None when they are."""
    meta, theirs = a.cert.meta, b.cert.meta
    if meta.seed != theirs.seed:
        return f"were run with different seeds ({meta.seed} vs {theirs.seed}): run every shard with the same --seed"
    if meta.alpha_option != theirs.alpha_option:
        return (
            f"were run with different alphas ({meta.alpha_option} vs {theirs.alpha_option}): "
            "run every shard with the same --alpha"
        )
    if _share(a).plan != _share(b).plan:
        return (
            f"were planned differently (plan fingerprint {_share(a).plan[:12]}… vs {_share(b).plan[:12]}…: "
            "the matrix, scope, profile, options or models differ): run every shard with the same losscheck, "
            "models, --scope, --profile and options"
        )
    if _share(a).count != _share(b).count:
        return (
            f"are shards of different counts ({_label(a)} vs {_label(b)}): run every shard with the same N "
            "in --shard I/N"
        )
    return None


def _share(run: ShardRun) -> ShardRecord:
    assert run.cert.shard is not None  # `_checked` refused certificates without one
    return run.cert.shard


def _label(run: ShardRun) -> str:
    return f"{_share(run).index}/{_share(run).count}"


def _planned(cert: Certificate) -> list[MatrixEntry]:
    """The plan in scope of a certificate, as its processes' manifests gave it."""
    return [MatrixEntry(m.cell, m.mode or "", m.argument or "", bool(m.slow), m.estimated_s) for m in cert.matrix]


def _environment(shards: Sequence[ShardRun]) -> RunEnvironment:
    """What the shards' runners share (a field they differ in left unset: each shard's own is in
    `merged`), and every process's threads, its worker id prefixed by its shard."""
    envs = [r.cert.environment for r in shards]
    shared = {
        f.name: getattr(envs[0], f.name)
        for f in dataclasses.fields(RunEnvironment)
        if f.name != "workers" and all(getattr(e, f.name) == getattr(envs[0], f.name) for e in envs)
    }
    workers = {f"shard {_label(r)} {w}": v for r in shards for w, v in r.cert.environment.workers.items()}
    return RunEnvironment(**shared, workers=workers)
