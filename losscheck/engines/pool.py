"""The instances an adapter runs (speculation on, speculation off), built on first use under an
explicit memory policy.

`KEEP_ALL` keeps every instance once built: switching sides costs nothing, and memory holds all
of them (tiny models, CPU runs). `ONE_AT_A_TIME` releases every other instance before it builds
one: a real target on one GPU, where an engine reserves most of the device's memory (vLLM 90% by
default) and a second instance cannot start. An adapter shows its `Instances` as `instances`
(`HoldsInstances`): a run then orders its cells' draws side by side and, one at a time, keeps
losscheck's reference copy of the target unloaded while an instance lives (docs/black-box-engines.md).
"""

from __future__ import annotations

import enum
import gc
import sys
from collections.abc import Callable, Hashable
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Policy(enum.Enum):
    KEEP_ALL = "keep-all"
    ONE_AT_A_TIME = "one-at-a-time"


class Instances(Generic[K, T]):
    """`build(key)` on first use of `key`; `release(key, instance)` (if given) before an instance is
    dropped, for engines that hold memory or processes outside Python's reach, or counters to keep."""

    def __init__(self, build: Callable[[K], T], policy: Policy, release: Callable[[K, T], None] | None = None) -> None:
        self.build, self.policy, self.release = build, policy, release
        self._alive: dict[K, T] = {}

    def get(self, key: K) -> T:
        if key not in self._alive:
            if self.policy is Policy.ONE_AT_A_TIME:
                self.close()
            self._alive[key] = self.build(key)
        return self._alive[key]

    def discard(self, key: K) -> None:
        """Drop `key`'s instance (one that failed and is in an unknown state: never reused)."""
        if key in self._alive:
            self._drop(key)
            free_memory()

    def alive(self) -> tuple[K, ...]:
        return tuple(self._alive)

    def close(self, free: bool = True) -> None:
        """Release every instance and give their memory back; `free=False`: leave the collection
        to a caller that drops more before one `free_memory` (each costs ~0.2 s with transformers
        loaded)."""
        if not self._alive:
            return
        for key in list(self._alive):
            self._drop(key)
        if free:
            free_memory()

    def _drop(self, key: K) -> None:
        instance = self._alive.pop(key)
        if self.release is not None:
            self.release(key, instance)


@runtime_checkable
class HoldsInstances(Protocol):
    """An engine adapter whose instances live in an `Instances` (optional)."""

    @property
    def instances(self) -> Instances[Any, Any]: ...


def instances_of(engine: object) -> Instances[Any, Any] | None:
    """`engine`'s instances when it shows them, else None."""
    return engine.instances if isinstance(engine, HoldsInstances) else None


def one_at_a_time(engine: object) -> bool:
    """Whether `engine` keeps one instance alive at a time."""
    instances = instances_of(engine)
    return instances is not None and instances.policy is Policy.ONE_AT_A_TIME


def free_memory() -> None:
    """Collect what dropped instances held, and return the CUDA cache where torch uses it (a full
    collection: ~0.2 s walking torch and transformers, a sixth of that once `freeze_long_lived` took
    them out of its walks)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def freeze_long_lived() -> None:
    """Collect once, then move every survivor out of the cyclic collector's walks (`gc.freeze`).

    Called once a process has imported and collected what it runs: torch, transformers and the
    plan live as long as the process, and a full collection walked them every time (417k objects,
    0.19 s each on the 2-core machine), in `free_memory` between engine instances as in Python's
    own full collections. Frozen, they are walked no more; what cells allocate later is collected
    as before. Once per process (the frozen count says so, whatever module copies pytester made):
    a nested pytest session in process would otherwise freeze a test's live objects, and their
    cycles would outlive it."""
    if gc.get_freeze_count() == 0:
        # every run loads a model through it, so it is imported here to be frozen with the rest
        # (~4 s, which only a test process that never loads a model would not have paid anyway)
        import transformers.modeling_utils  # noqa: F401

        gc.collect()
        gc.freeze()
