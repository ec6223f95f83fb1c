"""Where a saved run's certificate is: `losscheck report` and `losscheck compare` name a run
directory (reports/<run>, as `--losscheck-out` writes it) or its certificate.json, and nothing
else stands in for one (never the directory above, never a directory of runs)."""

from __future__ import annotations

from pathlib import Path

from losscheck.errors import LosscheckError

CERTIFICATE = "certificate.json"
RUN = f"a run directory (reports/<run>, with {CERTIFICATE}) or its {CERTIFICATE}"


def certificate_file(run: str | Path) -> Path:
    """The certificate file of `run`: `run` itself when it is a file, else `run`/certificate.json;
    an error naming `run` and the fix (the runs a directory of runs holds) otherwise."""
    path = Path(run)
    if path.is_file():
        return path
    if not path.is_dir():
        raise LosscheckError(f"{str(path)!r}: no such file or directory; name {RUN}")
    if (path / CERTIFICATE).is_file():
        return path / CERTIFICATE
    where = f"{str(path)!r} is not a run directory: it has no {CERTIFICATE}"
    runs = sorted(p.parent.as_posix() for p in path.glob(f"*/{CERTIFICATE}"))
    if runs:
        shown = ", ".join(repr(r) for r in runs[-3:])
        raise LosscheckError(f"{where}; the runs in it: {'…, ' if len(runs) > 3 else ''}{shown}: name one")
    raise LosscheckError(f"{where}; name {RUN}")
