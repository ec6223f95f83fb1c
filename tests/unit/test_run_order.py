"""The run order under pytest-xdist (`losscheck.plan.cost.run_order`, `dealt`): each worker's
first chunk starts with one of the costliest cells, and the chunks are those xdist's `load`
scheduling sends (checked against xdist's own scheduler, so that a new xdist that sends other
chunks fails here, not in a slower run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from losscheck.core.sampling import SamplingParams
from losscheck.plan.cell import ENGINE, Cell
from losscheck.plan.cost import dealt, estimated_seconds, run_order, seconds_on
from losscheck.plugin.hooks import SCHEDULING, _first_chunks, pytest_configure_node

pytest_plugins = ["pytester"]


class _Node:
    """What xdist's scheduler reads of a worker: its gateway id; it records the batches sent."""

    def __init__(self, i: int) -> None:
        self.gateway = SimpleNamespace(id=f"gw{i}")
        self.sent: list[list[int]] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.append(list(indices))

    def shutdown(self) -> None:
        self.shutting_down = True


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("count", [3, 9, 70, 200])
def test_the_first_chunks_are_those_xdist_s_load_scheduling_sends(pytester, workers, count):
    from xdist.scheduler.load import LoadScheduling

    config = pytester.parseconfig("--tx", f"{workers}*popen", "--dist", "load")
    scheduler = LoadScheduling(config)
    nodes = [_Node(i) for i in range(workers)]
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, [f"t{i}" for i in range(count)])
    scheduler.schedule()
    controller = SimpleNamespace(config=config, workerinput={"workercount": workers})
    pytest_configure_node(controller)  # what the controller tells each worker
    got, chunk = _first_chunks(SimpleNamespace(workerinput=controller.workerinput), count)
    assert got == workers
    if chunk == 1:  # fewer than two items a worker: one at a time in turn, all sent at once
        assert [sum(n.sent, []) for n in nodes] == [list(range(w, count, workers)) for w in range(workers)]
    else:
        assert [n.sent[0] for n in nodes] == [list(range(w * chunk, (w + 1) * chunk)) for w in range(workers)]


def test_in_process_or_under_another_scheduling_nothing_is_dealt():
    assert _first_chunks(SimpleNamespace(), 70) == (1, 1)
    worksteal = SimpleNamespace(workerinput={"workercount": 2, SCHEDULING: ("worksteal", None)})
    assert _first_chunks(worksteal, 70) == (1, 1)
    assert dealt([[0], [1], [2]], 1, 1) == [0, 1, 2]


def test_the_costliest_units_start_the_workers_chunks_in_snake_order_and_a_split_block_stays_whole():
    """Worker 0 takes units 0 and 3, worker 1 units 1 and 2: the costliest has the cheaper of the
    next round behind it (in turn, worker 0 took 0 and 2, the costliest of both rounds)."""
    assert dealt([[i] for i in range(9)], 2, 2) == [0, 3, 1, 2, 4, 5, 6, 7, 8]
    assert dealt([[0, 1, 2], [3], [4], [5], [6], [7], [8]], 2, 4) == [0, 1, 2, 5, 3, 4, 6, 7, 8]
    main_job = dealt([[i] for i in range(70)], 2, 9)  # the main job's chunks of 9
    assert main_job[:9] == [0, 3, 4, 7, 8, 11, 12, 15, 16] and main_job[9:18] == [1, 2, 5, 6, 9, 10, 13, 14, 17]


def test_a_unit_that_leaves_a_chunk_short_keeps_the_order():
    """A split block wider than a chunk: dealing would shift the next worker's items."""
    assert dealt([[0, 1, 2], [3], [4]], 2, 2) == [0, 1, 2, 3, 4]


def test_on_the_text_target_the_top_p_cell_starts_a_worker_and_greedy_runs_last():
    """Hugging Face assisted generation's plan on the 8,192-token text target, two workers and
    xdist's chunks of 2 (6 cells and 3 other items): the top-p cell (173-181 s on 2026-12-07,
    against 25-91 s for the others, top-k 8's included since the five looks) starts a worker; the
    greedy cell (23-29 s) is not first, as it was when the order ignored the vocabulary."""
    from losscheck import bundled

    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.3),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=1.0, top_k=8),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.0),
    ]
    cells = [Cell(ENGINE, 4, p) for p in params]
    seconds = seconds_on(str(bundled.fixtures_dir() / "text_target"))
    order = [cells[i] for i in run_order(cells, seconds, workers=2, chunk=2)]
    assert order[0].params.label() == cells[4].params.label(), [c.id for c in order]
    assert order[-1].params.greedy
    assert seconds(cells[4]) > seconds(cells[3]) == seconds(cells[0]) > estimated_seconds(cells[5]) == seconds(cells[5])


ORDER_PROBE = """
import json, os
import pytest
from losscheck.core.sampling import SamplingParams
from losscheck.plan.cell import ENGINE, Cell

CELLS = [Cell(ENGINE, 4, SamplingParams(temperature=t, top_k=k, top_p=p))
         for t, k, p in [(1.0, 0, 1.0), (0.3, 0, 1.0), (1.5, 0, 1.0), (1.0, 8, 1.0), (1.0, 0, 0.9), (0.0, 0, 1.0)]]

@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_cell(cell, worker_id):
    with open(f"ran-{worker_id}.txt", "a") as out:
        out.write(cell.id + "\\n")
"""


@pytest.mark.e2e
def test_under_two_xdist_workers_the_two_costliest_cells_start_them(pytester):
    """The order as real xdist workers run it: six engine cells of the bundled target (chunks of
    2), the controller telling its workers how it schedules (`pytest_configure_node`): the top-p
    cell starts one worker and the greedy cell, the next costliest on the bundled target, the
    other (undealt, both would start the first worker's chunk)."""
    pytester.makepyfile(test_probe=ORDER_PROBE)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)
    first = {(pytester.path / f"ran-gw{w}.txt").read_text().split()[0] for w in (0, 1)}
    assert first == {"engine-k4-T1-topp0.9", "engine-k4-greedy"}, first
