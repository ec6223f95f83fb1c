"""The speculative loop with the main target split over tensor-parallel ranks (the `split` axis).

`split_generate` starts the ranks itself. Each rank joins a `torch.distributed` process group
(gloo over CPU processes; nccl with one CUDA device per rank) and builds the server of the cell
unsplit, with the run's own builder (`ServeContext.ranks`, a `RankRecipe`): the main target loads with
Hugging Face's tensor-parallel plan (the loader sees the group), and drafters, stress variants and
planted bugs come the same way as in an unsplit cell; a drafter with its own model is replicated
on every rank, as vLLM does. Every rank runs every `Call` with the same seeds; rank 0's
generations come back, and every other rank's tokens must equal them.

The calling process never joins a process group (it may be an xdist worker); only the ranks do.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from losscheck.core.engine import Engine
from losscheck.core.generation import Generation
from losscheck.errors import CellUnavailable, LosscheckError, flag
from losscheck.serving.axis import Axis, Call, Facts, RankRecipe, Scalar, ServeContext, Server, Serving

if TYPE_CHECKING:
    from collections.abc import Sequence

# Imported once by the fork server (see `_context`), not once per rank: on a 2-core CI machine
# importing transformers costs ~10 s, more than a split run of the bundled target.
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "losscheck.core.engine",
    __name__,
]
AXIS_NAME = "split"
STOP_GRACE_S = 5.0  # a rank asked to terminate gets this long before it is killed
PEER_GRACE_S = 2.0  # after a rank's error, how long its peers get to end, to tell a crash from a symptom


class SplitUnavailable(CellUnavailable):
    """This platform cannot run a split target (no torch.distributed, no backend for the device,
    too few devices, transformers' tensor-parallel loading missing a package); the message says
    why, for a caller to skip with."""

    aspect = AXIS_NAME


class SplitError(LosscheckError):
    """A split run failed: a rank raised (its traceback is in the message), died, disagreed with
    rank 0, or the run timed out. Every rank has been stopped by the time it is raised."""

    def __init__(self, message: str, pids: tuple[int, ...] = (), crash: str | None = None) -> None:
        super().__init__(message)
        self.pids = pids  # the ranks' process ids, all ended
        self.crash = crash  # "rank R died of SIGNAL" when a rank crashed in native code


@dataclass
class SplitRun:
    generations: list[Generation]  # one per Call, rank 0's, tensors on the CPU
    wall_s: float  # wall time of the whole split run (process start to results)
    ranks: int
    backend: str  # "gloo" / "nccl"
    identity: dict[str, str] = dataclasses.field(default_factory=dict)  # rank 0's target, with its "split"
    crashed: str | None = None  # the crash that ended a first run, which this one repeated

    def facts(self) -> Facts:
        """The split axis's facts for the cell's record: ranks, backend, wall time, any crash."""
        summary = f"target split over {self.ranks} ranks ({self.backend}), split run {self.wall_s:.1f} s wall"
        facts: dict[str, Scalar] = {"ranks": self.ranks, "backend": self.backend, "wall_s": round(self.wall_s, 2)}
        if self.crashed:
            summary += f"; run twice: in the first, {self.crashed}"
            facts["crashed"] = self.crashed
        return {"split": {**facts, "summary": summary}}


def check_split(config: Any, ranks: int) -> None:
    """`LosscheckError` unless `ranks` (at least 2) divides the model's attention heads and
    key/value heads: HF's plan shards the q/k/v projections by whole heads."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if ranks < 2:
        raise LosscheckError(
            f"split={ranks}: a tensor-parallel run needs at least 2 ranks; run an unsplit "
            "cell (split=1) through the engine directly"
        )
    if heads % ranks or kv_heads % ranks:
        raise LosscheckError(
            f"split={ranks} does not divide the target's heads: num_attention_heads={heads}, "
            f"num_key_value_heads={kv_heads} (model_type={getattr(config, 'model_type', '?')!r}); choose a "
            "split that divides both"
        )


def rank_disagreement(rank: int, mine: list[Generation], rank0: list[Generation]) -> str | None:
    """What differs between `rank`'s generations and rank 0's (tokens and lengths), or None."""
    for i, (a, b) in enumerate(zip(mine, rank0)):
        if not (a.lengths.equal(b.lengths) and a.tokens.equal(b.tokens)):
            rows = [r for r in range(len(b.lengths)) if a.row(r) != b.row(r)]
            return (
                f"call {i}: rank {rank} generated different tokens from rank 0 on rows {rows} "
                f"(row {rows[0]}: {a.row(rows[0])} vs {b.row(rows[0])})"
            )
    return None


def split_generate(
    recipe: RankRecipe,
    unsplit: Serving,
    cell_id: str,
    ranks: int,
    calls: Sequence[Call],
    timeout_s: float = 900.0,
) -> SplitRun:
    """Run `calls` with the server `recipe.build(unsplit)` builds in each of `ranks` ranks, the
    main target split over them. `unsplit`: the cell's serving without the split.

    A run where a rank died of a signal (a crash in native code, not a Python error) runs once
    more, from new ranks, and the `SplitRun` names the crash (`crashed`): a rare crash below
    losscheck (seen once: glibc's heap check aborting a gloo rank) must not fail a certificate,
    and a crash that repeats still does.

    Raises `SplitUnavailable` where the platform cannot split, `LosscheckError` for a split the
    model does not allow, `SplitError` when a rank fails, ranks disagree or `timeout_s` passes.
    """
    started = time.perf_counter()
    check_split(_config(recipe), ranks)
    backend = _backend(recipe.device, ranks)
    try:
        outputs, pids = _run_ranks(recipe, unsplit, ranks, calls, backend, started + timeout_s, timeout_s)
        crashed = None
    except SplitError as first:
        if first.crash is None:
            raise
        crashed = first.crash
        outputs, pids = _run_ranks(recipe, unsplit, ranks, calls, backend, started + timeout_s, timeout_s)
    for rank in range(1, ranks):
        differs = rank_disagreement(rank, outputs[rank][1], outputs[0][1])
        if differs:
            raise SplitError(
                f"ranks of split={ranks} diverged on cell {cell_id}: {differs}; every rank "
                "runs the same seeds on an all-reduced target, so this is a bug",
                pids,
            )
    identity, generations = outputs[0]
    return SplitRun(generations, time.perf_counter() - started, ranks, backend, identity, crashed)


def _run_ranks(
    recipe: RankRecipe,
    unsplit: Serving,
    ranks: int,
    calls: Sequence[Call],
    backend: str,
    deadline: float,
    timeout_s: float,
) -> tuple[dict[int, tuple[dict[str, str], list[Generation]]], tuple[int, ...]]:
    """One split run: start the ranks, collect every rank's output (`_collect`), stop them all."""
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="losscheck-split-") as rendezvous:
        results = ctx.Queue()
        store = f"file://{os.path.join(rendezvous, 'store')}"
        procs = [
            ctx.Process(  # type: ignore[attr-defined]  # every concrete context has Process
                target=_rank_main,
                name=f"losscheck-rank{rank}",
                daemon=True,
                args=(rank, ranks, store, backend, timeout_s, recipe, unsplit, list(calls), results),
            )
            for rank in range(ranks)
        ]
        try:
            for proc in procs:
                proc.start()
            outputs = _collect(procs, results, deadline, timeout_s)
        finally:
            _stop(procs)
            results.close()
    return outputs, tuple(p.pid or 0 for p in procs)


def _backend(device_option: str | None, ranks: int) -> str:
    """gloo for CPU ranks, nccl for CUDA ranks (one device each); `SplitUnavailable` otherwise."""
    import importlib.util

    import torch

    from losscheck.core.precision import resolve_device

    dist = torch.distributed
    if not dist.is_available():
        raise SplitUnavailable("this torch build has no torch.distributed")
    if importlib.util.find_spec("accelerate") is None:
        raise SplitUnavailable(
            "transformers loads a tensor-parallel plan only with the accelerate package "
            "installed (pip install accelerate)"
        )
    device = resolve_device(device_option)
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise SplitUnavailable("this torch build has no nccl backend for CUDA ranks")
        if torch.cuda.device_count() < ranks:
            raise SplitUnavailable(
                f"split={ranks} runs one rank per CUDA device and {torch.cuda.device_count()} "
                "are visible; pass --losscheck-device=cpu to split over CPU processes (gloo)"
            )
        return "nccl"
    if device.type != "cpu":
        raise SplitUnavailable(f"no tensor-parallel backend for device {device.type!r}; pass {flag('device')}=cpu")
    if not dist.is_gloo_available():
        raise SplitUnavailable("this torch build has no gloo backend for CPU ranks")
    return "gloo"


def _config(recipe: RankRecipe) -> Any:
    """The main target's config, read without loading weights."""
    from transformers import AutoConfig

    from losscheck import bundled

    path = recipe.target or bundled.target_path()
    return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=recipe.trust_remote_code)


def _context() -> BaseContext:
    """A fork server that has imported torch and transformers once for every later rank (fork
    itself is unsafe once torch runs threads); plain spawn where there is none, and on a CUDA
    machine, where a CUDA query made while preloading would be inherited by every rank."""
    import multiprocessing

    import torch

    if "forkserver" not in multiprocessing.get_all_start_methods() or torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _collect(
    procs: list[BaseProcess], results: Any, deadline: float, timeout_s: float
) -> dict[int, tuple[dict[str, str], list[Generation]]]:
    """Rank -> (its target's identity, its generations), or `SplitError` at the first rank
    failure, death or the deadline."""
    pids = tuple(p.pid or 0 for p in procs)
    outputs: dict[int, tuple[dict[str, str], list[Generation]]] = {}
    while len(outputs) < len(procs):
        try:
            kind, rank, payload = results.get(timeout=max(0.01, min(0.5, deadline - time.perf_counter())))
        except queue.Empty:
            if time.perf_counter() >= deadline:
                raise SplitError(
                    f"split run of {len(procs)} ranks timed out after {timeout_s:g} s "
                    f"(timeout_s={timeout_s:g}); every rank was killed",
                    pids,
                ) from None
            dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode is not None]
            if dead and results.empty():
                r = dead[0]
                crash = _crash(procs, r)
                if crash:
                    raise SplitError(f"{crash} without a result", pids, crash) from None
                raise SplitError(
                    f"rank {r} of {len(procs)} (pid {pids[r]}) exited with code {procs[r].exitcode} "
                    "without a result (killed, or out of memory?)",
                    pids,
                ) from None
            continue
        if kind == "error":
            crash = _peer_crash(procs, rank)
            lead = f"{crash}; then " if crash else ""
            raise SplitError(f"{lead}rank {rank} of {len(procs)} (pid {pids[rank]}) failed:\n{payload}", pids, crash)
        outputs[rank] = pickle.loads(payload)
    return outputs


def _crash(procs: list[BaseProcess], rank: int) -> str | None:
    """What ended `rank` when it was a signal other than the parent's own terminate or kill ("rank
    R of N (pid P) died of SIGNAL, ..."), else None."""
    code = procs[rank].exitcode
    if code is None or code >= 0 or -code in (signal.SIGTERM, signal.SIGKILL):
        return None
    return (
        f"rank {rank} of {len(procs)} (pid {procs[rank].pid}) died of {signal.Signals(-code).name}, a crash "
        "in native code (its Python stack, where faulthandler could print one, is in the captured stderr)"
    )


def _peer_crash(procs: list[BaseProcess], rank: int) -> str | None:
    """The crash of a rank other than `rank`, waiting up to `PEER_GRACE_S` for the peers to end:
    a rank that dies in native code sends nothing, and its peers then fail on the closed
    connection, so their error is the symptom and its crash the cause."""
    deadline = time.perf_counter() + PEER_GRACE_S
    for r, proc in enumerate(procs):
        if r != rank and proc.pid is not None:
            proc.join(max(0.0, deadline - time.perf_counter()))
    crashes = [c for r in range(len(procs)) if r != rank and (c := _crash(procs, r))]
    return "; ".join(crashes) or None


def _stop(procs: list[BaseProcess]) -> None:
    """End every rank still running: terminate, then kill after `STOP_GRACE_S`."""
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.terminate()
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(STOP_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _rank_main(
    rank: int,
    ranks: int,
    store: str,
    backend: str,
    timeout_s: float,
    recipe: RankRecipe,
    unsplit: Serving,
    calls: list[Call],
    results: Any,
) -> None:
    """One rank: join the group, build the cell's server, run every call, report to `results`
    ("ok", rank, pickled (target identity, generations on the CPU)) or ("error", rank, traceback text)."""
    import faulthandler

    import torch
    import torch.distributed as dist

    # a rank that dies of a signal (a crash in a native library) prints its Python stack to
    # stderr, where the cell's captured output keeps it
    faulthandler.enable(all_threads=True)
    # transformers' mesh reads the rank's device from LOCAL_RANK, and builds it on the machine's
    # accelerator: gloo ranks hide the GPUs (before anything asks CUDA) to get a CPU mesh
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks))
    if backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        torch.set_num_threads(1)  # the ranks share the machine's cores
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # the parent enforces `timeout_s`; the group's own timeout only frees a rank whose parent
        # died, so it must not fire first and pre-empt the parent's timeout error
        dist.init_process_group(
            backend, init_method=store, rank=rank, world_size=ranks, timeout=timedelta(seconds=timeout_s + 60)
        )
        server = recipe.build(unsplit)
        assert server.engine is not None
        out = [_on_cpu(gen) for gen in server.generate(calls)]
        # plain pickle: the queue's own pickler would share tensors by file descriptor, which
        # dies with this process
        results.put(("ok", rank, pickle.dumps((server.engine.target.identity, out))))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        # flushed before the group goes down: the other ranks then fail too ("connection closed"),
        # and the parent must hear the cause first
        results.close()
        results.join_thread()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _on_cpu(gen: Generation) -> Generation:
    """`gen` with its tensors moved to the CPU, to cross the process boundary."""
    counts = {name: getattr(gen.stats, name).cpu() for name in ("proposed", "accepted", "reached")}
    stats = dataclasses.replace(gen.stats, **counts)
    slots = None if gen.slots is None else gen.slots.cpu()
    draft_q = None if gen.draft_q is None else gen.draft_q.cpu()
    return dataclasses.replace(
        gen, tokens=gen.tokens.cpu(), lengths=gen.lengths.cpu(), stats=stats, slots=slots, draft_q=draft_q
    )


# --- the serving axis ----------------------------------------------------------------------------
class Split:
    """A server whose calls run in `ranks` ranks, the main target split over them (rank 0's
    generations; the run's wall time and backend are its facts). A platform that cannot split
    raises `SplitUnavailable` at the first call: the cell is not run, with that reason."""

    engine: Engine | None

    def __init__(self, ranks: int, inner: Server, context: ServeContext) -> None:
        self.engine = None
        self.ranks = ranks
        self.context = context
        self.run: SplitRun | None = None

    def call_rows(self, rows: int) -> int:
        return rows

    def generate(self, calls: Sequence[Call]) -> list[Generation]:
        unsplit = tuple((name, v) for name, v in self.context.serving.items() if name != AXIS.name)
        if self.context.ranks is None:
            raise LosscheckError("a split cell needs ServeContext.ranks to build its server in the ranks")
        self.run = split_generate(self.context.ranks, unsplit, self.context.cell_id, self.ranks, calls)
        return self.run.generations

    def facts(self) -> Facts:
        return {} if self.run is None else self.run.facts()


AXIS = Axis(
    name=AXIS_NAME,
    off=1,
    values=(2,),
    suffix=lambda ranks: f"tp{ranks}",
    serve=Split,
    order=1,
    doc="the main target split over tensor-parallel ranks (torch.distributed, Hugging Face's tp plan)",
    with_reduced_precision=True,
    rounds_differently=True,
    runs_elsewhere=True,
    excludes=frozenset({"prefix", "batching"}),
)
