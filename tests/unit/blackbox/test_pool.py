"""`losscheck.engines.pool.Instances`: what each memory policy builds and releases, and one
collection (`free_memory`, a full `gc.collect`) per release however
many instances it drops."""

from __future__ import annotations

import pytest

from losscheck.engines import pool
from losscheck.engines.pool import Instances, Policy


@pytest.fixture
def collections(monkeypatch) -> list[int]:
    """Each `free_memory` call, counted instead of run."""
    counted: list[int] = []
    monkeypatch.setattr(pool, "free_memory", lambda: counted.append(1))
    return counted


def test_one_at_a_time_releases_the_other_instance_before_a_build_and_collects_once(collections):
    released: list[bool] = []
    instances = Instances(lambda key: f"llm-{key}", Policy.ONE_AT_A_TIME, lambda key, _: released.append(key))
    assert instances.get(True) == "llm-True" and not collections  # nothing to release yet
    assert instances.get(False) == "llm-False"
    assert released == [True] and instances.alive() == (False,) and len(collections) == 1
    assert instances.get(False) == "llm-False" and len(collections) == 1  # reused, not rebuilt


def test_a_caller_that_drops_more_collects_once_itself(collections):
    released: list[bool] = []
    instances = Instances(lambda key: f"llm-{key}", Policy.KEEP_ALL, lambda key, _: released.append(key))
    instances.get(True), instances.get(False)
    assert instances.alive() == (True, False) and not released  # both kept
    instances.close(free=False)
    assert released == [True, False] and not instances.alive() and not collections
    instances.get(True)
    instances.close()
    assert released == [True, False, True] and len(collections) == 1
    instances.close()  # nothing alive: nothing to collect
    assert len(collections) == 1


def test_the_long_lived_heap_is_frozen_once_and_what_dies_later_is_still_collected():
    """The plugin froze this process's imports before its first test (`pytest_runtestloop`); a
    second call freezes nothing more, and a cycle made afterwards is collected as before."""
    import gc
    import weakref

    frozen = gc.get_freeze_count()
    assert frozen > 100_000  # torch and transformers, at least
    pool.freeze_long_lived()
    assert gc.get_freeze_count() == frozen

    class Node:
        pass

    cycle = Node()
    cycle.itself = cycle
    alive = weakref.ref(cycle)
    del cycle
    pool.free_memory()
    assert alive() is None
