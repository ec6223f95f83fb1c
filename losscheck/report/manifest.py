"""What one pytest process knows about the run it is part of: the full matrix, the alpha split,
the identity (content hash) of every model it loaded, and its own environment.

Every process that runs certification tests (the only one in-process, each xdist worker
otherwise) sends its manifest once, on its first certification test report, through pytest's
report channel. The controller writes the certificate from the manifests and the cell records, so
it never loads a model, and a `-k` selection or a CI shard still knows the whole matrix it belongs
to.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from losscheck.jsonrecord import JsonRecord
from losscheck.plan.entry import MatrixEntry

if TYPE_CHECKING:
    import torch

    from losscheck.core.contract import Drafter
    from losscheck.engines import BlackBoxEngine
    from losscheck.run.session import Session

UNHASHED = "no weights found to hash: give the drafter an `identity` dict with its own 'sha256'"

Identity = dict[str, object]  # a model's identity: path, sha256, precision and what it declares of itself


@dataclass(frozen=True)
class RegisteredTest:
    """A statistical test a sampled cell may run, as the registry declares it."""

    name: str
    family: str
    scope: str
    anytime: bool  # valid under any stopping rule (an e-value)
    spends_alpha: bool  # False: fails only on an event of probability 0 under H0


@dataclass(frozen=True)
class AlphaSplit:
    """The family-wise α and its Bonferroni split over the statistical cells of the full matrix."""

    family: float
    statistical_tests: int
    per_test: float | None  # None: no statistical cell
    tests: tuple[RegisteredTest, ...] = ()


@dataclass(frozen=True)
class OutOfScope:
    cell: str
    reason: str


@dataclass(frozen=True)
class DeclaredScope:
    declared: str  # the --scope text
    out: tuple[OutOfScope, ...] = ()  # the cells of the full matrix it leaves out


@dataclass(frozen=True)
class Environment:
    """What one process ran on."""

    losscheck: str
    git_revision: str | None  # None: not run from a git checkout
    python: str
    platform: str
    machine: str
    cpu_count: int | None
    torch: str
    transformers: str
    numpy: str
    scipy: str
    device: str
    accelerator: str
    worker: str  # the xdist worker id ("main" in process)
    threads: int  # torch's threads in this process
    cuda: str | None = None  # the CUDA version torch was built with (None: a CPU build)
    driver: str | None = None  # the NVIDIA driver's version, where one is loaded
    device_count: int | None = None  # CUDA devices visible (None: none)


@dataclass(frozen=True)
class Manifest(JsonRecord):
    """One process's manifest: the full matrix, the α split, every model's identity, the declared
    scope and the environment."""

    matrix: tuple[MatrixEntry, ...]
    alpha: AlphaSplit
    targets: dict[str, Identity]
    drafters: dict[str, dict[str, Identity]]  # target name -> drafter name -> identity
    engine: Identity | None
    scope: DeclaredScope
    environment: Environment


def build(session: Session) -> Manifest:
    """The manifest of this process (loads the models and plans the matrix, if not done yet)."""
    from losscheck.plan import matrix

    plan = session.plan
    return Manifest(
        matrix=tuple(matrix.entries(plan)),
        alpha=AlphaSplit(session.options.alpha, session.n_statistical, session.per_test_alpha, registered_tests()),
        targets={name: portable(dict(t.identity)) for name, t in session.targets.items()},
        drafters={}
        if session.engine_only
        else {
            name: {key: portable(drafter_identity(d)) for key, d in session.drafters(name).items()}
            for name in session.target_names
        },
        engine=engine_identity(session.blackbox, portable_pins(session.engine_pins))
        if session.blackbox is not None
        else None,
        scope=DeclaredScope(
            session.options.scope.label(), tuple(OutOfScope(o["cell"], o["reason"]) for o in session.out_of_scope)
        ),
        environment=environment(session.device),
    )


def registered_tests() -> tuple[RegisteredTest, ...]:
    """Every statistical test a sampled cell may run, as the registry declares it
    (`losscheck.stats.registry`): the tests each cell's share of alpha is split over."""
    import importlib

    from losscheck.stats import registry

    for family_module in ("losscheck.stats.pit", "losscheck.stats.conditional", "losscheck.cells.conformance"):
        importlib.import_module(family_module)  # each registers its family's tests when imported

    return tuple(RegisteredTest(t.name, t.family, t.scope, t.anytime, t.spends_alpha) for t in registry.all_tests())


def portable(identity: Identity) -> Identity:
    """`identity` with its model `path` as a certificate attached to a release can carry it: a
    bundled fixture as `bundled:NAME`, any other path relative to the directory the run started
    in (the hash, not the path, is what identifies the model)."""
    from losscheck import bundled

    path = identity.get("path")
    if not isinstance(path, str) or not path:
        return identity
    fixtures = bundled.fixtures_dir().resolve()
    found = Path(path).resolve()
    if found.is_relative_to(fixtures):
        shown = f"bundled:{found.relative_to(fixtures).as_posix()}"
    else:
        shown = Path(os.path.relpath(found)).as_posix()
    return {**identity, "path": shown}


def portable_pins(pins: Identity) -> Identity:
    """`pins` with the draft model's path made `portable`, as the models' paths are."""
    draft = pins.get("draft_model")
    return {**pins, "draft_model": portable(draft)} if isinstance(draft, dict) else pins


def engine_identity(engine: BlackBoxEngine, pins: Identity | None = None) -> Identity:
    """A black-box engine's name, block length and precision, what the run pins of it (package
    version, draft model hash, options: `losscheck.engines.pins`), and its own `identity` if it
    has one (which may name its draft model itself)."""
    return {
        "name": engine.name,
        "k": engine.k,
        "precision": engine.precision,
        **(pins or {}),
        **getattr(engine, "identity", {}),
    }


def drafter_identity(drafter: Drafter) -> Identity:
    """Name, class, declared knobs and content hash: the drafter's own `identity` (files it was
    loaded from), else a hash of the tensors of the modules it holds."""
    identity: Identity = {
        "name": drafter.name,
        "class": f"{type(drafter).__module__}.{type(drafter).__qualname__}",
        "block_lengths": list(drafter.block_lengths),
        "widths": list(drafter.widths),
        **getattr(drafter, "identity", {}),
    }
    if not identity.get("sha256"):
        identity["weights_sha256"] = weights_sha256(drafter)
        if identity["weights_sha256"] is None:
            identity["hash_note"] = UNHASHED
    return identity


def weights_sha256(obj: object) -> str | None:
    """sha256 over name, dtype, shape and bytes of every tensor of the `torch.nn.Module`
    attributes of `obj` (None when it has none). Bytes as stored, so bf16 and fp32 copies of the
    same weights hash differently: the hash names what ran."""
    import torch

    modules = sorted((k, v) for k, v in vars(obj).items() if isinstance(v, torch.nn.Module))
    if not modules:
        return None
    digest = hashlib.sha256()
    for attr, module in modules:
        for name, tensor in sorted(module.state_dict().items()):
            digest.update(f"{attr}.{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(_bytes(tensor))
    return digest.hexdigest()


def _bytes(tensor: torch.Tensor) -> bytes:
    import torch

    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return flat.view(torch.uint8).numpy().tobytes()


def environment(device: torch.device) -> Environment:
    """Library versions, losscheck's version and git revision, device and accelerator, and the
    threads this process's torch uses."""
    import numpy
    import scipy
    import torch
    import transformers

    return Environment(
        losscheck=_losscheck_version(),
        git_revision=git_revision(Path(__file__).resolve().parent),
        python=sys.version.split()[0],
        platform=platform.platform(),
        machine=platform.machine(),
        cpu_count=os.cpu_count(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        numpy=numpy.__version__,
        scipy=scipy.__version__,
        device=str(device),
        accelerator=accelerator(device),
        worker=os.environ.get("PYTEST_XDIST_WORKER", "main"),
        threads=torch.get_num_threads(),
        cuda=torch.version.cuda,
        driver=nvidia_driver(),
        device_count=torch.cuda.device_count() if torch.cuda.is_available() else None,
    )


def nvidia_driver(version_file: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    """The loaded NVIDIA kernel driver's version: the first dotted number of the "NVRM version:"
    line (None: no NVIDIA driver loaded)."""
    import re

    try:
        first = version_file.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    found = re.search(r"\b\d+\.\d+(?:\.\d+)?\b", first)
    return found.group(0) if found else first.strip()


def accelerator(device: torch.device) -> str:
    """What `device` is, in words: the GPU's name, or the CPU's architecture."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


def git_revision(path: Path) -> str | None:
    """The commit of the checkout `path` lies in ("+dirty" with uncommitted changes to tracked
    files), or None outside a git checkout (an installed wheel)."""
    try:
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _losscheck_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("losscheck")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed)"
