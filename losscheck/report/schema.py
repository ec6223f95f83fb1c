"""The certificate's published JSON schema, `certificate.schema.json` (draft 2020-12), generated
from the records that write the certificate (`losscheck.report.document.Certificate` and the cell
record, `losscheck.cells.record.CellRecord`), so the published schema cannot drift from what
losscheck writes. Only a model's identity, which a drafter may extend with fields of its own, is
described here by hand. `python -m losscheck.report.schema` rewrites the file; a test keeps the
published one equal to what this module generates."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from losscheck.jsonrecord import json_schema
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


def path() -> Path:
    return Path(str(files("losscheck.report").joinpath("certificate.schema.json")))


def published() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(path().read_text())
    return schema


def generated() -> dict[str, Any]:
    """The schema of certificate.json as the records define it."""
    found = json_schema(Certificate)
    defs = found["$defs"]
    assert isinstance(defs, dict)
    root = defs.pop("certificate")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://losscheck.invalid/schemas/certificate/{SCHEMA.rpartition('/')[2]}",
        "title": "losscheck certificate",
        **root,
        "$defs": {"identity": IDENTITY, **defs},
    }


def text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    path().write_text(text(generated()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
