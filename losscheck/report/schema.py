"""The certificate's published JSON schema, `certificate.schema.json` (draft 2020-12). The
document's own shape (verdict, scope, alpha, matrix, models) is written there by hand; the
definitions of a cell's record are generated from `losscheck.cells.record.CellRecord`, so the two
cannot drift apart. `python -m losscheck.report.schema` rewrites the file; a test keeps the
published one equal to what this module generates."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from losscheck.cells.record import record_schema

HAND_WRITTEN = ("identity",)  # the definitions not generated from the record


def path() -> Path:
    return Path(str(files("losscheck.report").joinpath("certificate.schema.json")))


def published() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(path().read_text())
    return schema


def generated() -> dict[str, Any]:
    """The published schema with its record definitions generated afresh."""
    schema = published()
    record = record_schema()
    defs = record["$defs"]
    assert isinstance(defs, dict)
    own = {name: d for name, d in schema["$defs"].items() if name in HAND_WRITTEN}
    schema["$defs"] = {**own, **defs}
    schema["properties"]["cells"]["items"] = {"$ref": record["$ref"]}
    return schema


def text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    path().write_text(text(generated()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
