"""Serving axes: the ways a serving engine runs requests that must not change what it emits.

A serving axis (tensor-parallel split, prefix cache, continuous batching, …) is one module of
`losscheck.serving` that defines `AXIS`, an `Axis`: the values the matrix gives it, the part of a
cell's id it adds, which of its cells belong to the slow tier, and how it serves a cell's requests
— by wrapping the `Server` of the cell (`Axis.serve`). The matrix, the cells and the certificate
know axes only through this registry, so a new axis is one module and its tests.

Terms. A *call* is one batch of requests: prompts, a token budget, sampling parameters and the
name of its random stream (`Call.stream`; the generator is derived from the run seed and it, so a
rank of a split run draws the same numbers). A *server* turns calls into `Generation`s.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Generic, Protocol, TypeVar

import torch

from losscheck.core.contract import Drafter
from losscheck.core.engine import Engine
from losscheck.core.generation import Generation
from losscheck.core.sampling import SamplingParams, make_generator
from losscheck.engines.registry import AxisValue  # an axis's own value: ranks, "cold" / "warm", 2 (k)
from losscheck.errors import LosscheckError
from losscheck.jsonrecord import Scalar

Prompts = list[list[int]]
Facts = dict[str, dict[str, Scalar]]  # serving axis -> what it measured, with a one-line "summary"
Serving = tuple[tuple[str, AxisValue], ...]  # a cell's non-default axis values, in registry order
UNBOUNDED = 1 << 62  # `Server.call_rows` of a server that sizes its own batches


@dataclass(frozen=True)
class Call:
    """One batch of requests a cell serves."""

    prompts: Prompts
    max_new_tokens: int
    params: SamplingParams
    stream: tuple[object, ...]  # names the call's random stream under the run seed

    def generator(self, seed: int, device: torch.device | str = "cpu") -> torch.Generator:
        return make_generator(seed, *self.stream, device=device)


class Server(Protocol):
    """Serves a cell's calls. `engine` is the in-process speculative engine when there is one
    (a split run's engines live in its ranks), for checks that watch its verifier."""

    engine: Engine | None

    def call_rows(self, rows: int) -> int:
        """Most requests one call may carry, given the `rows` an engine batch holds in memory."""
        ...

    def generate(self, calls: Sequence[Call]) -> list[Generation]:
        """One generation per call, in order."""
        ...

    def facts(self) -> Facts:
        """What the certificate records of this way of serving: axis name -> its facts, with a
        one-line "summary" the certificate prints."""
        ...


@dataclass(frozen=True)
class RankRecipe:
    """How a rank of an axis that runs elsewhere (a split) builds the cell's server, minus that
    axis, in its own process. Picklable: it crosses to the ranks."""

    device: str | None  # the run's device option (None: the default), which decides the backend
    target: str | None  # the main target's path or id (None: the bundled one)
    trust_remote_code: bool  # how the target's config may be read
    # the cell's server with serving `unsplit`, built in the calling process from the run's
    # options: a module-level function bound by `functools.partial`, so that it pickles
    build: Callable[[Serving], Server]


@dataclass(frozen=True)
class ServeContext:
    """What an axis may use to serve a cell: the run's seed and batch limit, the cell's id, the
    whole cell serving (axis values), the planted bug (`losscheck.run.plant.Plant`; an axis takes
    the part it may plant through its own protocol, e.g. `PlantsPrefixCache`) and how a rank
    rebuilds the cell elsewhere (`RankRecipe`)."""

    seed: int
    cell_id: str
    serving: Mapping[str, AxisValue]
    max_rows: int  # most rows one scheduler runs at once
    greedy_max_new: int  # the first turn's budget of a warm prefix cache
    plant: object | None = None
    ranks: RankRecipe | None = None  # None: the cell cannot be rebuilt in other processes


class EngineServer:
    """The base server: each call is one `Engine.generate` batch."""

    def __init__(self, engine: Engine, seed: int) -> None:
        self.engine: Engine | None = engine
        self.seed = seed

    def call_rows(self, rows: int) -> int:
        return rows

    def generate(self, calls: Sequence[Call]) -> list[Generation]:
        assert self.engine is not None
        device = self.engine.target.device
        return [
            self.engine.generate(c.prompts, c.max_new_tokens, c.params, c.generator(self.seed, device)) for c in calls
        ]

    def facts(self) -> Facts:
        return {}


class Wrapped:
    """A server that changes some of what `inner` does; the rest passes through."""

    def __init__(self, inner: Server) -> None:
        self.inner = inner
        self.engine = inner.engine

    def call_rows(self, rows: int) -> int:
        return self.inner.call_rows(rows)

    def generate(self, calls: Sequence[Call]) -> list[Generation]:
        return self.inner.generate(calls)

    def facts(self) -> Facts:
        return self.inner.facts()


V = TypeVar("V", int, str)  # one axis's value type


@dataclass(frozen=True)
class Axis(Generic[V]):
    """One serving axis, of values of type `V`."""

    name: str  # its key in a cell's serving
    off: V  # its value in the base cell
    values: tuple[V, ...]  # the matrix's cells: one per value, one change from the base cell
    suffix: Callable[[V], str]  # the part of a cell's id, e.g. "prefix-warm"
    serve: Callable[[V, Server, ServeContext], Server]  # the cell's server along this axis
    order: int  # where the suffix goes in a cell's id, and the order `serve` wraps in (lowest first)
    doc: str  # one line for the docs and the certificate
    # combinations with other axes, each a slow-tier cell (greedy and sampled)
    pairs: tuple[Mapping[str, AxisValue], ...] = ()
    # a greedy slow-tier cell of each value in the run's first reduced precision
    with_reduced_precision: bool = False
    # greedy divergences within the precision's round-off are near-ties (another reduction order)
    rounds_differently: bool = False
    # the requests a cell measures in place of its prompts (a warm cache's second turn), given
    # the cell's whole server: (value, server, context, prompts, max_new_tokens, params, stream) -> requests
    requests: Callable[[V, Server, ServeContext, Prompts, int, SamplingParams, object], Prompts] | None = None
    # the cell's engine runs in other processes (a split run): none is built in this one
    runs_elsewhere: bool = False
    # combinations that cannot run, by axis name (e.g. a split cell's ranks run no prefix cache)
    excludes: frozenset[str] = field(default_factory=frozenset)
    # how the axis changes the cell's drafter, applied where the engine is built (in a split
    # cell's ranks too), before a planted bug wraps it: (value, drafter) -> drafter
    drafter: Callable[[V, Drafter], Drafter] | None = None


@cache
def axes() -> tuple[Axis, ...]:
    """Every serving axis: the `AXIS` of each module of `losscheck.serving`, in `order`."""
    import losscheck.serving as package

    found = []
    for module in pkgutil.iter_modules(package.__path__):
        axis = getattr(importlib.import_module(f"{package.__name__}.{module.name}"), "AXIS", None)
        if isinstance(axis, Axis):
            found.append(axis)
    return tuple(sorted(found, key=lambda a: a.order))


def axis(name: str) -> Axis:
    for found in axes():
        if found.name == name:
            return found
    raise LosscheckError(f"no serving axis {name!r}; the axes are {[a.name for a in axes()]}")


def served_drafter(drafter: Drafter, values: Serving) -> Drafter:
    """`drafter` as the cell's serving `values` change it (`Axis.drafter`), in registry order."""
    for name, value in values:
        change = axis(name).drafter
        if change is not None:
            drafter = change(value, drafter)
    return drafter


def serving(**values: AxisValue) -> Serving:
    """A cell's serving from axis values: unknown axes and combinations an axis excludes refused,
    base values dropped, in registry order."""
    for name in values:
        axis(name)
    found = tuple((a.name, values[a.name]) for a in axes() if a.name in values and values[a.name] != a.off)
    given = {name for name, _ in found}
    for name in given:
        clash = axis(name).excludes & given
        if clash:
            raise LosscheckError(f"serving axis {name!r} cannot be combined with {sorted(clash)}")
    return found


def value(cell_serving: Serving, name: str) -> AxisValue:
    """The value of axis `name` in a cell's serving (its `off` value when absent)."""
    return dict(cell_serving).get(name, axis(name).off)


def id_suffix(cell_serving: Serving) -> list[str]:
    return [axis(name).suffix(v) for name, v in cell_serving]


def record(cell_serving: Serving) -> dict[str, AxisValue]:
    """Every axis's value, base values included: the certificate's record of a cell's serving."""
    given = dict(cell_serving)
    return {a.name: given.get(a.name, a.off) for a in axes()}


def rounds_differently(cell_serving: Serving) -> bool:
    return any(axis(name).rounds_differently for name, _ in cell_serving)


def requests(
    server: Server, context: ServeContext, prompts: Prompts, max_new_tokens: int, params: SamplingParams, stream: object
) -> Prompts:
    """The requests a cell measures for `prompts` under its serving (`Axis.requests`)."""
    for name, v in context.serving.items():
        hook = axis(name).requests
        if hook is not None:
            prompts = hook(v, server, context, prompts, max_new_tokens, params, stream)
    return prompts


def runs_elsewhere(cell_serving: Serving) -> bool:
    return any(axis(name).runs_elsewhere for name, _ in cell_serving)


def build_server(engine: Engine | None, context: ServeContext) -> Server:
    """The cell's server: the engine's, wrapped by each of the cell's axes in order. An axis that
    replaces the engine (a split run) is given `engine=None` servers to wrap."""
    server: Server = EngineServer(engine, context.seed) if engine is not None else _NoEngine()
    for name, v in context.serving.items():
        server = axis(name).serve(v, server, context)
    return server


class _NoEngine(EngineServer):
    def __init__(self) -> None:
        self.engine = None
        self.seed = 0

    def generate(self, calls: Sequence[Call]) -> list[Generation]:
        raise LosscheckError("this cell's server has no engine: an axis that runs elsewhere must replace it")
