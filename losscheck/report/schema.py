"""The published JSON schemas (draft 2020-12) of what losscheck writes, each generated from the
records that write it, so a published schema cannot drift from the files:

- `certificate.schema.json`: certificate.json (`losscheck.report.document.Certificate` and the
  cell record, `losscheck.cells.record.CellRecord`); only a model's identity, which a drafter may
  extend with fields of its own, is described here by hand;
- `perf.schema.json`: the perf tier's run file, perf.json (`losscheck.report.perf_record.PerfRunFile`);
- `engine-perf.schema.json`: an engine perf run's perf.json
  (`losscheck.report.engine_perf_record.EnginePerfFile`).

`python -m losscheck.report.schema` rewrites the files; a test keeps each published one equal to
what this module generates."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from losscheck.jsonrecord import json_schema
from losscheck.report import engine_perf_record, perf_record
from losscheck.report.document import SCHEMA, Certificate

IDENTITY = {
    "type": "object",
    "description": "what a model is: its path (bundled:NAME, or relative to the run directory) and content hash",
    "properties": {
        "path": {"type": ["string", "null"]},
        "sha256": {"type": ["string", "null"]},
        "weights_sha256": {"type": ["string", "null"]},
        "precision": {"type": "string"},
        "name": {"type": "string"},
        "block_lengths": {"type": "array", "items": {"type": "integer"}},
    },
}


# file -> (the record type, its schema name, the title)
PUBLISHED: dict[str, tuple[type, str, str]] = {
    "certificate.schema.json": (Certificate, SCHEMA, "losscheck certificate"),
    "perf.schema.json": (perf_record.PerfRunFile, perf_record.SCHEMA, "losscheck perf tier run"),
    "engine-perf.schema.json": (
        engine_perf_record.EnginePerfFile,
        engine_perf_record.SCHEMA,
        "losscheck engine perf run",
    ),
}
CERTIFICATE = "certificate.schema.json"


def path(name: str = CERTIFICATE) -> Path:
    return Path(str(files("losscheck.report").joinpath(name)))


def published(name: str = CERTIFICATE) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(path(name).read_text())
    return schema


def generated(name: str = CERTIFICATE) -> dict[str, Any]:
    """The schema of the file `name` describes, as its records define it."""
    record, schema_name, title = PUBLISHED[name]
    found = json_schema(record)
    defs = found["$defs"]
    assert isinstance(defs, dict)
    root = defs.pop(next(iter(defs)))  # the record's own definition comes first
    kind, _, version = schema_name.removeprefix("losscheck.").rpartition("/")
    extra = {"identity": IDENTITY} if record is Certificate else {}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://losscheck.invalid/schemas/{kind}/{version}",
        "title": title,
        **root,
        "$defs": {**extra, **defs},
    }


def text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    for name in PUBLISHED:
        path(name).write_text(text(generated(name)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
