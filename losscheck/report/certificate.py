"""The certificate: `reports/<run>/certificate.json` (versioned schema) and `summary.md`."""

from __future__ import annotations

import datetime as dt
import json
import platform
import sys
from pathlib import Path
from typing import Any

from losscheck.report.summary import markdown_table
from losscheck.session import Session

SCHEMA = "losscheck.certificate/1"


def environment() -> dict[str, str]:
    import numpy
    import scipy
    import torch
    import transformers

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "threads": str(torch.get_num_threads()),
    }


def drafter_identity(drafter: Any) -> dict[str, Any]:
    return {
        "name": drafter.name,
        "class": f"{type(drafter).__module__}.{type(drafter).__qualname__}",
        "block_lengths": list(drafter.block_lengths),
        "widths": list(drafter.widths),
        **getattr(drafter, "identity", {}),
    }


def build(session: Session, records: list[dict[str, Any]], exit_status: int) -> dict[str, Any]:
    o = session.options
    targets = session.targets
    return {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "seed": o.seed,
        "options": {
            "alpha": o.alpha,
            "per_test_alpha": session.per_test_alpha,
            "statistical_tests": session.n_statistical,
            "profile": o.profile.__dict__,
            "mutant": o.mutant,
            "drafter_option": o.drafter,
            "device": str(session.device),
            "precisions": [p.label() for p in o.precisions],
            "strict": o.strict,
        },
        "environment": environment(),
        "targets": {name: t.identity for name, t in targets.items()},
        "drafters": {
            name: {key: drafter_identity(d) for key, d in session.drafters(name).items()} for name in targets
        },
        "verdict": "pass" if records and all(r.get("passed") for r in records) and exit_status == 0 else "fail",
        "pytest_exit_status": exit_status,
        "cells": records,
    }


def write_run(session: Session, records: list[dict[str, Any]], exit_status: int) -> Path:
    """Write the certificate and Markdown summary under `--losscheck-out`; return the run dir."""
    cert = build(session, records, exit_status)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    run = Path(session.options.out) / f"{stamp}-seed{session.options.seed}"
    run.mkdir(parents=True, exist_ok=True)
    (run / "certificate.json").write_text(json.dumps(_finite(cert), indent=2, allow_nan=False, default=str))
    (run / "summary.md").write_text(markdown(cert))
    return run


def _finite(value: Any) -> Any:
    """NaN / inf (e.g. the acceptance of a never-proposed slot) become null: strict JSON."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def markdown(cert: dict[str, Any]) -> str:
    main = cert["targets"]["main"]
    lines = [
        f"# losscheck certificate — {cert['verdict'].upper()}",
        "",
        f"- created: {cert['created']}, seed {cert['seed']} (replay with `--losscheck-seed={cert['seed']}`)",
        f"- target: `{main.get('path')}` sha256 `{main.get('sha256', '?')[:16]}…` ({main.get('precision')})",
        f"- drafters: {', '.join(sorted(cert['drafters']['main']))}",
        f"- family-wise alpha {cert['options']['alpha']} over {cert['options']['statistical_tests']} statistical "
        f"tests (per test {cert['options']['per_test_alpha']:.3g}); every sampled cell detects TV "
        f"{cert['options']['profile']['detect_tv']} at power {cert['options']['profile']['power']}",
        f"- environment: python {cert['environment']['python']}, torch {cert['environment']['torch']}, "
        f"transformers {cert['environment']['transformers']}",
        "",
        markdown_table(cert["cells"]),
    ]
    return "\n".join(lines)
