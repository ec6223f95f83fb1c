"""A cell of the full matrix as the certificate accounts for it and `losscheck certify --list`
shows it: `MatrixEntry`. Torch-free: the xdist controller reads the processes' matrices."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MatrixEntry:
    """One planned cell: its id, mode, the certification test argument that runs it, its tier
    and the plan's estimate of its seconds (`losscheck.plan.cost`)."""

    cell: str
    mode: str
    argument: str  # the certification test's cell argument
    slow: bool = False
    estimated_s: float | None = None
