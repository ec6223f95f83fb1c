"""Building a cell's engine and server: the cell's target, drafter (stressed when the cell says
so), block length and width, with the run's verifier (`--losscheck-verifier`) and the run's
planted bug (`losscheck.run.plant`) if any, served along the cell's serving axes
(`losscheck.serving.axis`).

Which verifier decides a speculative engine's blocks, first that applies: a planted bug's own
verifier (the mutant tier tests the gate against it, whatever the run's verifier), the run's
`--losscheck-verifier`, the drafter's declared `verifier` (a checkpoint configured with a relaxed
acceptance rule), `losscheck.core.verify.verify_block`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING

from losscheck.core.contract import Drafter, Target
from losscheck.core.engine import Engine
from losscheck.core.tree_engine import TreeEngine
from losscheck.core.verify import Verifier
from losscheck.drafters.tree import TreeDrafter
from losscheck.errors import OptionError, flag
from losscheck.run.loading import load_object
from losscheck.serving.axis import (
    RankRecipe,
    ServeContext,
    Server,
    Serving,
    build_server,
    runs_elsewhere,
    served_drafter,
)

if TYPE_CHECKING:
    from losscheck.plan.cell import Cell
    from losscheck.run.options import Options
    from losscheck.run.plant import Plant
    from losscheck.run.session import Session


def engine(session: Session, cell: Cell) -> Engine:
    """The speculative engine of `cell`, planted when the run plants a bug."""
    target, drafter = session.cell_target(cell), session.drafters(cell.target, cell.precision)[cell.drafter]
    if cell.stress is not None:
        from losscheck.drafters.stress import stressed

        drafter = stressed(drafter, cell.stress, target.vocab_size)
    drafter = served_drafter(drafter, cell.serving)
    verifier = load_verifier(session.options.verifier) if session.options.verifier else None
    return planted_engine(session.plant, target, drafter, cell.k, cell.width, verifier)


def planted_engine(
    plant: Plant | None,
    target: Target,
    drafter: Drafter,
    k: int,
    width: int | None = None,
    verifier: Verifier | None = None,
) -> Engine:
    """The speculative engine of `drafter` on `target` deciding blocks with `verifier` (None: the
    drafter's own or losscheck's), with `plant`'s bug when there is one: a plant's verifier wins."""
    if isinstance(drafter, TreeDrafter):  # a tree per round: the tree loop, its width the cell's
        if verifier is not None or plant is not None:
            raise OptionError(
                f"drafter {drafter.name!r} drafts trees, which losscheck's tree verifier decides "
                f"(losscheck.core.tree.verify_tree); {flag('verifier')} and the planted bugs of the catalogue "
                "replace a chain's parts. Leave the tree family out (--losscheck-bundled=reference) or drop them; "
                "a tree verifier of your own goes through `losscheck verifier-tier --tree`"
            )
        return TreeEngine(target, drafter if width is None else drafter.at_width(width))
    if plant is None:
        return Engine(target, drafter, k, width, verifier=verifier)
    if plant.wrap_drafter is not None:
        drafter = plant.wrap_drafter(drafter)
    if plant.wrap_target is not None:
        target = plant.wrap_target(target, k)
    # a plant registered before plants could replace the history step has no `history`
    parts = {part: getattr(plant, part, None) for part in ("history", "ends", "logprobs", "stop_rule")}
    return Engine(target, drafter, k, width, verifier=plant.verifier or verifier, **parts)


_VERIFIERS: dict[str, Verifier] = {}  # spec -> the verifier its factory built, once per process
_SHAPE = "(logits [B, k+1, V], drafts [B, k], q [B, k, V] | None, params, generator) -> BlockOutcome"


def load_verifier(spec: str, option: str = "--losscheck-verifier") -> Verifier:
    """The `Verifier` that the factory `spec` (`pkg.mod:factory`, no arguments) returns, built once
    per process; an `OptionError` naming `option` and the fix when the path does not resolve, the
    factory is not callable or takes arguments, raises, or returns something not callable."""
    if spec in _VERIFIERS:
        return _VERIFIERS[spec]
    where = f"{option}={spec!r}"
    factory = load_object(spec, option)
    if not callable(factory):
        raise OptionError(f"{where} is a {type(factory).__name__}, not a factory() -> Verifier")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: calling it tells
        signature = None
    if signature is not None:
        try:
            signature.bind()
        except TypeError:
            looks_like_verifier = _binds(signature, 5)
            raise OptionError(
                f"{where}: {getattr(factory, '__qualname__', spec)}{signature} takes arguments; a verifier "
                "factory takes none and returns the Verifier"
                + (
                    ". This looks like a Verifier itself: name a function that returns it "
                    "(losscheck's own is losscheck.verifiers:reference)"
                    if looks_like_verifier
                    else ""
                )
            ) from None
    try:
        verifier = factory()
    except Exception as exc:  # the user's factory raised
        raise OptionError(f"{where}: calling the factory raised {type(exc).__name__}: {exc}") from exc
    if not callable(verifier):
        raise OptionError(
            f"{where}: the factory returned a {type(verifier).__name__}, not a Verifier: a callable {_SHAPE}"
        )
    _VERIFIERS[spec] = verifier
    return verifier


def _binds(signature: inspect.Signature, n: int) -> bool:
    try:
        signature.bind(*range(n))
    except TypeError:
        return False
    return True


def baseline_engine(session: Session, cell: Cell) -> Engine:
    """Plain decoding of `cell`'s target in its precision: the same loop with no drafter (never planted)."""
    return Engine(session.cell_target(cell))


def serve_context(session: Session, cell: Cell) -> ServeContext:
    profile = session.options.profile
    return ServeContext(
        seed=session.options.seed,
        cell_id=cell.id,
        serving=dict(cell.serving),
        max_rows=profile.batch,
        greedy_max_new=profile.greedy_max_new,
        plant=session.plant,
        ranks=rank_recipe(session.options, cell),
    )


def rank_recipe(options: Options, cell: Cell) -> RankRecipe:
    """How a rank of a split run rebuilds `cell`'s server from the run's options alone."""
    return RankRecipe(
        options.device, options.target, options.trust_remote_code, functools.partial(rank_server, options, cell)
    )


def served(session: Session, cell: Cell) -> tuple[Server, ServeContext]:
    """The cell's server — its engine in this process, or, for an axis that runs elsewhere (a
    split), no engine here at all — and the context it was built with (which
    `losscheck.serving.axis.requests` takes)."""
    context = serve_context(session, cell)
    built = None if runs_elsewhere(cell.serving) else engine(session, cell)
    return build_server(built, context), context


def server(session: Session, cell: Cell) -> Server:
    """The cell's server (`served`)."""
    return served(session, cell)[0]


def rank_server(options: Options, cell: Cell, serving: Serving) -> Server:
    """The server of `cell` served as `serving`, in another process (a rank of a split run), from
    the run's options alone."""
    from losscheck.run.session import Session

    return server(Session(options), dataclasses.replace(cell, serving=serving))
